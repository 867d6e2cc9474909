#!/usr/bin/env bash
# Issue 28's pipeline benchmark on this machine: one model, one batch, 2 ranks, laid out as
# tensor parallelism (tp=2), data parallelism (dp=2, ZeRO 0 and 1) and a pipeline of 2 stages
# under every order, beside PyTorch's own pipelining, on a loopback shaped to 200 Mbit/s (the
# gradient all-reduce of the 4 x 512 model, 50 MB in fp32, then takes about as long as the
# step's compute: a link between servers that a reduction saturates). Interleaved, medians.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/2026-12-03-pipeline/out}
.venv/bin/python -m oases bench configs/bench.toml --nproc-per-node 2 --link 200mbit \
  --steps 5 --warmup 2 --out "$OUT" --train.global_batch=8 --train.micro_batch=2 \
  --layouts megatron@tp=2 megatron@tp=1 megatron@tp=1,zero=1 megatron@pp=2,pps=gpipe \
  megatron@pp=2 megatron@pp=2,pps=zb-h1 oases@pp=2,pps=1f1b-pair torch-pp@pp=2,pps=gpipe \
  torch-pp@pp=2
