"""What a resumed run must share with its checkpoint: the model's shape, the data position's
settings and the corpus (its fingerprint), each refused in one line naming both values before
the run writes anything; a changed LR schedule said in one line; ``resume=never`` and a wrong
``resume`` value explained.

Single-process runs of the real training loop on a tiny text file (as in test_checkpoint.py).
"""

import io
import json
import shutil
from pathlib import Path

import pytest

from oases.config import config_to_dict, load_config
from oases.train import checkpoint as ckpt
from oases.train.data import Fingerprint, fingerprint_files, list_stdlib_files, load_corpus
from oases.train.resume import (
    MODEL_FREE,
    check_corpus,
    check_resume_compatible,
    resolve_resume,
)
from test_train_loop import run, tiny_cfg, write_text


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One finished 6-step run (tp=1, checkpoint at step 6) to resume in every test."""
    root = tmp_path_factory.mktemp("resume")
    write_text(root / "text.txt")
    run(tiny_cfg(root, "a", "--parallel.tp=1"))
    return root


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file below ``folder``: (size, mtime_ns)."""
    return {
        str(p): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _refused(root, *overrides):
    """The one-line error of resuming run ``a`` with ``overrides``; nothing was written."""
    before = _snapshot(root / "a")
    with pytest.raises(ValueError) as info:
        run(tiny_cfg(root, "a", "--parallel.tp=1", "--checkpoint.resume=auto", *overrides))
    assert _snapshot(root / "a") == before  # config.toml, metrics, checkpoints untouched
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_resume_refuses_a_change_of_model_shape_before_writing(trained):
    good = trained / "a" / "checkpoints" / "step_000006"
    msg = _refused(trained, "--model.n_layers=1")
    assert msg == (
        f"checkpoint {good} was saved with model.n_layers=2 (now 1); resume with "
        "the same settings, or start a new run in another folder "
        "(--train.run_dir=NEW)"
    )
    msg = _refused(trained, "--model.n_heads=2")
    assert "model.n_heads=4 (now 2)" in msg and "model.n_kv_heads=4 (now 2)" in msg
    msg = _refused(trained, "--model.dim=64")
    assert "model.dim=32 (now 64)" in msg and "model.ffn_dim=128 (now 256)" in msg
    assert "model.vocab_size=257 (now 300)" in _refused(trained, "--model.vocab_size=300")
    assert "model.tie_embeddings=False (now True)" in _refused(
        trained, "--model.tie_embeddings=true"
    )
    assert "model.rope_theta=10000.0 (now 500.0)" in _refused(trained, "--model.rope_theta=500")
    assert "train.seed=0 (now 1)" in _refused(trained, "--train.seed=1")


def test_fields_that_may_change_on_resume(tmp_path):
    saved = load_config(None, [])
    manifest = {"config": config_to_dict(saved)}
    assert set(MODEL_FREE) == {"dropout", "init_std", "init_from"}
    changed = load_config(
        None,
        [
            "--model.dropout=0.1",
            "--model.init_std=0.5",
            "--parallel.tp=2",
            "--train.micro_batch=2",
            "--train.steps=99",
            "--schedule.name=oases",
            "--train.log_every=3",
        ],
    )
    assert check_resume_compatible(changed, manifest, tmp_path) == []


def test_a_longer_run_says_how_the_lr_schedule_changes(trained, tmp_path):
    shutil.copytree(trained / "a", tmp_path / "b")  # the other tests resume "a" at step 6
    log = io.StringIO()
    from oases.train.loop import train

    out = train(
        tiny_cfg(
            trained,
            "b",
            "--parallel.tp=1",
            "--checkpoint.resume=auto",
            "--train.steps=8",
            "--model.dropout=0.1",
            f"--train.run_dir={tmp_path / 'b'}",
        ),
        log=log,
    )
    assert out["start_step"] == 6 and out["end_step"] == 8
    lines = [x for x in log.getvalue().splitlines() if x.startswith("warning: ")]
    assert lines == [
        "warning: resuming at step 6 with train.steps=6 (now 8): the learning-rate "
        "schedule changes from here on (lr 3.000e-04 under the saved schedule, "
        "9.750e-04 now)"
    ]


def test_corpus_fingerprint_in_every_checkpoint_and_resume_on_changed_data(tmp_path):
    write_text(tmp_path / "text.txt")
    run(tiny_cfg(tmp_path, "a", "--parallel.tp=1", "--checkpoint.every=3"))
    corpus = load_corpus(str(tmp_path / "text.txt"))
    for step in ("step_000003", "step_000006"):
        manifest = ckpt.read_manifest(tmp_path / "a" / "checkpoints" / step)
        assert manifest["extras"]["corpus"] == corpus.fingerprint.to_dict()
        assert manifest["extras"]["tokenizer"] == {
            "name": "byte",
            "vocab_size": 256,
            "doc_sep_id": 0,
        }
    before = corpus.fingerprint
    with (tmp_path / "text.txt").open("a") as fh:
        fh.write("one more line\n")
    after = load_corpus(str(tmp_path / "text.txt")).fingerprint
    assert after.digest != before.digest and after.bytes == before.bytes + 14
    good = tmp_path / "a" / "checkpoints" / "step_000006"
    msg = _refused(tmp_path, "--train.steps=8")
    assert msg == (
        f"checkpoint {good} was trained on data.source="
        f"{str(tmp_path / 'text.txt')!r} with fingerprint {before}, now {after}: "
        "resume on the same data, set --checkpoint.allow_data_change=true to "
        "continue on this data, or start a new run in another folder "
        "(--train.run_dir=NEW)"
    )
    # with the flag: one warning line, and the run goes on
    log = io.StringIO()
    from oases.train.loop import train

    out = train(
        tiny_cfg(
            tmp_path,
            "a",
            "--parallel.tp=1",
            "--checkpoint.resume=auto",
            "--train.steps=8",
            "--checkpoint.allow_data_change=true",
        ),
        log=log,
    )
    assert out["start_step"] == 6 and out["end_step"] == 8
    warnings = [x for x in log.getvalue().splitlines() if "fingerprint" in x and "warning" in x]
    assert warnings == [
        f"warning: checkpoint {good} was trained on data.source="
        f"{str(tmp_path / 'text.txt')!r} with fingerprint {before}, now {after}; "
        "resuming on the new data (checkpoint.allow_data_change=true)"
    ]
    manifest = ckpt.read_manifest(tmp_path / "a" / "checkpoints" / "step_000008")
    assert manifest["extras"]["corpus"] == after.to_dict()  # the new data from here on


def test_another_source_is_refused_or_allowed_with_a_warning(trained, tmp_path):
    other = write_text(tmp_path / "other.txt")
    good = trained / "a" / "checkpoints" / "step_000006"
    msg = _refused(trained, f"--data.source={other}")
    assert msg.startswith(
        f"checkpoint {good} was saved with data.source="
        f"{str(trained / 'text.txt')!r} (now {str(other)!r})"
    )
    cfg = tiny_cfg(trained, "a", "--checkpoint.allow_data_change=true", f"--data.source={other}")
    warnings = check_resume_compatible(cfg, ckpt.read_manifest(good), good)
    assert warnings == [
        f"resuming checkpoint {good} (data.source="
        f"{str(trained / 'text.txt')!r}) on data.source={str(other)!r} "
        "(checkpoint.allow_data_change=true)"
    ]


def test_stdlib_fingerprint_and_its_message(tmp_path):
    import sysconfig

    files = list_stdlib_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    now = fingerprint_files(files, root)
    assert now == fingerprint_files(files, root) and now.files == len(files)
    assert now == Fingerprint.from_dict(json.loads(json.dumps(now.to_dict())))
    # another Python's stdlib: the same names, one file of another size
    other = Fingerprint("0123456789abcdef", now.files, now.bytes + 120)
    cfg = load_config(None, [])
    manifest = {"extras": {"corpus": other.to_dict()}}
    with pytest.raises(ValueError) as info:
        check_corpus(cfg, manifest, now, tmp_path)
    assert str(info.value) == (
        f"checkpoint {tmp_path} was trained on data.source='stdlib' with fingerprint "
        f"0123456789abcdef ({now.files} files, {(now.bytes + 120) / 1e6:.2f} MB), now {now} "
        "(another Python version's stdlib?): resume on the same data, set "
        "--checkpoint.allow_data_change=true to continue on this data, or start a new run in "
        "another folder (--train.run_dir=NEW)"
    )
    assert check_corpus(cfg, {"extras": {}}, now, tmp_path) is None  # an older checkpoint
    assert check_corpus(cfg, {"extras": {"corpus": now.to_dict()}}, now, tmp_path) is None


def test_resume_never_and_a_wrong_resume_value(tmp_path):
    cfg = load_config(None, [f"--train.run_dir={tmp_path}", "--checkpoint.resume=never"])
    assert resolve_resume(cfg) is None  # nothing there: a new run
    root = ckpt.checkpoint_root(cfg)
    (root / "step_000010").mkdir(parents=True)
    (root / "step_000010" / ckpt.COMPLETE).write_text("10\n")
    with pytest.raises(ValueError) as info:
        resolve_resume(cfg)
    assert str(info.value) == (
        f"checkpoint.resume='never' starts a new run, but {root} already holds checkpoints "
        "(up to step 10) that it would mix with and prune: start it in another folder "
        "(--train.run_dir=NEW), continue them (--checkpoint.resume=auto), or delete that "
        "folder yourself"
    )
    assert (root / "step_000010").is_dir()  # never deleted
    wrong = load_config(None, [f"--train.run_dir={tmp_path}", "--checkpoint.resume=yes"])
    with pytest.raises(ValueError) as info:
        resolve_resume(wrong)
    assert str(info.value) == (
        "checkpoint.resume='yes' must be never, auto or the path of a "
        "checkpoint or of a folder of checkpoints, and there is no yes"
    )
