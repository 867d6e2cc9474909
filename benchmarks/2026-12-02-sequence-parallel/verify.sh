#!/usr/bin/env bash
# oases plan --verify on 2 ranks with sequence parallelism in the search (issue 17): a profile
# of this machine (it runs sequence-parallel programs too), then the planner's uniform
# candidates of oases and megatron up to tp=2 (with and without sequence parallelism, ZeRO 0)
# and the chosen plan, each measured in interleaved launches and re-timed in its launch.
# About 15 minutes on 2 idle CPU cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=benchmarks/2026-12-02-sequence-parallel/verify
bench="configs/bench.toml --train.global_batch=8 --train.micro_batch=8 --train.precision=fp32"
.venv/bin/oases profile $bench --nproc-per-node 2 --link none --out $out/profile.json
.venv/bin/oases plan $bench --world-size 2 --profile $out/profile.json --zero 0 \
  --schedules oases,megatron --max-tp 2 --fixed-micro-batch --sequence-parallel auto \
  --out $out/plan.json --verify $out --link none --steps 4 --warmup 2 --rounds 2 \
  --candidates all
