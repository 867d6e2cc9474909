#!/usr/bin/env bash
# 2026-12-04d: issue 28 item 3's overlap inside stages, measured: pp=2 x tp=2 on 4 ranks over
# the same 200 Mbit/s loopback (TP all-reduces and the stage boundary both on it), one sequence
# per micro-batch (8 micro-batches a step, n_sub=1): megatron@pp=2 (synchronous TP inside 1F1B)
# against oases@pp=2,pps=1f1b-pair (one micro-batch's forward all-reduces under another's
# backward). 4 ranks on 2 cores: each rank's compute runs at about half speed, the same for
# both layouts (interleaved A B A B). Root for the shaped namespace; under the CPU lock.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/2026-12-03-pipeline/out-2026-12-04d}
LINK=${LINK:-200mbit}  # the 1 Gbit/s run: LINK=1gbit OUT=...-1gbit, the two pp layouts only
PY=${PY:-.venv/bin/python}
"$PY" -m oases bench configs/bench.toml --nproc-per-node 4 --link "$LINK" --steps 5 \
  --warmup 2 --out "$OUT" --train.global_batch=8 --train.micro_batch=1 --schedule.n_sub=1 \
  --layouts megatron@tp=2,pp=2 oases@tp=2,pp=2,pps=1f1b-pair megatron@tp=2
