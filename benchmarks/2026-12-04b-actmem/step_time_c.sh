#!/bin/sh
# 2026-12-04c: overlap-recompute with sequence parallelism at three sub-batches (6 sequences)
# on the shaped link (tp=2, 343 Mbit/s, configs/bench.toml), against its all-reduce version and
# its inline weight gradients (dw=off); 1 warm-up and 5 timed steps. Root (shaped loopback).
# OUT names the folder (default step-ovr-nsub3); SRC as step_time.sh.
cd "$(dirname "$0")/../.." || exit 1
out=benchmarks/2026-12-04b-actmem
flock /tmp/oases-cpu.lock env PYTHONPATH="${SRC:-src}" /work/main/.venv/bin/python -m oases bench \
  configs/bench.toml --nproc-per-node 2 --link 343mbit \
  --train.micro_batch=6 --train.global_batch=6 --schedule.n_sub=3 \
  --schedules "${ENTRIES:-overlap-recompute,overlap-recompute@sp=gathered,overlap-recompute@sp=gathered,dw=off}" \
  --steps ${STEPS:-5} --warmup 1 --out $out/${OUT:-step-ovr-nsub3}
