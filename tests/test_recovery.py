"""Recovery of local ranks (`oases train --max-restarts`) under injected faults.

Fast: the pieces (OASES_FAULT parsing, which rank caused a failure, where a restart resumes,
the events held until the ranks pass their checks, the first step after the resume point).
Slow: 2 ranks of a tiny model (configs/tiny.toml, the oases schedule with two sub-batches and
two collectives in flight, 8 steps, a checkpoint every 2, all kept; tiny.toml's 30 s collective
timeout, also for SIGSTOP: the supervisor ends the attempt 2 s after it sees the stopped rank),
one uninterrupted reference run shared by every fault, then per fault (``train/faults.py``):
the run finishes all its steps; every step logs the same loss as the reference (1e-6: same tp,
same machine, a resume is exact); the complete checkpoints at the end are the reference's (none
lost); the one restart line names the rank and the signal and the step it resumes from; no
``torchelastic_*`` folder is left in the temporary directory. A refused run writes nothing into
the run directory. Every run is a new session, killed as a whole (ranks included, stopped ones
too) if it outlives its timeout.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from oases.config import load_config
from oases.parallel import comm
from oases.schedule.instructions import Start, Wait
from oases.schedule.program import build_program
from oases.train import checkpoint as ckpt
from oases.train import faults
from oases.train.faults import parse
from oases.train.rank_ends import RankEnd, cause_of, describe_failure
from oases.train.restart_events import EventLog, read_events, write_event
from oases.train.resume import newest_valid_checkpoint
from oases.train.supervise import STOP_GRACE_S, MetricsWatch, restart_config

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny.toml"
STEPS = 8
ARGS = [
    str(TINY),
    "--nproc-per-node",
    "2",
    "--max-restarts",
    "2",
    "--schedule.name=oases",
    "--schedule.n_sub=2",
    "--schedule.max_inflight=2",
    f"--train.steps={STEPS}",
    "--checkpoint.every=2",
    "--checkpoint.keep=10",
    "--train.eval_every=4",
    "--train.sample_tokens=0",
]


# ---------------------------------------------------------------- pieces, one process


def test_fault_spec_parses_and_rejects_with_one_line():
    f = parse("kill:rank=1:step=7:at=collective:n=3")
    assert (f.kind, f.rank, f.step, f.at, f.n, f.attempt) == ("kill", 1, 7, "collective", 3, 0)
    assert parse("stop:rank=0:step=2").at == "step"
    for bad, words in [
        ("boom:rank=1:step=2", "kind must be one of kill, stop"),
        ("kill:step=2", "rank= is required"),
        ("kill:rank=1:step=2:at=lunch", "at must be one of"),
        ("kill:rank=1:step=2:at=collective", "n >= 2"),
        ("kill:rank=x:step=2", "integers"),
        ("kill:rank=1:step=2:when=now", "'when=now' is not one of"),
    ]:
        with pytest.raises(ValueError, match=words):
            parse(bad)


def test_fault_is_read_when_armed_and_its_collective_hook_removed(monkeypatch, tmp_path):
    """``OASES_FAULT`` set after import is seen by ``arm`` (read then, not at import); it arms
    only the rank and attempt it names; ``disarm`` removes the collective hook it added."""
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("OASES_FAULT", raising=False)
    assert faults.arm(tmp_path) is None  # unset: nothing armed
    monkeypatch.setenv("OASES_FAULT", "kill:rank=0:step=3:at=collective:n=2")
    assert faults.arm(tmp_path) is None  # another rank's fault
    monkeypatch.setenv("RANK", "0")
    hooks = len(comm._HOOKS)
    try:
        assert faults.arm(tmp_path) == parse("kill:rank=0:step=3:at=collective:n=2")
        assert len(comm._HOOKS) == hooks + 1
    finally:
        faults.disarm()
    assert len(comm._HOOKS) == hooks
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert faults.arm(tmp_path) is None  # the restarted attempt runs clean


def test_cause_is_a_stopped_rank_else_the_first_failure_signal_first():
    killed, peer = RankEnd(1, 10.0, signal="SIGKILL"), RankEnd(0, 10.0, exitcode=1, error="E")
    assert cause_of([peer, killed]) is killed  # seen in the same poll: the signal caused it
    assert cause_of([RankEnd(1, 11.0, signal="SIGKILL"), peer]) is peer  # seen first
    stopped = RankEnd(1, 12.0, signal="SIGSTOP")
    assert cause_of([peer, stopped]) is stopped
    assert describe_failure([peer, stopped]) == (
        "rank 1 stopped (SIGSTOP), rank 0 exited with code 1 (E)"
    )
    assert cause_of([RankEnd(0, 5.0), killed]) is killed  # rank 0 killed by the supervisor


def test_events_are_held_until_opened_and_read_in_time_order(tmp_path):
    run_dir = tmp_path / "run"
    log = EventLog(run_dir)
    log.add({"event": "launch"})
    log.add({"event": "attempt", "attempt": 0})
    assert not run_dir.exists()  # nothing written, not even the folder, before open()
    write_event(run_dir, {"event": "fault"})  # a rank's row, written at once
    log.open()
    log.add({"event": "finished"})
    text = (run_dir / "restarts.jsonl").read_text()
    assert [json.loads(line)["event"] for line in text.splitlines()] == [
        "fault",
        "launch",
        "attempt",
        "finished",
    ]  # as written
    assert [e["event"] for e in read_events(run_dir)] == [
        "launch",
        "attempt",
        "fault",
        "finished",
    ]  # by time, from the last launch
    EventLog(run_dir).add({"event": "launch"})  # a refused second launch: never opened
    assert (run_dir / "restarts.jsonl").read_text() == text


def test_metrics_watch_finds_the_first_step_after_the_resume_point(tmp_path):
    path = tmp_path / "metrics.jsonl"

    def rows(*steps: int) -> str:
        return "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in steps)

    path.write_text(rows(1, 2, 3, 4, 5, 6))  # an earlier run's record
    since = path.stat().st_mtime + 1e-3
    watch = MetricsWatch(path, since, resume_step=4)
    time.sleep(0.05)
    assert not watch.written() and watch.poll() is None  # not this attempt's file yet
    part = tmp_path / "metrics.jsonl.part"  # the ranks rewrite it as MetricsLog does
    part.write_text(rows(1, 2, 3, 4) + json.dumps({"step": 4, "val_loss": 2.0}) + "\n")
    os.replace(part, path)
    assert watch.written() and watch.poll() is None
    new_rows = rows(5, 6, 7)
    with open(path, "a") as fh:
        fh.write(new_rows[:10])  # half a line: not read as a row
        fh.flush()
        assert watch.poll() is None
        fh.write(new_rows[10:])
    assert watch.poll() == 5  # not 7, the last row when it looked


def _fake_checkpoint(root: Path, step: int) -> Path:
    """A complete checkpoint as far as ``read_manifest`` sees (no tensors)."""
    path = root / ckpt.step_dir_name(step)
    path.mkdir(parents=True)
    (path / ckpt.MANIFEST).write_text(
        json.dumps({"format": ckpt.FORMAT_VERSION, "step": step, "files": {}})
    )
    (path / ckpt.COMPLETE).write_text(f"{step}\n")
    return path


def test_restart_resumes_from_the_runs_newest_checkpoint(tmp_path):
    cfg = load_config(TINY, [f"--train.run_dir={tmp_path / 'run'}"])
    root = ckpt.checkpoint_root(cfg)

    def resume(setting: str, given: int | None) -> str:
        c = load_config(
            TINY, [f"--train.run_dir={tmp_path / 'run'}", f"--checkpoint.resume={setting}"]
        )
        return restart_config(c, given).checkpoint.resume

    other = _fake_checkpoint(tmp_path / "other", 4)  # the run started from another run's step 4
    assert resume(str(other), 4) == str(other)  # nothing saved yet: the same start again
    assert resume("never", None) == "never"
    _fake_checkpoint(root, 6)  # then the run saved step 6, and failed
    assert resume(str(other), 4) == "auto"  # not back to step 4
    assert resume("never", None) == "auto"  # its own checkpoints, not a refusal
    assert resume(str(root / "step_000006"), 6) == str(root / "step_000006")
    assert restart_config(cfg, None) is cfg  # auto stays auto
    bad = _fake_checkpoint(root, 8)
    (bad / ckpt.MANIFEST).write_text("{")  # damaged: auto would skip it
    found, skipped = newest_valid_checkpoint(root)
    assert found == (6, root / "step_000006") and "unreadable oases.json" in str(skipped[0])


# ---------------------------------------------------------------- faults, 2 ranks (slow)


def _run_session(
    cmd: list[str], env: dict[str, str], timeout_s: float
) -> subprocess.CompletedProcess:
    """``cmd`` in a new session; past ``timeout_s`` the whole process group gets SIGKILL (the
    supervisor and its ranks, a stopped rank included) and the test fails."""
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} still running after {timeout_s} s: killed\n{out}{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _run(
    run_dir: Path, tmp: Path, fault: str = "", extra: tuple[str, ...] = (), timeout_s: float = 150
) -> subprocess.CompletedProcess:
    """``oases train ARGS`` in a subprocess, with ``OASES_FAULT=fault`` and ``TMPDIR=tmp``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "TORCHELASTIC_RUN_ID",
            "TORCHELASTIC_RESTART_COUNT",
            "LOCAL_RANK",
            "RANK",
            "WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "OASES_FAULT",
        )
    }
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    env["TMPDIR"] = str(tmp)
    if fault:
        env["OASES_FAULT"] = fault
    tmp.mkdir(parents=True, exist_ok=True)
    proc = _run_session(
        [sys.executable, "-m", "oases", "train", *ARGS, f"--train.run_dir={run_dir}", *extra],
        env,
        timeout_s,
    )
    left = [p.name for p in tmp.iterdir() if p.name.startswith(("torchelastic_", "oases-"))]
    assert left == [], "launcher folders left in the temporary directory"
    return proc


def _metrics(run_dir: Path) -> tuple[dict[int, float], dict[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return (
        {r["step"]: r["loss"] for r in rows if "loss" in r},
        {r["step"]: r["val_loss"] for r in rows if "val_loss" in r},
    )


def _complete(run_dir: Path) -> list[str]:
    return [p.name for _, p in ckpt.complete_checkpoints(run_dir / "checkpoints")]


def _events(run_dir: Path, kind: str) -> list[dict]:
    """The last launch's events of one kind."""
    return [r for r in read_events(run_dir) if r["event"] == kind]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted run of the fault tests' config."""
    base = tmp_path_factory.mktemp("reference")
    proc = _run(base / "run", base / "tmp")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses, vals = _metrics(base / "run")
    assert sorted(losses) == list(range(1, STEPS + 1)) and sorted(vals) == [4, 8]
    assert _complete(base / "run") == [f"step_{s:06d}" for s in (2, 4, 6, 8)]
    assert "attempt" not in proc.stderr  # no restart line
    return base / "run"


def _assert_recovered(
    reference: Path, run_dir: Path, proc: subprocess.CompletedProcess, resume_step: int
) -> None:
    """All steps done, each loss the reference's, the reference's checkpoints, and the
    attempt that finished resumed from ``resume_step``."""
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (losses, vals), (ref, ref_vals) = _metrics(run_dir), _metrics(reference)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in losses.items():  # same tp, same machine: exact, 1e-6 to spare
        assert loss == pytest.approx(ref[step], abs=1e-6), step
    assert vals == pytest.approx(ref_vals, abs=1e-6)
    assert _complete(run_dir) == _complete(reference)  # no completed checkpoint lost
    assert not list((run_dir / "checkpoints").glob("*.tmp"))
    assert _events(run_dir, "attempt")[-1]["resume_step"] == resume_step, proc.stderr
    resumed = [ln for ln in proc.stdout.splitlines() if ln.startswith("resumed from ")]
    path = run_dir / "checkpoints" / ckpt.step_dir_name(resume_step)
    assert resumed[-1].startswith(f"resumed from {path} at step {resume_step} "), resumed


FAULTS = {  # fault -> (rank, signal, last step logged, step the restart resumes from)
    "kill:rank=0:step=6:at=save": (0, "SIGKILL", 6, 4),  # step 6's files written, no commit
    "kill:rank=1:step=3:at=collective:n=5": (1, "SIGKILL", 2, 2),
    "stop:rank=1:step=7:at=step": (1, "SIGSTOP", 6, 6),  # ended 2 s after seen stopped
}


def _assert_one_restart(
    run_dir: Path,
    proc: subprocess.CompletedProcess,
    rank: int,
    sig: str,
    last: int,
    resume: int,
    first_resume: int = 0,
) -> dict:
    """The one restart line and the events (each attempt's first step is the one after its
    resume point: ``first_resume``, then ``resume``); returns the injected fault's event."""
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("attempt ")]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"attempt 0 failed after step {last}: rank {rank} "), lines[0]
    assert sig in lines[0], lines[0]
    assert f"restart 1 of 2: every rank resumes from step {resume} " in lines[0], lines[0]
    (injected,) = _events(run_dir, "fault")
    (failure,) = _events(run_dir, "failure")
    assert failure["cause"] == rank and failure["restart"] and injected["rank"] == rank
    assert failure["time"] >= injected["time"]
    assert [(e["attempt"], e["step"]) for e in _events(run_dir, "first_step")] == [
        (0, first_resume + 1),
        (1, resume + 1),
    ]
    return injected


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault", list(FAULTS), ids=["kill-mid-save", "kill-mid-collective", "stop-mid-step"]
)
def test_fault_restarts_the_group_and_loses_nothing(reference, tmp_path, fault):
    rank, sig, last, resume = FAULTS[fault]
    run_dir = tmp_path / "run"
    proc = _run(run_dir, tmp_path / "tmp", fault)
    _assert_recovered(reference, run_dir, proc, resume)
    injected = _assert_one_restart(run_dir, proc, rank, sig, last, resume)
    if sig == "SIGSTOP":  # ended by the supervisor, not by the peer's 30 s collective timeout
        assert f"rank {rank} stopped (SIGSTOP); restart 1 of 2" in proc.stderr, proc.stderr
        (failure,) = _events(run_dir, "failure")
        assert failure["time"] - injected["time"] >= STOP_GRACE_S
    if "collective" in fault:  # the rank died with the previous collective in flight
        assert injected["previous"]["async"] and injected["previous"]["group"] == "tp"
        program = build_program("oases", 2 * 2 + 2, 2, max_inflight=2)  # 2 layers
        starts = [i for i, ins in enumerate(program) if isinstance(ins, Start)]
        before = program[starts[3]]  # the 4th collective (a step's first 5 are the schedule's)
        waited = program.index(Wait(before.kind, before.index, before.sub))
        assert waited > starts[4] and injected["previous"]["tag"].startswith(
            f"{before.kind}:{before.index}:{before.sub}"
        )


@pytest.mark.slow
def test_kill_mid_step_after_an_explicit_checkpoint_restarts_from_the_newest(reference, tmp_path):
    """Resumed from an explicit checkpoint path (step 4), the run saves step 6, then rank 1 is
    killed in step 8: the restart continues from step 6, not from the path it was given."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    for step in (6, 8):
        shutil.rmtree(run_dir / "checkpoints" / ckpt.step_dir_name(step))
    given = run_dir / "checkpoints" / "step_000004"
    proc = _run(
        run_dir, tmp_path / "tmp", "kill:rank=1:step=8:at=step", (f"--checkpoint.resume={given}",)
    )
    _assert_recovered(reference, run_dir, proc, 6)
    assert f"resumed from {given} at step 4 " in proc.stdout
    injected = _assert_one_restart(run_dir, proc, 1, "SIGKILL", 7, 6, first_resume=4)
    assert injected["next"]["direction"] == "backward"  # mid-step: forward done


@pytest.mark.slow
def test_truncated_and_deleted_shards_resume_from_the_newest_intact_checkpoint(reference, tmp_path):
    """Between runs, step 8's shard of rank 1 is truncated and step 6's of rank 0 deleted:
    the run resumes from step 4 with a warning for each, and saves 6 and 8 again."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    shard = run_dir / "checkpoints" / "step_000008" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    (run_dir / "checkpoints" / "step_000006" / "__0_0.distcp").unlink()
    proc = _run(run_dir, tmp_path / "tmp")
    _assert_recovered(reference, run_dir, proc, 4)
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("warning: skipping")]
    assert any("step_000008: __1_0.distcp has" in w and "truncated" in w for w in warnings)
    assert any("step_000006: missing file __0_0.distcp" in w for w in warnings), warnings
    assert "attempt " not in proc.stderr  # nothing failed: no restart


@pytest.mark.slow
def test_user_error_is_not_retried_and_writes_nothing(reference, tmp_path):
    """A user error ends the run with its one line (no restart line, no second attempt's
    line) and leaves no trace in the run directory: data too short for a new run, and a
    resume refused (another model width) in a copy of the reference run, whose files stay
    byte for byte as they were."""
    text = tmp_path / "short.txt"
    text.write_text("too short for one window\n")
    run_dir = tmp_path / "run"
    proc = _run(run_dir, tmp_path / "tmp", extra=(f"--data.source={text}",))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: data.source="), proc.stderr
    assert not (run_dir / "restarts.jsonl").exists()

    resumed = tmp_path / "resumed"
    shutil.copytree(reference, resumed)
    before = {p: p.read_bytes() for p in resumed.rglob("*") if p.is_file()}
    proc = _run(resumed, tmp_path / "tmp", extra=("--model.dim=64",))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.dim=32 (now 64)" in lines[0], proc.stderr
    after = {p: p.read_bytes() for p in resumed.rglob("*") if p.is_file()}
    assert after.keys() == before.keys() and after == before
