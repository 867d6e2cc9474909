#!/bin/sh
# Step time on the shaped link (tp=2, 343 Mbit/s) after this round's changes: overlap-recompute
# with sequence parallelism (its attention's deferred weight gradients now run before the next
# block's rebuild) against its all-reduce version and its inline weight gradients (dw=off),
# two sub-batches (the bench config's, as the 2026-12-03 deferred-weight-grads report); and
# megatron / overlap with sp=gathered at three sub-batches (the issue's step-time ask; the gloo
# collectives now wait for gloo's thread to let go of their buffers). Root (shaped loopback).
cd "$(dirname "$0")/../.." || exit 1
out=benchmarks/2026-12-04b-actmem
flock /tmp/oases-cpu.lock env PYTHONPATH="${SRC:-src}" /work/main/.venv/bin/python -m oases bench \
  configs/bench.toml --nproc-per-node 2 --link 343mbit \
  --schedules "overlap-recompute,overlap-recompute@sp=gathered,overlap-recompute@sp=gathered,dw=off" \
  --steps ${STEPS:-5} --warmup 1 --out $out/step-ovr-nsub2
flock /tmp/oases-cpu.lock env PYTHONPATH="${SRC:-src}" /work/main/.venv/bin/python -m oases bench \
  configs/bench.toml --nproc-per-node 2 --link 343mbit \
  --train.micro_batch=6 --train.global_batch=6 --schedule.n_sub=3 \
  --schedules "megatron,megatron@sp=gathered,overlap,overlap@sp=gathered" \
  --steps ${STEPS:-5} --warmup 1 --out $out/step-nsub3
