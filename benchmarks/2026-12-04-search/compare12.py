"""Round 11: every before/after pair of out12/ (or the folder named): the plan file less its
notes and the ``chosen:`` line must be equal (exit 1 otherwise); the other printed lines that
differ (less progress, timings and paths) are listed: the bounds skip more chains, so the
counts of plans simulated and chains solved, and the tables' rows drawn from skipped chains,
may differ."""

import sys
from pathlib import Path

from compare10 import lines, plan  # (round 10's: the same lines and plan file compared)

OUT = Path(__file__).parent / (sys.argv[1] if len(sys.argv) > 1 else "out12")

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
    print(
        f"{before.stem[7:]}: plan file {'equal' if same_plan else 'DIFFERENT'}, chosen line "
        f"{'equal' if chosen else 'DIFFERENT'}; {len(other)} other lines differ"
    )
    for x in other:
        print(f"    after: {x.strip()[:110]}")
sys.exit(1 if bad else 0)
