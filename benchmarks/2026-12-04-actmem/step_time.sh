#!/bin/sh
# Step time with and without sequence parallelism on the shaped link (tp=2, 343 Mbit/s), three
# sub-batches, as the 2026-12-03 report: sp=gathered (the default now: no re-gather) and
# sp=shards (gh, Megatron-LM's). Root (for the shaped loopback). SRC: the source tree to run
# (default: this checkout's src). STEPS timed steps (5), OUT the output folder.
cd "$(dirname "$0")/../.." && flock /tmp/oases-cpu.lock env PYTHONPATH="${SRC:-src}" \
  /work/main/.venv/bin/python -m oases bench configs/bench.toml --nproc-per-node 2 \
  --link 343mbit --train.micro_batch=6 --train.global_batch=6 --schedule.n_sub=3 \
  --schedules "megatron,megatron@sp=gathered,megatron@sp=shards,overlap,overlap@sp=gathered,overlap@sp=shards" \
  --steps ${STEPS:-5} --warmup 1 --out benchmarks/2026-12-04-actmem/${OUT:-step-nsub3}
