#!/usr/bin/env bash
# Section 4b of ../README.md: plan --verify of each ZeRO stage with the contention term
# (commit 91cf7b8: pieces timed alone, the slowdown beside each collective measured). The
# results here were made with the same commands writing to /tmp and copied in.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=benchmarks/2026-12-02-zero/contention
bench="configs/bench.toml --parallel.tp=1 --train.global_batch=8"
.venv/bin/oases profile $bench --nproc-per-node 2 --link none --out $out/profile.json
for z in 0 1 2 3; do
  .venv/bin/oases plan $bench --world-size 2 --profile $out/profile.json --zero $z \
    --schedules oases --max-tp 1 --fixed-micro-batch --out $out/plan-zero$z.json \
    --verify $out/verify-zero$z --link none --steps 5 --warmup 2 --rounds 2 --candidates chosen
done
