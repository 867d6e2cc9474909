#!/usr/bin/env bash
# Round 4 (2026-12-04c): the 96-layer case with pipelines (`--pp auto`), before = BEFORE
# (default 5c308d3) and after = AFTER (default a256ce9), each commit's src/ archived, run
# alternately RUNS times (default 3) under one hold of the CPU lock:
#   flock /tmp/oases-cpu.lock bash run4.sh
# Writes out4/WHICH-RUN.{txt,json} and times4.tsv (which, run, load, wall s, the flat search's
# and the pipeline search's own times as `oases plan` prints them).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
python=${PYTHON:-/work/main/.venv/bin/python}
cd "$here"
mkdir -p out4
declare -A src
for which in before after; do
  rev=${BEFORE:-5c308d3}
  [ "$which" = after ] && rev=${AFTER:-a256ce9}
  src[$which]=$(mktemp -d)
  git -C "$root" archive "$rev" src | tar -x -C "${src[$which]}"
done
for run in $(seq 1 "${RUNS:-3}"); do
  for which in before after; do
    load=$(cut -d" " -f1 /proc/loadavg)
    start=$(date +%s.%N)
    PYTHONPATH=${src[$which]}/src "$python" -m oases plan gpt-96.toml --world-size 32 \
      --memory-gb 48 --hardware paper-3090-pcie-32 --train.global_batch=128 --pp auto \
      --out "out4/$which-$run.json" > "out4/$which-$run.txt" 2>&1
    end=$(date +%s.%N)
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$which" "$run" "$load" "$(echo "$end - $start" | bc)" \
      "$(grep -o 'searched in [0-9.]* s' "out4/$which-$run.txt")" \
      "$(grep -o 'walked whole, [0-9.]* s' "out4/$which-$run.txt")" >> times4.tsv
  done
done
