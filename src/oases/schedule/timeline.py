"""Timelines: what ran when, on a compute lane and a communication lane per rank.

The executor (measured) and the simulator (predicted) produce the same ``Timeline``, so the two
can be drawn side by side and compared number by number. Export: Chrome trace JSON (open in
Perfetto or chrome://tracing) and a PNG drawn with matplotlib (imported only when plotting).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from oases.parallel.context import Group


@dataclass(frozen=True)
class Event:
    """One interval. ``lane`` is "compute" or "comm"; times are seconds from the step start."""

    rank: int
    lane: str
    name: str
    phase: str  # forward | recompute | backward | fwd | bwd | dp
    sub: int
    start_s: float
    end_s: float


@dataclass
class Timeline:
    events: list[Event] = field(default_factory=list)

    def add(self, event: Event) -> None:
        self.events.append(event)

    @staticmethod
    def merge(timelines: list[Timeline]) -> Timeline:
        return Timeline([e for t in timelines for e in t.events])

    def span_s(self) -> float:
        if not self.events:
            return 0.0
        return max(e.end_s for e in self.events) - min(e.start_s for e in self.events)

    def busy_s(self, lane: str, rank: int | None = None) -> float:
        """Total length of the union of ``lane``'s intervals (on one rank, or rank 0's)."""
        rank = min((e.rank for e in self.events), default=0) if rank is None else rank
        spans = sorted((e.start_s, e.end_s) for e in self.events
                       if e.lane == lane and e.rank == rank)
        total, cur_s, cur_e = 0.0, None, None
        for s, e in spans:
            if cur_e is None or s > cur_e:
                total += 0.0 if cur_e is None else cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        return total + (0.0 if cur_e is None else cur_e - cur_s)

    def to_json(self) -> list[dict]:
        return [asdict(e) for e in self.events]

    @staticmethod
    def from_json(rows: list[dict]) -> Timeline:
        return Timeline([Event(**r) for r in rows])

    def gather(self, group: Group) -> Timeline:
        """Every rank's events in one timeline (collective over ``group``: all ranks call it)."""
        from oases.parallel import comm

        rows = comm.all_gather_objects(self.to_json(), group)
        return Timeline.from_json([row for rank_rows in rows for row in rank_rows])

    def save_chrome_trace(self, path: str | Path) -> None:
        """Write the Chrome trace-event JSON (pid = rank, tid = lane, microseconds)."""
        t0 = min((e.start_s for e in self.events), default=0.0)
        trace = [
            {"name": e.name, "cat": e.phase, "ph": "X", "pid": e.rank,
             "tid": 0 if e.lane == "compute" else 1,
             "ts": (e.start_s - t0) * 1e6, "dur": max(e.end_s - e.start_s, 0.0) * 1e6,
             "args": {"sub_batch": e.sub, "phase": e.phase}}
            for e in self.events
        ]
        for rank in sorted({e.rank for e in self.events}):
            for tid, lane in ((0, "compute"), (1, "comm")):
                trace.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                              "args": {"name": lane}})
        Path(path).write_text(json.dumps({"traceEvents": trace}))

    def plot(self, path: str | Path, title: str = "") -> None:
        """Draw compute and comm lanes per rank, coloured by sub-batch, to a PNG."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        ranks = sorted({e.rank for e in self.events})
        t0 = min((e.start_s for e in self.events), default=0.0)
        colors = plt.get_cmap("tab10")
        fig, ax = plt.subplots(figsize=(14, 1.0 + 1.1 * len(ranks)))
        labels, ticks = [], []
        for k, rank in enumerate(ranks):
            for lane_i, lane in enumerate(("compute", "comm")):
                y = (len(ranks) - 1 - k) * 2.5 + (1 - lane_i) * 1.1
                ticks.append(y + 0.45)
                labels.append(f"rank {rank} {lane}")
                for e in self.events:
                    if e.rank != rank or e.lane != lane:
                        continue
                    hatch = "//" if e.phase == "recompute" else None
                    alpha = 0.55 if e.phase in ("backward", "bwd") else 0.95
                    ax.broken_barh([((e.start_s - t0) * 1e3, (e.end_s - e.start_s) * 1e3)],
                                   (y, 0.9), facecolors=colors(e.sub % 10), alpha=alpha,
                                   hatch=hatch, edgecolor="black", linewidth=0.2)
        ax.set_yticks(ticks, labels)
        ax.set_xlabel("time (ms); colour = sub-batch; light = backward; hatched = recompute")
        ax.set_title(title or "Oases timeline")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


# Instrumentation only: timelines currently recording (empty unless inside record_timeline()).
_ACTIVE: list[Timeline] = []


@contextlib.contextmanager
def record_timeline() -> Iterator[Timeline]:
    """Every schedule step run inside the block adds its events to the yielded Timeline."""
    timeline = Timeline()
    _ACTIVE.append(timeline)
    try:
        yield timeline
    finally:
        _ACTIVE.remove(timeline)


def active_timelines() -> list[Timeline]:
    return _ACTIVE
