#!/usr/bin/env bash
# Round 4 of the executor-cost report (issue 33): `oases bench --overhead` (all seven entries, both
# models) with main's executor (BEFORE, exported with git archive), then this tree, back to back
# in one hold of the shared CPU lock; then the shaped-link bench (tp=2, 343 Mbit/s, root for the
# loopback) of megatron and overlap BEFORE and AFTER, 5 timed steps each. About 15 minutes.
set -euo pipefail
cd "$(dirname "$0")/../../.."
HERE=benchmarks/2026-12-04-overhead/round4
BEFORE=${BEFORE:-f2c89a3}  # main before this round
PY=${PY:-/work/main/.venv/bin/python}
TMP=$(mktemp -d)
git archive "$BEFORE" src | tar -x -C "$TMP"
flock /tmp/oases-cpu.lock bash -c "
  env PYTHONPATH=$TMP/src $PY -m oases bench --overhead --out runs/overhead4-before
  env PYTHONPATH=src $PY -m oases bench --overhead --out runs/overhead4-after"
for side in before after; do cp runs/overhead4-$side/overhead.json "$HERE/$side.json"; \
  cp runs/overhead4-$side/overhead.md "$HERE/$side.md"; done
if [ "${SHAPED:-1}" = 1 ]; then
  flock /tmp/oases-cpu.lock bash -c "
    env PYTHONPATH=$TMP/src $PY -m oases bench configs/bench.toml --nproc-per-node 2 --link 343mbit \
      --schedules megatron,overlap --steps 5 --warmup 1 --out runs/shaped4-before
    env PYTHONPATH=src $PY -m oases bench configs/bench.toml --nproc-per-node 2 --link 343mbit \
      --schedules megatron,overlap --steps 5 --warmup 1 --out runs/shaped4-after"
  for side in before after; do mkdir -p "$HERE/shaped-$side"; \
    cp runs/shaped4-$side/{report.md,bench.json,raw.json} "$HERE/shaped-$side/"; done
fi
rm -rf "$TMP"
