#!/usr/bin/env bash
# Reproduces this report: each injected fault on 2 local CPU ranks under `oases train
# --max-restarts 2` (a reference run, 4 faults, 2 damaged checkpoints), then torchrun's own
# agent on gloo with the same config (3 kills with its default shared rendezvous store; 3 kills,
# a SIGSTOP and a user error with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1). 5 minutes on an idle
# 2-core machine. The times are wall clock: run it on an idle machine (the load is printed and
# written into the README's results section, which this rewrites).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=benchmarks/2026-12-01-faults
echo "before: load average $(cut -d' ' -f1-3 /proc/loadavg)"
top -bn1 | head -15
.venv/bin/python $out/measure.py $out "$@"
echo "after: load average $(cut -d' ' -f1-3 /proc/loadavg)"
