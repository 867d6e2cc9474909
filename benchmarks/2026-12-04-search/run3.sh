#!/usr/bin/env bash
# Round 3 (2026-12-04b): before = main at ceb21e5, after = this branch at REV (default HEAD),
# each run alone under /tmp/oases-cpu.lock (held once for the batch: `flock /tmp/oases-cpu.lock
# bash run3.sh`), before and after back to back, the load average at each start beside it.
# Writes out3/WHICH-CASE-RUN.txt, out3/WHICH-CASE.json and times3.tsv.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
python=/work/main/.venv/bin/python
cd "$here"
mkdir -p out3
declare -A src
for which in before after; do
  rev=ceb21e5
  [ "$which" = after ] && rev=${REV:-HEAD}
  src[$which]=$(mktemp -d)
  git -C "$root" archive "$rev" src | tar -x -C "${src[$which]}"
  echo "$which: $(git -C "$root" rev-parse --short "$rev")" >> out3/revisions.txt
done
declare -A args
args[gpt96-48gb]="gpt-96.toml --world-size 32 --memory-gb 48 --hardware paper-3090-pcie-32 --train.global_batch=128"
args[gpt96-24gb]="gpt-96.toml --world-size 32 --memory-gb 24 --hardware paper-3090-pcie-32 --train.global_batch=128"
args[gpt96-48gb-ppauto]="${args[gpt96-48gb]} --pp auto"
args[llama64-1024]="llama-64.toml --world-size 1024 --hardware a100-ib-1024.toml"
for f in paper-h1024-l24 paper-h2048-l24 paper-h3072-l24 paper-h4096-l16 paper-h6144-l16 \
         paper-h8192-l8 paper-h12288-l4; do
  args[$f]="$f.toml --world-size 32 --hardware paper-3090-pcie-32"
done
# CASES: "case:runs ..." in order
for item in ${CASES:-gpt96-48gb:3 gpt96-24gb:3 llama64-1024:3 gpt96-48gb-ppauto:1}; do
  name=${item%:*}; runs=${item#*:}
  for run in $(seq 1 "$runs"); do
    for which in before after; do
      load=$(cut -d" " -f1 /proc/loadavg)
      start=$(date +%s.%N)
      # shellcheck disable=SC2086
      PYTHONPATH=${src[$which]}/src timeout "${LIMIT:-600}" "$python" -m oases plan ${args[$name]} \
        --out "out3/$which-$name.json" > "out3/$which-$name-$run.txt" 2>&1
      rc=$?
      end=$(date +%s.%N)
      wall=$(echo "$end - $start" | bc)
      [ $rc = 124 ] && wall=cut
      printf '%s\t%s\t%s\t%s\t%s\n' "$which" "$name" "$run" "$wall" "$load" >> times3.tsv
      echo "$which $name run $run: $wall s (load $load)"
    done
  done
done
rm -rf "${src[@]}"
