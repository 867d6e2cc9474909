#!/usr/bin/env bash
# The paper's seven GPT models on paper-3090-pcie-32 (the protocol of
# benchmarks/2026-11-30-paper-simulation: 4 sequences per TP group at Megatron's degree per
# micro-batch, 20 micro-batches), the planner's plan without ZeRO (auto,zero=0) and with ZeRO
# in its search (auto), beside Megatron-LM (megatron-recompute at tp=4, 8 for H >= 6144).
# Usage: paper.sh [OUT] (default: this report's paper/; 2026-12-02-zero passes its own).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-benchmarks/2026-12-01-zero/paper}
mkdir -p $out
for entry in paper-h1024-l24:4 paper-h2048-l24:4 paper-h3072-l24:4 paper-h4096-l16:4 \
             paper-h6144-l16:8 paper-h8192-l8:8 paper-h12288-l4:8; do
  model=${entry%:*} tp=${entry#*:}
  micro=$((4 * 32 / tp))
  .venv/bin/oases simulate --model "$model" --cluster paper-3090-pcie-32 \
    --schedules "megatron-recompute@tp=$tp,oases@auto,zero=0,oases@auto" \
    --micro-batch 4 --micro-batch-tp "$tp" --global-batch $((20 * micro)) \
    --out "$out/$model" | tee "$out/$model.txt"
done
