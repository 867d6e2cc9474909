"""The per-rank side of ``oases plan --verify``: measure one plan's real training step.

Run under torchrun (``python -m oases.bench.plan_runner SPEC.json``), one plan per launch so
the peak memory of a step is this plan's alone. A step is what the planner predicts: the
schedule's forward and backward over every micro-batch, the data-parallel gradient reduction,
and one AdamW step (``ZeroAdamW`` over the shards of regions the plan shards with ZeRO, whose
updated shards the next step gathers). Rank 0 writes ``{median_step_s, steps_s,
peak_mem_bytes, loss}``; the peak is the largest over ranks (CUDA allocator peak on a GPU, else
the process's peak resident set), beside ``reserved_peak_bytes`` (the allocator's reserved peak
on a GPU) and ``baseline_bytes`` (``profile_runner.device_baseline``: on a GPU the device
memory outside the allocator). With ``retime`` it adds the plan's pieces and optimizer step
timed after the steps, as ``oases profile`` times them (``retime``).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import torch

from oases.bench import run_rank_spec
from oases.bench.profile_runner import device_baseline, measure_compute
from oases.config import Config, load_config
from oases.memory import peak_memory_mb, peak_reserved_mb, reset_peak_memory
from oases.model import build_model
from oases.parallel import comm
from oases.parallel.apply import parallelize
from oases.parallel.context import ParallelContext, init_distributed
from oases.parallel.shard import shard_model
from oases.plan import ParallelPlan
from oases.planner import batch_shape
from oases.precision import Precision, resolve_precision
from oases.schedule import build_schedule
from oases.schedule.specs import SPECS, sub_batches
from oases.timing import DeviceClock
from oases.train.optim import build_optimizer


def run(spec: dict) -> None:
    cfg = load_config(spec.get("config"), spec.get("overrides", ()))
    torch.set_num_threads(1)
    plan = ParallelPlan.load(spec["plan"])
    embed_tp = plan.tp_of("embed")
    ctx = init_distributed(
        tp=embed_tp, timeout_s=cfg.parallel.timeout_s, degrees=plan.degrees(), pp=plan.pp
    )
    comm.barrier(ctx.world_group)
    before_model = device_baseline(ctx)  # as the profile measures its baseline
    torch.manual_seed(cfg.train.seed)
    model = parallelize(build_model(cfg.model), ctx, plan)
    model.train()
    shard_model(model, plan.zero_stages(cfg.parallel.zero), cfg.parallel.reshard_after_forward)
    optimizer = build_optimizer(model, cfg.train)  # ZeroAdamW where regions are sharded
    # the world's micro-batch, as the planner assumed it (the plan notes the one it searched),
    # in the embedding's layout: each of its dp groups feeds its share
    # (a pipeline's: across one stage of stage_size ranks, every stage fed the same rows)
    micro_rows = int(plan.notes.get("micro_rows") or batch_shape(cfg, ctx.world_size).micro_rows)
    local_micro = micro_rows * embed_tp // ctx.stage_size
    local_rows = cfg.train.global_batch * embed_tp // ctx.stage_size
    precision = resolve_precision(cfg.train.precision, ctx.device, cfg.parallel.grad_reduce_dtype)
    schedule = build_schedule(
        plan.schedule,
        n_sub=plan.n_sub,
        micro_batch=local_micro,
        max_inflight=cfg.schedule.max_inflight,
        grad_reduce_dtype=precision.grad_reduce_dtype,
        sp=plan.sp(),
    )
    gen = torch.Generator().manual_seed(cfg.train.seed + ctx.stage.rank // embed_tp)
    tokens = torch.randint(
        0, cfg.model.vocab_size, (local_rows, cfg.model.seq_len), generator=gen
    ).to(ctx.device)
    targets = torch.roll(tokens, -1, dims=1)
    times, opt_times, loss = [], [], float("nan")
    clock = DeviceClock(ctx.device)  # CUDA: events, read after the closing barrier's sync
    reset_peak_memory(ctx.device)
    for it in range(int(spec.get("warmup", 2)) + int(spec["steps"])):
        optimizer.zero_grad(set_to_none=True)
        comm.barrier(ctx.world_group)
        start = clock.now()
        with precision.autocast():
            loss = float(schedule.step(model, tokens, targets))
        mid = clock.now()
        if not spec.get("no_optimizer"):
            optimizer.step()
        comm.barrier(ctx.world_group)
        end = clock.now()
        clock.resolve()
        if it >= int(spec.get("warmup", 2)):
            times.append(clock.elapsed_s(start, end))
            opt_times.append(clock.elapsed_s(mid, end))
    peaks = comm.all_gather_objects(peak_memory_mb(ctx.device) * 2**20, ctx.world_group)
    reserved = comm.all_gather_objects(peak_reserved_mb(ctx.device) * 2**20, ctx.world_group)
    baselines = comm.all_gather_objects(before_model, ctx.world_group)
    retimed: dict = {}
    if spec.get("retime"):
        del model, optimizer, schedule
        if plan.pp > 1:  # the pieces of one stage's layout, timed without the pipeline
            ctx = init_distributed(
                tp=embed_tp, timeout_s=cfg.parallel.timeout_s, degrees=plan.degrees()
            )
            plan = dataclasses.replace(
                plan,
                pp=1,
                stage_starts=[],
                regions=[dataclasses.replace(r, dp=ctx.world_size // r.tp) for r in plan.regions],
            )
        retimed = retime(cfg, ctx, plan, local_micro, int(spec.get("retime_repeats", 2)), precision)
    if ctx.rank == 0:
        Path(spec["out"]).write_text(
            json.dumps(
                {
                    "median_step_s": statistics.median(times),
                    "steps_s": times,
                    "median_optimizer_s": statistics.median(opt_times),
                    "peak_mem_bytes": max(peaks),
                    "baseline_bytes": max(baselines),
                    "reserved_peak_bytes": max(reserved),
                    "device": ctx.device.type,
                    "loss": loss,
                    **retimed,
                },
                indent=1,
            )
        )
    comm.barrier(ctx.world_group)  # nobody exits while a peer still talks


def retime(
    cfg: Config,
    ctx: ParallelContext,
    plan: ParallelPlan,
    rows: int,
    repeats: int,
    precision: Precision,
) -> dict:
    """The plan's pieces and optimizer step timed now, in this launch, the way ``oases
    profile`` times them (``profile_runner.measure_compute``: an unsharded copy of the plan's
    model, collectives skipped, forward and backward pieces from the schedule's twin without
    recompute, recompute pieces from the schedule itself), so that ``oases plan --verify`` can
    predict the measured steps from the machine as it runs now as well as from the profile.
    Returns ``{"pieces": [...], "optimizer": [{n_params, s}]}`` in the profile's format."""
    spec = SPECS[plan.schedule]
    twin = "overlap" if spec.overlapped else "megatron"
    schedules = (plan.schedule,) if spec.recompute == "none" else (twin, plan.schedule)
    torch.manual_seed(cfg.train.seed)
    model = parallelize(build_model(cfg.model), ctx, plan)
    model.train()
    pieces, _, opt_s = measure_compute(
        model,
        ctx,
        rows,
        sub_batches(plan.schedule, plan.n_sub),
        repeats,
        cfg.train,
        schedules,
        precision,
        sp=plan.sp(),
    )
    n_params = sum(p.numel() for p in model.parameters())
    return {"pieces": pieces, "optimizer": [{"n_params": n_params, "s": statistics.median(opt_s)}]}


if __name__ == "__main__":
    run_rank_spec(run)
