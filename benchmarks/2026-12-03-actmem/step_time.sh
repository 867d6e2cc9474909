#!/bin/sh
# Step time with and without sequence parallelism (gh in megatron and overlap) on the shaped
# link (tp=2, 343 Mbit/s), three sub-batches, as the 2026-12-03 deferred-weight-grads report.
# Root (for the shaped loopback). Few steps: the CPU lock is shared.
cd "$(dirname "$0")/../.." && flock /tmp/oases-cpu.lock env PYTHONPATH=src \
  /work/main/.venv/bin/python -m oases bench configs/bench.toml --nproc-per-node 2 \
  --link 343mbit --train.micro_batch=6 --train.global_batch=6 --schedule.n_sub=3 \
  --schedules "megatron,megatron@sp=gathered,overlap,overlap@sp=gathered" --steps 3 --warmup 1 \
  --out benchmarks/2026-12-03-actmem/step-nsub3
