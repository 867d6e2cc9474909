#!/usr/bin/env bash
# The executor-cost report (issue 33): `oases bench --overhead` with main's executor (BEFORE, a
# commit, exported with git archive) and with this tree, each under the shared CPU lock (it
# times steps). About 3-4 minutes of CPU each on 2 cores, more while waiting for the lock.
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=benchmarks/2026-12-04-overhead
BEFORE=${BEFORE:-0aedfd6}  # main before this work (the bench module is copied in)
PY=${PY:-/work/main/.venv/bin/python}
TMP=$(mktemp -d)
git archive "$BEFORE" src | tar -x -C "$TMP"
cp src/oases/bench/overhead.py "$TMP/src/oases/bench/"
cp src/oases/cli/bench.py "$TMP/src/oases/cli/"
flock /tmp/oases-cpu.lock env PYTHONPATH="$TMP/src" "$PY" -m oases bench --overhead \
  --out runs/overhead-before
flock /tmp/oases-cpu.lock env PYTHONPATH=src "$PY" -m oases bench --overhead --out runs/overhead
cp runs/overhead-before/overhead.json "$HERE/before.json"
cp runs/overhead-before/overhead.md "$HERE/before.md"
cp runs/overhead/overhead.json "$HERE/after.json"
cp runs/overhead/overhead.md "$HERE/after.md"
rm -rf "$TMP"
