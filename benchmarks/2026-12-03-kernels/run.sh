#!/usr/bin/env bash
# The kernel model's report (issue 30), nothing but Python (about 2 minutes on 2 CPU cores):
# (1) the sweep of sweep.py with the tree before the kernel model (BEFORE, a commit; exported
#     with git archive) and with this one, summarize.py -> results.md;
# (2) the issue's two examples with `oases simulate`, tables kept in out/;
# (3) `oases profile --kernels` on this machine's CPU (under the shared CPU lock: it times
#     kernels), kept as out/kernels-cpu.json, and the issue's first example priced from it;
# (4) the CPU path untouched: every candidate of `oases plan` from the sequence-parallel
#     report's profile predicted by both trees (cpu_identical.py), compared byte for byte.
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=benchmarks/2026-12-03-kernels
BEFORE=${BEFORE:-0a0b75c}  # main before the kernel model
PY=.venv/bin/python
mkdir -p "$HERE/out" runs/kernels
TMP=$(mktemp -d)
git archive "$BEFORE" src | tar -x -C "$TMP"
PYTHONPATH="$TMP/src" nice $PY "$HERE/sweep.py" runs/kernels/before.json
PYTHONPATH=src nice $PY "$HERE/sweep.py" runs/kernels/after.json
cp runs/kernels/before.json runs/kernels/after.json "$HERE/out/"
$PY "$HERE/summarize.py" runs/kernels/before.json runs/kernels/after.json "$HERE/results.md"

example() {  # name model micro global_batch
  for tree in before after; do
    src=$([ "$tree" = before ] && echo "$TMP/src" || echo src)
    for cluster in a100-ib-64 h100-ib-64; do
      PYTHONPATH="$src" nice $PY -m oases simulate --model "$HERE/$2.toml" --cluster "$cluster" \
        --schedules megatron@tp=1,zero=3 --dtype bf16 --attention fused --micro-batch "$3" \
        --micro-batch-tp 1 --global-batch "$4" --out "runs/kernels/$1-$cluster-$tree" \
        > "$HERE/out/$1-$cluster-$tree.txt"
    done
  done
}
example issue-8b-s8192 llama3-8b-s8192 1 64
example issue-13b-s4096 llama2-13b-s4096 2 128

flock /tmp/oases-cpu.lock env PYTHONPATH=src $PY -m oases profile --kernels --repeats 3 \
  --out "$HERE/out/kernels-cpu.json" | tee "$HERE/out/kernels-cpu.txt"
PYTHONPATH=src nice $PY -m oases simulate --model "$HERE/llama3-8b-s8192.toml" \
  --cluster "$HERE/out/kernels-cpu.json" --schedules megatron@tp=1 --dtype fp32 \
  --attention fused --micro-batch 1 --micro-batch-tp 1 --global-batch 1 \
  --out runs/kernels/cpu > "$HERE/out/issue-8b-on-this-cpu.txt" || true
for tree in before after; do
  src=$([ "$tree" = before ] && echo "$TMP/src" || echo src)
  PYTHONPATH="$src" nice $PY "$HERE/cpu_identical.py" "$HERE/out/cpu-candidates-$tree.txt"
done
cmp "$HERE/out/cpu-candidates-before.txt" "$HERE/out/cpu-candidates-after.txt" \
  && echo "CPU profile predictions: bit-identical" | tee "$HERE/out/cpu-identical.txt"
rm -rf "$TMP"
