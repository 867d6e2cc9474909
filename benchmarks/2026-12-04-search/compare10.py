"""Round 10: every before/after pair of out10/ compared: the plan file less its notes, and
every printed line less the progress and timing lines and the output paths."""

import json
import re
import sys
from pathlib import Path


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


def main() -> int:
    out = Path(__file__).parent / (sys.argv[1] if len(sys.argv) > 1 else "out10")
    bad = 0
    for before in sorted(out.glob("before-*.txt")):
        after = before.with_name(before.name.replace("before-", "after-", 1))
        if not after.exists():
            continue
        same_text = lines(before) == lines(after)
        files = before.with_suffix(".json"), after.with_suffix(".json")
        same_plan = all(f.exists() for f in files) and plan(files[0]) == plan(files[1])
        bad += not (same_text and same_plan)
        print(
            f"{before.stem[7:]}: printed lines {'same' if same_text else 'DIFFER'} "
            f"({len(lines(before))}), plan file {'same' if same_plan else 'DIFFERS'}"
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
