#!/usr/bin/env bash
# The H200's second call (benchmarks/2026-12-04-gpu, "The kernel model on an H200"): the kernel
# model's terms measured (oases profile --kernels, bf16 and fp32) and GPT-2 medium trained on
# one GPU in bf16, eager and with schedule.cuda_graphs=true, for the simulator's prediction.
#
#   PY=python3 bash benchmarks/2026-12-04-gpu/kernels.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python}
OUT_DIR=${1:-${OUT:-benchmarks/2026-12-04-gpu/kernels}}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
for dtype in bf16 fp32; do
  echo "== oases profile --kernels --dtype $dtype"
  timeout 200 $PY -m oases profile configs/tiny.toml --kernels --dtype "$dtype" \
    --out "$OUT_DIR/h200-$dtype.json" 2>&1 | tee -a "$OUT_DIR/kernels.txt"
done
for graphs in false true; do
  echo "== GPT-2 medium, bf16, schedule.cuda_graphs=$graphs"
  timeout 150 $PY -m oases train benchmarks/2026-12-04-gpu/gpt2-medium.toml --nproc-per-node 1 \
    --schedule.cuda_graphs=$graphs --train.run_dir="$OUT_DIR/medium-$graphs" 2>&1 | tail -n 8 \
    | tee -a "$OUT_DIR/medium.txt"
done
