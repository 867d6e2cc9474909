"""Timelines: what ran when, per rank, on a compute lane and the lanes of its collectives.

The executor (measured) and the simulator (predicted) produce the same ``Timeline``, so the two
can be drawn side by side and compared number by number. An event is compute or communication
(``Event.lane``); its phase says which kind (``lane_of``): TP all-reduces ("fwd", "bwd"),
reshards between TP degrees ("rsf", "rsb"), data-parallel gradient all-reduces ("dp") and the
pipeline's point-to-point ("sf", "rf", "sb", "rb") run on their own streams, so each gets a lane
of its own (``LANES``). Export: Chrome trace JSON (open in
Perfetto or chrome://tracing, a thread per lane) and a PNG (``schedule.timeline_plot``, with
matplotlib, imported only when plotting).
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


LANES = ("compute", "TP comm", "reshard", "DP comm", "ZeRO gather", "pipeline p2p")
WHOLE_STEP_PHASES = ("dp", "rs", "ag", "optimizer")  # events that serve several sub-batches


@dataclass(frozen=True)
class Event:
    """One interval. ``lane`` is "compute" or "comm"; times are seconds from the step start."""

    rank: int
    lane: str
    name: str
    phase: str  # forward | recompute | backward | optimizer | fwd | bwd | rsf | rsb | dp | rs | ag
    sub: int
    start_s: float
    end_s: float


def lane_of(event: Event) -> str:
    """The lane an event is drawn on: compute, or its collective's kind (``LANES``)."""
    if event.lane == "compute":
        return "compute"
    return {
        "dp": "DP comm",
        "rs": "DP comm",
        "ag": "ZeRO gather",
        "rsf": "reshard",
        "rsb": "reshard",
        "sf": "pipeline p2p",
        "rf": "pipeline p2p",
        "sb": "pipeline p2p",
        "rb": "pipeline p2p",
        "tie": "DP comm",
    }.get(event.phase, "TP comm")


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
        spans = sorted(
            (e.start_s, e.end_s) for e in self.events if e.lane == lane and e.rank == rank
        )
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

    def lanes(self) -> list[str]:
        """The lanes present, in drawing order (``LANES``)."""
        present = {lane_of(e) for e in self.events}
        return [lane for lane in LANES if lane in present]

    def sub_batches_per_micro_batch(self) -> int:
        """k, read off the events: the sub-batches the first rank runs forward before its first
        backward (every schedule runs a micro-batch's forwards before its backwards, and a
        micro-batch's collectives end before the next micro-batch starts)."""
        rank = min((e.rank for e in self.events), default=0)
        compute = sorted(
            (e for e in self.events if e.rank == rank and e.lane == "compute"),
            key=lambda e: e.start_s,
        )
        first_bwd = next((e.start_s for e in compute if e.phase == "backward"), float("inf"))
        return max(
            1, len({e.sub for e in compute if e.phase == "forward" and e.start_s < first_bwd})
        )

    def save_chrome_trace(self, path: str | Path) -> None:
        """Write the Chrome trace-event JSON (pid = rank, tid = lane of ``LANES``,
        microseconds)."""
        t0 = min((e.start_s for e in self.events), default=0.0)
        trace = [
            {
                "name": e.name,
                "cat": e.phase,
                "ph": "X",
                "pid": e.rank,
                "tid": LANES.index(lane_of(e)),
                "ts": (e.start_s - t0) * 1e6,
                "dur": max(e.end_s - e.start_s, 0.0) * 1e6,
                "args": {"sub_batch": e.sub, "phase": e.phase},
            }
            for e in self.events
        ]
        for rank in sorted({e.rank for e in self.events}):
            for tid, lane in enumerate(LANES):
                trace.append(
                    {
                        "name": "thread_name",
                        "ph": "M",
                        "pid": rank,
                        "tid": tid,
                        "args": {"name": lane},
                    }
                )
        Path(path).write_text(json.dumps({"traceEvents": trace}))

    @staticmethod
    def load_chrome_trace(path: str | Path) -> Timeline:
        """Read back what ``save_chrome_trace`` wrote (also an older trace: tid 0 compute,
        else communication), to draw it again."""
        events = []
        for r in json.loads(Path(path).read_text())["traceEvents"]:
            if r.get("ph") != "X":
                continue
            start = r["ts"] * 1e-6
            events.append(
                Event(
                    r["pid"],
                    "compute" if r["tid"] == 0 else "comm",
                    r["name"],
                    r["args"]["phase"],
                    r["args"]["sub_batch"],
                    start,
                    start + r["dur"] * 1e-6,
                )
            )
        return Timeline(events)

    def plot(
        self,
        path: str | Path,
        title: str = "",
        n_sub: int | None = None,
        zoom: tuple[float, float] | None | str = "auto",
    ) -> None:
        """Draw the timeline to a PNG (``schedule.timeline_plot``): a lane per rank and kind
        of work, hue = sub-batch, shade = micro-batch, hatch = phase, a legend; ``zoom``
        ("auto": where bars would be too thin to see) adds a panel of a short window."""
        from oases.schedule.timeline_plot import plot_timeline

        plot_timeline(self, path, title, n_sub or self.sub_batches_per_micro_batch(), zoom)


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
