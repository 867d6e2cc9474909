#!/usr/bin/env bash
# Round 5, repeated: `oases bench --overhead` BEFORE (main after round 4, 97e0c46) and AFTER (this tree),
# alternating, RUNS times (default 3), in one hold of the CPU lock; tables in round4/repeat/.
set -euo pipefail
cd "$(dirname "$0")/../../.."
HERE=benchmarks/2026-12-04-overhead/round5
BEFORE=${BEFORE:-97e0c46}
PY=${PY:-/work/main/.venv/bin/python}
TMP=$(mktemp -d)
git archive "$BEFORE" src | tar -x -C "$TMP"
mkdir -p "$HERE/repeat"
flock /tmp/oases-cpu.lock bash -c "
  for r in \$(seq 1 ${RUNS:-3}); do
    env PYTHONPATH=$TMP/src $PY -m oases bench --overhead --out runs/overhead5r-before-\$r
    env PYTHONPATH=src $PY -m oases bench --overhead --out runs/overhead5r-after-\$r
    cp runs/overhead5r-before-\$r/overhead.json $HERE/repeat/before-\$r.json
    cp runs/overhead5r-after-\$r/overhead.json $HERE/repeat/after-\$r.json
  done"
rm -rf "$TMP"
