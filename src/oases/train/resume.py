"""What a resumed run must share with its checkpoint, checked before the run writes anything.

A checkpoint's manifest (``oases.json``) holds the resolved config of the run that saved it and
the fingerprint of its corpus (``extras.corpus``, ``data.Fingerprint``). A resumed run is refused
with one line naming the field and both values when:

- a model field differs (``MODEL_FREE`` lists the only ones that may change): the weights have
  the saved shapes (``n_layers``, ``dim``, ``n_heads``, ``n_kv_heads``, ``ffn_dim``,
  ``vocab_size``, ``seq_len``, ``arch``, ``tie_embeddings``) or were trained for the saved
  function (``norm_eps``, ``rope_theta``);
- a setting the data position depends on differs (``RESUME_FIXED``): the same position would be
  another batch;
- the corpus differs (another ``data.source``, or files whose names or sizes changed: another
  Python version's stdlib, say), unless ``checkpoint.allow_data_change`` turns that into a
  warning.

Settings of the learning-rate schedule (``train.steps``, ``lr``, ``min_lr``, ``warmup_steps``)
may change; ``schedule_change`` says in one line what that does to the rate at the resumed step.
Everything else (tp, plan, schedule, micro-batch, logging, checkpoint cadence) may change freely.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any

from oases.config import Config, ModelConfig, TrainConfig, config_to_dict
from oases.train.checkpoint import (
    _STEP_DIR,
    COMPLETE,
    MANIFEST,
    checkpoint_root,
    complete_checkpoints,
    latest_checkpoint,
    read_manifest,
)
from oases.train.data import Fingerprint
from oases.train.optim import lr_at

# Model fields a checkpoint serves under any value, and why.
MODEL_FREE = {
    "dropout": "regularization only: no weight's shape or meaning depends on it",
    "init_std": "initialization only: a resumed run loads its weights",
    "init_from": "where a fresh run's weights come from: a resumed run loads the checkpoint's",
}
# Settings the data position depends on: the same position would be another batch.
RESUME_FIXED = (
    ("data", "tokenizer"),
    ("data", "vocab_size"),
    ("train", "seed"),
    ("train", "global_batch"),
)
SCHEDULE_FIELDS = ("steps", "lr", "min_lr", "warmup_steps")
NEW_RUN_ADVICE = "start a new run in another folder (--train.run_dir=NEW)"


def _effective(config: dict[str, dict[str, Any]], section: str, key: str) -> Any:
    """A saved or current setting as the run used it (``data.vocab_size = 0`` means the
    model's, in configs saved before ``config.resolve_vocab``)."""
    value = config[section][key]
    if (section, key) == ("data", "vocab_size") and not value:
        return config["model"]["vocab_size"]
    return value


def check_resume_compatible(cfg: Config, manifest: dict[str, Any], path: Path) -> list[str]:
    """ValueError naming every setting that differs from the checkpoint's run and that the
    checkpoint cannot serve; returns the warnings to print (a data source changed under
    ``checkpoint.allow_data_change``)."""
    saved, now = manifest.get("config", {}), config_to_dict(cfg)
    fields = [
        ("model", f.name) for f in dataclasses.fields(ModelConfig) if f.name not in MODEL_FREE
    ]
    fields += RESUME_FIXED
    source_changed = (
        "data" in saved
        and "source" in saved["data"]
        and saved["data"]["source"] != now["data"]["source"]
    )
    if not cfg.checkpoint.allow_data_change:
        fields.append(("data", "source"))
    diff = [
        f"{s}.{k}={_effective(saved, s, k)!r} (now {_effective(now, s, k)!r})"
        for s, k in fields
        if s in saved and k in saved[s] and _effective(saved, s, k) != _effective(now, s, k)
    ]
    if diff:
        raise ValueError(
            f"checkpoint {path} was saved with {', '.join(diff)}; resume with the "
            f"same settings, or {NEW_RUN_ADVICE}"
        )
    if source_changed:
        return [
            f"resuming checkpoint {path} (data.source={saved['data']['source']!r}) on "
            f"data.source={now['data']['source']!r} (checkpoint.allow_data_change=true)"
        ]
    return []


def check_corpus(
    cfg: Config, manifest: dict[str, Any], corpus: Fingerprint | None, path: Path
) -> str | None:
    """ValueError when the corpus differs from the one the checkpoint was trained on (its
    fingerprint); the warning line instead under ``checkpoint.allow_data_change``; None when
    they agree or the checkpoint predates fingerprints."""
    saved = manifest.get("extras", {}).get("corpus")
    if saved is None or corpus is None:
        return None
    before = Fingerprint.from_dict(saved)
    if before == corpus:
        return None
    what = (
        f"checkpoint {path} was trained on data.source={cfg.data.source!r} with fingerprint "
        f"{before}, now {corpus}"
    )
    if cfg.checkpoint.allow_data_change:
        return f"{what}; resuming on the new data (checkpoint.allow_data_change=true)"
    hint = " (another Python version's stdlib?)" if cfg.data.source == "stdlib" else ""
    raise ValueError(
        f"{what}{hint}: resume on the same data, set "
        "--checkpoint.allow_data_change=true to continue on this data, or "
        f"{NEW_RUN_ADVICE}"
    )


def schedule_change(cfg: Config, manifest: dict[str, Any], step: int) -> str | None:
    """One line when the LR schedule's settings differ from the checkpoint's: which ones and
    the rate at ``step`` under the old and the new schedule; None when they agree."""
    saved = manifest.get("config", {}).get("train", {})
    now = config_to_dict(cfg)["train"]
    changed = [k for k in SCHEDULE_FIELDS if k in saved and saved[k] != now[k]]
    if not changed:
        return None
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    old = dataclasses.replace(cfg.train, **{k: v for k, v in saved.items() if k in known})
    what = ", ".join(f"train.{k}={saved[k]} (now {now[k]})" for k in changed)
    return (
        f"resuming at step {step} with {what}: the learning-rate schedule changes from "
        f"here on (lr {lr_at(step, old):.3e} under the saved schedule, "
        f"{lr_at(step, cfg.train):.3e} now)"
    )


# ------------------------------------------------------------ which checkpoint a run resumes


def find_checkpoint(path: Path) -> Path:
    """The checkpoint ``path`` stands for: itself (``.../step_000123``), the newest complete
    one of a folder of checkpoints, or that of a run directory (its ``config.toml``'s
    ``checkpoint.dir``, by default ``RUN/checkpoints``). ValueError naming where it looked."""
    if (path / COMPLETE).is_file() or _STEP_DIR.match(path.name):
        return path  # read_manifest says what is wrong with an incomplete one
    if not path.is_dir():
        raise ValueError(f"{path}: no such checkpoint, folder of checkpoints or run directory")
    folders = [path, path / "checkpoints"]
    if (path / "config.toml").is_file():
        from oases.config import load_config

        with contextlib.suppress(ValueError):
            folders.insert(1, checkpoint_root(load_config(path / "config.toml")))
    for folder in folders:
        latest = latest_checkpoint(folder)
        if latest is not None:
            return latest
    looked = ", ".join(dict.fromkeys(map(str, folders)))
    raise ValueError(f"{path}: no complete checkpoint (looked in {looked})")


def newest_valid_checkpoint(
    root: str | os.PathLike[str],
) -> tuple[tuple[int, Path] | None, list[ValueError]]:
    """(step, path) of the newest complete checkpoint in ``root`` that ``read_manifest``
    accepts (what ``resume = "auto"`` picks) or None, and the errors of the newer, damaged
    ones it skipped (newest first)."""
    skipped: list[ValueError] = []
    for step, path in reversed(complete_checkpoints(root)):
        try:
            read_manifest(path)
        except ValueError as exc:
            skipped.append(exc)
            continue
        return (step, path), skipped
    return None, skipped


def resolve_resume(cfg: Config, warnings: list[str] | None = None) -> Path | None:
    """The checkpoint to resume from (None for a fresh start); ValueError naming the path.

    ``auto`` takes the newest checkpoint whose manifest reads (skipping a newer one that is
    damaged, with a line appended to ``warnings``; when none reads, the newest one's error). A
    run never writes into a folder that holds newer checkpoints than its own (they would be
    mixed up and the new ones pruned), and never deletes a user's checkpoints to make room:
    ``never`` with checkpoints present, or resuming an older step than the folder's newest, is
    an error that names another ``train.run_dir`` as the way to start afresh.
    """
    resume, root = cfg.checkpoint.resume, checkpoint_root(cfg)
    existing = complete_checkpoints(root)
    if resume == "never":
        if existing:
            raise ValueError(
                f"checkpoint.resume='never' starts a new run, but {root} already holds "
                f"checkpoints (up to step {existing[-1][0]}) that it would mix with and prune: "
                "start it in another folder (--train.run_dir=NEW), continue them "
                "(--checkpoint.resume=auto), or delete that folder yourself"
            )
        return None
    if resume == "auto":  # the newest valid one; if none is valid, the newest one's error
        found, skipped = newest_valid_checkpoint(root)
        if found is None:
            if skipped:
                raise skipped[0]
            return None
        if warnings is not None:  # each damaged one, newest first
            warnings += [f"skipping a damaged checkpoint: {exc}" for exc in skipped]
        return found[1]
    path = Path(resume).expanduser()
    if not path.exists():
        raise ValueError(
            f"checkpoint.resume={resume!r} must be never, auto or the path of a "
            f"checkpoint or of a folder of checkpoints, and there is no {path}"
        )
    if not (
        _STEP_DIR.match(path.name) or (path / MANIFEST).exists() or (path / ".metadata").exists()
    ):
        latest = latest_checkpoint(path)
        if latest is None:
            raise ValueError(f"checkpoint.resume={resume!r}: no complete checkpoint in this folder")
        path = latest
    m = _STEP_DIR.match(path.name)
    if m and existing and existing[-1][0] > int(m.group(1)) and existing[-1][1] != path:
        raise ValueError(
            f"checkpoint.resume={resume!r} is step {int(m.group(1))} but {root} holds step "
            f"{existing[-1][0]}: new checkpoints would be pruned; use another checkpoint.dir"
        )
    return path
