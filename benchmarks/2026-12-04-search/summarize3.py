"""Round 3's table from times3.tsv and out3/ (run3.sh): median wall per case before and after,
plans simulated, and whether the chosen plan (its line and the plan file) is the same."""

from __future__ import annotations

import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

here = Path(__file__).parent
walls: dict[tuple[str, str], list[float]] = defaultdict(list)
loads: dict[tuple[str, str], list[str]] = defaultdict(list)
order: list[str] = []
for line in (here / "times3.tsv").read_text().splitlines():
    which, case, _run, wall, load = line.split("\t")
    if case not in order:
        order.append(case)
    if wall != "cut":
        walls[which, case].append(float(wall))
    loads[which, case].append(load)


def chosen(which: str, case: str) -> tuple[str, str]:
    text = (here / "out3" / f"{which}-{case}-1.txt").read_text()
    line = next((x for x in text.splitlines() if x.startswith("chosen")), "?")
    found = re.search(r"searched in [^:]*: (\d+) plans simulated", text)
    return re.sub(r"; bound by.*", "", line), found.group(1) if found else "?"


def plan_file(which: str, case: str) -> dict:
    data = json.loads((here / "out3" / f"{which}-{case}.json").read_text())
    data.pop("notes", None)
    return data


print(
    "| case | before: median (runs) | after: median (runs) | before / after "
    "| plans simulated before / after | plan before and after | loads before; after |"
)
print("|---|---|---|---|---|---|---|")
for case in order:
    b, a = walls["before", case], walls["after", case]
    mb = statistics.median(b) if b else float("nan")
    ma = statistics.median(a) if a else float("nan")
    (cb, nb), (ca, na) = chosen("before", case), chosen("after", case)
    same = cb == ca and plan_file("before", case) == plan_file("after", case)
    print(
        f"| {case} | {mb:.1f} s ({len(b)}) | {ma:.1f} s ({len(a)}) | {mb / ma:.2f}x "
        f"| {nb} / {na} | {'same' if same else 'DIFFERENT'} "
        f"| {', '.join(loads['before', case])}; {', '.join(loads['after', case])} |"
    )
print()
for case in order:
    print(f"- {case}: {chosen('after', case)[0]}")
