"""Medians over the repeated runs (repeat.sh): per model and entry, the ratio to the plain step
and to the k-plain floor, BEFORE and AFTER. Usage: python summarize.py [DIR] (default: this
round's repeat/; round 5: ../round5/repeat)"""

import json
import statistics
import sys
from pathlib import Path

here = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "repeat"
rows: dict[tuple[str, str, str], list[dict]] = {}
for path in sorted(here.glob("*.json")):
    side = path.stem.split("-")[0]
    for model, data in json.loads(path.read_text())["models"].items():
        for r in data["entries"]:
            rows.setdefault((model, r["entry"], side), []).append(r)
print("| model | entry | before: ratio (runs) | after: ratio (runs) | before / after vs k-plain |")
print("|---|---|---|---|---|")
for model, entry in dict.fromkeys((m, e) for m, e, _ in rows):
    cells = []
    for side in ("before", "after"):
        rs = rows[model, entry, side]
        ratios = sorted(r["ratio"] for r in rs)
        cells.append(
            f"{statistics.median(ratios):.2f}x ({', '.join(f'{x:.2f}' for x in ratios)})"
        )
    k = [statistics.median(r["ratio_k"] for r in rows[model, entry, s]) for s in ("before", "after")]
    print(f"| {model} | {entry} | {cells[0]} | {cells[1]} | {k[0]:.2f}x / {k[1]:.2f}x |")
