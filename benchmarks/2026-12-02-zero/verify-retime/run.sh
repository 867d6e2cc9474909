#!/usr/bin/env bash
# Section 4c of ../README.md: plan --verify of each ZeRO stage after commit 7f3f7a1 (every
# launch re-times its plan's pieces; collectives slowed by compute beside them; the optimizer
# timed between the profile's own steps). About 20 minutes on 2 idle CPU cores.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=benchmarks/2026-12-02-zero/verify-retime
bench="configs/bench.toml --parallel.tp=1 --train.global_batch=8"
.venv/bin/oases profile $bench --nproc-per-node 2 --link none --out $out/profile.json
for z in 0 1 2 3; do
  .venv/bin/oases plan $bench --world-size 2 --profile $out/profile.json --zero $z \
    --schedules oases --max-tp 1 --fixed-micro-batch --out $out/plan-zero$z.json \
    --verify $out/verify-zero$z --link none --steps 6 --warmup 2 --rounds 3 --candidates chosen
done
