"""Draw a Chrome trace written by ``Timeline.save_chrome_trace`` with whichever oases is
imported (this branch, or main's code on PYTHONPATH): the before/after pictures of run.sh.

    python render.py TRACE.json OUT.png TITLE [N_SUB]
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

from oases.schedule.timeline import Event, Timeline


def load(path: str) -> Timeline:
    """Events from a trace of either version (tid 0: compute; else a collective)."""
    events = []
    for r in json.loads(Path(path).read_text())["traceEvents"]:
        if r.get("ph") == "X":
            start = r["ts"] * 1e-6
            events.append(Event(r["pid"], "compute" if r["tid"] == 0 else "comm", r["name"],
                                r["args"]["phase"], r["args"]["sub_batch"], start,
                                start + r["dur"] * 1e-6))
    return Timeline(events)


if __name__ == "__main__":
    trace, out, title = sys.argv[1:4]
    timeline = load(trace)
    if "n_sub" in inspect.signature(timeline.plot).parameters and len(sys.argv) > 4:
        timeline.plot(out, title=title, n_sub=int(sys.argv[4]))
    else:  # main's plot takes no sub-batch count
        timeline.plot(out, title=title)
