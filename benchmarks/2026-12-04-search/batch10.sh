#!/usr/bin/env bash
# Round 10 (2026-12-04j): the whole batch under one hold of the CPU lock:
#   flock /tmp/oases-cpu.lock bash batch10.sh
# 1. the pipeline search alone (pp_only10.py: as `oases plan --pp auto` runs it, its parts timed
#    by wrappers, no profiler) on BEFORE's and AFTER's src/, one run each -> out10/parts-SIDE.txt
# 2. run10.sh: `oases plan` before and after, alternating -> out10/, times10.tsv
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
python=${PYTHON:-/work/main/.venv/bin/python}
cd "$here"
mkdir -p out10
declare -A rev=([before]=${BEFORE:-b614cc2} [after]=${AFTER:-HEAD})
for side in before after; do
  src=$(mktemp -d)
  git -C "$root" archive "${rev[$side]}" src | tar -x -C "$src"
  echo "load $(cut -d' ' -f1 /proc/loadavg) rev $(git -C "$root" rev-parse --short "${rev[$side]}")" > "out10/parts-$side.txt"
  PYTHONPATH=$src/src "$python" pp_only10.py gpt-96.toml 32 48 paper-3090-pcie-32 \
    --train.global_batch=128 --spare >> "out10/parts-$side.txt" 2>&1
  rm -rf "$src"
done
bash run10.sh
