#!/usr/bin/env bash
# 2026-12-04b: our pipeline orders against PyTorch's own under the same orders, side by side on
# 2 ranks over the same 200 Mbit/s loopback as run.sh, one sequence per micro-batch (8
# micro-batches a step, n_sub=1): 1F1B, interleaved 1F1B (2 chunks a stage) and zero bubble
# (ours ZB-H1 with one chunk a stage; torch's interleaved ZB1P with 2). Root for the shaped
# namespace; under the project's CPU lock.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/2026-12-03-pipeline/out-2026-12-04b}
PY=${PY:-.venv/bin/python}
"$PY" -m oases bench configs/bench.toml --nproc-per-node 2 --link 200mbit --steps 5 \
  --warmup 2 --out "$OUT" --train.global_batch=8 --train.micro_batch=1 --schedule.n_sub=1 \
  --layouts megatron@pp=2 torch-pp@pp=2 megatron@pp=2,pps=interleaved \
  torch-pp@pp=2,pps=interleaved megatron@pp=2,pps=zb-h1 torch-pp@pp=2,pps=zb
