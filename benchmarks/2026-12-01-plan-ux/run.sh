#!/usr/bin/env bash
# `oases plan` and `oases simulate` as issues 12 and 13 tried them, with this branch: the
# 4 x 8 RTX 3090 / 25 GbE cluster file, and issue 12's 96-layer model on paper-3090-pcie-32 at
# 12 and 24 GiB (12.885 and 25.770 GB: --memory-gb counts GB) and at the default budget.
# About 1.5 minutes on 2 CPU cores; outputs beside this script.
set -uo pipefail
cd "$(dirname "$0")"
oases=../../.venv/bin/oases
out=$(mktemp -d)
$oases simulate --model gpt-h2048.toml --cluster lab.toml \
  --schedules megatron,megatron-recompute,commfree-recompute@auto,oases@auto \
  --out "$out/sim" > simulate-lab.txt 2>&1
$oases simulate --model gpt-h2048.toml --cluster lab.toml --schedules oases@auto,oases@tp=2 \
  --n-sub 1 --out "$out/sim1" > simulate-lab-n-sub-1.txt 2>&1
$oases plan gpt-h2048.toml --world-size 32 --hardware lab.toml --out "$out/plan.json" \
  > plan-lab.txt 2>&1
for gb in 12.885 25.770 0; do
  $oases plan gpt-96.toml --world-size 32 --hardware paper-3090-pcie-32 \
    --train.global_batch=128 --memory-gb $gb --out "$out/plan-$gb.json" \
    > "plan-96-layers-$gb.txt" 2>&1
done
$oases plan gpt-96.toml --world-size 32 --hardware rtx3090-pcie --train.global_batch=128 \
  > plan-world-too-large.txt 2>&1
$oases plan gpt-96.toml --world-size 64 --hardware paper-3090-pcie-32 \
  --train.global_batch=256 >> plan-world-too-large.txt 2>&1
sed -i "s#$out#OUT#g" ./*.txt
rm -rf "$out"
