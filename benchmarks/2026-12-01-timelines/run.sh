#!/usr/bin/env bash
# Before/after pictures of three timelines: the training timeline of the main job (`make
# train`'s config, its second step), a measured `oases bench` timeline (the schedules report's
# trace, shaped link) and a simulated one (`oases simulate`). Before = main's code at $BASE,
# after = this branch. About 2 minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
BASE=${BASE:-11c1632}  # main's commit these pictures compare against
here=benchmarks/2026-12-01-timelines
old=$(mktemp -d)
git archive "$BASE" src configs | tar -x -C "$old"
py=.venv/bin/python

# 1. the training timeline: main's code trains 3 steps of configs/default.toml (make train's
#    job) and draws its second step; this branch draws the same trace
PYTHONPATH=$old/src $py -m oases train "$old/configs/default.toml" --train.steps=3 \
  --train.eval_every=1000 --train.run_dir="$old/run" --checkpoint.resume=never > /dev/null
cp "$old/run/timeline.png" $here/train-before.png
cp "$old/run/timeline.json" $here/train-trace.json
title="oases, step 2, rank 0/2 tp=2 (tp_rank 0) dp=1 (dp_rank 0) gloo on cpu"  # loop.py's
$py $here/render.py $here/train-trace.json $here/train-after.png "$title"

# 2. a measured bench timeline: oases at tp=2 on the loopback shaped to an RTX 3090 server
trace=benchmarks/2026-11-30-schedules/rtx3090-pcie/oases_trace.json
title="oases, tp=2, loopback shaped to 343.0 Mbit/s"  # bench/runner.py's
PYTHONPATH=$old/src $py $here/render.py $trace $here/bench-before.png "$title"
$py $here/render.py $trace $here/bench-after.png "$title" 2

# 3. a simulated timeline: the issue's 4 x 8 RTX 3090 over 25 GbE, GPT H=2048 L=24, 128
#    sequences per step, 32 per micro-batch across the cluster (main: --micro-batch counted
#    across the cluster; now per model replica: 4 at tp=4)
cat > "$old/lab.toml" <<'TOML'
name = "lab"
servers = 4
nics_per_server = 1
inter_link = "25gbe"
[server]
gpus_per_server = 8
gpu = "rtx3090"
link = "pcie4-x16"
TOML
PYTHONPATH=$old/src $py -m oases simulate --model paper-h2048-l24 --cluster "$old/lab.toml" \
  --schedules megatron-recompute@tp=4,oases@tp=4 --micro-batch 32 --global-batch 128 \
  --out "$old/sim" > $here/simulate-before.txt
cp "$old/sim/timeline-oases.png" $here/simulate-before.png
$py -m oases simulate --model paper-h2048-l24 --cluster "$old/lab.toml" \
  --schedules megatron-recompute@tp=4,oases@tp=4 --micro-batch 4 --global-batch 128 \
  --out "$old/sim-after" > $here/simulate-after.txt
cp "$old/sim-after/timeline-oases.png" $here/simulate-after.png
sed -i "s#$old#TMP#g" $here/simulate-before.txt $here/simulate-after.txt
rm -rf "$old"
