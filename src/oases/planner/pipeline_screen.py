"""The pipeline search's screen: every combination of depth, stage layout and micro-batch
priced by composing one stage's simulation without a pipeline, to order the combinations
before the finalists are walked whole (``planner.pipeline_search``)::

    price_layout   the stage's layout, pp=1 on W/pp ranks, at 1 and 2 micro-batches
                       c      = t(2 micro-batches) - t(1)     one micro-batch's pass
                       tail   = t(1) - c                      DP reduction, ZeRO, optimizer
                       region_s                               each region's compute
    screen_layout  boundaries = balanced_stage_starts(region_s, pp)
                   step = (n_micro + pp - 1) * c * max share + tail * max share
                          + 2 (pp - 1) point-to-point messages on the slowest boundary's link
                   peak = the layout's peak, its state and activations scaled to the fullest
                          stage (1F1B's first stage: pp micro-batches in flight)

The formula only orders the combinations; no number a candidate carries comes from here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from oases.config import ModelConfig
from oases.plan import ParallelPlan
from oases.planner.batch import BatchShape
from oases.planner.costs import Costs, region_kind, region_param_count
from oases.planner.pipeline_boundaries import balanced_stage_starts, stage_shares
from oases.planner.pipeline_walk import p2p_s
from oases.planner.region_prices import region_compute_s
from oases.planner.simulate import PlanResult, simulate_plan

LayoutPrice = tuple[float, float, PlanResult, list[float]]  # (c, tail, one micro-batch, region_s)


@dataclass(frozen=True)
class Screen:
    """One combination as the screen priced it."""

    step_s: float
    peak_bytes: float
    plan: ParallelPlan
    batch: BatchShape
    depth_best: bool = False  # the best screen of its depth (walked whatever the others)
    region_s: tuple[float, ...] = ()  # each region's compute (the interleaved order's cuts)
    cuts: frozenset[int] | None = None  # the blocks a stage may start at (None: any)


def pipeline_depths(
    world_size: int, n_layers: int, gpus_per_server: int | None, only: tuple[int, ...] = ()
) -> list[int]:
    """The pipeline depths searched: divisors pp > 1 of the world (``only``: those of them),
    at most one block per stage, whose stages of W/pp ranks fit the servers (a divisor or a
    multiple of a server's GPUs: a stage never straddles part of a server)."""
    out = []
    for pp in range(2, world_size + 1):
        if world_size % pp or pp > n_layers or (only and pp not in only):
            continue
        stage = world_size // pp
        if gpus_per_server and stage % gpus_per_server and gpus_per_server % stage:
            continue
        out.append(pp)
    return out


def layout_key(plan: ParallelPlan) -> tuple:
    return (
        plan.schedule,
        plan.n_sub,
        plan.sequence_parallel,
        tuple((r.tp, r.zero) for r in plan.regions),
    )


def price_layout(
    cfg: ModelConfig,
    base: ParallelPlan,
    costs: Costs,
    stage_world: int,
    shape: BatchShape,
    max_inflight: int,
) -> LayoutPrice | None:
    """(c, tail, the one-micro-batch result, each region's compute) of one stage's layout
    run without a pipeline on ``stage_world`` ranks (None where the batch does not split)."""
    rows = shape.micro_rows
    try:
        one = simulate_plan(
            cfg,
            base,
            costs,
            stage_world,
            BatchShape(rows, rows),
            max_inflight=max_inflight,
            timeline=False,
        )
        two = simulate_plan(
            cfg,
            base,
            costs,
            stage_world,
            BatchShape(2 * rows, rows),
            max_inflight=max_inflight,
            timeline=False,
            memory=False,  # (its step alone is read: the same step, no memory walk)
        )
        region_s = region_compute_s(
            cfg, base, costs, stage_world, BatchShape(rows, rows), max_inflight=max_inflight
        )
    except ValueError:  # the batch does not split (BatchSplitError), or the layout refuses it
        return None
    c = two.step_s - one.step_s
    if region_s is None or not sum(region_s):
        region_s = [1.0] * len(base.regions)
    return c, one.step_s - c, one, region_s


def screen_layout(
    cfg: ModelConfig,
    base: ParallelPlan,
    priced: LayoutPrice,
    costs: Costs,
    pp: int,
    stage_shape: BatchShape,
    n_micro: int,
    prec: object,
    cuts: set[int] | None = None,
) -> Screen:
    """``base`` (one stage's layout, ``priced``) as a pipeline of ``pp`` stages: boundaries,
    screen step and peak (module docstring); ``cuts``: the blocks a stage may start at (None:
    any). ValueError where the cuts give no ``pp`` stages."""
    c, tail, one, region_s = priced
    starts = balanced_stage_starts(region_s, pp, cuts)
    top = max(stage_shares(region_s, starts))
    stage_world = base.regions[0].tp * base.regions[0].dp
    t = max(base.regions[b].tp for b in starts)  # the widest boundary's rows per rank
    message = (
        stage_shape.micro_rows
        * t
        / stage_world
        * cfg.seq_len
        * cfg.dim
        * getattr(prec, "activation_bytes", 4)
    )
    link = p2p_s(costs, 0, stage_world * (pp - 1), message)  # the slowest boundary's link
    step = (n_micro + pp - 1) * c * top + tail * top + 2 * (pp - 1) * link
    b = one.breakdown
    state = b.get("params_bytes", 0.0) + b.get("grads_bytes", 0.0)
    state += b.get("optimizer_state_bytes", 0.0)
    act = b.get("activations_peak_bytes", 0.0)
    rest = max(0.0, one.peak_mem_bytes - state - act)
    held = stage_shares(region_params(cfg, base), starts)
    peak = rest + state * max(held) + act * top * min(pp, n_micro)  # 1F1B's first stage
    plan = dataclasses.replace(base, pp=pp, stage_starts=list(starts))
    return Screen(
        step,
        peak,
        plan,
        stage_shape,
        region_s=tuple(region_s),
        cuts=None if cuts is None else frozenset(cuts),
    )


def region_params(cfg: ModelConfig, plan: ParallelPlan) -> list[float]:
    """Parameters of every region at its degree (the last stage's tied head: a copy of the
    embedding)."""
    out = [float(region_param_count(cfg, region_kind(r.name), r.tp)) for r in plan.regions]
    if cfg.tie_embeddings:
        out[-1] += out[0]
    return out
