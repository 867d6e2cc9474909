#!/bin/sh
# The issue's case (6-layer GPT-2, dim 128, 4 heads, ffn 256, S=2048, 8 sequences, tp=2) under
# oases bench --memory: resident peak, saved bytes per block vs analytic, live tensor peak;
# sequence parallelism off, gathered (the default) and shards (Megatron-LM's). SRC as
# step_time.sh.
cd "$(dirname "$0")/../.." && flock /tmp/oases-cpu.lock env PYTHONPATH="${SRC:-src}" \
  /work/main/.venv/bin/python -m oases bench --memory \
  --schedules megatron,megatron@sp=gathered,megatron@sp=shards,overlap,overlap@sp=gathered,overlap@sp=shards \
  --steps 2 --warmup 1 --out benchmarks/2026-12-04-actmem/bench-memory \
  --model.arch=gpt2 --model.n_layers=6 --model.dim=128 --model.n_heads=4 --model.ffn_dim=256 \
  --model.seq_len=2048 --model.vocab_size=256 --parallel.tp=2 --schedule.n_sub=2 \
  --train.global_batch=8 --train.micro_batch=8
