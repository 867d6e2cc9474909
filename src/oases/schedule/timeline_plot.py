"""Drawing a ``Timeline`` to a PNG, so that every bar says what it is without the code.

Lanes, per rank (only those with events; ``timeline.LANES``)::

    rank r compute   forward (plain), recompute (hatched //), backward (hatched ..), optimizer
    rank r TP comm   the all-reduces that end TP regions, forward and backward
    rank r reshard   the all-gathers where the TP degree changes between regions
    rank r DP comm   the data-parallel gradient all-reduces (grey: they serve every sub-batch)
                     and ZeRO's gradient reduce-scatters (purple)
    rank r ZeRO gather  ZeRO stage 3's weight all-gathers before each pass (green)
    rank r pipeline p2p the sends and receives of activations and their gradients between
                     pipeline stages ("sf", "rf", "sb", "rb"; measured: from start to wait,
                     simulated: the transfer on the link)

Colour: hue = sub-batch within its micro-batch (a, b, ...), shade = micro-batch (darkest
first; each micro-batch's span is also marked, by number, over the first rank's lanes),
hatch = phase. A
long step whose bars would be thinner than ``THIN_PX`` pixels gets a second panel: a window of
``ZOOM_BARS`` compute instructions around the middle of the first rank's backward (of the first
micro-batch drawn), shaded on the whole-step panel above it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from oases.schedule.timeline import WHOLE_STEP_PHASES, Event, lane_of

if TYPE_CHECKING:
    from oases.schedule.timeline import Timeline

PLOT_PX = 1300  # width of a panel's plotting area in pixels (14 inches at 110 dpi, less labels)
THIN_PX = 2.0  # "auto" zooms when the median compute bar would be narrower than this
ZOOM_BARS = 24  # compute instructions in the zoomed panel
HATCH = {"recompute": "///", "backward": "...."}
DP_GREY, OPTIMIZER_GREY = (0.6, 0.6, 0.6), (0.25, 0.25, 0.25)
RS_PURPLE, AG_GREEN = (0.58, 0.4, 0.74), (0.17, 0.63, 0.17)
FIXED = {"dp": DP_GREY, "optimizer": OPTIMIZER_GREY, "rs": RS_PURPLE, "ag": AG_GREEN}
MAX_MICRO_LABELS = 8


def _colour(e: Event, k: int, micro: list[int], cmap: Any) -> tuple[float, float, float]:
    """Hue by sub-batch, lighter for each later micro-batch of ``micro`` (those drawn)."""
    if e.phase in FIXED:
        return FIXED[e.phase]
    base = cmap(e.sub % k % 10)[:3]
    m = e.sub // k
    fade = 0.6 * micro.index(m) / (len(micro) - 1) if len(micro) > 1 and m in micro else 0.0
    return tuple(c + (1 - c) * fade for c in base)


def _zoom_window(
    timeline: Timeline, zoom: tuple[float, float] | None | str
) -> tuple[float, float] | None:
    """(start, end) in the events' clock, or None: no zoomed panel."""
    if zoom is None or isinstance(zoom, tuple):
        return zoom
    if zoom != "auto":
        raise ValueError(f"zoom={zoom!r}: give None, 'auto' or (start_s, end_s)")
    rank = min(e.rank for e in timeline.events)
    compute = sorted(
        (e for e in timeline.events if e.rank == rank and e.lane == "compute"),
        key=lambda e: e.start_s,
    )
    widths = sorted(e.end_s - e.start_s for e in compute)
    span = timeline.span_s()
    if not widths or span <= 0 or widths[len(widths) // 2] / span * PLOT_PX >= THIN_PX:
        return None
    first = min(e.sub for e in compute)  # the first micro-batch drawn: sub-batches first..
    k = timeline.sub_batches_per_micro_batch()
    back = [
        i
        for i, e in enumerate(compute)
        if e.phase in ("backward", "recompute") and e.sub < first - first % k + k
    ]
    mid = back[len(back) // 2] if back else len(compute) // 2
    lo = max(0, min(mid - ZOOM_BARS // 2, len(compute) - ZOOM_BARS))
    chosen = compute[lo : lo + ZOOM_BARS]
    return chosen[0].start_s, chosen[-1].end_s


def _draw(
    ax: Any,
    events: list[Event],
    rows: list[tuple[int, str]],
    t0: float,
    k: int,
    micro: list[int],
    cmap: Any,
    window: tuple[float, float] | None,
) -> None:
    """One panel: a row per (rank, lane), bars grouped by style (one broken_barh each)."""
    y_of = {row: (len(rows) - 1 - i) * 1.2 for i, row in enumerate(rows)}
    groups: dict[tuple, list[tuple[float, float]]] = {}
    for e in events:
        if window is not None and (e.end_s < window[0] or e.start_s > window[1]):
            continue
        key = (y_of[e.rank, lane_of(e)], _colour(e, k, micro, cmap), HATCH.get(e.phase))
        groups.setdefault(key, []).append(((e.start_s - t0) * 1e3, (e.end_s - e.start_s) * 1e3))
    for (y, colour, hatch), bars in groups.items():
        ax.broken_barh(
            bars, (y, 0.9), facecolors=colour, hatch=hatch, edgecolor="black", linewidth=0.25
        )
    ax.set_yticks([y_of[r] + 0.45 for r in rows], [f"rank {r} {lane}" for r, lane in rows])
    if window is not None:
        ax.set_xlim((window[0] - t0) * 1e3, (window[1] - t0) * 1e3)
    ax.set_ylim(-0.3, max(y_of.values()) + (1.9 if window is None else 1.1))
    ax.set_xlabel("time (ms)")


def _mark_micro_batches(
    ax: Any, events: list[Event], rank: int, y: float, t0: float, k: int, micro: list[int]
) -> None:
    """A bracket with its label over each micro-batch's span on ``rank``'s compute lane."""
    if len(micro) > MAX_MICRO_LABELS:
        return
    for m in micro:
        span = [
            e
            for e in events
            if e.rank == rank
            and e.lane == "compute"
            and e.phase not in WHOLE_STEP_PHASES
            and e.sub // k == m
        ]
        if not span:
            continue
        a = (min(e.start_s for e in span) - t0) * 1e3
        b = (max(e.end_s for e in span) - t0) * 1e3
        ax.plot([a, a, b, b], [y + 1.05, y + 1.25, y + 1.25, y + 1.05], color="black", lw=0.8)
        ax.text((a + b) / 2, y + 1.32, f"micro-batch {m + 1}", ha="center", va="bottom", fontsize=8)


def _legend(k: int, micro: list[int], phases: set[str], cmap: Any) -> list:
    from matplotlib.patches import Patch

    handles = [
        Patch(
            facecolor=cmap(j % 10),
            edgecolor="black",
            linewidth=0.3,
            label=f"sub-batch {chr(ord('a') + j)}",
        )
        for j in range(min(k, 26))
    ]
    if len(micro) > 1:
        first = Event(0, "compute", "", "forward", micro[0] * k, 0.0, 0.0)
        last = Event(0, "compute", "", "forward", micro[-1] * k, 0.0, 0.0)
        handles += [
            Patch(
                facecolor=_colour(first, k, micro, cmap),
                edgecolor="black",
                linewidth=0.3,
                label=f"micro-batch {micro[0] + 1} (dark)",
            ),
            Patch(
                facecolor=_colour(last, k, micro, cmap),
                edgecolor="black",
                linewidth=0.3,
                label=f"micro-batch {micro[-1] + 1} (light)",
            ),
        ]
    for phase in ("forward", "recompute", "backward"):
        if phase in phases:
            handles.append(
                Patch(
                    facecolor="white",
                    edgecolor="black",
                    linewidth=0.3,
                    hatch=HATCH.get(phase),
                    label=phase,
                )
            )
    if "dp" in phases:
        handles.append(
            Patch(
                facecolor=DP_GREY, edgecolor="black", linewidth=0.3, label="DP gradient all-reduce"
            )
        )
    if "rs" in phases:
        handles.append(
            Patch(
                facecolor=RS_PURPLE,
                edgecolor="black",
                linewidth=0.3,
                label="ZeRO gradient reduce-scatter",
            )
        )
    if "ag" in phases:
        handles.append(
            Patch(
                facecolor=AG_GREEN, edgecolor="black", linewidth=0.3, label="ZeRO weight all-gather"
            )
        )
    if "optimizer" in phases:
        handles.append(
            Patch(facecolor=OPTIMIZER_GREY, edgecolor="black", linewidth=0.3, label="optimizer")
        )
    return handles


def plot_timeline(
    timeline: Timeline,
    path: str | Path,
    title: str,
    n_sub: int,
    zoom: tuple[float, float] | None | str = "auto",
) -> None:
    """Draw ``timeline`` (``n_sub`` sub-batches per micro-batch) to the PNG ``path``. A
    ``Figure`` without pyplot: the caller's matplotlib backend and settings stay as they are."""
    import matplotlib
    from matplotlib.figure import Figure

    events = timeline.events
    if not events:
        raise ValueError("the timeline has no events to draw")
    k = max(1, n_sub)
    micro = sorted({e.sub // k for e in events if e.phase not in WHOLE_STEP_PHASES})
    ranks = sorted({e.rank for e in events})
    rows = [(r, lane) for r in ranks for lane in timeline.lanes()]
    t0 = min(e.start_s for e in events)
    window = _zoom_window(timeline, zoom)
    cmap = matplotlib.colormaps["tab10"]
    panels = [None] if window is None else [None, window]
    height = 0.42 * len(rows) + 1.3
    with matplotlib.rc_context({"hatch.linewidth": 0.5}):  # hatches are drawn at save time
        fig = Figure(figsize=(14, 1.3 + height * len(panels)))
        axes = fig.subplots(len(panels), 1, squeeze=False)
        for ax, win in zip(axes[:, 0], panels):
            _draw(ax, events, rows, t0, k, micro, cmap, win)
        _finish(fig, axes, timeline, events, rows, ranks, t0, k, micro, cmap, window, title, path)


def _finish(
    fig: object,
    axes: object,
    timeline: Timeline,
    events: list,
    rows: list,
    ranks: list,
    t0: float,
    k: int,
    micro: list,
    cmap: object,
    window: object,
    title: str,
    path: str | Path,
) -> None:
    """Micro-batch marks, the zoom window's shading and titles, the legend; save."""
    top = axes[0, 0]
    _mark_micro_batches(top, events, ranks[0], (len(rows) - 1) * 1.2, t0, k, micro)
    n_compute = sum(1 for e in events if e.rank == ranks[0] and e.lane == "compute")
    if window is not None:
        a, b = ((w - t0) * 1e3 for w in window)
        top.axvspan(a, b, color="gold", alpha=0.35, lw=0, zorder=0)
        top.set_title(
            f"the whole range drawn ({n_compute} compute instructions per rank); "
            "shaded: the window below",
            fontsize=9,
        )
        axes[1, 0].set_title(
            f"zoom: {a:.1f}-{b:.1f} ms, {ZOOM_BARS} compute instructions "
            "around the middle of the backward",
            fontsize=9,
        )
    handles = _legend(k, micro, {e.phase for e in events}, cmap)
    fig.legend(
        handles=handles, loc="lower center", ncol=min(len(handles), 8), frameon=False, fontsize=8
    )
    fig.suptitle(title or "Oases timeline", fontsize=11)
    fig.tight_layout(rect=(0, 0.06 if len(handles) <= 8 else 0.1, 1, 1))
    fig.savefig(path, dpi=110)
