#!/usr/bin/env bash
# The paper's seven GPT models on its 32-GPU RTX 3090 cluster without NVLink, on paper:
# Megatron-LM (megatron-recompute), Merak and Oases simulated by `oases simulate`, then
# summarize.py writes the tables of README.md, results.json and sweep.png.
#
# Assumptions (the same for every model, see README.md): Megatron-LM and Merak run uniform
# tp = 4 (the GPUs of a server), or 8 where tp=4 does not fit in 95% of 24 GB (H >= 6144);
# a micro-batch gives 4 sequences to each TP group at that degree (the authors' script:
# --batch_size 4), 20 micro-batches per step (its --gas 20). Oases is simulated twice: its
# schedule at Megatron's degree, and with the planner's degrees (auto).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=runs/paper-simulation
mkdir -p "$OUT"
MODELS=(paper-h1024-l24:4 paper-h2048-l24:4 paper-h3072-l24:4 paper-h4096-l16:4
        paper-h6144-l16:8 paper-h8192-l8:8 paper-h12288-l4:8)

simulate() {  # model tp out [extra args]
  # --micro-batch counts sequences per model replica (per TP group at tp=$2); auto keeps the
  # cluster micro-batch of that degree (--micro-batch-tp)
  local micro=$((4 * 32 / $2))
  nice .venv/bin/oases simulate --model "$1" --cluster paper-3090-pcie-32 \
    --schedules "megatron-recompute@tp=$2,merak@tp=$2,oases@tp=$2,oases@auto" \
    --micro-batch 4 --micro-batch-tp "$2" --global-batch $((20 * micro)) --out "$3" "${@:4}"
}

for entry in "${MODELS[@]}"; do  # the preset's link between servers: 100 Gb Ethernet
  model=${entry%:*} tp=${entry#*:}
  simulate "$model" "$tp" "$OUT/100/$model" | tee "$OUT/100-$model.txt"
done
for gbps in 10 25 40 200; do     # how the answer moves with that assumption
  for entry in "${MODELS[@]}"; do
    model=${entry%:*} tp=${entry#*:}
    simulate "$model" "$tp" "$OUT/$gbps/$model" --inter-gbps "$gbps" > /dev/null
  done
done
nice .venv/bin/python benchmarks/2026-11-30-paper-simulation/summarize.py "$OUT"
