#!/usr/bin/env bash
# bf16 on this CPU machine, beside fp32 (issue 15): the default job for 200 steps in each
# precision, then every schedule in both precisions side by side in one `oases bench` launch on
# the shaped link. Root (for the shaped loopback); about 35 minutes on 2 idle CPU cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=benchmarks/2026-12-02-bf16
# 1. the README's main job, 200 steps, fp32 and bf16 (validation loss every 50 steps)
for p in fp32 bf16; do
  .venv/bin/oases train configs/default.toml --train.precision=$p \
    --train.run_dir=$out/runs/$p --checkpoint.resume=never \
    | tee $out/train-$p.log
done
# 2. every schedule in fp32 and bf16, one launch, on the link of the 2026-11-30 schedules
#    report (343 Mbit/s: an RTX 3090 PCIe server's all-reduce/compute ratio in fp32 there)
schedules=""
for s in megatron megatron-recompute commfree-recompute overlap overlap-recompute oases; do
  schedules="$schedules,$s,$s@precision=bf16"
done
.venv/bin/oases bench configs/bench.toml --nproc-per-node 2 --link 343mbit \
  --schedules ${schedules#,} --steps 4 --warmup 1 --out $out/bench-343mbit
# 3. the 200-step curves side by side (compare.png) and the validation table
.venv/bin/python $out/compare.py
