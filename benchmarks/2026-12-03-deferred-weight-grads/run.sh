#!/usr/bin/env bash
# Deferred weight gradients under sequence parallelism (issue 17, third round): every schedule
# with and without sequence parallelism on the shaped link (tp=2, 343 Mbit/s), two sub-batches
# (the bench config's) and three, 10 timed steps each; peak memory; where the link idles.
# Root (for the shaped loopback); about 50 minutes on 2 idle cores. (A first placement of
# the deferred weight gradients, right after their region's tp piece, is kept in
# first-placement-nsub2: step 1 at commit 7714c00.)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=benchmarks/2026-12-03-deferred-weight-grads
schedules="megatron-sp"
for s in megatron megatron-recompute commfree-recompute overlap overlap-recompute oases; do
  schedules="$schedules,$s,$s@sp=gathered"
done
# 0. the comparison: the overlapped schedules with sequence parallelism, weight gradients
# deferred (the default) and inline (dw=off), two sub-batches, one launch
.venv/bin/oases bench configs/bench.toml --nproc-per-node 2 --link 343mbit \
  --schedules "overlap,overlap@sp=gathered,overlap@sp=gathered,dw=off,overlap-recompute,overlap-recompute@sp=gathered,overlap-recompute@sp=gathered,dw=off,oases,oases@sp=gathered,oases@sp=gathered,dw=off" \
  --steps 10 --warmup 1 --out $out/ab-nsub2
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
# 3b. at the final commit (4e661be): the block-recompute pairs' memory and step again
.venv/bin/oases bench configs/bench.toml --nproc-per-node 2 --memory \
  --schedules "megatron-recompute,megatron-recompute@sp=gathered,overlap-recompute,overlap-recompute@sp=gathered" \
  --steps 2 --warmup 1 --out $out/memory-final
.venv/bin/oases bench configs/bench.toml --nproc-per-node 2 --link 343mbit \
  --schedules "overlap-recompute,overlap-recompute@sp=gathered" --steps 10 --warmup 1 \
  --out $out/final-nsub2
# 4. where the link idles (rank 0's traced step of each overlapped entry of step 0)
.venv/bin/python benchmarks/2026-12-02-sequence-parallel/idle.py $out/ab-nsub2/*_trace.json \
  > $out/idle.md
