#!/usr/bin/env bash
# Measured timelines of every pipeline schedule (the pipeline p2p lane beside compute and TP
# comm): `oases train` records its second step's timeline on every rank (``timeline.png``).
# 2 ranks, pp=2 x tp=1, configs/bench.toml's model (4 blocks, dim 512, S = 256), fp32, gloo,
# 4 micro-batches of one sequence, megatron inside the stages (1f1b-pair: oases), unshaped
# loopback; under the project's CPU lock. Writes meas-<schedule>.png beside this file.
set -euo pipefail
cd "$(dirname "$0")/../../.."
HERE=benchmarks/2026-12-03-pipeline/timelines
PY=${PY:-.venv/bin/python}
TMP=$(mktemp -d)
for entry in gpipe:megatron 1f1b:megatron 1f1b-pair:oases zb-h1:megatron interleaved:megatron; do
  order=${entry%%:*} inner=${entry##*:}
  chunks=1; [ "$order" = interleaved ] && chunks=2
  "$PY" -m oases train configs/bench.toml --nproc-per-node 2 --parallel.tp=1 --parallel.pp=2 \
    --parallel.pp_schedule="$order" --parallel.pp_chunks=$chunks --schedule.name="$inner" \
    --schedule.n_sub=1 --train.steps=2 --train.global_batch=4 --train.micro_batch=1 \
    --train.sample_tokens=0 --checkpoint.every=0 --train.run_dir="$TMP/$order" > "$TMP/$order.log"
  cp "$TMP/$order/timeline.png" "$HERE/meas-$order.png"
  grep -E "step +2/" "$TMP/$order.log" | tail -1 | sed "s/^/$order: /"
done
rm -rf "$TMP"
