#!/usr/bin/env bash
# 2026-12-05 (issue 29, round 14): BEFORE (default cc9fb8a, round 13's code) and AFTER (default:
# this checkout's HEAD), alternating, each case RUNS times, the batch under one hold of the CPU lock:
#   CASES="gpt96-48gb:3 gpt96-24gb:3" flock /tmp/oases-cpu.lock bash run14.sh  (a warm-up compiles the kernels first: warm.txt)
# Writes out20/SIDE-CASE-RUN.{txt,json} and times20.tsv (side, case, run, load, wall s, max
# resident KiB of the main process and its worker, the searches' own times as printed).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
python=${PYTHON:-/work/main/.venv/bin/python}
cd "$here"
out_dir=${OUT:-out20}
times=${TIMES:-times20.tsv}
mkdir -p "$out_dir"
declare -A src
declare -A rev=([before]=${BEFORE:-cc9fb8a} [after]=${AFTER:-HEAD})
for side in before after; do
  src[$side]=$(mktemp -d)
  git -C "$root" archive "${rev[$side]}" src | tar -x -C "${src[$side]}"
  echo "$side: $(git -C "$root" rev-parse --short "${rev[$side]}")" >> "$out_dir/revision.txt"
  # the compiled loops (numba, cached on disk beside their modules) compiled once here, untimed,
  # as an install's first search does (its seconds written to warm.txt): round 14's planner.jit,
  # round 13's tape_kernel.load
  PYTHONPATH=${src[$side]}/src "$python" -c "import time; t = time.perf_counter()
try:
    from oases.planner import jit
    ok = jit.load()
except ImportError:
    from oases.planner import tape_kernel
    ok = tape_kernel.load() is not None
print('$side', 'compiled or loaded in', round(time.perf_counter() - t, 2), 's', ok)" >> "$out_dir/warm.txt"
done
declare -A args
args[gpt96-48gb]="gpt-96.toml --world-size 32 --memory-gb 48 --hardware paper-3090-pcie-32 --train.global_batch=128"
args[gpt96-24gb]="gpt-96.toml --world-size 32 --memory-gb 24 --hardware paper-3090-pcie-32 --train.global_batch=128"
args[gpt96-48gb-ppauto]="${args[gpt96-48gb]} --pp auto"
args[llama64-1024]="llama-64.toml --world-size 1024 --hardware a100-ib-1024.toml"
for m in h1024-l24 h2048-l24 h3072-l24 h4096-l16 h6144-l16 h8192-l8 h12288-l4; do
  args[paper-$m]="paper-$m.toml --world-size 32 --hardware paper-3090-pcie-32"
done
for item in ${CASES:-gpt96-48gb:3 gpt96-24gb:3 gpt96-48gb-ppauto:3 llama64-1024:3}; do
  name=${item%:*}; runs=${item#*:}
  for run in $(seq 1 "$runs"); do
    for side in ${SIDES:-before after}; do
      out="$out_dir/$side-$name-$run"
      load=$(cut -d" " -f1 /proc/loadavg)
      start=$(date +%s.%N)
      # shellcheck disable=SC2086
      PYTHONPATH=${src[$side]}/src /usr/bin/time -f "maxrss_kib %M" "$python" -m oases plan \
        ${args[$name]} --out "$out.json" > "$out.txt" 2>&1
      end=$(date +%s.%N)
      printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$side" "$name" "$run" "$load" \
        "$(echo "$end - $start" | bc)" "$(grep -o 'maxrss_kib [0-9]*' "$out.txt")" \
        "$(grep -o 'searched in [0-9.]* s' "$out.txt")" \
        "$(grep -o 'walked whole, [0-9.]* s' "$out.txt")" >> "$times"
    done
  done
done
rm -rf "${src[before]}" "${src[after]}"
