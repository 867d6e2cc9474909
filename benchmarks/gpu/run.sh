#!/usr/bin/env bash
# The GPU check of issues 16 and 33, in one command (each part time-limited: 12 minutes at
# most; 134-165 s on an H200):
#
#   benchmarks/gpu/run.sh [OUT_DIR]        (default: $OUT, else benchmarks/gpu/out)
#
#   1. pytest tests/test_gpu.py tests/test_gpu_graphs.py: every schedule against the
#      single-device model (fp32, and bf16 under the same autocast), the device clock (CUDA
#      events, no sync), a timeline, no host sync in a step of any schedule
#      (torch.cuda.set_sync_debug_mode("warn"), warnings as errors), the memory terms; CUDA
#      graphs of a step (schedule.cuda_graphs): every schedule's graphed step against its eager
#      step over three optimizer steps, bf16, dropout inside a graph, the eager fallbacks, no
#      sync in a replay; on 2+ GPUs NCCL ranks: every schedule, a mixed plan and dropout
#      recompute against the single-device model / its twin, bf16, a timeline with a
#      communication lane, the profile's collectives growing with size (skipped on one GPU)
#   2. oases profile on the GPU(s): collective times (2+ GPUs) and optimizer step times grow
#      with size, fitted bandwidths finite and positive
#   3. a short training run that writes its timeline (timeline.png / timeline.json)
#   4. oases bench --overhead --cuda-graphs: each schedule's step against the plain model's,
#      eager and captured as a CUDA graph (overhead/overhead.md)
#   5. the same training run eager and with schedule.cuda_graphs=true on one GPU: median step
#      times and final losses (graphs.txt)
#
# Run from the repository root, with the project's Python (PY, default python) and CUDA.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python}
OUT_DIR=${1:-${OUT:-benchmarks/gpu/out}}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
START=$(date +%s)
FAILED=()
step() { echo; echo "== $* ($(( $(date +%s) - START )) s)"; }
fail() { FAILED+=("$1"); echo "FAILED: $1"; }
GPUS=$($PY -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$GPUS" -lt 1 ]; then echo "error: no CUDA device visible" >&2; exit 2; fi
NPROC=$(( GPUS >= 2 ? 2 : 1 ))
TP=$NPROC
{
  date -u +"%Y-%m-%d %H:%M:%S UTC"; git rev-parse HEAD 2>/dev/null || true
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'nccl', torch.cuda.nccl.version())"
} | tee "$OUT_DIR/machine.txt"
[ "$GPUS" -ge 2 ] || echo "note: one GPU: the NCCL checks (2+ GPUs) are skipped"

step "1. tests/test_gpu.py tests/test_gpu_graphs.py"
timeout 200 $PY -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py tests/test_gpu_graphs.py 2>&1 \
  | tee "$OUT_DIR/test_gpu.txt" || fail "tests/test_gpu.py tests/test_gpu_graphs.py"

step "2. oases profile on $NPROC GPU(s)"
timeout 100 $PY -m oases profile configs/tiny.toml --parallel.tp="$TP" --nproc-per-node "$NPROC" \
  --out "$OUT_DIR/profile.json" --repeats 3 2>&1 | tail -n 20 | tee "$OUT_DIR/profile.txt" \
  || fail "oases profile"
$PY - "$OUT_DIR/profile.json" <<'PYCHECK' 2>&1 | tee "$OUT_DIR/profile-check.txt" \
  || fail "profile times grow with size"
import json, sys
import torch
from oases.planner.profile import check_collective_fit
from oases.timing import DeviceClock

prof = json.load(open(sys.argv[1]))
by = {}
for e in prof["collectives"]:
    by.setdefault((e["op"], e["group_size"]), []).append((e["nbytes"], e["s"]))
for (op, g), pts in sorted(by.items()):
    pts.sort()
    lat, bw = check_collective_fit(op, g, pts)  # raises unless finite and positive
    print(f"{op} over {g}: {pts[0][0]} B {pts[0][1] * 1e6:.1f} us -> {pts[-1][0]} B "
          f"{pts[-1][1] * 1e6:.1f} us; fit {lat * 1e6:.1f} us + bytes / {bw / 1e9:.2f} GB/s")
    assert pts[-1][1] > pts[0][1], f"{op} over {g}: times do not grow with size"
if not by:
    print("collectives: none (one GPU: no group to measure)")
opt = sorted((e["n_params"], e["s"]) for e in prof["optimizer"])
print("optimizer (profile):", ", ".join(f"{n} params {s * 1e3:.3f} ms" for n, s in opt))
if len(opt) > 1:
    assert opt[-1][1] > opt[0][1], "optimizer times do not grow with size"
# the optimizer step at two sizes on this GPU, on the device clock (as the profile times it)
clock, dev = DeviceClock(torch.device("cuda")), torch.device("cuda")
times = []
for n in (2**20, 2**26):
    p = torch.nn.Parameter(torch.randn(n, device=dev))
    p.grad = torch.randn(n, device=dev)
    opt_ = torch.optim.AdamW([p], lr=1e-3)
    for _ in range(3):
        opt_.step()
    s = sorted(clock.time_s(opt_.step) for _ in range(5))[2]
    times.append(s)
    print(f"AdamW step, {n} params: {s * 1e3:.3f} ms")
assert times[1] > times[0], "optimizer times do not grow with size"
print("profile check: ok")
PYCHECK

step "3. a short training run with its timeline"
timeout 80 $PY -m oases train configs/tiny.toml --nproc-per-node "$NPROC" \
  --parallel.tp="$TP" --schedule.name=oases --train.steps=4 --train.eval_every=0 \
  --checkpoint.every=0 --train.run_dir="$OUT_DIR/train" 2>&1 | tail -n 15 \
  | tee "$OUT_DIR/train.txt" || fail "oases train"
$PY - "$OUT_DIR/train/timeline.json" <<'PYCHECK' 2>&1 | tee -a "$OUT_DIR/train.txt" \
  || fail "training timeline"
import sys
from oases.schedule.timeline import Timeline

tl = Timeline.load_chrome_trace(sys.argv[1])
comm = [e for e in tl.events if e.lane == "comm"]
print(f"timeline: {len(tl.events)} events, span {tl.span_s() * 1e3:.2f} ms, compute busy "
      f"{tl.busy_s('compute') * 1e3:.2f} ms, comm busy {tl.busy_s('comm') * 1e3:.2f} ms "
      f"({len(comm)} collectives)")
assert tl.events and all(e.end_s >= e.start_s for e in tl.events)
PYCHECK

step "4. oases bench --overhead --cuda-graphs (one GPU)"
timeout 150 $PY -m oases bench --overhead --cuda-graphs --out "$OUT_DIR/overhead" 2>&1 \
  | tee "$OUT_DIR/overhead.txt" || fail "oases bench --overhead --cuda-graphs"

step "5. training eager and with schedule.cuda_graphs=true (one GPU)"
for graphs in false true; do
  timeout 90 $PY -m oases train configs/tiny.toml --nproc-per-node 1 --parallel.tp=1 \
    --model.n_layers=12 --model.dim=256 --model.n_heads=4 --model.dropout=0.0 \
    --schedule.name=oases --schedule.n_sub=2 --train.steps=30 --train.global_batch=8 \
    --train.micro_batch=8 --train.eval_every=0 --train.log_every=10 --checkpoint.every=0 \
    --schedule.cuda_graphs=$graphs --train.run_dir="$OUT_DIR/graphs-$graphs" 2>&1 | tail -n 6 \
    | tee -a "$OUT_DIR/graphs.txt" || fail "oases train, schedule.cuda_graphs=$graphs"
done
$PY - "$OUT_DIR" <<'PYCHECK' 2>&1 | tee -a "$OUT_DIR/graphs.txt" || fail "graphs against eager"
import json, statistics, sys
from pathlib import Path

runs = {}
for graphs in ("false", "true"):
    rows = [json.loads(line) for line in Path(sys.argv[1], f"graphs-{graphs}", "metrics.jsonl")
            .read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "step_time_s" in r]
    runs[graphs] = (statistics.median(r["step_time_s"] for r in steps[5:]), steps[-1]["loss"])
    print(f"cuda_graphs={graphs}: median step {runs[graphs][0] * 1e3:.2f} ms over steps 6-"
          f"{len(steps)}, final loss {runs[graphs][1]:.5f}")
(te, le), (tg, lg) = runs["false"], runs["true"]
print(f"graphed / eager step time: {tg / te:.3f}; final losses differ by {abs(lg - le):.2e}")
assert abs(lg - le) <= 1e-3 * abs(le), "the graphed run's loss left the eager run's"
PYCHECK

step "done in $(( $(date +%s) - START )) s; outputs in $OUT_DIR"
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "GPU check FAILED: ${FAILED[*]}"
  exit 1
fi
echo "GPU check passed"
