"""Round 11: every before/after pair of out12/ (or the folder named): the plan file less its
notes and the ``chosen:`` line must be equal (exit 1 otherwise); the other printed lines that
differ (less progress, timings and paths) are listed: the bounds skip more chains, so the
counts of plans simulated and chains solved, and the tables' rows drawn from skipped chains,
may differ."""

import json
import re
import sys
from pathlib import Path

OUT = Path(__file__).parent / (sys.argv[1] if len(sys.argv) > 1 else "out12")


def lines(path: Path) -> list[str]:
    keep = []
    for line in path.read_text().splitlines():
        if line.startswith(("searching:", "maxrss_kib", "wrote ", "run it on", "  torchrun")):
            continue
        line = re.sub(r"^searched in [0-9.]+ s", "searched in _ s", line)
        line = re.sub(r"walked whole, [0-9.]+ s$", "walked whole, _ s", line)
        keep.append(line)
    return keep


def plan(path: Path) -> dict:
    out = json.loads(path.read_text())
    out.pop("notes", None)
    return out


bad = 0
for before in sorted(OUT.glob("before-*.txt")):
    after = before.with_name(before.name.replace("before-", "after-", 1))
    if not after.exists():
        continue
    a, b = lines(before), lines(after)
    chosen = [x for x in a if x.startswith("chosen:")] == [x for x in b if x.startswith("chosen:")]
    same_plan = plan(before.with_suffix(".json")) == plan(after.with_suffix(".json"))
    other = [x for x in b if x not in a]
    ok = chosen and same_plan
    bad += not ok
    print(f"{before.stem[7:]}: plan file {'equal' if same_plan else 'DIFFERENT'}, chosen line "
          f"{'equal' if chosen else 'DIFFERENT'}; {len(other)} other lines differ")
    for x in other:
        print(f"    after: {x.strip()[:110]}")
sys.exit(1 if bad else 0)
