"""times.tsv and out/ -> results.md: the median wall time of `oases plan` per case before and
after, and the plans chosen, compared (the same regions, degrees, ZeRO stages, schedule,
sub-batch count, sequence parallelism and micro-batch; step time and peak to 1e-9 relative)."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

HERE = Path(__file__).parent


def chosen(text: str) -> str:
    match = re.search(r"^chosen: (.*?); predicted ([^;]*) per step", text, re.M)
    runs = re.search(r"^degrees by region: (.*)$", text, re.M)
    return f"{match.group(1)}; {match.group(2)}; {runs.group(1)}" if match and runs else "?"


def simulated(text: str) -> str:
    after = re.search(r"in [0-9.]+ s: (\d+) plans simulated", text)
    before = re.search(r"\((\d+) plans simulated", text)
    return (after or before).group(1) if (after or before) else "?"


def same_plan(a: dict, b: dict) -> str:
    keys = ("regions", "schedule", "n_sub", "sequence_parallel")
    if any(a.get(k) != b.get(k) for k in keys):
        return "DIFFERENT: " + ", ".join(k for k in keys if a.get(k) != b.get(k))
    notes = {k: a["notes"].get(k) for k in ("world_size", "global_batch", "micro_rows")}
    if notes != {k: b["notes"].get(k) for k in notes}:
        return "DIFFERENT: micro-batch"
    for k in ("predicted_step_s", "predicted_peak_mem_bytes"):
        if abs(a[k] - b[k]) > 1e-9 * abs(a[k]):
            return f"DIFFERENT: {k} {a[k]} vs {b[k]}"
    return "same"


def main() -> None:
    times: dict[tuple[str, str], list[float]] = {}
    loads: dict[tuple[str, str], list[float]] = {}
    order: list[str] = []
    for line in (HERE / "times.tsv").read_text().splitlines():
        which, case, _, wall, load = line.split("\t")
        times.setdefault((which, case), []).append(float(wall))
        loads.setdefault((which, case), []).append(float(load))
        if case not in order:
            order.append(case)
    rows = ["| case | before: median (runs) | after: median (runs) | before / after | plans simulated "
            "before / after | plan chosen, before and after |", "|---|---|---|---|---|---|"]
    detail = ["| case | plan chosen (after) | load averages at the runs' starts, before; after |",
              "|---|---|---|"]
    for case in order:
        cells = []
        for which in ("before", "after"):
            t = times.get((which, case), [])
            cells.append(f"{statistics.median(t):.1f} s ({len(t)})" if t else "-")
        b, a = times.get(("before", case)), times.get(("after", case))
        faster = f"{statistics.median(b) / statistics.median(a):.2f}x" if a and b else "-"
        texts = {w: (HERE / "out" / f"{w}-{case}-1.txt") for w in ("before", "after")}
        sims = " / ".join(simulated(p.read_text()) if p.exists() else "-"
                          for p in texts.values())
        plans = {w: HERE / "out" / f"{w}-{case}.json" for w in ("before", "after")}
        same = (same_plan(json.loads(plans["before"].read_text()),
                          json.loads(plans["after"].read_text()))
                if all(p.exists() for p in plans.values()) else "-")
        rows.append(f"| {case} | {cells[0]} | {cells[1]} | {faster} | {sims} | {same} |")
        after_text = texts["after"].read_text() if texts["after"].exists() else ""
        load = "; ".join(", ".join(f"{x:.2f}" for x in loads.get((w, case), []))
                         for w in ("before", "after"))
        detail.append(f"| {case} | {chosen(after_text)} | {load} |")
    (HERE / "results.md").write_text("\n".join(rows + [""] + detail) + "\n")
    print("\n".join(rows + [""] + detail))


if __name__ == "__main__":
    main()
