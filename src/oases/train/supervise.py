"""Recovery of local ranks: run the group, and after a failure restart all of it from the newest
valid checkpoint, with a fresh rendezvous, up to ``--max-restarts`` times.

``supervise(cfg, nproc, max_restarts, threads)`` runs attempts 0, 1, ... Each attempt is one
group of ``nproc`` spawned ranks (``train.rank_group``: per-rank environment, ``error.json``
per failed rank) around a new rendezvous store: the supervisor listens on 127.0.0.1 port 0 (the
system picks a free port, no race with other programs) before any rank starts, rank 0 serves
the ``TCPStore`` on that socket for the attempt, and the ranks join it as torchrun's agent has
them join its own (``MASTER_PORT``, ``TORCHELASTIC_USE_AGENT_STORE=True``: every rank's
``init_process_group`` is then a client of that store). The attempt number reaches the ranks
as ``TORCHELASTIC_RESTART_COUNT``, as under torchrun. The supervisor imports no torch to start
the ranks; the first attempt's rank 0 makes the launcher's checks after its imports
(``first_checks``) and reports the step the run resumes from; the others wait for the go.

    attempt: listen -> spawn ranks -> [rank 0: checks, report] -> go -> poll ... -> close

While an attempt runs, the supervisor polls every ``POLL_S``: each rank's exit status and
whether it is stopped (``/proc``). A rank
that exits non-zero or dies of a signal ends the attempt, and so does a rank seen stopped
(SIGSTOP, SIGTSTP, or held by a debugger: state T in ``/proc``) for ``STOP_GRACE_S``: it would
hang its peers until their collective timeout (``parallel.timeout_s``), so the supervisor does
not wait for that; the grace lets a brief stop (a profiler attaching for a moment) pass. A rank
held stopped on purpose (a debugger at a breakpoint) is ended the same way: debug one process
(``--nproc-per-node 1``, no restarts: no supervisor) or under torchrun. Every other rank is
then killed with SIGKILL (a stopped process cannot act on SIGTERM), so nothing of a failed
attempt is left when the next one starts. The cause is a stopped rank if there is one, else
the earliest failure seen, a signal before an error exit on a tie. The attempt succeeds when
every rank has exited 0.

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

The ranks' ``error.json`` files go to a temporary folder removed at the end. Linux: ``/proc``
tells a stopped rank.

Why not torch's agent (``elastic_launch`` with ``max_restarts``, what torchrun runs): with its
shared rendezvous store the restarted gloo ranks connect to the previous round's addresses and
fail (measured in ``benchmarks/2026-12-01-faults``; pytorch/pytorch#135712, #167288). Why not
one ``elastic_launch(max_restarts=0)`` per attempt: its agent reports only the first failure it
polls, hides the pids, and stops a failed group with SIGTERM, waiting 30 s for a stopped rank
that cannot act on it. Why not ``start_processes``, the engine under both (used here before):
it needs torch in the supervisor before the first rank starts, 2-3 s of imports on the path to
the first step; ``rank_group`` spawns the ranks with the standard library.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oases.config import Config
from oases.train.launch import EXIT_RANK_FAILED, EXIT_USER_ERROR
from oases.train.rank_ends import (
    RankEnd,
    cause_of,
    describe_failure,
    error_line,
    is_stopped,
    with_survivors,
)
from oases.train.rank_group import RankGroup
from oases.train.restart_events import EventLog

POLL_S = 0.05
STOP_GRACE_S = 2.0  # a rank stopped this long ends the attempt (see the module docstring)


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
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume="auto"))


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
    """One attempt's settings; ``resume`` (step, checkpoint) is None until known: the first
    attempt's rank 0 reports it after the launcher's checks (``first_checks``)."""

    cfg: Config
    nproc: int
    number: int
    max_restarts: int
    threads: int | None
    run_id: str
    log_root: Path
    resume: tuple[int, Path | None] | None
    events: EventLog


def first_checks(cfg: Config, nproc: int) -> tuple[int, Path | None]:
    """The launcher's checks (``launch.check_launch``), made by rank 0 of the first attempt
    while its peers import, and the step the run resumes from."""
    from oases.train.launch import check_launch

    check_launch(cfg, nproc)
    return _resume_point(cfg)


def _rank_envs(a: Attempt, port: int) -> dict[int, dict[str, str]]:
    """Each rank's launcher environment, as torchrun's agent sets it (its store at ``port``)."""
    return {
        r: {
            "RANK": str(r),
            "LOCAL_RANK": str(r),
            "GROUP_RANK": "0",
            "ROLE_RANK": str(r),
            "WORLD_SIZE": str(a.nproc),
            "LOCAL_WORLD_SIZE": str(a.nproc),
            "ROLE_WORLD_SIZE": str(a.nproc),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": str(True),
            "TORCHELASTIC_RUN_ID": a.run_id,
            "TORCHELASTIC_RESTART_COUNT": str(a.number),
            "TORCHELASTIC_MAX_RESTARTS": str(a.max_restarts),
        }
        for r in range(a.nproc)
    }


def run_attempt(a: Attempt) -> list[RankEnd] | None:
    """Run one group of ranks to the end. None on success, else how every rank ended (the
    failed ones as seen, the rest as killed by the supervisor: ``exitcode`` None)."""
    from oases.train.metrics import metrics_path

    started = time.time()
    # the attempt's rendezvous port, listened on before any rank starts; rank 0 serves it
    listen = socket.create_server(("127.0.0.1", 0), backlog=max(128, a.nproc))
    port = listen.getsockname()[1]
    check = functools.partial(first_checks, a.cfg, a.nproc) if a.resume is None else None
    group = RankGroup(_rank_envs(a, port), a.log_root / f"attempt_{a.number}", listen, check)
    listen.close()
    watch: MetricsWatch | None = None
    ended: dict[int, RankEnd] = {}
    stopped_since: dict[int, float] = {}
    try:
        while True:
            now = time.time()
            if watch is None:
                if a.resume is None:
                    a.resume = group.report()[1]
                if a.resume is not None:  # the checks passed: the ranks may run
                    a.events.add(
                        {
                            "event": "attempt",
                            "attempt": a.number,
                            "port": port,
                            "nproc": a.nproc,
                            "resume_step": a.resume[0],
                        }
                    )
                    group.go(a.cfg, a.threads)
                    watch = MetricsWatch(metrics_path(a.cfg), started, a.resume[0])
            codes = {r: group.exitcode(r) for r in group.pids}
            for r, code in codes.items():
                if code is not None and code != 0 and r not in ended:
                    ended[r] = RankEnd(
                        r,
                        now,
                        exitcode=code if code > 0 else None,
                        signal=signal.Signals(-code).name if code < 0 else None,
                        error=error_line(group.error_files[r]),
                    )
            running = [r for r, code in codes.items() if code is None]
            stopped = {r for r in running if is_stopped(group.pids[r])}
            stopped_since = {r: stopped_since.get(r, now) for r in stopped}
            hung = any(now - t >= STOP_GRACE_S for t in stopped_since.values())
            if ended or hung:
                ends = list(ended.values()) + [
                    RankEnd(r, now, signal="SIGSTOP") for r in sorted(stopped)
                ]
                return with_survivors(ends, a.nproc, now)
            if watch is not None:
                if not a.events.opened and watch.written():  # the ranks passed their checks
                    a.events.open()
                if watch.first_step is None and watch.poll() is not None:
                    a.events.add(
                        {"event": "first_step", "step": watch.first_step, "attempt": a.number}
                    )
            if not running:  # every rank exited 0
                a.events.open()  # finished: its checks passed
                return None
            time.sleep(POLL_S)
    finally:
        group.close()
        if watch is not None and watch.written():  # e.g. a rank failed in its first step
            a.events.open()


# ---------------------------------------------------------------- the attempts


class StopSignalError(Exception):
    """SIGTERM, SIGHUP or SIGQUIT reached the supervisor (SIGINT: KeyboardInterrupt)."""

    def __init__(self, sig: int) -> None:
        super().__init__(f"stopped by {signal.Signals(sig).name}")
        self.sigval = signal.Signals(sig)


def _raise_stopped(sig: int, frame: Any) -> None:
    raise StopSignalError(sig)


def supervise(cfg: Config, nproc: int, max_restarts: int, threads: int | None) -> int:
    """Run ``cfg`` on ``nproc`` local ranks, restarting the group up to ``max_restarts``
    times; returns the process exit code (0, ``EXIT_USER_ERROR`` or ``EXIT_RANK_FAILED``;
    128 + the signal when SIGINT, SIGTERM, SIGHUP or SIGQUIT stopped it: every rank is killed,
    nothing restarted)."""
    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.getsignal(s) for s in _STOP_SIGNALS} if main else {}
    for s in previous:
        signal.signal(s, _raise_stopped)
    events = EventLog(cfg.train.run_dir)
    try:
        with tempfile.TemporaryDirectory(prefix="oases-launch-") as logs:
            return _attempts(cfg, nproc, max_restarts, threads, Path(logs), events)
    except (StopSignalError, KeyboardInterrupt) as exc:
        sig = getattr(exc, "sigval", signal.SIGINT)
        events.add({"event": "gave_up", "reason": f"{sig.name} received"})
        print(f"error: stopped by {sig.name}; every rank was stopped", file=sys.stderr, flush=True)
        return 128 + int(sig)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def finished_line(restarts: int, elapsed_s: float) -> str:
    """The supervisor's last line after a run that needed restarts: the whole run's time (the
    last attempt's done line counts only its own steps)."""
    return (
        f"finished after {restarts} restart{'s' if restarts > 1 else ''}: "
        f"{elapsed_s:.1f}s since the launch, every attempt included (the done line above "
        "counts the last attempt's steps)"
    )


def _attempts(
    cfg: Config, nproc: int, max_restarts: int, threads: int | None, logs: Path, events: EventLog
) -> int:
    from oases.train.metrics import metrics_path

    resume: tuple[int, Path | None] | None = None  # the first attempt's rank 0 reports it
    run_id = f"oases-{uuid.uuid4().hex[:8]}"
    events.add(
        {
            "event": "launch",
            "run_id": run_id,
            "nproc": nproc,
            "max_restarts": max_restarts,
            "resume": cfg.checkpoint.resume,
        }
    )
    attempt_cfg = cfg
    launched = time.time()
    for number in range(max_restarts + 1):
        started = time.time()
        attempt = Attempt(
            attempt_cfg, nproc, number, max_restarts, threads, run_id, logs, resume, events
        )
        ends = run_attempt(attempt)
        if number == 0:  # the step the user's checkpoint.resume names (None: none named)
            first = attempt.resume or _resume_point(cfg)
            named = cfg.checkpoint.resume not in ("auto", "never") and first[1] is not None
            given_step = first[0] if named else None
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
        resume_step, resume_path = None, None
        if retry:
            attempt_cfg = restart_config(cfg, given_step)
            resume = resume_step, resume_path = _resume_point(attempt_cfg)
        events.add(
            {
                "event": "failure",
                "attempt": number,
                "cause": cause.rank,
                "description": what,
                "when": when,
                "ranks": [e.to_json() for e in ends],
                "user_error": user_error,
                "restart": retry,
                "resume_step": resume_step if retry else None,
                "last_logged_step": last,
            }
        )
        if user_error:  # the ranks printed the one error line
            events.add({"event": "gave_up", "reason": "user error"})
            return EXIT_USER_ERROR
        if not retry:
            events.add({"event": "gave_up", "reason": "no restarts left"})
            print(
                f"error: training failed {when}: {what} (attempt {number}; no restart left, "
                f"--max-restarts={max_restarts})",
                file=sys.stderr,
                flush=True,
            )
            return EXIT_RANK_FAILED
        where = (
            f"step {resume_step} ({resume_path})"
            if resume_path is not None
            else "step 0 (no checkpoint yet)"
        )
        print(
            f"attempt {number} failed {when}: {what}; restart {number + 1} of "
            f"{max_restarts}: every rank resumes from {where}",
            file=sys.stderr,
            flush=True,
        )
    return EXIT_RANK_FAILED  # pragma: no cover - the last attempt returns above
