#!/usr/bin/env bash
# ZeRO 1-3 inside the Oases schedules, measured and planned (issue 14). Root, for the shaped
# loopback. About 40 minutes on 2 CPU cores; run it on an idle machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=benchmarks/2026-12-01-zero
bench="configs/bench.toml --parallel.tp=1 --train.global_batch=8"   # tp=1 x dp=2, 4 rows/rank
entries=oases,oases@zero=1,oases@zero=2,oases@zero=3,fsdp2
# 1. a profile of this machine for the planner (every piece at tp 1 and 2; collectives incl.
#    the reduce-scatter; activations; the baseline)
[ -f $out/profile.json ] || .venv/bin/oases profile configs/bench.toml --nproc-per-node 2 --link none --out $out/profile.json
# 2. whole training steps (forward, backward, gradient sync, clipping, AdamW and ZeRO's gather)
#    side by side, unshaped and on the loopback shaped to an RTX 3090 PCIe server's ratio
.venv/bin/oases bench $bench --nproc-per-node 2 --schedules $entries --with-optimizer \
  --link none --steps 6 --warmup 2 --out $out/unshaped
.venv/bin/oases bench $bench --nproc-per-node 2 --schedules $entries --with-optimizer \
  --link 343mbit --steps 6 --warmup 2 --out $out/shaped
# 3. memory per rank: model state by kind from the tensors, measured peak, the simulator's
#    prediction from the profile's activations (dp=2) and the analytic ones (dp=4: no profile of
#    4 ranks; 4 gloo ranks on 2 cores measure memory, not time)
.venv/bin/oases bench $bench --nproc-per-node 2 --memory --schedules $entries --steps 2 \
  --memory-profile $out/profile.json --out $out/memory-dp2
.venv/bin/oases bench configs/bench.toml --parallel.tp=1 --train.global_batch=16 \
  --nproc-per-node 4 --memory --schedules $entries --steps 2 --out $out/memory-dp4
# 4. plan --verify: the chosen plan at each ZeRO stage on 2 ranks, predicted vs measured
for z in 0 1 2 3; do
  .venv/bin/oases plan $bench --world-size 2 --profile $out/profile.json --zero $z \
    --schedules oases --max-tp 1 --fixed-micro-batch --out $out/plan-zero$z.json --verify $out/verify-zero$z \
    --link none --steps 3 --warmup 2 --rounds 2 --candidates chosen
done
# 5. the 96-layer GPT-2 of issue 14 on the paper's cluster at 48 and 24 GB (pure planning)
for gb in 48 24; do
  .venv/bin/oases plan $out/gpt-96.toml --world-size 32 --hardware paper-3090-pcie-32 \
    --train.global_batch=128 --memory-gb $gb --out $out/plan-96-${gb}gb.json \
    | tee $out/plan-96-${gb}gb.txt
done
# 5b. the 24 GB case without ZeRO, then without ZeRO nor the micro-batch search
.venv/bin/oases plan $out/gpt-96.toml --world-size 32 --hardware paper-3090-pcie-32 \
  --train.global_batch=128 --memory-gb 24 --zero 0 --out $out/plan-96-24gb-zero0-micro.json \
  > $out/plan-96-24gb-zero0-micro.txt
.venv/bin/oases plan $out/gpt-96.toml --world-size 32 --hardware paper-3090-pcie-32 \
  --train.global_batch=128 --memory-gb 24 --zero 0 --fixed-micro-batch \
  --out $out/plan-96-24gb-zero0.json > $out/plan-96-24gb-zero0.txt
# 6. the paper's models on its cluster: the planner with and without ZeRO in its search
bash $out/paper.sh
# 7. without recompute (fsdp2 recomputes nothing): megatron and overlap at stages 0 and 3 beside
#    fsdp2, unshaped and shaped
for link in none 343mbit; do
  .venv/bin/oases bench $bench --nproc-per-node 2 --with-optimizer --link $link --steps 6 \
    --warmup 2 --schedules megatron,megatron@zero=1,megatron@zero=3,overlap@zero=3,fsdp2 \
    --out $out/no-recompute-$link
done
