"""The per-rank side of ``oases bench --layouts``: one model laid out several ways (TP, DP,
ZeRO, pipeline stages; PyTorch's own pipelining), timed side by side, interleaved A B C A B C.

Run under torchrun (``python -m oases.bench.layout_runner SPEC.json``). Every layout gets its
own process groups (``init_distributed`` once per layout, in the same order on every rank), its
own copy of the single-device model built from the seed, and the same global batch
(``train.global_batch`` sequences, cut into micro-batches of ``train.micro_batch`` sequences
per model replica). A step is what ``schedule.step`` runs: forwards, backwards and the
gradient reduction of the layout (data-parallel all-reduces or ZeRO's reduce-scatters and
gathers; point-to-point between stages), not the optimizer, which is the same work in every
layout. Rank 0 writes ``raw.json``: every layout's step times and peak resident memory.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import torch

from oases.bench import run_rank_spec
from oases.bench.layouts import Layout, parse_layout
from oases.bench.runner import _timed
from oases.config import load_config
from oases.memory import peak_memory_mb, reset_peak_memory
from oases.model import build_model
from oases.parallel.apply import parallelize
from oases.parallel.context import ParallelContext, init_distributed
from oases.parallel.shard import shard_model
from oases.plan import ParallelPlan
from oases.schedule import build_schedule


def replica_rows(t: torch.Tensor, ctx: ParallelContext, tp: int) -> torch.Tensor:
    """This rank's rows of the global batch: its model replica's share (TP group g of its
    stage holds rows [g B tp / S, (g + 1) B tp / S) of the stage's S ranks)."""
    per = t.shape[0] * tp // ctx.stage_size
    g = ctx.stage.rank // tp
    return t[g * per : (g + 1) * per]


def _oases_step(
    base: torch.nn.Module,
    cfg,  # noqa: ANN001
    ctx: ParallelContext,
    lay: Layout,
    tokens: torch.Tensor,
    targets: torch.Tensor,
) -> Callable[[], None]:
    plan = ParallelPlan.uniform(
        cfg.model, ctx.world_size, lay.tp, pp=lay.pp, pp_schedule=lay.pps, pp_chunks=lay.v
    )
    plan.check(cfg.model, ctx.world_size)
    model = parallelize(copy.deepcopy(base), ctx, plan)
    if lay.zero:
        shard_model(model, lay.zero)
    sched = build_schedule(
        lay.name,
        n_sub=cfg.schedule.n_sub,
        max_inflight=cfg.schedule.max_inflight,
        micro_batch=cfg.train.micro_batch,
    )
    x, y = (replica_rows(t, ctx, lay.tp) for t in (tokens, targets))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        sched.step(model, x, y)

    return step


def run(spec: dict) -> None:
    cfg = load_config(spec.get("config"), spec.get("overrides", ()))
    torch.set_num_threads(1)
    torch.manual_seed(cfg.train.seed)
    base = build_model(cfg.model)
    gen = torch.Generator().manual_seed(cfg.train.seed)
    shape = (cfg.train.global_batch, cfg.model.seq_len)
    tokens = torch.randint(0, cfg.model.vocab_size, shape, generator=gen)
    targets = torch.randint(0, cfg.model.vocab_size, shape, generator=gen)
    steps: dict[str, tuple[ParallelContext, Callable[[], None]]] = {}
    for entry in spec["layouts"]:
        lay = parse_layout(entry)
        ctx = init_distributed(tp=lay.tp, pp=lay.pp, timeout_s=cfg.parallel.timeout_s)
        if lay.name == "torch-pp":
            from oases.bench.torch_pp import torch_pp_step

            n_micro = cfg.train.global_batch // cfg.train.micro_batch
            steps[entry] = (
                ctx,
                torch_pp_step(copy.deepcopy(base), ctx, lay.pps, n_micro, tokens, targets, lay.v),
            )
        else:
            steps[entry] = (ctx, _oases_step(base, cfg, ctx, lay, tokens, targets))
    times: dict[str, list[float]] = {e: [] for e in steps}
    mems: dict[str, float] = {}
    warmup, n_steps = int(spec.get("warmup", 2)), int(spec["steps"])
    for it in range(warmup + n_steps):
        for entry, (ctx, step) in steps.items():
            reset_peak_memory(ctx.device)
            dt = _timed(ctx, step)
            if it >= warmup:
                times[entry].append(dt)
                mems[entry] = max(mems.get(entry, 0.0), peak_memory_mb(ctx.device))
    first = next(iter(steps.values()))[0]
    if first.rank == 0:
        out = Path(spec["out"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "raw.json").write_text(
            json.dumps(
                {
                    "world_size": first.world_size,
                    "times_s": times,
                    "peak_mem_mb": mems,
                    "tokens_per_step": shape[0] * shape[1],
                },
                indent=1,
            )
        )
    from oases.parallel import comm

    comm.barrier(first.world_group)  # nobody exits while a peer still talks


if __name__ == "__main__":
    run_rank_spec(run)
