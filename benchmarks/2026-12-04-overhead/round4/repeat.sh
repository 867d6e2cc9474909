#!/usr/bin/env bash
# Round 4, repeated: `oases bench --overhead` BEFORE (main, f2c89a3) and AFTER (this tree),
# alternating, RUNS times (default 3), in one hold of the CPU lock; tables in round4/repeat/.
# Round 5: ROUND=round5 BEFORE=97e0c46 bash round4/repeat.sh (tables in round5/repeat/).
# Round 7: ROUND=round7 BEFORE=5122e4a SCHEDULES=commfree-recompute,oases@k=2,oases@k=4 (only
# those entries).
set -euo pipefail
cd "$(dirname "$0")/../../.."
HERE=benchmarks/2026-12-04-overhead/${ROUND:-round4}
BEFORE=${BEFORE:-f2c89a3}
PY=${PY:-/work/main/.venv/bin/python}
TMP=$(mktemp -d)
git archive "$BEFORE" src | tar -x -C "$TMP"
mkdir -p "$HERE/repeat"
flock /tmp/oases-cpu.lock bash -c "
  for r in \$(seq 1 ${RUNS:-3}); do
    env PYTHONPATH=$TMP/src $PY -m oases bench --overhead ${SCHEDULES:+--schedules $SCHEDULES} --out runs/overhead-${ROUND:-round4}-before-\$r
    env PYTHONPATH=src $PY -m oases bench --overhead ${SCHEDULES:+--schedules $SCHEDULES} --out runs/overhead-${ROUND:-round4}-after-\$r
    cp runs/overhead-${ROUND:-round4}-before-\$r/overhead.json $HERE/repeat/before-\$r.json
    cp runs/overhead-${ROUND:-round4}-after-\$r/overhead.json $HERE/repeat/after-\$r.json
  done"
rm -rf "$TMP"
