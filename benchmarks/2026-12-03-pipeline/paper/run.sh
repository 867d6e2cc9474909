#!/usr/bin/env bash
# The pipeline on paper: issue 28's LLaMA-2-13B case on the Oases paper's cluster
# (paper-3090-pcie-32) at 100, 25 and 10 Gb Ethernet between servers, bf16, fused attention,
# 128 sequences a step: the planner's best plan without a pipeline (oases@auto) beside
# pipelines of 8 stages (one per server, TP inside it) under every order, by oases simulate.
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=benchmarks/2026-12-03-pipeline/paper
for gbps in 100 25 10; do
  nice .venv/bin/python -m oases simulate --model "$here/llama13b.toml" \
    --cluster paper-3090-pcie-32 --inter-gbps "$gbps" --dtype bf16 --attention fused \
    --global-batch 128 --micro-batch 2 --micro-batch-tp 4 --out "runs/pipeline-paper/$gbps" \
    --schedules "oases@auto,megatron@tp=4,pp=8,sp=shards,oases@tp=4,pp=8,sp=shards,oases@tp=4,pp=8,pps=1f1b-pair,sp=shards,oases@tp=4,pp=8,pps=zb-h1,sp=shards,oases@tp=4,pp=8,pps=gpipe,sp=shards" \
    > "$here/$gbps.txt"
done
