#!/usr/bin/env bash
# Reproduces this report (root, for the shaped loopback). About 30 minutes on 2 CPU cores.
# The link is the one the schedules report shaped to an RTX 3090 PCIe server's comm/compute
# ratio (auto:rtx3090-pcie resolved to 343 Mbit/s there); fixed here so that the profile and
# every measurement see the same link.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=benchmarks/2026-11-30-planner
# 1. profile this machine: every piece at tp 1 and 2, every sub-batch size; collectives; memory
.venv/bin/oases profile configs/bench.toml --nproc-per-node 2 --link 343mbit --out $out/profile.json
# 2. plan without a budget, then measure every uniform plan of every schedule and the chosen one
.venv/bin/oases plan configs/bench.toml --world-size 2 --profile $out/profile.json \
  --out $out/plan.json --verify $out/verify --link 343mbit --steps 3 --warmup 2 --rounds 2
# 3. a tight budget: the planner must move to recompute / higher degrees, and the run must fit
#    (0.44 GiB; --memory-gb counts GB = 10^9 bytes since 2026-12-01: 0.44 GiB = 0.4724 GB)
.venv/bin/oases plan configs/bench.toml --world-size 2 --profile $out/profile.json \
  --memory-gb 0.4724 --out $out/plan-0.44GiB.json --verify $out/verify-0.44GiB --link 343mbit \
  --steps 3 --warmup 2 --rounds 2 --candidates chosen
# 4. an impossible budget: a one-line error naming the smallest feasible budget (exit 2)
#    (0.3 GiB = 0.3221 GB)
.venv/bin/oases plan configs/bench.toml --world-size 2 --profile $out/profile.json \
  --memory-gb 0.3221 --out /dev/null 2>&1 | tee $out/impossible-budget.txt || true
# 5. a mixed-degree plan (blocks 0-1 at tp=1 x dp=2, the rest at tp=2), predicted vs measured
.venv/bin/python benchmarks/2026-11-30-planner/mixed.py
