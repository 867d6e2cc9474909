#!/usr/bin/env bash
# Sequence parallelism (issue 17) on this CPU machine: every schedule with and without it, and
# the megatron-sp baseline, side by side in one `oases bench` launch on the shaped link (tp=2,
# 343 Mbit/s as in the 2026-11-30 schedules report); then oases with three sub-batches (the
# count that can hide a sequence-parallel region's two collectives); the executor's saved
# bytes per block; the simulator's view. Root (for the shaped loopback); about 30 minutes on 2
# idle CPU cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=benchmarks/2026-12-02-sequence-parallel
schedules="megatron-sp"
for s in megatron megatron-recompute commfree-recompute overlap overlap-recompute oases; do
  schedules="$schedules,$s,$s@sp=gathered"
done
schedules="$schedules,commfree-recompute@sp=shards,oases@sp=shards"
# 1. n_sub=2 (the bench config's), every schedule, one launch
.venv/bin/oases bench configs/bench.toml --nproc-per-node 2 --link 343mbit \
  --schedules "$schedules" --steps 4 --warmup 1 --out $out/bench-343mbit
# 2. three sub-batches (6 sequences per micro-batch): the overlapped schedules
.venv/bin/oases bench configs/bench.toml --nproc-per-node 2 --link 343mbit \
  --train.micro_batch=6 --train.global_batch=6 --schedule.n_sub=3 \
  --schedules "megatron,megatron-sp,overlap,overlap@sp=gathered,oases,oases@sp=gathered,oases@sp=shards" \
  --steps 4 --warmup 1 --out $out/bench-343mbit-nsub3
# 3. memory: each entry in a launch of its own (unshaped), measured peak beside the simulator's
.venv/bin/oases bench configs/bench.toml --nproc-per-node 2 --memory \
  --schedules "megatron,megatron@sp=gathered,megatron-recompute,megatron-recompute@sp=gathered,oases,oases@sp=gathered,oases@sp=shards" \
  --steps 2 --warmup 1 --out $out/memory
# 4. every schedule with and without it at three sub-batches (6 sequences), more steps
schedules="megatron-sp"
for s in megatron megatron-recompute commfree-recompute overlap overlap-recompute oases; do
  schedules="$schedules,$s,$s@sp=gathered"
done
.venv/bin/oases bench configs/bench.toml --nproc-per-node 2 --link 343mbit \
  --train.micro_batch=6 --train.global_batch=6 --schedule.n_sub=3 \
  --schedules "$schedules" --steps 6 --warmup 1 --out $out/bench-343mbit-nsub3-all
# --- second round (section 3.2): after the position table left the glue's sum, the sequence
# collectives became rank-major and the timing launches left MALLOC_MMAP_THRESHOLD_ to the
# launches that measure memory
# 5. the collectives of a step alone, with and without the memory launches' allocator setting
shaped() {  # run "$@" on a loopback shaped as `--link 343mbit` shapes it
  OASES_LINK_SHAPED=1 unshare -n -- sh -c 'set -e; ip link set lo mtu 16384; ip link set lo up;
    tc qdisc add dev lo root tbf rate 343000kbit burst 32kb limit 256mb; exec "$@"' shaped "$@"
}
for env in MALLOC_MMAP_THRESHOLD_=131072 MALLOC_CHECK_=0; do  # (the second: no setting)
  shaped env $env OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 2 \
    $out/comm_only.py megatron,megatron+sp
done
# 6. every schedule with and without it, three sub-batches (10 timed steps) and two (6)
schedules="megatron-sp"
for s in megatron megatron-recompute commfree-recompute overlap overlap-recompute oases; do
  schedules="$schedules,$s,$s@sp=gathered"
done
.venv/bin/oases bench configs/bench.toml --nproc-per-node 2 --link 343mbit \
  --train.micro_batch=6 --train.global_batch=6 --schedule.n_sub=3 \
  --schedules "$schedules" --steps 10 --warmup 1 --out $out/v2-nsub3
.venv/bin/oases bench configs/bench.toml --nproc-per-node 2 --link 343mbit \
  --schedules "$schedules,commfree-recompute@sp=shards,oases@sp=shards" --steps 6 --warmup 1 \
  --out $out/v2-nsub2
# 7. memory again (the collectives' buffers changed), and where the link idles
.venv/bin/oases bench configs/bench.toml --nproc-per-node 2 --memory \
  --schedules "megatron,megatron@sp=gathered,megatron-recompute,megatron-recompute@sp=gathered,oases,oases@sp=gathered,oases@sp=shards" \
  --steps 2 --warmup 1 --out $out/v2-memory
.venv/bin/python $out/idle.py $out/v2-nsub2/oases_trace.json \
  $out/v2-nsub2/oases_sp-gathered_trace.json $out/v2-nsub3/oases_trace.json \
  $out/v2-nsub3/oases_sp-gathered_trace.json > $out/idle.md
