#!/usr/bin/env bash
# Wall time of `oases plan` (issue 29), each run alone on the machine's cores under
# /tmp/oases-cpu.lock (the lock the project's helpers share: the time waited for it is not
# counted), the load average at its start beside it.
#
#   run.sh after  [N]    this branch's search (its commit REV, default HEAD), N runs of every case
#   run.sh before [N]    main at 0aedfd6 (the search before this session), N runs of every case
#   CASES="gpt96-48gb ..." run.sh ...   only those cases, in that order
#   LIMIT=S              give a run at most S seconds (default 900; a run cut is written "cut")
#   FIRST=N              number the runs from N (more runs of cases already run)
#   LOCKED=1             the caller holds /tmp/oases-cpu.lock (batch.sh: one wait for many runs)
#   summarize.py         medians, the plans chosen before and after compared -> results.md
#
# Cases: issue 29's 96-layer GPT-2 (gpt-96.toml) on 32 RTX 3090s at 48 and 24 GB, the Oases
# paper's seven GPT models on its 32-GPU cluster (paper-*.toml, the default budget: 95% of
# 24 GB), a 64-layer LLaMA of H=8192 on 1,024 A100s (llama-64.toml, a100-ib-1024.toml).
# Outputs: out/WHICH-CASE-RUN.txt (what `oases plan` printed), out/WHICH-CASE.json (the plan),
# times.tsv (which, case, run, wall seconds, load average at the start).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
which=${1:-after}
runs=${2:-3}
limit=${LIMIT:-900}
python=${PYTHON:-$root/.venv/bin/python}
[ -x "$python" ] || python=/work/main/.venv/bin/python
cd "$here"
mkdir -p out
rev=0aedfd6
[ "$which" = after ] && rev=${REV:-HEAD}
src=$(mktemp -d)
git -C "$root" archive "$rev" src | tar -x -C "$src"
export PYTHONPATH=$src/src
echo "$which: $(git -C "$root" rev-parse --short "$rev")" >> out/revisions.txt
lock="flock /tmp/oases-cpu.lock"
[ -n "${LOCKED:-}" ] && lock=""  # the caller holds the lock for a batch of runs
declare -A args
args[gpt96-48gb]="gpt-96.toml --world-size 32 --memory-gb 48 --hardware paper-3090-pcie-32 --train.global_batch=128"
args[gpt96-24gb]="gpt-96.toml --world-size 32 --memory-gb 24 --hardware paper-3090-pcie-32 --train.global_batch=128"
order=(gpt96-48gb gpt96-24gb)
for f in paper-h1024-l24 paper-h2048-l24 paper-h3072-l24 paper-h4096-l16 paper-h6144-l16 \
         paper-h8192-l8 paper-h12288-l4; do
  args[$f]="$f.toml --world-size 32 --hardware paper-3090-pcie-32"
  order+=("$f")
done
args[llama64-1024]="llama-64.toml --world-size 1024 --hardware a100-ib-1024.toml"
order+=(llama64-1024)
# shellcheck disable=SC2206
[ -n "${CASES:-}" ] && order=($CASES)
for name in "${order[@]}"; do
  for run in $(seq "${FIRST:-1}" $((${FIRST:-1} + runs - 1))); do
    # shellcheck disable=SC2086
    wall=$($lock bash -c '
      load=$(cut -d" " -f1 /proc/loadavg)
      start=$(date +%s.%N)
      timeout "$4" "$0" -m oases plan $1 --out "$2" > "$3" 2>&1
      rc=$?
      end=$(date +%s.%N)
      [ $rc = 124 ] && echo "cut $load" || echo "$(echo "$end - $start" | bc) $load"' \
      "$python" "${args[$name]}" "out/$which-$name.json" "out/$which-$name-$run.txt" "$limit")
    printf '%s\t%s\t%s\t%s\t%s\n' "$which" "$name" "$run" ${wall} >> times.tsv
    echo "$which $name run $run: ${wall% *} s (load ${wall#* })"
    [ "${wall% *}" = cut ] && break
  done
done
rm -rf "$src"
exit 0
