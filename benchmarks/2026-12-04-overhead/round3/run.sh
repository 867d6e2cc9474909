#!/usr/bin/env bash
# Round 3 of the executor-cost report (issue 33): `oases bench --overhead` (all seven entries, both
# models) with main's executor (BEFORE, exported with git archive; this branch's bench module
# copied in, so both tables have the k-plain column), then this tree, back to back in one hold of
# the shared CPU lock; then the shaped-link bench (tp=2, 343 Mbit/s, root for the loopback) of
# overlap@k=2 BEFORE and AFTER, 5 timed steps each. About 15 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../../.."
HERE=benchmarks/2026-12-04-overhead/round3
BEFORE=${BEFORE:-ceb21e5}  # main before this round
PY=${PY:-/work/main/.venv/bin/python}
TMP=$(mktemp -d)
git archive "$BEFORE" src | tar -x -C "$TMP"
cp src/oases/bench/overhead.py "$TMP/src/oases/bench/"
flock /tmp/oases-cpu.lock bash -c "
  env PYTHONPATH=$TMP/src $PY -m oases bench --overhead --out runs/overhead3-before
  env PYTHONPATH=src $PY -m oases bench --overhead --out runs/overhead3-after"
for side in before after; do cp runs/overhead3-$side/overhead.{json,md} "$HERE/"; \
  mv "$HERE/overhead.json" "$HERE/$side.json"; mv "$HERE/overhead.md" "$HERE/$side.md"; done
flock /tmp/oases-cpu.lock bash -c "
  env PYTHONPATH=$TMP/src $PY -m oases bench configs/bench.toml --nproc-per-node 2 --link 343mbit \
    --schedules overlap --steps 5 --warmup 1 --out runs/shaped3-before
  env PYTHONPATH=src $PY -m oases bench configs/bench.toml --nproc-per-node 2 --link 343mbit \
    --schedules overlap --steps 5 --warmup 1 --out runs/shaped3-after"
for side in before after; do mkdir -p "$HERE/shaped-$side"; \
  cp runs/shaped3-$side/{report.md,bench.json,raw.json} "$HERE/shaped-$side/"; done
rm -rf "$TMP"
