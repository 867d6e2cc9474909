#!/usr/bin/env bash
# ZeRO 1-3 inside the Oases schedules, re-measured after the fixes of 2026-12-02 (issue 14):
# the gloo reduce-scatter as an all-to-all, the stages 1-2 weight gathers under the next
# forward, the memory walk's workspace and gather copies. Root, for the shaped loopback. About
# 45 minutes on 2 CPU cores; run it on an idle machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=benchmarks/2026-12-02-zero
bench="configs/bench.toml --parallel.tp=1 --train.global_batch=8"   # tp=1 x dp=2, 4 rows/rank
entries=oases,oases@zero=1,oases@zero=2,oases@zero=3,fsdp2
# 1. a profile of this machine at the benchmark's own batch (4 rows per rank at tp=1)
.venv/bin/oases profile $bench --nproc-per-node 2 --link none --out $out/profile.json
# 2. whole training steps side by side, unshaped and shaped to an RTX 3090 PCIe server's ratio
for link in none 343mbit; do
  .venv/bin/oases bench $bench --nproc-per-node 2 --schedules $entries --with-optimizer \
    --link $link --steps 6 --warmup 2 --out $out/bench-$link
done
# 3. without recompute (fsdp2 recomputes nothing)
for link in none 343mbit; do
  .venv/bin/oases bench $bench --nproc-per-node 2 --with-optimizer --link $link --steps 6 \
    --warmup 2 --schedules megatron,megatron@zero=1,megatron@zero=3,overlap@zero=3,fsdp2 \
    --out $out/no-recompute-$link
done
# 4. memory per rank at dp=2 and dp=4, predicted with the profile's memory terms
.venv/bin/oases bench $bench --nproc-per-node 2 --memory --schedules $entries --steps 2 \
  --memory-profile $out/profile.json --out $out/memory-dp2
.venv/bin/oases bench configs/bench.toml --parallel.tp=1 --train.global_batch=16 \
  --nproc-per-node 4 --memory --schedules $entries --steps 2 \
  --memory-profile $out/profile.json --out $out/memory-dp4
# 4b. (run after the rest, on its own) memory without recompute, beside fsdp2
.venv/bin/oases bench $bench --nproc-per-node 2 --memory --steps 2 \
  --schedules megatron,megatron@zero=1,megatron@zero=3,overlap@zero=3,fsdp2 \
  --memory-profile $out/profile.json --out $out/memory-dp2-no-recompute
# 4c. (run after the rest) the collectives of one step per stage, from the recording hook
.venv/bin/torchrun --nproc-per-node 2 $out/collectives.py > $out/collectives.txt
# 5. plan --verify: the chosen plan at each ZeRO stage on 2 ranks, predicted vs measured
for z in 0 1 2 3; do
  .venv/bin/oases plan $bench --world-size 2 --profile $out/profile.json --zero $z \
    --schedules oases --max-tp 1 --fixed-micro-batch --out $out/plan-zero$z.json \
    --verify $out/verify-zero$z --link none --steps 5 --warmup 2 --rounds 2 --candidates chosen
done
# 6. the 96-layer GPT-2 of issue 14 on the paper's cluster at 48 and 24 GB (pure planning)
for gb in 48 24; do
  .venv/bin/oases plan benchmarks/2026-12-01-zero/gpt-96.toml --world-size 32 \
    --hardware paper-3090-pcie-32 --train.global_batch=128 --memory-gb $gb \
    --out $out/plan-96-${gb}gb.json | tee $out/plan-96-${gb}gb.txt
done
# 7. the paper's models with and without ZeRO in the search
bash benchmarks/2026-12-01-zero/paper.sh $out/paper
