"""The collectives one optimizer step issues at each ZeRO stage, from the recording hook.

Run on 2 ranks: ``.venv/bin/torchrun --nproc-per-node 2 benchmarks/2026-12-02-zero/collectives.py``.
The bench model (configs/bench.toml), tp=1 x dp=2, schedule oases with 2 sub-batches, 2
micro-batches of 2 sequences per rank; the second of two steps is recorded (the first has no
updated weights to gather). Prints, per stage, the MiB each rank sends in a ring for each
collective kind (all-reduce 2(d-1)/d n, reduce-scatter (d-1)/d n of its input n, all-gather
(d-1) n of its shard n), and when the weight gathers are issued and waited relative to the
computes that read them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import oases
from oases.config import load_config
from oases.parallel.comm import record_collectives
from oases.parallel.shard import shard_model
from oases.schedule import build_schedule
from oases.schedule.program import Compute, Start, Wait
from oases.train.optim import build_optimizer


def bus_bytes(rec) -> float:  # noqa: ANN001
    d = rec.group_size
    return {"all_reduce": 2 * (d - 1) / d, "reduce_scatter": (d - 1) / d,
            "all_gather": d - 1}[rec.op] * rec.nbytes


def main() -> None:
    cfg = load_config("configs/bench.toml", ["--parallel.tp=1", "--train.global_batch=8"])
    ctx = oases.init_distributed(tp=1)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(ctx.rank)
    tokens = torch.randint(0, cfg.model.vocab_size, (4, cfg.model.seq_len), generator=gen)
    rows = []
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = oases.parallelize(oases.build_model(cfg.model), ctx)
        shard_model(model, stage)
        sched = build_schedule("oases", n_sub=2, micro_batch=2)
        opt = build_optimizer(model, cfg.train)
        sched.step(model, tokens, tokens)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with record_collectives() as recs:
            sched.step(model, tokens, tokens)
            opt.step()
        by_op: dict[str, float] = {}
        for r in recs:
            if r.group == "dp":
                by_op[r.op] = by_op.get(r.op, 0.0) + bus_bytes(r) / 2**20
        program = sched.program(model, 4)
        first_compute = next(i for i, ins in enumerate(program) if isinstance(ins, Compute))
        gathers = [(i, ins) for i, ins in enumerate(program) if isinstance(ins, Start)
                   and ins.kind == "ag"]
        at_head = sum(i < first_compute for i, _ in gathers)
        ahead = 0  # stage 3: gathers issued a compute before the compute that first reads them
        for i, ins in gathers:
            wait = program.index(Wait("ag", ins.index, ins.sub), i)
            between = [c for c in program[i:wait] if isinstance(c, Compute)]
            ahead += bool(between)
        rows.append((stage, by_op, len(gathers), at_head, ahead))
    if ctx.rank == 0:
        print(f"{'stage':<7}{'all-reduce':>12}{'reduce-scatter':>16}{'all-gather':>12}"
              f"{'total':>9}  weight gathers (at the head / issued under a compute)")
        for stage, ops, n, head, ahead in rows:
            total = sum(ops.values())
            ar, rs, ag = (ops.get(k, 0.0) for k in ("all_reduce", "reduce_scatter", "all_gather"))
            print(f"{stage:<7}{ar:>12.2f}{rs:>16.2f}{ag:>12.2f}{total:>9.2f}  "
                  f"{n} ({head} / {ahead})")
        print("MiB each rank sends per optimizer step on the DP group (2 micro-batches)")
    dist.barrier()


if __name__ == "__main__":
    main()
