#!/usr/bin/env bash
# The simulator and planner in bf16 (issue 15), nothing but Python (a few minutes on 2 CPU
# cores): `oases simulate` writes one folder per run under runs/bf16-simulation, its table is
# kept here as out/*.txt, and summarize.py writes results.md and results.json.
#
# (a) The paper's seven GPT models on its 32-GPU RTX 3090 cluster (paper-3090-pcie-32), in
#     fp32 (the paper's setting) and in bf16 with fp32 master weights and an fp32 DP gradient
#     reduction, with the commands of benchmarks/2026-11-30-paper-simulation: Megatron-LM
#     (megatron-recompute), Merak and Oases at Megatron's degree (tp=4, 8 for H >= 6144), Oases
#     with the planner's degrees (auto); 4 sequences per TP group per micro-batch, 20
#     micro-batches per step. Materialized attention, as the paper's prototype ran it.
#     (a2) paper-h2048-l24 again in bf16 with --grad-reduce-dtype bf16.
# (b) LLaMA-2-7B and 13B shapes on 64 A100s and 64 H100s in bf16, the planner's choice for
#     three schedules (@auto), 1024 sequences of 4096 tokens per step (4M tokens, LLaMA-2's
#     batch), a micro-batch of one sequence per model replica at tp=1 (64 across the cluster),
#     attention as a fused flash-style kernel (PyTorch's SDPA on GPUs); materialized attention
#     beside it for the 7B on A100s.
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=benchmarks/2026-12-02-bf16-simulation
OUT=runs/bf16-simulation
mkdir -p "$OUT" "$HERE/out"
MODELS=(paper-h1024-l24:4 paper-h2048-l24:4 paper-h3072-l24:4 paper-h4096-l16:4
        paper-h6144-l16:8 paper-h8192-l8:8 paper-h12288-l4:8)

paper() {  # model tp name [extra args]
  local micro=$((4 * 32 / $2))
  nice .venv/bin/oases simulate --model "$1" --cluster paper-3090-pcie-32 \
    --schedules "megatron-recompute@tp=$2,merak@tp=$2,oases@tp=$2,oases@auto" \
    --micro-batch 4 --micro-batch-tp "$2" --global-batch $((20 * micro)) \
    --out "$OUT/$3" "${@:4}" | tee "$HERE/out/$3.txt"
}

for entry in "${MODELS[@]}"; do
  model=${entry%:*} tp=${entry#*:}
  paper "$model" "$tp" "fp32-$model" --dtype fp32
  paper "$model" "$tp" "bf16-$model" --dtype bf16
done
paper paper-h2048-l24 4 "bf16-gr16-paper-h2048-l24" --dtype bf16 --grad-reduce-dtype bf16

llama() {  # model cluster name [extra args]
  nice .venv/bin/oases simulate --model "$HERE/$1.toml" --cluster "$2" --dtype bf16 \
    --schedules "megatron-recompute@auto,megatron@auto,oases@auto" \
    --global-batch 1024 --micro-batch 1 --micro-batch-tp 1 \
    --out "$OUT/$3" "${@:4}" | tee "$HERE/out/$3.txt"
}

for model in llama2-7b llama2-13b; do
  for cluster in a100-ib-64 h100-ib-64; do
    llama "$model" "$cluster" "$model-$cluster" --attention fused
  done
done
llama llama2-7b a100-ib-64 "llama2-7b-a100-ib-64-materialized" --attention materialized

nice .venv/bin/python "$HERE/summarize.py" "$OUT"
