#!/bin/sh
# 2026-12-04c: the issue's case (6-layer GPT-2, dim 128, 4 heads, ffn 256, S=2048, 8 sequences,
# tp=2; overlap at 2 sub-batches) under oases bench --memory, as the 2026-12-04 report's
# bench_memory.sh: resident peak (1 warm-up, 2 steps, AdamW), then one counted step (saved
# bytes per block vs analytic, live tensor peak); sequence parallelism off, gathered, shards.
cd "$(dirname "$0")/../.." && flock /tmp/oases-cpu.lock env PYTHONPATH="${SRC:-src}" \
  /work/main/.venv/bin/python -m oases bench --memory \
  --schedules megatron,megatron@sp=gathered,megatron@sp=shards,overlap,overlap@sp=gathered,overlap@sp=shards \
  --steps 2 --warmup 1 --out benchmarks/2026-12-04b-actmem/bench-memory \
  --model.arch=gpt2 --model.n_layers=6 --model.dim=128 --model.n_heads=4 --model.ffn_dim=256 \
  --model.seq_len=2048 --model.vocab_size=256 --parallel.tp=2 --schedule.n_sub=2 \
  --train.global_batch=8 --train.micro_batch=8
