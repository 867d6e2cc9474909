#!/usr/bin/env bash
# The pipeline planner on paper (issue 28 item 7): for each model and cluster, the planner's
# best plan without a pipeline and with one, and each search's wall time. The cases of one
# group run in one process under /tmp/oases-cpu.lock (the lock this project's helpers share),
# one case after another. Outputs: out/CASE.json, out/CASE.nopp.json and out/CASE.pp.json
# (plan files), out/GROUP.txt (what it printed).
#   run.sh [GROUP ...]     groups: llama (issue 28's LLaMA-2-13B at every network), 100, 10,
#                          25, a100 (the 96-layer GPT-2 and the paper's seven models there)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
python=${PYTHON:-/work/main/.venv/bin/python}
export PYTHONPATH=$root/src
cd "$here"
mkdir -p out out-plans
declare -A nets=(
  [100]="paper-3090-pcie-32|100|32" [25]="paper-3090-pcie-32|25|32"
  [10]="paper-3090-pcie-32|10|32" [a100]="a100-ib-64|-|64"
)
groups=("${@:-llama 100 10 25 a100}")
for group in ${groups[@]}; do
  cases=()
  if [ "$group" = llama ]; then
    for tag in 100 25 10 a100; do
      cases+=("llama13b-$tag|llama13b.toml|${nets[$tag]}|fused")
    done
  else
    cases+=("gpt96-$group|gpt-96.toml|${nets[$group]}|-")
    for m in paper-h1024-l24 paper-h2048-l24 paper-h3072-l24 paper-h4096-l16 \
             paper-h6144-l16 paper-h8192-l8 paper-h12288-l4; do
      cases+=("${m#paper-}-$group|$m.toml|${nets[$group]}|-")
    done
  fi
  if [ -n "${NOLOCK:-}" ]; then  # NOLOCK=1: the plans only, at the lowest priority, without
    # the lock: their wall times are not measurements (the machine is shared), OUT=out-plans
    OUT=out-plans nice -n 19 "$python" run_case.py "${cases[@]}" > "out-plans/$group.txt" 2>&1
  else
    flock /tmp/oases-cpu.lock nice "$python" run_case.py "${cases[@]}" > "out/$group.txt" 2>&1
  fi
  echo "$group: $(ls out/*-"${group/llama/}"*.json 2>/dev/null | wc -l) files"
done
