"""Pipeline stages simulated together: every stage's program walked side by side, joined by its
point-to-point pairs (``simulate_plan`` of a plan with ``pp`` > 1 comes here).

Each stage runs the program the executor runs (``schedule.pipeline_program.build_stage_program``,
in the plan's ``pp_schedule``); ``walk_stages`` steps the stages' ``event_walk.walk_program``
walks in turn, each until it waits for a send no stage has started yet::

    stage s     ... [epi b-1](j)  Start sf(b, j) ~~~ on s's "p2p" stream: begin, + transfer
                                        |
    stage s+1   ... Start rf(b, j) ...  Wait rf(b, j): now = max(now, begin + transfer)
                                        (the wait is the bubble: class "pp")

and dx_b back the same way (sb on s+1, rb on s). A send begins when its sender reaches it and
its "p2p" stream is free (one per stage: its sends to both neighbours leave through the same
port), so nothing here is a bubble formula: warm-up, cool-down and the links' time fall out of
the walk. The transfer is priced on the ranks it joins (``p2p_s``): rank 0 of stage s is
``s x W / pp`` (TP innermost, then DP, then PP), so a boundary crosses servers where those
ranks sit on different servers (with a preset: server ``rank // gpus_per_server``), and every
rank of the stage sends at once (a server's ports shared by its GPUs). Inside a stage, its
collectives are priced as rank 0's groups of a world of ``W / pp`` ranks (stage 0's; the
stages repeat that layout).

The interleaved schedule's model chunks need nothing of their own here: a stage's program holds
all its chunks' passes, and the boundary that wraps around (the last stage to the first) is
priced on those two stages' ranks like any other.

A step's time is the slowest stage's (with its optimizer step); what bounds it is that stage's
parts (``PlanResult.step_parts``: "bubble" its waits on the other stages). Memory per stage
(``peak_memory.peak_memory`` on its own program): parameters, gradients and optimizer state of
its regions only (a tied head: a copy of the embedding on the last stage), its activations as
its schedule keeps them (1F1B's stage s up to P - s micro-batches in flight, GPipe's every one);
the plan's peak is the largest stage's.

Not modelled: gradient clipping's norm over the stages, the loss's sum to every stage, a
receive posted late (the runtime posts each a unit ahead).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import TYPE_CHECKING

from oases.config import ModelConfig
from oases.plan import ParallelPlan
from oases.planner.batch import BatchShape, region_rows
from oases.planner.costs import Costs, region_kind, region_param_count, region_params, sp_mode
from oases.planner.event_walk import SENDS, SimResult, StepCosts, walk_program
from oases.planner.layout import dp_bucket_bytes, plan_sp, region_uses, zero_layout
from oases.planner.peak_memory import ModelState, peak_memory
from oases.planner.plan_costs import plan_step_costs
from oases.planner.precision import precision_of
from oases.schedule.instructions import Instr
from oases.schedule.timeline import Event, Timeline
from oases.stages import StageLayout

if TYPE_CHECKING:
    from oases.planner.simulate import PlanResult


def walk_stages(
    programs: list[list[Instr]],
    costs: list[StepCosts],
    *,
    commfree: bool = False,
    ranks: list[int] | None = None,
    record: bool = True,
) -> list[SimResult]:
    """Walk the stages' ``programs`` (stage s priced by ``costs[s]``, its events on rank
    ``ranks[s]``) together: round by round, each stage's walk runs until it waits for a send
    not yet started (module docstring). ValueError where no stage can go on."""
    sent: dict[tuple[str, int, int], tuple[float, float]] = {}
    ranks = list(range(len(programs))) if ranks is None else ranks
    walks = [
        walk_program(p, c, commfree=commfree, rank=r, record=record, sent=sent)
        for p, c, r in zip(programs, costs, ranks)
    ]
    waiting: list[tuple[str, int, int] | None] = [None] * len(walks)
    results: list[SimResult | None] = [None] * len(walks)
    left = set(range(len(walks)))
    while left:
        moved = False
        for s in sorted(left):
            if waiting[s] is not None and waiting[s] not in sent:
                continue
            moved = True
            try:
                waiting[s] = next(walks[s])
            except StopIteration as done:
                results[s] = done.value
                left.discard(s)
        if not moved:
            raise ValueError(
                "the stages' programs wait on each other: "
                + ", ".join(f"stage {s} for {waiting[s]}" for s in sorted(left))
            )
    return [r for r in results if r is not None]


def p2p_s(costs: Costs, src: int, dst: int, nbytes: float) -> float:
    """Seconds to send ``nbytes`` from global rank ``src`` to ``dst``: the costs' own
    ``p2p_s`` where they have one, else a two-rank all-gather of twice the bytes (each side
    moves ``nbytes`` over the link those ranks share: ``collective_ranks_s`` knows which)."""
    own = getattr(costs, "p2p_s", None)
    if own is not None:
        return float(own(src, dst, nbytes))
    if nbytes <= 0:
        return 0.0
    by_ranks = getattr(costs, "collective_ranks_s", None)
    if by_ranks is not None:
        return float(by_ranks("all_gather", (src, dst), int(2 * nbytes)))
    return float(costs.collective_s("all_gather", 2, int(2 * nbytes)))


def stage_state(
    cfg: ModelConfig, plan: ParallelPlan, stage_world: int, layout: StageLayout, stage: int
) -> ModelState:
    """``layout.model_state`` of one stage: the parameters of its regions only (0 elsewhere);
    the last stage's tied head holds a copy of the embedding (as many as region 0's shard)."""
    n = len(plan.regions)
    numel = [
        region_param_count(cfg, region_kind(r.name), r.tp) if layout.holds(stage, i) else 0
        for i, r in enumerate(plan.regions)
    ]
    if cfg.tie_embeddings and layout.pp > 1 and stage == layout.pp - 1:
        numel[n - 1] += region_params(cfg, "embed", plan.regions[0].tp)[0]
    return ModelState(
        tuple(numel), tuple(stage_world // r.tp for r in plan.regions), plan.zero_stages()
    )


def stage_buckets(
    cfg: ModelConfig,
    plan: ParallelPlan,
    stage_world: int,
    state: ModelState,
    layout: StageLayout,
    stage: int,
) -> dict[int, list[tuple[int, int]]]:
    """``layout.dp_buckets`` of one stage: backward task i reduces region i's own parameters
    (where the stage holds it; ``state``: the last stage's tied copy with the head's) and
    region i+1's norm (where it holds that one: the task before the stage's first region
    carries that region's norm)."""
    degrees = [r.tp for r in plan.regions]
    if all(t == stage_world for t in degrees):
        return {}
    kinds = [region_kind(r.name) for r in plan.regions]
    norm = 2 * cfg.dim if cfg.arch == "gpt2" else cfg.dim
    buckets: dict[int, list[tuple[int, int]]] = {}
    for i, kind in enumerate(kinds):
        holds = layout.holds(stage, i)
        own = state.numel[i] - (norm if kind != "embed" else 0) if holds else 0
        parts = {stage_world // degrees[i]: 0 if state.stages[i] else own}
        if i + 1 < len(kinds) and layout.holds(stage, i + 1) and not state.stages[i + 1]:
            dp = stage_world // degrees[i + 1]
            parts[dp] = parts.get(dp, 0) + norm
        if any(parts.values()):
            buckets[i] = [(dp, numel) for dp, numel in parts.items() if numel]
    return buckets


def simulate_pipeline(
    cfg: ModelConfig,
    plan: ParallelPlan,
    costs: Costs,
    world_size: int,
    batch: BatchShape,
    *,
    max_inflight: int = 1,
    timeline: bool = True,
    reshard_after_forward: bool = True,
) -> PlanResult:
    """Predict one optimizer step of ``plan`` with its pipeline stages (module docstring): a
    ``simulate.PlanResult`` whose breakdown is the bounding stage's, with
    ``stage{s}_step_s``, ``stage{s}_bubble_s``, ``stage{s}_peak_bytes``, ``..._params_bytes``
    and ``..._activations_bytes`` (its peak) for every stage."""
    from oases.planner.simulate import PlanResult
    from oases.schedule.pipeline_program import build_stage_program
    from oases.schedule.program import SPECS, deferred_regions

    plan.check(cfg, world_size)
    layout = plan.stage_layout()
    pp, spec = layout.pp, SPECS[plan.schedule]
    stage_world = world_size // pp
    k = plan.n_sub if spec.overlapped else 1
    degrees = [r.tp for r in plan.regions]
    kinds = [region_kind(r.name) for r in plan.regions]
    n = len(degrees)
    rows = region_rows(plan, stage_world, batch, k)
    prec = precision_of(costs)
    sp = plan_sp(plan)
    stages = plan.zero_stages()
    zero = zero_layout(cfg, stages, reshard_after_forward)
    ranks = [s * stage_world for s in range(pp)]

    def message_bytes(b: int) -> float:  # x_b (or dx_b) of one sub-batch at region b's degree
        return (
            rows[b]
            * (cfg.seq_len // degrees[b] if sp else cfg.seq_len)
            * cfg.dim
            * (prec.activation_bytes)
        )

    links = {
        b: p2p_s(costs, ranks[layout.stage_of(b - 1)], ranks[layout.stage_of(b)], message_bytes(b))
        for b in layout.starts
    }
    tie_s = 0.0
    if cfg.tie_embeddings and pp > 1:
        tie_bytes = region_params(cfg, "embed", degrees[0])[0] * prec.master_bytes
        by_ranks = getattr(costs, "collective_ranks_s", None)
        tie_s = (
            by_ranks("all_reduce", (ranks[0], ranks[-1]), int(tie_bytes))
            if by_ranks is not None
            else costs.collective_s("all_reduce", 2, int(tie_bytes))
        )
    programs, steps, states, buckets = [], [], [], []
    for s in range(pp):
        state = stage_state(cfg, plan, stage_world, layout, s)
        bucket = stage_buckets(cfg, plan, stage_world, state, layout, s)
        program = build_stage_program(
            plan.schedule,
            plan.n_sub,
            layout,
            s,
            n_micro=batch.n_micro(),
            pp_schedule=plan.pp_schedule,
            max_inflight=max_inflight,
            dp_tasks=tuple(sorted(bucket)),
            degrees=None if len(set(degrees)) == 1 else tuple(degrees),
            zero=zero,
            sp=sp,
            tied=cfg.tie_embeddings,
        )
        step = plan_step_costs(
            cfg,
            plan,
            costs,
            stage_world,
            rows,
            state=state,
            buckets=bucket,
            deferring=deferred_regions(program),
        )
        programs.append(program)
        steps.append(_with_links(step, links, tie_s))
        states.append(state)
        buckets.append(bucket)
    sims = walk_stages(
        programs, steps, commfree=spec.recompute == "commfree", ranks=ranks, record=timeline
    )
    optimizer = getattr(costs, "optimizer_s", None)
    opt = [
        optimizer(sum(st.updated(i) for i in range(n))) if optimizer is not None else 0.0
        for st in states
    ]
    mems = [
        peak_memory(
            cfg,
            programs[s],
            kinds,
            degrees,
            rows,
            sp_mode(spec.recompute, sp),
            costs,
            states[s],
            region_uses(cfg, n, tied=pp == 1),
            dp_bucket_bytes(buckets[s], prec.grad_reduce_bytes),
            graph_mode=sp_mode("none", sp),
        )
        for s in range(pp)
    ]
    totals = [sim.step_s + o for sim, o in zip(sims, opt)]
    bound = max(range(pp), key=totals.__getitem__)
    fullest = max(range(pp), key=lambda s: mems[s]["peak"])
    events = Timeline()
    for s, sim in enumerate(sims):
        events.events += sim.timeline.events
        if timeline and opt[s]:
            events.add(
                Event(ranks[s], "compute", "optimizer", "optimizer", 0, sim.step_s, totals[s])
            )
    sim = sims[bound]
    per_stage = {}
    for s in range(pp):
        per_stage[f"stage{s}_step_s"] = totals[s]
        per_stage[f"stage{s}_bubble_s"] = sims[s].exposed_s.get("pp", 0.0)
        per_stage[f"stage{s}_peak_bytes"] = mems[s]["peak"]
        per_stage[f"stage{s}_params_bytes"] = mems[s]["params"]
        per_stage[f"stage{s}_activations_bytes"] = mems[s]["activations_peak"]
    return PlanResult(
        totals[bound],
        mems[fullest]["peak"],
        events,
        {
            "compute_s": sim.compute_busy_s,
            "comm_s": sim.comm_busy_s,
            "optimizer_s": opt[bound],
            **{f"exposed_{c}_s": v for c, v in sorted(sim.exposed_s.items())},
            **{f"{key}_bytes": v for key, v in mems[fullest].items()},
            "bound_stage": float(bound),
            "peak_stage": float(fullest),
            **per_stage,
        },
    )


def _with_links(step: StepCosts, links: dict[int, float], tie_s: float) -> StepCosts:
    """``step`` with the pipeline's instructions priced: a send at boundary b takes
    ``links[b]`` on the stage's "p2p" stream, a receive nothing on its own side, "tie" its
    all-reduce on a stream of its own."""

    def collective_s(kind: str, index: int) -> float:
        if kind in SENDS:
            return links[index]
        if kind in ("rf", "rb"):
            return 0.0
        if kind == "tie":
            return tie_s
        return step.collective_s(kind, index)

    def stream_of(kind: str, index: int) -> Hashable:
        if kind in SENDS:
            return "p2p"
        if kind == "tie":
            return "tie"
        if step.stream_of is None:
            return "dp" if kind in ("dp", "rs", "ag") else "tp"
        return step.stream_of(kind, index)

    return dataclasses.replace(step, collective_s=collective_s, stream_of=stream_of)
