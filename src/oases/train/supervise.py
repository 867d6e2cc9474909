"""Recovery of local ranks: run the group, and after a failure restart all of it from the newest
valid checkpoint, with a fresh rendezvous, up to ``--max-restarts`` times.

``supervise(cfg, nproc, max_restarts, threads)`` runs attempts 0, 1, ... Each attempt is one
group of ``nproc`` ranks started by torch's elastic multiprocessing (``start_processes``: spawn,
per-rank environment, ``error.json`` per failed rank) around a new rendezvous store: the
supervisor opens a ``TCPStore`` on port 0 (the system picks a free port, no race with other
programs), holds it for the attempt and closes it after, and the ranks join it as torchrun's
agent has them join its own (``MASTER_PORT``, ``TORCHELASTIC_USE_AGENT_STORE=True``: every
rank's ``init_process_group`` is then a client of that store). The attempt number reaches the
ranks as ``TORCHELASTIC_RESTART_COUNT``, as under torchrun.

While an attempt runs, the supervisor polls every ``POLL_S``: each rank's exit status (peeked
with ``waitid(WNOWAIT)``, reaped later by torch) and whether it is stopped (``/proc``). A rank
that exits non-zero or dies of a signal ends the attempt, and so does a rank seen stopped
(SIGSTOP, SIGTSTP, or held by a debugger: state T in ``/proc``) for ``STOP_GRACE_S``: it would
hang its peers until their collective timeout (``parallel.timeout_s``), so the supervisor does
not wait for that; the grace lets a brief stop (a profiler attaching for a moment) pass. A rank
held stopped on purpose (a debugger at a breakpoint) is ended the same way: debug one process
(``--nproc-per-node 1``, no restarts: no supervisor) or under torchrun. Every other rank is
then killed with SIGKILL (a stopped process cannot act on SIGTERM), so nothing of a failed
attempt is left when the next one starts. The cause is a stopped rank if there is one, else
the earliest failure seen, a signal before an error exit on a tie.

Decision: a cause that exited with ``EXIT_USER_ERROR`` (bad config, missing data, a damaged
checkpoint: the rank printed one ``error:`` line) is never retried. Anything else (a signal, a
collective timeout, a crash) restarts the group while restarts are left. A restart resumes
from the newest valid checkpoint of the run (``checkpoint.resume = "auto"``); ``never`` and an
explicit checkpoint path are replaced by ``auto`` once the run has saved a newer checkpoint,
so a restart never goes back to the old path (nor refuses the run's own checkpoints).
Between attempts one line goes to stderr: the failed rank, its signal or exit code and last
error line, the restart number and the step the next attempt resumes from.

Events, with wall-clock times, go to ``<run_dir>/restarts.jsonl`` (``train/restart_events.py``
says which). The supervisor holds its events in memory (``EventLog``) until an attempt's ranks
have passed their setup checks (rank 0 has rewritten the metrics file, which it does after every
check of config, data and checkpoint) or finished: a run refused by those checks writes nothing
into the run directory.

Torch's launcher logs go to a temporary folder removed at the end (no ``torchelastic_*``
folder is left in the system's temporary directory). Linux: ``/proc`` tells a stopped rank.

Why not torch's agent (``elastic_launch`` with ``max_restarts``, what torchrun runs): with its
shared rendezvous store the restarted gloo ranks connect to the previous round's addresses and
fail (measured in ``benchmarks/2026-12-01-faults``; pytorch/pytorch#135712, #167288). Why not
one ``elastic_launch(max_restarts=0)`` per attempt: its agent reports only the first failure it
polls, hides the pids, and stops a failed group with SIGTERM, waiting 30 s for a stopped rank
that cannot act on it. ``start_processes``, the engine under both, gives the pids: the
supervisor sees every rank's end and every stopped rank, and kills with SIGKILL at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oases.config import Config
from oases.train.launch import EXIT_RANK_FAILED, EXIT_USER_ERROR, nccl_timeout_line, run_rank
from oases.train.restart_events import EventLog

_SOURCE_PREFIX = re.compile(r"\[[^\]\s]+\.(?:cc|cpp|h|hpp):\d+\]\s*")
POLL_S = 0.05
STOP_GRACE_S = 2.0  # a rank stopped this long ends the attempt (see the module docstring)


# ---------------------------------------------------------------- how a rank ended


@dataclass(frozen=True)
class RankEnd:
    """How one rank of a failed attempt ended, as the supervisor saw it."""

    rank: int
    seen: float  # time.time() when the supervisor noticed
    exitcode: int | None = None  # None: ended by a signal, or still running
    signal: str | None = None  # "SIGKILL", ...; "SIGSTOP" for a rank found stopped
    error: str = ""  # the rank's last error line (its error.json), if any

    @property
    def failed(self) -> bool:
        """Ended (or stopped) before the group finished: a worker ends only after the
        supervisor has collected every rank's result, so even exit code 0 is early."""
        return self.signal is not None or self.exitcode is not None

    def describe(self) -> str:
        if self.signal == "SIGSTOP":
            return f"rank {self.rank} stopped (SIGSTOP)"
        text = (f"rank {self.rank} killed by {self.signal}" if self.signal
                else f"rank {self.rank} exited with code {self.exitcode}")
        return f"{text} ({self.error})" if self.error else text

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def cause_of(ends: list[RankEnd]) -> RankEnd:
    """The rank that brought the attempt down: a stopped rank (its peers timed out on it), else
    the earliest failure seen; on a tie, a signal before a non-zero exit code before exit code
    0 (a rank interrupted by SIGINT exits 0 early), then the lowest rank."""
    failed = [e for e in ends if e.failed]
    stopped = [e for e in failed if e.signal == "SIGSTOP"]
    if stopped:
        return min(stopped, key=lambda e: e.rank)
    return min(failed, key=lambda e: (e.seen, e.signal is None, e.exitcode == 0, e.rank))


def describe_failure(ends: list[RankEnd]) -> str:
    """One line: the cause, and for a stopped rank the peer error that revealed it."""
    cause = cause_of(ends)
    text = cause.describe()
    if cause.signal == "SIGSTOP":
        peers = [e for e in ends if e.failed and e is not cause and e.signal != "SIGSTOP"]
        if peers:
            text += f", {min(peers, key=lambda e: e.seen).describe()}"
    return text


def _error_line(path: str) -> str:
    """The first line of the exception message in a torch elastic ``error.json`` (an NCCL
    watchdog timeout: ``launch.nccl_timeout_line``)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    msg = data.get("message", "")
    if isinstance(msg, dict):
        msg = msg.get("message", "")
    nccl = nccl_timeout_line(str(msg))  # the watchdog's message, wrapped in a C++ trace
    if nccl is not None:
        return nccl
    line = next((ln.strip() for ln in str(msg).splitlines() if ln.strip()), "")
    line = _SOURCE_PREFIX.sub("", line)  # gloo's "[/path/to/file.cc:78] "
    return line if len(line) <= 160 else line[:157] + "..."


def _peek_exit(pid: int) -> tuple[int | None, str | None] | None:
    """(exit code, signal name) of child ``pid`` if it has ended, else None; not reaped."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # already reaped by torch's join, which reaps clean exits only
        return 0, None
    if info is None:
        return None
    if info.si_code == os.CLD_EXITED:
        return info.si_status, None
    return None, signal.Signals(info.si_status).name


def _is_stopped(pid: int) -> bool:
    """True when ``pid`` is stopped (SIGSTOP, SIGTSTP, ...): state T in ``/proc/PID/stat``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] in (["T"], ["t"])


# ---------------------------------------------------------------- where an attempt resumes


def _resume_point(cfg: Config) -> tuple[int, Path | None]:
    """(step, checkpoint) the ranks of ``cfg`` will start from (0, None: a fresh start); the
    ranks decide with ``resume.resolve_resume``, this predicts it for the log line."""
    from oases.train import checkpoint as ckpt
    from oases.train import resume as resumes

    resume = cfg.checkpoint.resume
    if resume == "never":
        return 0, None
    if resume == "auto":
        found = resumes.newest_valid_checkpoint(ckpt.checkpoint_root(cfg))[0]
        return (0, None) if found is None else found
    try:
        path = resumes.resolve_resume(cfg)
        return (0, None) if path is None else (int(ckpt.read_manifest(path)["step"]), path)
    except (ValueError, KeyError):
        return 0, None  # the ranks report it


def restart_config(cfg: Config, given_step: int | None) -> Config:
    """The config a restart runs: ``resume = "auto"`` once the run's checkpoint folder holds
    a valid checkpoint newer than the one the user named (``given_step``; None when the user
    named none), so that the restart continues from the newest checkpoint of the run."""
    from oases.train import checkpoint as ckpt
    from oases.train import resume as resumes

    resume = cfg.checkpoint.resume
    newest = resumes.newest_valid_checkpoint(ckpt.checkpoint_root(cfg))[0]
    if resume == "auto" or newest is None:
        return cfg
    if resume != "never" and (given_step is None or newest[0] <= given_step):
        return cfg
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint,
                                                                   resume="auto"))


# ---------------------------------------------------------------- one attempt


def last_logged_step(path: Path, since: float) -> int | None:
    """The step of the last training row of metrics file ``path`` if the file was written at
    or after ``since`` (the ranks rewrite it when they start), else None."""
    try:
        st = path.stat()
        if st.st_mtime < since:
            return None
        with open(path, "rb") as fh:
            fh.seek(max(0, st.st_size - 4096))
            lines = fh.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "loss" in row:
            return int(row.get("step", 0))
    return None


class MetricsWatch:
    """What the ranks of one attempt wrote to metrics file ``path``: rank 0 rewrites the file
    (a new file renamed over the old) once its setup checks passed, at or after ``since``, then
    appends a row per step. Reads only what was appended since the last look."""

    def __init__(self, path: Path, since: float, resume_step: int) -> None:
        self.path, self.since, self.resume_step = path, since, resume_step
        self.inode, self.offset, self.tail = -1, 0, b""
        self.first_step: int | None = None

    def written(self) -> bool:
        """True once this attempt's rank 0 has rewritten the file (its setup checks passed)."""
        try:
            return self.path.stat().st_mtime >= self.since
        except OSError:
            return False

    def poll(self) -> int | None:
        """The step of the attempt's first training row after ``resume_step``, once logged."""
        if self.first_step is not None:
            return self.first_step
        try:
            st = self.path.stat()
            if st.st_mtime < self.since:
                return None
            if st.st_ino != self.inode or st.st_size < self.offset:  # a new or rewritten file
                self.inode, self.offset, self.tail = st.st_ino, 0, b""
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return None
        self.offset += len(data)
        *lines, self.tail = (self.tail + data).split(b"\n")
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and "loss" in row and row.get("step", 0) > self.resume_step:
                self.first_step = int(row["step"])
                return self.first_step
        return None


@dataclass
class Attempt:
    """One attempt's settings."""

    cfg: Config
    nproc: int
    number: int
    max_restarts: int
    threads: int | None
    run_id: str
    log_root: Path
    resume_step: int
    events: EventLog


def run_attempt(a: Attempt) -> list[RankEnd] | None:
    """Run one group of ranks to the end. None on success, else how every rank ended (the
    failed ones as seen, the rest as killed by the supervisor: ``exitcode`` None)."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes

    from oases.train.metrics import metrics_path

    started = time.time()
    # this attempt's rendezvous store, held until its ranks are gone (torchrun's agent store)
    store = TCPStore("127.0.0.1", 0, world_size=a.nproc, is_master=True,
                     wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=a.cfg.parallel.timeout_s))
    a.events.add({"event": "attempt", "attempt": a.number, "port": store.port,
                  "nproc": a.nproc, "resume_step": a.resume_step})
    envs = {r: {"RANK": str(r), "LOCAL_RANK": str(r), "GROUP_RANK": "0", "ROLE_RANK": str(r),
                "WORLD_SIZE": str(a.nproc), "LOCAL_WORLD_SIZE": str(a.nproc),
                "ROLE_WORLD_SIZE": str(a.nproc), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": str(True),
                "TORCHELASTIC_RUN_ID": a.run_id,
                "TORCHELASTIC_RESTART_COUNT": str(a.number),
                "TORCHELASTIC_MAX_RESTARTS": str(a.max_restarts)}
            for r in range(a.nproc)}
    logs = DefaultLogsSpecs(log_dir=str(a.log_root), redirects=Std.NONE, tee=Std.NONE)
    ctx = start_processes(name="oases", entrypoint=run_rank,
                          args={r: (a.cfg, a.threads) for r in range(a.nproc)}, envs=envs,
                          logs_specs=logs, start_method="spawn")
    pids = ctx.pids()
    watch = MetricsWatch(metrics_path(a.cfg), started, a.resume_step)
    ended: dict[int, RankEnd] = {}
    stopped_since: dict[int, float] = {}
    try:
        while True:
            now = time.time()
            for r, pid in pids.items():
                status = None if r in ended else _peek_exit(pid)
                if status is not None:
                    ended[r] = RankEnd(r, now, exitcode=status[0], signal=status[1],
                                       error=_error_line(ctx.error_files[r]))
            stopped = {r for r, pid in pids.items() if r not in ended and _is_stopped(pid)}
            stopped_since = {r: stopped_since.get(r, now) for r in stopped}
            hung = any(now - t >= STOP_GRACE_S for t in stopped_since.values())
            if ended or hung:
                ends = list(ended.values()) + [RankEnd(r, now, signal="SIGSTOP")
                                               for r in sorted(stopped)]
                return _with_survivors(ends, a.nproc, now)
            if not a.events.opened and watch.written():  # the ranks passed their checks
                a.events.open()
            if watch.first_step is None and watch.poll() is not None:
                a.events.add({"event": "first_step", "step": watch.first_step,
                              "attempt": a.number})
            if not stopped:  # collects the return values; a stopped rank cannot finish
                result = ctx.wait(0)
                if result is not None and not result.is_failed():
                    a.events.open()  # finished: its checks passed
                    return None
                if result is not None:  # a failure between the peek and the poll
                    return _with_survivors([
                        RankEnd(f.local_rank, now,
                                exitcode=f.exitcode if f.exitcode >= 0 else None,
                                signal=None if f.exitcode >= 0 else signal.Signals(
                                    -f.exitcode).name,
                                error=_error_line(f.error_file))
                        for f in result.failures.values()], a.nproc, now)
            time.sleep(POLL_S)
    finally:
        _kill_children(pids.values())
        ctx.close(death_sig=signal.SIGKILL, timeout=10)
        if watch.written():  # e.g. a rank failed in its first step, between two polls
            a.events.open()
        del store  # the server stops: the next attempt has a new store on a new port


def _kill_children(pids: Any) -> None:
    """SIGKILL each of ``pids`` that is still an unreaped child of this process (running,
    stopped, or a zombie; a reaped pid may already belong to another process)."""
    for pid in pids:
        try:
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # SIGKILL also ends a stopped process


def _with_survivors(ends: list[RankEnd], nproc: int, now: float) -> list[RankEnd]:
    """``ends`` plus a record for every rank still running (killed by the supervisor)."""
    seen = {e.rank for e in ends}
    return sorted(ends + [RankEnd(r, now) for r in range(nproc) if r not in seen],
                  key=lambda e: e.rank)


# ---------------------------------------------------------------- the attempts


def supervise(cfg: Config, nproc: int, max_restarts: int, threads: int | None) -> int:
    """Run ``cfg`` on ``nproc`` local ranks, restarting the group up to ``max_restarts``
    times; returns the process exit code (0, ``EXIT_USER_ERROR`` or ``EXIT_RANK_FAILED``;
    128 + the signal when SIGINT, SIGTERM, SIGHUP or SIGQUIT stopped it: torch's
    ``start_processes`` turns them into ``SignalException``; every rank is killed, nothing
    restarted)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.getsignal(s) for s in _STOP_SIGNALS} if main else {}
    events = EventLog(cfg.train.run_dir)
    try:
        with tempfile.TemporaryDirectory(prefix="oases-launch-") as logs:
            return _attempts(cfg, nproc, max_restarts, threads, Path(logs), events)
    except (SignalException, KeyboardInterrupt) as exc:
        sig = getattr(exc, "sigval", signal.SIGINT)
        events.add({"event": "gave_up", "reason": f"{sig.name} received"})
        print(f"error: stopped by {sig.name}; every rank was stopped", file=sys.stderr,
              flush=True)
        return 128 + int(sig)
    finally:
        for s, handler in previous.items():  # start_processes installed its own
            signal.signal(s, handler)


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def finished_line(restarts: int, elapsed_s: float) -> str:
    """The supervisor's last line after a run that needed restarts: the whole run's time (the
    last attempt's done line counts only its own steps)."""
    return (f"finished after {restarts} restart{'s' if restarts > 1 else ''}: "
            f"{elapsed_s:.1f}s since the launch, every attempt included (the done line above "
            "counts the last attempt's steps)")


def _attempts(cfg: Config, nproc: int, max_restarts: int, threads: int | None,
              logs: Path, events: EventLog) -> int:
    from oases.train.metrics import metrics_path

    resume_step, resume_path = _resume_point(cfg)
    given = cfg.checkpoint.resume not in ("auto", "never") and resume_path is not None
    given_step = resume_step if given else None
    run_id = f"oases-{uuid.uuid4().hex[:8]}"
    events.add({"event": "launch", "run_id": run_id, "nproc": nproc,
                "max_restarts": max_restarts, "resume": cfg.checkpoint.resume})
    attempt_cfg = cfg
    launched = time.time()
    for number in range(max_restarts + 1):
        started = time.time()
        ends = run_attempt(Attempt(attempt_cfg, nproc, number, max_restarts, threads, run_id,
                                   logs, resume_step, events))
        if ends is None:
            events.add({"event": "finished", "attempt": number})
            if number:
                print(finished_line(number, time.time() - launched), flush=True)
            return 0
        cause = cause_of(ends)
        last = last_logged_step(metrics_path(cfg), started)
        when = f"after step {last}" if last is not None else "before its first step"
        what = describe_failure(ends)
        user_error = cause.exitcode == EXIT_USER_ERROR and cause.signal is None
        retry = not user_error and number < max_restarts
        if retry:
            attempt_cfg = restart_config(cfg, given_step)
            resume_step, resume_path = _resume_point(attempt_cfg)
        events.add({
            "event": "failure", "attempt": number, "cause": cause.rank, "description": what,
            "when": when,
            "ranks": [e.to_json() for e in ends], "user_error": user_error, "restart": retry,
            "resume_step": resume_step if retry else None, "last_logged_step": last})
        if user_error:  # the ranks printed the one error line
            events.add({"event": "gave_up", "reason": "user error"})
            return EXIT_USER_ERROR
        if not retry:
            events.add({"event": "gave_up", "reason": "no restarts left"})
            print(f"error: training failed {when}: {what} (attempt {number}; no restart left, "
                  f"--max-restarts={max_restarts})", file=sys.stderr, flush=True)
            return EXIT_RANK_FAILED
        where = (f"step {resume_step} ({resume_path})" if resume_path is not None
                 else "step 0 (no checkpoint yet)")
        print(f"attempt {number} failed {when}: {what}; restart {number + 1} of "
              f"{max_restarts}: every rank resumes from {where}", file=sys.stderr, flush=True)
    return EXIT_RANK_FAILED  # pragma: no cover - the last attempt returns above
