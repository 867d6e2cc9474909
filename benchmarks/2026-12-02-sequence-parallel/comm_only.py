"""The collectives of one step alone, each timed from issue to wait: the program of each named
schedule (``NAME`` or ``NAME+sp`` for ``sp="gathered"``) on the bench model at three
sub-batches (6 sequences, tp=2), its collectives issued in program order on dummy buffers of
the right sizes and awaited where the program waits (``bench.runner.comm_only_step``'s loop,
timed per kind). Prints, per schedule, the median total of 3 steps (after one) and per kind
the count, median and sum per step.

Run under torchrun on 2 ranks in the shaped namespace (``run.sh`` step 5), e.g.
    torchrun --nproc-per-node 2 comm_only.py megatron,megatron+sp
with or without ``MALLOC_MMAP_THRESHOLD_=131072`` in the environment (the setting of the
launches that measure memory) to see what the allocator costs."""

from __future__ import annotations

import collections
import statistics
import sys
import time
from pathlib import Path

import torch

from oases.config import load_config
from oases.model import build_model
from oases.parallel import comm
from oases.parallel.apply import parallelize
from oases.parallel.context import init_distributed
from oases.schedule import build_schedule
from oases.schedule.program import Start, Wait

ROOT = Path(__file__).resolve().parents[2]


def main(names: list[str]) -> None:
    cfg = load_config(str(ROOT / "configs" / "bench.toml"),
                      ["train.micro_batch=6", "train.global_batch=6", "schedule.n_sub=3"])
    ctx = init_distributed(tp=cfg.parallel.tp)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = parallelize(build_model(cfg.model), ctx)
    rows, seq = cfg.train.micro_batch, cfg.model.seq_len
    for name in names:
        sched = build_schedule(name.removesuffix("+sp"), n_sub=3,
                               sp="gathered" if name.endswith("+sp") else None)
        ex = sched.executor(model)
        n_micro, k = sched.split(rows)
        act = torch.zeros(rows // (n_micro * k), seq, model.cfg.dim)  # [b, S, H]
        glue = sum(p.numel() for p in getattr(ex, "_sp_glue_params", ()))
        per: dict[str, list[float]] = collections.defaultdict(list)
        totals = []
        for rep in range(4):
            comm.barrier(ctx.world_group)
            t00 = time.perf_counter()
            handles = {}
            for ins in sched.program(model, rows):
                if not isinstance(ins, Start | Wait):
                    continue
                key = ins.kind, ins.index, ins.sub
                if isinstance(ins, Start) and ins.kind != "dp":
                    t0 = time.perf_counter()
                    if ins.kind == "sg":
                        h = comm.all_reduce_async(torch.zeros(glue), ctx.tp_group)
                    elif ins.kind in ("gf", "gb", "gr"):
                        h = comm.seq_gather_async(comm.seq_slice(act, ctx.tp_group),
                                                  ctx.tp_group)
                    elif ex.sp is not None:
                        h = comm.seq_reduce_scatter_async(act.clone(), ctx.tp_group,
                                                          consume=True)
                    else:
                        h = comm.all_reduce_async(act.clone(), ctx.tp_group)
                    handles[key] = (h, t0)
                elif isinstance(ins, Wait) and key in handles:
                    h, t0 = handles.pop(key)
                    h.wait()
                    if rep:
                        per[ins.kind].append((time.perf_counter() - t0) * 1e3)
            comm.barrier(ctx.world_group)
            if rep:
                totals.append(time.perf_counter() - t00)
        if ctx.rank == 0:
            print(f"{name}: total {statistics.median(totals):.3f} s per step, "
                  f"[b, S, H] = {tuple(act.shape)}, glue parameters {glue}")
            for kind, v in per.items():
                print(f"   {kind:4s} {len(v) // 3:3d} per step, median {statistics.median(v):7.2f}"
                      f" ms, {sum(v) / 3:8.1f} ms per step")


if __name__ == "__main__":
    main(sys.argv[1].split(","))
