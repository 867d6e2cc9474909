"""Per-region TP degrees inside pipeline stages: the stage layouts the pipeline search screens
beside its uniform ones (issue 28 item 7).

A stage of W/pp ranks runs its regions as a plan without a pipeline on W/pp ranks would, so
the degrees come from the plan search of one stage, used as a black box::

    solve_plan(cfg, W/pp ranks, a stage's micro-batch, pp x budget)
        -> every chain's answer (a degree per region: schedule, n_sub, ZeRO, sp)
    mixed_layouts: the MIXED_LAYOUTS fastest of them whose degrees are not all one
    stage_cuts:    the block starts where a boundary may go (one degree on both sides:
                   ``ParallelPlan.check``); balanced_stage_starts cuts only there

Why pp x the budget: a stage holds 1/pp of the state (weights, gradients, Adam moments),
and its activations -- 1F1B's first stage: pp micro-batches over 1/pp of the chain -- about
one micro-batch's over the whole chain, which the plan without a pipeline holds; so a layout
whose state is most of its peak may take up to pp x the budget there. The answer only seeds
the screen: its peak is scaled to the fullest stage (``pipeline_screen.screen_layout``) and
every finalist walked whole against the real budget.

The plan search of a stage runs on one process, even where ``oases plan`` lets searches use
a second (``search_prefetch.one_process``): a stage's search is short, and forking its worker
and walking its guessed chains cost more than they save (the 96-layer case's 19 stage
searches: 7.7 s with the worker, 5.4 s without; benchmarks/2026-12-04-search, round 10).
One process or two give the same candidates (``search_prefetch``).

Not searched: a stage's degrees solved for its own regions and budget (every stage keeps the
degrees the whole chain's answer gives its regions), stage boundaries where the degrees differ.
"""

from __future__ import annotations

from oases.config import ModelConfig
from oases.plan import ParallelPlan
from oases.planner.batch import BatchShape
from oases.planner.costs import Costs
from oases.planner.pipeline_screen import layout_key

MIXED_LAYOUTS = 4  # a stage size's mixed layouts screened (the solve's fastest)


def mixed_layouts(
    cfg: ModelConfig,
    costs: Costs,
    stage_world: int,
    stage_shape: BatchShape,
    budget_bytes: float,
    pp: int,
    *,
    schedules: tuple[str, ...],
    degrees: list[int],
    n_subs: tuple[int, ...],
    zeros: tuple[int, ...],
    sps: tuple[str, ...],
    max_inflight: int,
) -> list[ParallelPlan]:
    """The fastest ``MIXED_LAYOUTS`` plans with more than one TP degree that the plan search
    finds for one stage of ``stage_world`` ranks (module docstring), fastest first; [] where
    ``degrees`` leaves nothing to mix or the search finds nothing."""
    from oases.planner import search_prefetch
    from oases.planner.search import solve_plan

    usable = [t for t in degrees if stage_world % t == 0]
    if len(usable) < 2:
        return []
    try:
        with search_prefetch.one_process():  # (module docstring)
            _, candidates = solve_plan(
                cfg,
                costs,
                stage_world,
                stage_shape,
                pp * budget_bytes,
                schedules=schedules,
                n_subs=n_subs,
                degrees=usable,
                max_inflight=max_inflight,
                zeros=zeros,
                sps=tuple(s for s in sps if s),
            )
    except ValueError:  # nothing splits or fits a stage of this size
        return []
    mixed = sorted(
        (c for c in candidates if c.fits and not c.plan.is_uniform()),
        key=lambda c: c.result.step_s,
    )
    out: list[ParallelPlan] = []
    seen: set[tuple] = set()
    for c in mixed:
        key = layout_key(c.plan)
        if key not in seen:
            seen.add(key)
            out.append(c.plan)
        if len(out) == MIXED_LAYOUTS:
            break
    return out


def stage_cuts(plan: ParallelPlan) -> set[int]:
    """The blocks b (1 <= b < n_layers) at whose start a stage boundary may go: block b-1's
    MLP and block b's attention have one TP degree (a boundary sends one activation between
    two stages of one layout)."""
    n_layers = (len(plan.regions) - 2) // 2
    return {b for b in range(1, n_layers) if plan.regions[2 * b].tp == plan.regions[2 * b + 1].tp}
