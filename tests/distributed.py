"""Multi-rank test harness: run a function on N local ranks (spawned processes, gloo, file://).

    results = run_ranks(fn, world_size, tmp_path, *args, timeout_s=120)

Each rank is a fresh process started with the "spawn" start method. It sets one intra-op
thread, joins a gloo process group through a ``file://`` rendezvous inside ``tmp_path`` (no
ports, no races between tests), runs ``fn(rank, world_size, *args)``, writes the (picklable)
return value or the traceback text to a file, and destroys the group.

``fn`` must be a module-level function that the child can import: define rank functions in the
test module itself. The parent returns the per-rank results as a list indexed by rank. A rank
still running at ``timeout_s`` is killed and the test fails naming the ranks that did not
finish. Once one rank has failed, the others get a short grace period (they are probably blocked
in a collective with the failed one) and are then killed, so a failure costs seconds, not the
collective timeout.

When ranks fail, the ``AssertionError`` leads with the real failure: the earliest failure that is
not an echo (a peer that lost its connection or timed out in a collective because the failed
rank left it), its exception first and then its traceback; every other failed rank follows in
one line each::

    rank 1 of 2 failed: AssertionError: Tensor-likes are not close! ...
    <rank 1's traceback>
    other ranks:
      rank 0 (echo): RuntimeError: [...] Connection closed by peer [...]
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

REPO_ROOT = Path(__file__).resolve().parent.parent
SRC_DIR = REPO_ROOT / "src"
TESTS_DIR = Path(__file__).resolve().parent

# Collective timeout inside the ranks: short, so a hang surfaces as an error within seconds.
COLLECTIVE_TIMEOUT_S = 30.0
# After the first rank fails, how long the others may take to finish on their own.
FAILURE_GRACE_S = 5.0
_POLL_S = 0.05
# A failure whose exception says one of these is an echo: the rank lost a peer that failed first.
ECHO_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Socket closed",
    "timed out",
    "Timed out",
    "Timeout",
)


def _prepend_env_path(key: str, paths: list[Path]) -> None:
    existing = [p for p in os.environ.get(key, "").split(os.pathsep) if p]
    new = [str(p) for p in paths if str(p) not in existing]
    os.environ[key] = os.pathsep.join(new + existing)


def _child_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    rdzv_file: str,
    result_file: str,
    collective_timeout_s: float,
    args: tuple[Any, ...],
    backend: str = "gloo",
) -> None:
    """Entry point of one rank (runs in the spawned process).

    On failure the traceback and its time are written *before* the process group is torn down:
    tearing it down makes blocked peers fail too, and the parent lists the earliest failure first.
    """
    import torch.distributed as dist

    try:
        import torch

        torch.set_num_threads(1)
        device_id = None
        if backend == "nccl":  # one GPU per rank (init_distributed reads LOCAL_RANK)
            os.environ["LOCAL_RANK"] = str(rank)
            os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
            device_id = torch.device("cuda", rank)
            torch.cuda.set_device(device_id)
        dist.init_process_group(
            backend,
            init_method=f"file://{rdzv_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout_s),
            device_id=device_id,
        )
        value = fn(rank, world_size, *args)
        dist.destroy_process_group()
        outcome: tuple[Any, ...] = ("ok", value)
    except BaseException as exc:  # everything goes back to the parent
        outcome = ("error", traceback.format_exc(), time.time(), _exception_text(exc))
    ok = _write_outcome(result_file, outcome)
    if outcome[0] != "ok" and dist.is_initialized():
        # already failing and the traceback is written: a teardown error adds nothing
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # Non-zero exit code on error lets the parent notice quickly.
    os._exit(0 if ok else 1)


def _exception_text(exc: BaseException) -> str:
    """``Type: message`` of an exception (the message may span several lines)."""
    text = str(exc).strip()
    return type(exc).__name__ + (f": {text}" if text else "")


def _write_outcome(result_file: str, outcome: tuple[Any, ...]) -> bool:
    """Write the outcome atomically; an unpicklable return value becomes an error. True if ok."""
    tmp = result_file + ".part"
    try:
        with open(tmp, "wb") as fh:
            pickle.dump(outcome, fh)
    except Exception as exc:  # an unpicklable return value
        outcome = (
            "error",
            traceback.format_exc(),
            time.time(),
            f"the return value does not pickle: {_exception_text(exc)}",
        )
        with open(tmp, "wb") as fh:
            pickle.dump(outcome, fh)
    os.replace(tmp, result_file)
    return outcome[0] == "ok"


def _read_outcome(path: Path) -> tuple[Any, ...] | None:
    if not path.exists():
        return None
    with open(path, "rb") as fh:
        return pickle.load(fh)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    tmp_path: str | os.PathLike[str],
    *args: Any,
    timeout_s: float = 120.0,
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; return results.
    ``backend="nccl"``: NCCL ranks instead, rank r on GPU r (tests/test_gpu.py).

    Raises AssertionError naming the failed rank(s) with their tracebacks, or naming the ranks
    that did not finish within ``timeout_s`` (those are killed).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    # Children import the test module (for fn) and oases: make both importable even when the
    # package is not installed. Spawned children inherit os.environ at start.
    _prepend_env_path("PYTHONPATH", [SRC_DIR, TESTS_DIR])
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    Path(tmp_path).mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="ranks-", dir=tmp_path))
    rdzv_file = run_dir / "rdzv"
    result_files = [run_dir / f"rank{r}.result" for r in range(world_size)]

    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=_child_main,
            args=(
                fn,
                r,
                world_size,
                str(rdzv_file),
                str(result_files[r]),
                collective_timeout_s,
                args,
                backend,
            ),
            name=f"oases-rank{r}",
            daemon=True,
        )
        for r in range(world_size)
    ]
    start = time.monotonic()
    for p in procs:
        p.start()

    deadline = start + timeout_s
    first_failure_at: float | None = None
    try:
        while True:
            alive = [r for r, p in enumerate(procs) if p.is_alive()]
            if not alive:
                break
            now = time.monotonic()
            if first_failure_at is None and any(p.exitcode not in (None, 0) for p in procs):
                first_failure_at = now
            if first_failure_at is not None and now - first_failure_at > FAILURE_GRACE_S:
                break
            if now > deadline:
                break
            time.sleep(_POLL_S)
    finally:
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].kill()
        for p in procs:
            p.join(timeout=10)
    elapsed = time.monotonic() - start

    outcomes = [_read_outcome(f) for f in result_files]
    failures: list[Failure] = []
    for r, (p, out) in enumerate(zip(procs, outcomes)):
        if out is not None and out[0] == "error":
            failures.append(Failure(r, out[2], out[3], out[1]))
        elif out is None and r not in hung:
            failures.append(
                Failure(r, float("inf"), f"exited with code {p.exitcode} without a result", "")
            )
    if failures:
        raise AssertionError(failure_report(failures, world_size, elapsed, hung))
    if hung:
        raise AssertionError(
            f"ranks {hung} of {world_size} did not finish within {timeout_s:.0f}s and were killed"
        )
    return [out[1] for out in outcomes]  # type: ignore[index]


@dataclass(frozen=True)
class Failure:
    """One failed rank: when it failed (``time.time()``; inf if unknown), its exception as
    ``Type: message`` and its traceback."""

    rank: int
    at: float
    exception: str
    traceback: str

    @property
    def echo(self) -> bool:
        """Did this rank fail only because a peer failed first (lost connection, timeout)?"""
        return any(m in self.exception for m in ECHO_MARKERS)

    def line(self) -> str:
        """The exception in one line of at most ~200 characters."""
        text = " ".join(self.exception.split())
        return text if len(text) <= 200 else text[:197] + "..."


def failure_report(
    failures: list[Failure], world_size: int, elapsed: float, hung: list[int]
) -> str:
    """The message of a failed run: the real failure first (the earliest that is not an echo,
    else the earliest), with its whole exception and traceback; then one line per other rank."""
    ordered = sorted(failures, key=lambda f: (f.echo, f.at, f.rank))
    first, others = ordered[0], sorted(ordered[1:], key=lambda f: (f.at, f.rank))
    text = [f"rank {first.rank} of {world_size} failed: {first.exception}"]
    if first.traceback:
        text.append(f"--- rank {first.rank}'s traceback:\n{first.traceback.rstrip()}")
    if others or hung:
        text.append(f"other ranks ({len(failures)} of {world_size} failed after {elapsed:.1f}s):")
        text += [f"  rank {f.rank}{' (echo)' if f.echo else ''}: {f.line()}" for f in others]
        text += [f"  rank {r}: still running after the failure, killed" for r in hung]
    return "\n".join(text)
