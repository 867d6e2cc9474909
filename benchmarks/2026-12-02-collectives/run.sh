#!/usr/bin/env bash
# The 2026-11-30 paper-simulation protocol re-run on the collectives NCCL's tuner would run
# (planner/collectives.py), on both of the paper's 32-GPU RTX 3090 clusters, then the
# per-collective table, then summarize.py (tables of README.md, results.json, sweep.png).
#
# Per model and cluster (the 2026-11-30 assumptions: Megatron-LM and Merak at tp = 4, or 8
# where tp=4 does not fit 95% of 24 GB (H >= 6144); 4 sequences per TP group at that degree,
# 20 micro-batches per step): megatron-recompute, merak and oases at that degree, oases with
# the planner's degrees, and megatron-recompute with the planner's degrees (Megatron at its
# own best degree on each cluster), with --uncertainty. Then the link between servers swept
# on the cluster without NVLink, as 2026-11-30 did. summarize.py adds what the paper's
# prototype planner would have chosen (planner/prototype.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/collectives}
PY=${PY:-.venv/bin/python}
HERE=benchmarks/2026-12-02-collectives
mkdir -p "$OUT"
MODELS=(paper-h1024-l24:4 paper-h2048-l24:4 paper-h3072-l24:4 paper-h4096-l16:4
        paper-h6144-l16:8 paper-h8192-l8:8 paper-h12288-l4:8)

simulate() {  # cluster model tp out [extra args]
  local micro=$((4 * 32 / $3))
  nice "$PY" -m oases simulate --model "$2" --cluster "$1" \
    --schedules "megatron-recompute@tp=$3,merak@tp=$3,oases@tp=$3,oases@auto,megatron-recompute@auto" \
    --micro-batch 4 --micro-batch-tp "$3" --global-batch $((20 * micro)) --out "$4" "${@:5}"
}

for cluster in paper-3090-pcie-32 paper-3090-nvlink-32; do
  for entry in "${MODELS[@]}"; do
    model=${entry%:*} tp=${entry#*:}
    simulate "$cluster" "$model" "$tp" "$OUT/$cluster/100/$model" --uncertainty \
      | tee "$OUT/$cluster-100-$model.txt"
  done
done
for gbps in 10 25 40 200; do     # how the answer moves with the link between servers
  for entry in "${MODELS[@]}"; do
    model=${entry%:*} tp=${entry#*:}
    simulate paper-3090-pcie-32 "$model" "$tp" "$OUT/paper-3090-pcie-32/$gbps/$model" \
      --inter-gbps "$gbps" > /dev/null
  done
done
nice "$PY" "$HERE/collectives.py"
nice "$PY" "$HERE/summarize.py" "$OUT"
