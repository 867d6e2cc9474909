"""Checkpoints: atomic folders, keep, resume resolution, safe reading, clear errors, kill -9.

Single-process runs of the real training loop (no process group) on a tiny text file; the
multi-rank and resharding cases live in test_train_loop.py.
"""

import io
import json
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from exactness import fp32_tol
from oases.train import checkpoint as ckpt
from oases.train.checkpoint import latest_checkpoint, read_full_tensors
from oases.train.resume import resolve_resume
from test_train_loop import run, tiny_cfg, write_text


@pytest.fixture
def root(tmp_path):
    write_text(tmp_path / "text.txt")
    return tmp_path


def cfg1(root, name, *overrides):
    return tiny_cfg(root, name, "--parallel.tp=1", *overrides)


def test_every_keep_and_latest(root):
    out = run(cfg1(root, "a", "--checkpoint.every=2", "--checkpoint.keep=2"))
    folder = root / "a" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["step_000004", "step_000006"]
    assert out["checkpoint"] == str(folder / "step_000006")
    manifest = json.loads((folder / "step_000006" / "oases.json").read_text())
    assert manifest["step"] == 6 and manifest["extras"]["data"] == {"position": 6}
    assert manifest["config"]["model"]["vocab_size"] == 257 and manifest["tp"] == 1
    # unfinished saves are never chosen: a .tmp folder, a folder without COMPLETE
    (folder / "step_000009.tmp").mkdir()
    (folder / "step_000008").mkdir()
    assert latest_checkpoint(folder) == folder / "step_000006"
    assert latest_checkpoint(root / "nothing-here") is None
    # resume=auto continues from step 6 to 8; the metrics keep one line per step
    more = run(cfg1(root, "a", "--checkpoint.resume=auto", "--train.steps=8"))
    assert more["start_step"] == 6 and more["end_step"] == 8 and len(more["losses"]) == 2
    rows = [json.loads(x) for x in (root / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 9))
    assert sorted(p.name for p in folder.iterdir()) == ["step_000006", "step_000008"]


def test_resume_errors_are_one_line_naming_the_path(root):
    run(cfg1(root, "a"))
    good = root / "a" / "checkpoints" / "step_000006"

    def error(*overrides):
        with pytest.raises(ValueError) as info:
            run(cfg1(root, "b", *overrides))
        msg = str(info.value)
        assert "\n" not in msg
        return msg

    msg = error(f"--checkpoint.resume={root / 'missing'}")
    assert str(root / "missing") in msg and "must be never, auto or the path" in msg
    # a different model: refused before loading (test_resume.py has the details)
    msg = error(f"--checkpoint.resume={good}", "--model.dim=64")
    assert str(good) in msg and "model.dim=32 (now 64)" in msg
    # no COMPLETE marker
    incomplete = root / "c" / "step_000006"
    incomplete.parent.mkdir()
    shutil.copytree(good, incomplete)
    (incomplete / "COMPLETE").unlink()
    msg = error(f"--checkpoint.resume={incomplete}")
    assert str(incomplete) in msg and "incomplete" in msg
    # a folder with no complete checkpoint
    msg = error(f"--checkpoint.resume={incomplete.parent}")
    assert "no complete checkpoint" in msg


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_metadata_is_read_without_running_pickled_code(root, monkeypatch):
    run(cfg1(root, "a"))
    good = root / "a" / "checkpoints" / "step_000006"
    assert read_full_tensors(good, "model.embed")  # the restricted unpickler reads real files
    monkeypatch.chdir(root)
    (good / ".metadata").write_bytes(pickle.dumps(_Boom()))
    manifest = json.loads((good / "oases.json").read_text())
    manifest["files"][".metadata"] = (good / ".metadata").stat().st_size
    (good / "oases.json").write_text(json.dumps(manifest))
    from oases.train.safe_load import load_metadata

    with pytest.raises(ValueError, match="refusing to load global"):
        load_metadata(good)
    with pytest.raises(ValueError, match=str(good)):
        run(cfg1(root, "a", "--checkpoint.resume=auto"))
    assert not (root / "pwned").exists()


KILLED_RUN = """
import sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from oases.train import checkpoint
from test_train_loop import run, tiny_cfg

commit = checkpoint._commit
def slow_commit(tmp, final):
    if final.name == "step_000004":  # every tensor file of step 4 is written: hang here
        Path({marker!r}).write_text(str(tmp))
        time.sleep(600)
    commit(tmp, final)
checkpoint._commit = slow_commit
run(tiny_cfg(Path({root!r}), "k", "--parallel.tp=1", "--checkpoint.every=2"))
"""


def test_kill_during_save_leaves_the_previous_checkpoint(root):
    marker = root / "saving"
    script = KILLED_RUN.format(tests=str(Path(__file__).parent), marker=str(marker), root=str(root))
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), proc.stderr.read().decode() if proc.poll() is not None else ""
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    folder = root / "k" / "checkpoints"
    tmp = Path(marker.read_text())
    assert tmp.name == "step_000004.tmp" and any(tmp.glob("*.distcp"))
    assert latest_checkpoint(folder) == folder / "step_000002"
    out = run(cfg1(root, "k", "--checkpoint.resume=auto", "--checkpoint.every=2"))
    assert out["start_step"] == 2 and out["end_step"] == 6
    assert not tmp.exists()  # the next save cleared the killed one
    log = io.StringIO()  # and a fresh identical run agrees with the resumed one
    from oases.train.loop import train

    ref = train(cfg1(root, "ref"), log=log)
    assert out["losses"] == pytest.approx(ref["losses"][2:], abs=1e-6)


def _fake_checkpoint(folder: Path, step: int) -> Path:
    """A minimal complete checkpoint folder (manifest + marker, no tensors)."""
    p = folder / ckpt.step_dir_name(step)
    p.mkdir(parents=True)
    (p / ckpt.MANIFEST).write_text(
        json.dumps({"format": ckpt.FORMAT_VERSION, "step": step, "files": {}})
    )
    (p / ckpt.COMPLETE).write_text(f"{step}\n")
    return p


def test_a_run_never_mixes_with_another_runs_checkpoints(tmp_path):
    from oases.config import load_config

    cfg = load_config(None, [f"--train.run_dir={tmp_path}", "--checkpoint.resume=never"])
    root = ckpt.checkpoint_root(cfg)
    _fake_checkpoint(root, 100)
    newest = _fake_checkpoint(root, 200)
    never = r"resume='never' starts a new run, but .* \(up to step 200\)"
    with pytest.raises(ValueError, match=never):
        resolve_resume(cfg)
    older = load_config(
        None, [f"--train.run_dir={tmp_path}", f"--checkpoint.resume={root / 'step_000100'}"]
    )
    with pytest.raises(ValueError, match="is step 100 but .* holds step 200"):
        resolve_resume(older)
    auto = load_config(None, [f"--train.run_dir={tmp_path}", "--checkpoint.resume=auto"])
    assert resolve_resume(auto) == newest
    (newest / ckpt.MANIFEST).write_text("{broken")  # newest damaged: the newest valid one
    assert resolve_resume(auto) == root / "step_000100"
    (root / "step_000100" / ckpt.MANIFEST).write_text("{broken")  # none valid: the error
    with pytest.raises(ValueError, match="step_000200: unreadable"):
        resolve_resume(auto)


def test_resume_refuses_changed_data_settings(tmp_path):
    from oases.config import config_to_dict, load_config
    from oases.train.resume import check_resume_compatible

    saved = load_config(None, ["--train.seed=1"])
    manifest = {"config": config_to_dict(saved)}
    check_resume_compatible(saved, manifest, tmp_path)  # same settings: fine
    changed = load_config(None, ["--train.seed=2", "--data.tokenizer=bpe"])
    with pytest.raises(ValueError, match=r"data.tokenizer='byte' \(now 'bpe'\).*train.seed=1"):
        check_resume_compatible(changed, manifest, tmp_path)
    more_steps = load_config(None, ["--train.seed=1", "--train.steps=99", "--parallel.tp=2"])
    check_resume_compatible(more_steps, manifest, tmp_path)  # allowed to change


def test_checkpoints_hold_the_runs_dtype_and_resume_at_another_precision(root):
    """A checkpoint stores the run's dtype (train.precision); resuming it at another precision
    casts on load, both ways. fp32 -> float64: the first resumed step's loss is the saved
    weights' loss, within the fp32 bound (the fp32 run computes it in fp32, exactness.py)."""
    folder = root / "a" / "checkpoints"
    quick = "--train.sample_tokens=0"
    run(cfg1(root, "a", "--train.steps=5", quick), stop_after=3)  # fp32 (auto on CPU)
    saved = read_full_tensors(folder / "step_000003")
    assert {
        v.dtype for k, v in saved.items() if not k.startswith("rng.") and not k.endswith(".step")
    } == {torch.float32}
    up = run(
        cfg1(
            root,
            "a",
            "--train.steps=5",
            "--train.precision=fp64",
            quick,
            "--checkpoint.resume=auto",
        )
    )
    assert up["start_step"] == 3 and up["end_step"] == 5
    model64 = read_full_tensors(folder / "step_000005", "model.")
    assert {v.dtype for v in model64.values()} == {torch.float64}
    ref = run(cfg1(root, "ref", "--train.steps=5", quick))  # uninterrupted, fp32
    cfg = cfg1(root, "unused").model
    want = torch.tensor(ref["losses"][3])
    n_tokens = 4 * cfg.seq_len  # tiny.toml: global_batch 4
    torch.testing.assert_close(
        torch.tensor(up["losses"][0], dtype=torch.float32),
        want,
        **fp32_tol(want, cfg, n_tokens, False),
    )
    assert up["losses"][0] != ref["losses"][3]  # computed in float64, not fp32
    # and back: the float64 checkpoint resumes at fp32
    down = run(cfg1(root, "a", "--train.steps=6", quick, "--checkpoint.resume=auto"))
    assert down["start_step"] == 5 and math.isfinite(down["loss"])
    model32 = read_full_tensors(folder / "step_000006", "model.")
    assert {v.dtype for v in model32.values()} == {torch.float32}
    # bf16 (autocast, bf16 activations) resumes the fp32 checkpoint and keeps fp32 master
    # weights in its own; its first loss is the saved weights' loss to bf16's rounding
    # (activations with 8 bits of mantissa over 2 layers: 1e-2 relative, as the parity tests)
    bf16 = run(
        cfg1(
            root,
            "a",
            "--train.steps=7",
            quick,
            "--checkpoint.resume=auto",
            "--train.precision=bf16",
        )
    )
    assert bf16["start_step"] == 6
    again = run(
        cfg1(
            root,
            "b",
            "--train.steps=7",
            quick,
            "--train.precision=fp32",
            f"--checkpoint.resume={folder / 'step_000006'}",
        )
    )
    assert bf16["losses"][0] == pytest.approx(again["losses"][0], rel=1e-2)
    assert bf16["losses"][0] != again["losses"][0]  # computed in bf16
    assert {v.dtype for v in read_full_tensors(folder / "step_000007", "model.").values()} == {
        torch.float32
    }
