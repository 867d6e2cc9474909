#!/usr/bin/env bash
# 2026-12-04 round: one sequence per micro-batch (8 micro-batches a step, n_sub=1) on 2 ranks
# over the same 200 Mbit/s loopback as run.sh: megatron@pp=2 against oases@pp=2 with the
# paired order (issue 28 item 3) and with 1F1B, the interleaved order (2 chunks a stage) and
# PyTorch's 1F1B. Root for the shaped namespace; under the project's CPU lock.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/2026-12-03-pipeline/out-2026-12-04}
PY=${PY:-.venv/bin/python}
"$PY" -m oases bench configs/bench.toml --nproc-per-node 2 --link 200mbit --steps 5 \
  --warmup 2 --out "$OUT" --train.global_batch=8 --train.micro_batch=1 --schedule.n_sub=1 \
  --layouts megatron@pp=2 oases@pp=2,pps=1f1b-pair oases@pp=2 megatron@pp=2,pps=interleaved \
  torch-pp@pp=2
