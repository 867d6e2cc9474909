#!/usr/bin/env bash
# Deferred weight gradients under sequence parallelism (issue 17, third round): every schedule
# with and without sequence parallelism on the shaped link (tp=2, 343 Mbit/s), two sub-batches
# (the bench config's) and three, 10 timed steps each; peak memory; where the link idles; the
# planner's verify on 2 ranks. Root (for the shaped loopback); about 45 minutes on 2 idle cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=benchmarks/2026-12-03-deferred-weight-grads
schedules="megatron-sp"
for s in megatron megatron-recompute commfree-recompute overlap overlap-recompute oases; do
  schedules="$schedules,$s,$s@sp=gathered"
done
# 1. two sub-batches (4 sequences), every schedule, one launch
.venv/bin/oases bench configs/bench.toml --nproc-per-node 2 --link 343mbit \
  --schedules "$schedules,commfree-recompute@sp=shards,oases@sp=shards" --steps 10 --warmup 1 \
  --out $out/nsub2
# 2. three sub-batches (6 sequences)
.venv/bin/oases bench configs/bench.toml --nproc-per-node 2 --link 343mbit \
  --train.micro_batch=6 --train.global_batch=6 --schedule.n_sub=3 \
  --schedules "$schedules" --steps 10 --warmup 1 --out $out/nsub3
# 3. memory: each entry in a launch of its own (unshaped), measured beside the memory walk
.venv/bin/oases bench configs/bench.toml --nproc-per-node 2 --memory \
  --schedules "megatron,megatron@sp=gathered,megatron-recompute,megatron-recompute@sp=gathered,overlap-recompute,overlap-recompute@sp=gathered,oases,oases@sp=gathered,oases@sp=shards" \
  --steps 2 --warmup 1 --out $out/memory
# 4. where the link idles (rank 0's timelines of steps 1 and 2)
prev=benchmarks/2026-12-02-sequence-parallel
.venv/bin/python $prev/idle.py $out/nsub2/oases_trace.json $out/nsub2/oases_sp-gathered_trace.json \
  $out/nsub2/overlap-recompute_trace.json $out/nsub2/overlap-recompute_sp-gathered_trace.json \
  $out/nsub3/oases_trace.json $out/nsub3/oases_sp-gathered_trace.json > $out/idle.md
