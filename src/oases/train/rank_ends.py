"""How a local rank of a supervised attempt ended, as the supervisor sees it: its exit status
(``RankGroup.exitcode``), a stopped rank (``/proc``), its last error line (the ``error.json``
its launcher wrote), and which rank brought the attempt down (``cause_of``).

    supervise.run_attempt polls -> RankGroup.exitcode(r) / is_stopped(pid) -> RankEnd per rank
    -> with_survivors (the rest, killed) -> cause_of / describe_failure -> the restart decision
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oases.train.launch import nccl_timeout_line

_SOURCE_PREFIX = re.compile(r"\[[^\]\s]+\.(?:cc|cpp|h|hpp):\d+\]\s*")


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
        text = (
            f"rank {self.rank} killed by {self.signal}"
            if self.signal
            else f"rank {self.rank} exited with code {self.exitcode}"
        )
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


def error_line(path: str) -> str:
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


def is_stopped(pid: int) -> bool:
    """True when ``pid`` is stopped (SIGSTOP, SIGTSTP, ...): state T in ``/proc/PID/stat``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] in (["T"], ["t"])


def with_survivors(ends: list[RankEnd], nproc: int, now: float) -> list[RankEnd]:
    """``ends`` plus a record for every rank still running (killed by the supervisor)."""
    seen = {e.rank for e in ends}
    return sorted(
        ends + [RankEnd(r, now) for r in range(nproc) if r not in seen], key=lambda e: e.rank
    )
