#!/usr/bin/env bash
# Round 4 (2026-12-04d): the interleaved order searched. LLaMA-2-13B on the four clusters and
# the 96-layer GPT-2 at 100, 25 and 10 GbE, one process under the CPU lock; the best plan
# without a pipeline read from round 3 (FLAT_FROM=out-round3: search_plans did not change).
# Writes out-round4/CASE.json, CASE.pp.json, run.txt.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$here"
mkdir -p out-round4
n="paper-3090-pcie-32"
OUT=out-round4 FLAT_FROM=out-round3 PYTHONPATH=$root/src flock /tmp/oases-cpu.lock nice \
  "${PYTHON:-/work/main/.venv/bin/python}" run_case.py \
  "llama13b-100|llama13b.toml|$n|100|32|fused" "llama13b-25|llama13b.toml|$n|25|32|fused" \
  "llama13b-10|llama13b.toml|$n|10|32|fused" "llama13b-a100|llama13b.toml|a100-ib-64|-|64|fused" \
  "gpt96-100|gpt-96.toml|$n|100|32|-" "gpt96-25|gpt-96.toml|$n|25|32|-" \
  "gpt96-10|gpt-96.toml|$n|10|32|-" > out-round4/run.txt 2>&1
