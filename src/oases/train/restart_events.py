"""``<run_dir>/restarts.jsonl``: what happened to the attempts of ``oases train`` (local ranks,
``train/supervise.py``), one JSON object a line, each with its wall-clock ``time``.

Events: ``launch`` (one per ``oases train``: a resumed run appends to the file), ``attempt``
(started: its store's port, the resume step), ``first_step`` (the attempt's first step after
its resume step, as logged in the metrics file), ``failure`` (every rank's end, the cause, the
decision), ``finished`` or ``gave_up``; a fault injected by ``faults.py`` adds ``fault``,
written by the rank as it faults. The supervisor's rows are held (``EventLog``) until the ranks
have passed their setup checks, so a ``fault`` row can come before them in the file:
``read_events`` orders by time. ``benchmarks/*-faults`` reads them.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

EVENTS = "restarts.jsonl"


def _append_rows(run_dir: str | os.PathLike[str], rows: list[dict[str, Any]]) -> None:
    """Append ``rows`` to ``<run_dir>/restarts.jsonl``. A run directory that cannot be written
    is left to the ranks to report (one error line)."""
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(run_dir) / EVENTS, "a", encoding="utf-8") as fh:
            fh.writelines(json.dumps(row) + "\n" for row in rows)
    except OSError:
        pass


def write_event(run_dir: str | os.PathLike[str], event: dict[str, Any]) -> None:
    """Append ``event`` with the wall-clock ``time`` to ``<run_dir>/restarts.jsonl`` now."""
    _append_rows(run_dir, [{"time": time.time(), **event}])


class EventLog:
    """The supervisor's events of one ``oases train``: timed when added, held in memory until
    ``open()`` (the ranks passed their setup checks), then appended as they come."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = run_dir
        self.held: list[dict[str, Any]] = []
        self.opened = False

    def add(self, event: dict[str, Any]) -> None:
        row = {"time": time.time(), **event}
        if self.opened:
            _append_rows(self.run_dir, [row])
        else:
            self.held.append(row)

    def open(self) -> None:
        if not self.opened:
            self.opened = True
            _append_rows(self.run_dir, self.held)
            self.held = []


def read_events(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events of the last ``oases train`` launch in ``run_dir`` (a resumed run appends),
    in time order (a rank's ``fault`` row can be written before the supervisor's held rows)."""
    path = Path(run_dir) / EVENTS
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    rows.sort(key=lambda row: row["time"])
    starts = [i for i, row in enumerate(rows) if row.get("event") == "launch"]
    return rows[starts[-1] :] if starts else rows
