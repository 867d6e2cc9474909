"""Fault injection: a testing hook for the recovery tests and the fault report. Off by default.

One environment variable, read by ``arm()`` (through ``parallel.context.fault_spec()``, the
module that reads the environment), arms one fault on one rank::

    OASES_FAULT="KIND:rank=R:step=S:at=WHERE[:n=K][:attempt=A]"

    KIND     kill   the rank sends itself SIGKILL (kill -9: no clean-up, no error line)
             stop   the rank sends itself SIGSTOP (it freezes; its peers hit the collective
                    timeout ``parallel.timeout_s``)
    rank     the global rank that faults
    step     the training step (1-based, as logged) in which it faults
    at       step        mid-step: just before this rank issues its first backward collective
                         of step S (the forward of the first micro-batch is done)
             collective  mid-collective: just before this rank issues the K-th collective of
                         step S (``n=K``, K >= 2); with an overlapped schedule (``oases`` with
                         ``schedule.max_inflight=2``) collective K-1 is then in flight:
                         started and not yet waited
             save        mid-save: in the checkpoint save of step S, after ``dcp.save`` has
                         returned (every rank's tensor files and ``.metadata`` are written)
                         and before rank 0 commits (manifest, ``COMPLETE``, rename)
    attempt  the launch attempt it fires on (default 0: the first; a restarted group runs
             clean). The attempt is ``TORCHELASTIC_RESTART_COUNT``, set by oases' supervisor
             and by torchrun's agent alike.

Just before it faults, the rank appends ``{"event": "fault", "time": ...}`` to
``<run_dir>/restarts.jsonl`` (the fault report's "time to detect" starts there).

Hooks: ``arm(run_dir)`` (``launch.run_rank``), ``on_step(step)`` (top of every training step in
``loop.py``), ``on_save(step)`` (``checkpoint.save_checkpoint``); ``disarm()`` undoes ``arm``.
Mid-step and mid-collective ride on ``comm.add_issue_hook``, called with every collective just
before it is issued: the hook is added only on the armed rank, so no other rank's collective
pays for it. Cost when off: ``on_step`` and ``on_save`` return at their first line, ``comm``
calls nothing.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV = "OASES_FAULT"
KINDS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
POINTS = ("step", "collective", "save")


@dataclass(frozen=True)
class Fault:
    """One parsed ``OASES_FAULT``."""

    kind: str
    rank: int
    step: int
    at: str
    n: int = 0
    attempt: int = 0

    def label(self) -> str:
        where = (
            f"collective {self.n} of step {self.step}"
            if self.at == "collective"
            else (f"the save of step {self.step}" if self.at == "save" else f"step {self.step}")
        )
        return f"{self.kind} rank {self.rank} in {where}"


def parse(text: str) -> Fault:
    """``OASES_FAULT``'s value -> Fault; ValueError (one line) naming what is wrong."""
    kind, *fields = text.strip().split(":")
    if kind not in KINDS:
        raise ValueError(f"{ENV}={text!r}: kind must be one of {', '.join(KINDS)}")
    values: dict[str, str] = {}
    for f in fields:
        key, sep, value = f.partition("=")
        if not sep or key not in ("rank", "step", "at", "n", "attempt"):
            raise ValueError(f"{ENV}={text!r}: {f!r} is not one of rank=, step=, at=, n=, attempt=")
        values[key] = value
    try:
        fault = Fault(
            kind,
            int(values["rank"]),
            int(values["step"]),
            values.get("at", "step"),
            int(values.get("n", "0")),
            int(values.get("attempt", "0")),
        )
    except KeyError as exc:
        raise ValueError(f"{ENV}={text!r}: {exc.args[0]}= is required") from None
    except ValueError:
        raise ValueError(f"{ENV}={text!r}: rank, step, n and attempt are integers") from None
    if fault.at not in POINTS:
        raise ValueError(f"{ENV}={text!r}: at must be one of {', '.join(POINTS)}")
    if fault.at == "collective" and fault.n < 2:
        raise ValueError(f"{ENV}={text!r}: at=collective needs n >= 2")
    if fault.step < 1 or fault.rank < 0:
        raise ValueError(f"{ENV}={text!r}: step >= 1 and rank >= 0")
    return fault


@dataclass
class _Armed:
    fault: Fault
    run_dir: Path
    step: int = 0  # the training step in progress
    issued: int = 0  # collectives issued in it so far
    previous: dict[str, Any] | None = None  # the last of them


_ARMED: _Armed | None = None
_REMOVE_HOOK: Callable[[], None] | None = None


def _on_issue(record: Any) -> None:
    """``comm``'s issue hook on the armed rank: count the step's collectives, fire at the one
    the fault names."""
    armed = _ARMED
    if armed is None or armed.step != armed.fault.step:
        return
    armed.issued += 1
    fire = (armed.fault.at == "collective" and armed.issued == armed.fault.n) or (
        armed.fault.at == "step" and record.direction == "backward"
    )
    if fire:
        _fire(
            armed,
            armed.step - 1,
            f"before collective {armed.issued} of the step",
            {"next": _describe(record), "previous": armed.previous},
        )
    armed.previous = _describe(record)


def _describe(record: Any) -> dict[str, Any]:
    return {
        "op": record.op,
        "group": record.group,
        "direction": record.direction,
        "tag": record.tag,
        "async": record.is_async,
    }


def arm(run_dir: str | os.PathLike[str]) -> Fault | None:
    """Arm ``OASES_FAULT`` in this rank when it names this rank and this attempt; returns it.
    ValueError for a malformed value."""
    global _ARMED, _REMOVE_HOOK
    from oases.parallel.context import fault_spec, launch_identity

    spec = fault_spec()
    if not spec:
        return None
    fault = parse(spec)
    rank, attempt = launch_identity()
    if fault.rank != rank or fault.attempt != attempt:
        return None
    disarm()
    _ARMED = _Armed(fault, Path(run_dir))
    if fault.at in ("step", "collective"):
        from oases.parallel import comm

        _REMOVE_HOOK = comm.add_issue_hook(_on_issue)
    return fault


def disarm() -> None:
    """Forget the armed fault and remove its collective hook (a no-op when none is armed)."""
    global _ARMED, _REMOVE_HOOK
    _ARMED = None
    if _REMOVE_HOOK is not None:
        remove, _REMOVE_HOOK = _REMOVE_HOOK, None
        remove()


def on_step(step: int) -> None:
    """Top of training step ``step`` (1-based)."""
    if _ARMED is None:
        return
    _ARMED.step, _ARMED.issued, _ARMED.previous = step, 0, None


def on_save(step: int) -> None:
    """Inside the save of the checkpoint of step ``step``: every rank's DCP files are written,
    rank 0 has not committed yet."""
    if _ARMED is None or _ARMED.fault.at != "save" or _ARMED.fault.step != step:
        return
    _fire(_ARMED, step, "after dcp.save, before rank 0 commits")


def _fire(armed: _Armed, steps_done: int, where: str, detail: dict[str, Any] | None = None) -> None:
    global _ARMED
    from oases.train.restart_events import write_event

    _ARMED = None  # once: a stopped rank that is continued (SIGCONT) trains on
    f = armed.fault
    write_event(
        armed.run_dir,
        {
            "event": "fault",
            "kind": f.kind,
            "rank": f.rank,
            "at": f.at,
            "step": f.step,
            "n": f.n,
            "attempt": f.attempt,
            "steps_done": steps_done,
            "where": where,
            "pid": os.getpid(),
            **(detail or {}),
        },
    )
    os.kill(os.getpid(), KINDS[f.kind])
    if f.kind == "kill":  # pragma: no cover - SIGKILL does not return
        time.sleep(60)
