"""Time to the first step and resident memory per rank, command start to first step, after the
CLI started launching its ranks before importing torch (section 2's dated addition).

    python benchmarks/2026-12-03-data/first_step.py ROOT OUT_JSON [BEFORE_SRC] [REPEATS]

ROOT holds the prepared corpora (``prep/start-10M`` ... ``prep/start-5G``, made by ``bench.py
startup``); each run is ``oases train configs/default.toml --data.source=PREPARED
--train.steps=2 --train.eval_every=0 --train.sample_tokens=0 --checkpoint.resume=never`` (2
ranks) through ``bench.train_run``; BEFORE_SRC (a ``src`` folder of the commit before) adds
"before" rows on 10 MB and 5 GB. Runs interleave corpora and code, REPEATS rounds.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import train_run  # noqa: E402

ROOT, OUT = Path(sys.argv[1]), Path(sys.argv[2])
BEFORE = Path(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] else None
REPEATS = int(sys.argv[4]) if len(sys.argv) > 4 else 3
AFTER = Path(__file__).resolve().parents[2] / "src"
ARGS = (
    "configs/default.toml",
    "--train.steps=2",
    "--train.eval_every=0",
    "--train.sample_tokens=0",
    "--checkpoint.resume=never",
)

rows = []
for round_ in range(REPEATS):
    for size in ("10M", "100M", "1G", "5G"):
        codes = [("after", AFTER)]
        if BEFORE is not None and size in ("10M", "5G"):
            codes.append(("before", BEFORE))
        for code, src in codes:
            load = os.getloadavg()[0]
            row = train_run(
                src,
                ROOT / "runs" / f"first-step-{size}-{code}",
                *ARGS,
                f"--data.source={ROOT / 'prep' / f'start-{size}'}",
            )
            row |= {"corpus": size, "code": code, "round": round_, "load": round(load, 2)}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "tail"}), flush=True)
            OUT.write_text(json.dumps(rows, indent=1))
