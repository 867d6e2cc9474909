#!/usr/bin/env bash
# Reproduces this report (root, for the shaped loopback). About 20 minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=benchmarks/2026-11-30-schedules
# 1. every schedule, tp=2, loopback shaped to an RTX 3090 PCIe server's comm/compute ratio
.venv/bin/oases bench configs/bench.toml --link auto:rtx3090-pcie --steps 5 --out $out/rtx3090-pcie
# 2. the same on the unshaped loopback (fast links: overlap must not cost)
.venv/bin/oases bench configs/bench.toml --link none --steps 5 --out $out/unshaped
# 3. executor overhead at tp=1 (no communication at all), one rank
.venv/bin/oases bench configs/bench.toml --link none --nproc-per-node 1 --parallel.tp=1 \
  --schedules megatron,megatron-recompute,commfree-recompute,overlap,overlap-recompute,oases \
  --steps 5 --out $out/tp1
