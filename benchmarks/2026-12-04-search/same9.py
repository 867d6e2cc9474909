"""Round 9: are the before and after sides' outputs the same? For every out9/before-CASE-RUN
pair with its after twin: the plan file less its "notes", and the printed lines less the
progress lines ("searching: ..."), the searches' own timings and the output paths (the lines
naming out9/...). Prints one line per pair and exits 1 on any difference."""

import json
import re
import sys
from pathlib import Path

here = Path(__file__).parent / "out9"


def plan(path: Path) -> dict:
    data = json.loads(path.read_text())
    data.pop("notes", None)
    return data


def printed(path: Path) -> list[str]:
    keep = []
    for line in path.read_text().splitlines():
        if line.startswith("searching:") or "out9/" in line or line.startswith("maxrss_kib"):
            continue
        line = re.sub(r"searched in [0-9.]+ s", "searched in _ s", line)
        keep.append(re.sub(r"walked whole, [0-9.]+ s", "walked whole, _ s", line))
    return keep


bad = 0
for before in sorted(here.glob("before-*.json")):
    after = before.with_name(before.name.replace("before-", "after-", 1))
    same_plan = plan(before) == plan(after)
    same_text = printed(before.with_suffix(".txt")) == printed(after.with_suffix(".txt"))
    bad += not (same_plan and same_text)
    print(
        f"{before.stem[7:]}: plan {'same' if same_plan else 'DIFFERENT'}, "
        f"printed {'same' if same_text else 'DIFFERENT'}"
    )
sys.exit(1 if bad else 0)
