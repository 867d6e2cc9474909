#!/usr/bin/env bash
# 2026-12-04e: main as it stands (REV, default HEAD), alone on a quiet machine, each case
# RUNS times (default 3), the batch under one hold of the CPU lock:
#   flock /tmp/oases-cpu.lock bash run5.sh
# Writes out5/CASE-RUN.{txt,json} and times5.tsv (case, run, load, wall s, the searches' own
# times as `oases plan` prints them).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
python=${PYTHON:-/work/main/.venv/bin/python}
cd "$here"
mkdir -p out5
src=$(mktemp -d)
git -C "$root" archive "${REV:-HEAD}" src | tar -x -C "$src"
echo "rev: $(git -C "$root" rev-parse --short "${REV:-HEAD}")" > out5/revision.txt
declare -A args
args[gpt96-48gb]="gpt-96.toml --world-size 32 --memory-gb 48 --hardware paper-3090-pcie-32 --train.global_batch=128"
args[gpt96-24gb]="gpt-96.toml --world-size 32 --memory-gb 24 --hardware paper-3090-pcie-32 --train.global_batch=128"
args[gpt96-48gb-ppauto]="${args[gpt96-48gb]} --pp auto"
args[llama64-1024]="llama-64.toml --world-size 1024 --hardware a100-ib-1024.toml"
for item in ${CASES:-gpt96-48gb:3 gpt96-24gb:3 gpt96-48gb-ppauto:3 llama64-1024:1}; do
  name=${item%:*}; runs=${item#*:}
  for run in $(seq 1 "$runs"); do
    load=$(cut -d" " -f1 /proc/loadavg)
    start=$(date +%s.%N)
    # shellcheck disable=SC2086
    PYTHONPATH=$src/src "$python" -m oases plan ${args[$name]} --out "out5/$name-$run.json" \
      > "out5/$name-$run.txt" 2>&1
    end=$(date +%s.%N)
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$run" "$load" "$(echo "$end - $start" | bc)" \
      "$(grep -o 'searched in [0-9.]* s' "out5/$name-$run.txt")" \
      "$(grep -o 'walked whole, [0-9.]* s' "out5/$name-$run.txt")" >> times5.tsv
  done
done
