"""Where the link idles in a step: reads a timeline trace of ``oases bench`` (``*_trace.json``,
rank 0's lanes) and reports, per pass, the time no collective was in flight (issued and not yet
complete) while the step ran, and the compute tasks that ran during the longest gaps.

A collective's event spans issue to completion (queueing behind the one before included), so a
gap between the union of those spans is time the link had nothing to do: on a link-bound step
it is what a schedule loses against the collectives alone.

Run: .venv/bin/python benchmarks/2026-12-02-sequence-parallel/idle.py TRACE.json [TRACE.json ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def idle(path: Path, top: int = 5) -> str:
    events = [e for e in json.loads(path.read_text())["traceEvents"]
              if e.get("ph") == "X" and e["pid"] == 0]
    t0 = min(e["ts"] for e in events)
    comm = sorted((e for e in events if e["tid"] == 1), key=lambda e: e["ts"])
    compute = sorted((e for e in events if e["tid"] == 0), key=lambda e: e["ts"])
    span = max(e["ts"] + e["dur"] for e in events) - t0
    gaps: list[tuple[float, float, str]] = []  # (start, end, phase of the next collective)
    end = None
    for e in comm:
        if end is not None and e["ts"] > end:
            gaps.append((end, e["ts"], e["args"]["phase"]))
        end = e["ts"] + e["dur"] if end is None else max(end, e["ts"] + e["dur"])
    by_pass = {"forward": 0.0, "backward": 0.0}
    for a, b, phase in gaps:
        by_pass["forward" if phase in ("fwd", "gf", "gr") else "backward"] += b - a
    busy = sum(e["dur"] for e in compute)
    lines = [f"## {path.name}", "",
             f"step span {span / 1e3:.1f} ms, compute busy {busy / 1e3:.1f} ms, link idle "
             f"{sum(by_pass.values()) / 1e3:.1f} ms (before forward collectives "
             f"{by_pass['forward'] / 1e3:.1f} ms, before backward ones "
             f"{by_pass['backward'] / 1e3:.1f} ms), {len(comm)} collectives", "",
             "| link idle at (ms) | for (ms) | compute running then |", "|---|---|---|"]
    for a, b, _ in sorted(gaps, key=lambda g: g[0] - g[1])[:top]:
        running = [f"{c['name']} (sub {c['args']['sub_batch']}, {c['dur'] / 1e3:.0f} ms)"
                   for c in compute if c["ts"] < b and c["ts"] + c["dur"] > a]
        lines.append(f"| {(a - t0) / 1e3:.1f} | {(b - a) / 1e3:.1f} | {', '.join(running)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print("\n".join(idle(Path(p)) for p in sys.argv[1:]))
