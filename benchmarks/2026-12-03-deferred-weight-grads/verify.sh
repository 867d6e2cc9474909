#!/usr/bin/env bash
# oases plan --verify on 2 ranks with sequence parallelism in the search, after the deferred
# weight gradients (the profile now times sp-dx and sp-dw): as the 2026-12-02
# sequence-parallel report's verify.sh. About 15 minutes on 2 idle CPU cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=benchmarks/2026-12-03-deferred-weight-grads/verify
bench="configs/bench.toml --train.global_batch=8 --train.micro_batch=8 --train.precision=fp32"
.venv/bin/oases profile $bench --nproc-per-node 2 --link none --out $out/profile.json
.venv/bin/oases plan $bench --world-size 2 --profile $out/profile.json --zero 0 \
  --schedules oases,megatron --max-tp 2 --fixed-micro-batch --sequence-parallel auto \
  --out $out/plan.json --verify $out --link none --steps 4 --warmup 2 --rounds 2 \
  --candidates all
