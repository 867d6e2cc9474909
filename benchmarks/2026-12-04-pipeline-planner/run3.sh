#!/usr/bin/env bash
# Round 3 (per-region TP inside stages, every depth's best screen walked): the pipeline search
# again for every case of run.sh, the best plan without a pipeline read from the earlier runs
# (FLAT_FROM: out/ for LLaMA, out-plans/ for the others). One process per group under
# /tmp/oases-cpu.lock; outputs out-round3/CASE.json, CASE.pp.json, GROUP.txt.
#   run3.sh [GROUP ...]    groups as run.sh's: llama 10 25 100 a100 (this report: llama, 10
#                          and 25 under the lock; NOLOCK=1 run3.sh 100 a100)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
python=${PYTHON:-/work/main/.venv/bin/python}
export PYTHONPATH=$root/src OUT=out-round3
cd "$here"
mkdir -p out-round3
declare -A nets=(
  [100]="paper-3090-pcie-32|100|32" [25]="paper-3090-pcie-32|25|32"
  [10]="paper-3090-pcie-32|10|32" [a100]="a100-ib-64|-|64"
)
groups=("${@:-llama 10 25 100 a100}")
for group in ${groups[@]}; do
  cases=()
  if [ "$group" = llama ]; then
    export FLAT_FROM=out
    for tag in 100 25 10 a100; do
      cases+=("llama13b-$tag|llama13b.toml|${nets[$tag]}|fused")
    done
  else
    export FLAT_FROM=out-plans
    [ "$group" = a100 ] || cases+=("gpt96-$group|gpt-96.toml|${nets[$group]}|-")
    for m in paper-h1024-l24 paper-h2048-l24 paper-h3072-l24 paper-h4096-l16 \
             paper-h6144-l16 paper-h8192-l8 paper-h12288-l4; do
      cases+=("${m#paper-}-$group|$m.toml|${nets[$group]}|-")
    done
  fi
  if [ -n "${NOLOCK:-}" ]; then  # NOLOCK=1: plans only, lowest priority, no lock (the
    # machine is shared: the wall times are not measurements), GROUP-nolock.txt
    nice -n 19 "$python" run_case.py "${cases[@]}" > "out-round3/$group-nolock.txt" 2>&1
  else
    flock /tmp/oases-cpu.lock nice "$python" run_case.py "${cases[@]}" > "out-round3/$group.txt" 2>&1
  fi
done
