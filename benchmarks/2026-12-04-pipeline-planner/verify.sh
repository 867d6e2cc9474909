#!/usr/bin/env bash
# oases plan --pp 2 --verify on this machine (2 gloo ranks, unshaped loopback): the chosen plan
# and the best pp=2 plan run for real beside their predictions. Under the project's CPU lock.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$root"
PYTHONPATH=$root/src flock /tmp/oases-cpu.lock /work/main/.venv/bin/python -m oases plan \
  configs/bench.toml --train.global_batch=8 --train.micro_batch=2 --train.precision=fp32 \
  --world-size 2 --profile benchmarks/2026-12-02-sequence-parallel/verify/profile.json \
  --zero 0 --schedules megatron,oases --fixed-micro-batch --sequence-parallel off --pp 2 \
  --out "$here/verify/plan.json" --verify "$here/verify" --link none --steps 4 --warmup 2 \
  --rounds 2 --candidates chosen
