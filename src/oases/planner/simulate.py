"""Run a schedule program on costs instead of tensors: the planner's cost model.

The simulator consumes the very instruction lists the executor runs (``schedule.program``), with
one compute stream per rank and one communication stream per group of ranks (``stream_of``;
by default one for TP collectives and one for data-parallel gradient all-reduces), and returns
a ``Timeline`` in the executor's format::

    Compute(c)   compute stream:  start = now;  now += cost(c)
    Start(k)     comm stream:     begins at max(stream free, now); ends after cost(k)
                                  (a zero-cost one, a reshard's slicing direction, is done at once)
    Wait(k)      compute stream:  now = max(now, end of k)

So the same question (how long is a step under this schedule?) is answered by a measurement
and by a prediction, and the two timelines can be compared number by number.

Costs come from a ``StepCosts``: per-piece (or per-instruction) compute times and per-collective
times. ``simulate_plan`` builds them for a whole ``ParallelPlan`` from a ``planner.costs.Costs``
(a measured profile or a hardware preset): every region at its own TP degree and sub-batch rows,
reshards between degrees, DP gradient all-reduces per region group, the optimizer step, and peak
memory by walking the same program (parameters, gradients, Adam moments, the activations each
forward piece keeps until its backward, a recompute's transient graph, the head's logits).
Collectives of groups over the same ranks share one stream (one link); others run beside them,
except the data-parallel gradient all-reduces, which share one stream whatever their group: a
plan mixing degrees reduces its regions over DP groups of different sizes, but every one of them
crosses the same links (each server's ports between servers, which the price of one already
shares among all the server's GPUs), so two at once would book those links twice.
Shape legend: b sub-batch rows, S sequence, H hidden, F ffn, V vocabulary, t TP degree.

Modules: ``planner.event_walk`` walks one program on ``StepCosts`` (the drawing above);
``planner.plan_costs`` prices a plan's instructions; ``planner.layout`` says where a plan puts
its groups, gradient buckets and ZeRO shards; ``planner.batch`` cuts the batch into every
region's rows. This module assembles a plan's step from them: its program, the micro-batches,
the optimizer and the peak memory.
"""

from __future__ import annotations

import functools
import gc
from dataclasses import dataclass, replace

from oases.config import ModelConfig
from oases.plan import ParallelPlan
from oases.planner.batch import BatchShape, region_rows
from oases.planner.costs import Costs, region_kind, sp_mode
from oases.planner.event_walk import SimResult, simulate_program
from oases.planner.layout import (
    dp_bucket_bytes,
    dp_buckets,
    model_state,
    plan_sp,
    region_uses,
    zero_layout,
)
from oases.planner.peak_memory import peak_memory
from oases.planner.peak_memory_tape import peak_memory_tape
from oases.planner.plan_costs import (
    plan_step_costs,
    price_tape,
    region_signatures,
)
from oases.planner.precision import precision_of
from oases.planner.tape import Tape, TapeError, compile_tape, kept_tape
from oases.planner.tape_walk import walk_tape
from oases.schedule.program import Instr, deferred_regions
from oases.schedule.timeline import Event, Timeline


@dataclass(frozen=True)
class PlanResult:
    step_s: float
    peak_mem_bytes: float
    timeline: Timeline
    breakdown: dict[str, float]  # seconds and bytes by cause, for reports

    def step_parts(self) -> dict[str, float]:
        """The step cut into what the compute stream did: compute, waiting on each class of
        collective (exposed communication), waiting on another pipeline stage (the bubble:
        its point-to-point receives and sends), the optimizer. The parts add up to ``step_s``
        (of a pipeline: the bounding stage's, ``planner.pipeline_walk``)."""
        b = self.breakdown
        return {
            "compute": b.get("compute_s", 0.0),
            "TP comm": b.get("exposed_tp_s", 0.0),
            "DP comm": b.get("exposed_dp_s", 0.0),
            "reshard": b.get("exposed_reshard_s", 0.0),
            "bubble": b.get("exposed_pp_s", 0.0),
            "optimizer": b.get("optimizer_s", 0.0),
        }

    def bound(self) -> str:
        """What bounds the step: its largest part."""
        parts = self.step_parts()
        return max(parts, key=parts.__getitem__)


def plan_program(
    cfg: ModelConfig,
    plan: ParallelPlan,
    world_size: int,
    batch: BatchShape,
    *,
    max_inflight: int = 1,
    n_micro: int | None = None,
    dp: bool = True,
    first: bool = True,
    reshard_after_forward: bool = True,
) -> list[Instr]:
    """The instruction list one rank runs for a step of ``plan``: the executor's very program
    (``Schedule.program`` builds the same from a parallelized model), ZeRO's instructions
    included where the plan's regions carry a stage. ``n_micro``: build only that many
    micro-batches (default: the batch's); ``dp=False``: a micro-batch that is not the last
    (without the data-parallel gradient all-reduces, and stage 1's reduce-scatters, which come
    only in the last); ``first=False``: one that is not the first (without the stages 1-2
    gathers of the updated weights, which come at the step's head)."""
    from oases.schedule.program import build_program

    name, n_regions, n_sub, kw = _program_args(
        cfg,
        plan,
        world_size,
        batch,
        max_inflight=max_inflight,
        n_micro=n_micro,
        dp=dp,
        first=first,
        reshard_after_forward=reshard_after_forward,
    )
    return build_program(name, n_regions, n_sub, **dict(kw))


def _program_args(
    cfg: ModelConfig,
    plan: ParallelPlan,
    world_size: int,
    batch: BatchShape,
    *,
    max_inflight: int,
    n_micro: int | None,
    dp: bool,
    first: bool,
    reshard_after_forward: bool,
    buckets: dict[int, list[tuple[int, int]]] | None = None,
) -> tuple[str, int, int, tuple[tuple[str, object], ...]]:
    """``build_program``'s arguments for ``plan_program`` (hashable: a tape's key);
    ``buckets``: the plan's DP buckets where already known."""
    degrees = tuple(r.tp for r in plan.regions)
    kinds = [region_kind(r.name) for r in plan.regions]
    stages = plan.zero_stages()
    if not dp:
        buckets = {}
    elif buckets is None:
        buckets = dp_buckets(cfg, kinds, list(degrees), world_size, stages)
    return (
        plan.schedule,
        len(degrees),
        plan.n_sub,
        (
            ("n_micro", batch.n_micro() if n_micro is None else n_micro),
            ("max_inflight", max_inflight),
            ("dp_tasks", tuple(sorted(buckets))),
            ("degrees", None if len(set(degrees)) == 1 else degrees),
            (
                "zero",
                zero_layout(cfg, stages, reshard_after_forward, gather_updated=first, ends_step=dp),
            ),
            ("sp", plan_sp(plan)),
        ),
    )


def _tape(name: str, n_regions: int, n_sub: int, kw: tuple[tuple[str, object], ...]) -> Tape | None:
    """The compiled program of ``build_program(name, n_regions, n_sub, **kw)`` (None where
    the tape cannot walk it: the reference walks do), remembered: every degree of a schedule
    walks the same one (the last 256; inside ``tape.tapes_kept``, a search, every one)."""
    return kept_tape((name, n_regions, n_sub, kw), lambda: _recent_tape(name, n_regions, n_sub, kw))


@functools.lru_cache(maxsize=256)
def _recent_tape(
    name: str, n_regions: int, n_sub: int, kw: tuple[tuple[str, object], ...]
) -> Tape | None:
    from oases.schedule.program import build_program

    try:
        return compile_tape(build_program(name, n_regions, n_sub, **dict(kw)))
    except TapeError:
        return None


def release_programs() -> None:
    """Forget every program built and compiled so far (``_recent_tape`` and the builders'
    caches, ``schedule.program.clear_program_caches``), and collect them."""
    from oases.schedule.program import clear_program_caches

    _recent_tape.cache_clear()
    clear_program_caches()
    gc.collect()


def simulate_plan(
    cfg: ModelConfig,
    plan: ParallelPlan,
    costs: Costs,
    world_size: int,
    batch: BatchShape,
    *,
    max_inflight: int = 1,
    rank: int = 0,
    timeline: bool = True,
    scaled: bool = True,
    reshard_after_forward: bool = True,
    tapes: bool = True,
    memory: bool = True,
) -> PlanResult:
    """Predict one optimizer step of ``plan`` (its ``schedule`` and ``n_sub``): time, timeline
    (``timeline=False``: none, faster) and peak memory per device.

    Micro-batches run one after another and each waits for all of its collectives before the
    next one starts; the DP all-reduces start only in the last. So every micro-batch but the
    last takes the same time, and ``scaled`` (the default) simulates one micro-batch without
    and one with the DP all-reduces and adds them up::

        step = (n_micro - 1) * t(micro-batch) + t(last micro-batch, with DP)

    ``scaled=False`` simulates the whole program instead (the slow obvious reference).

    ZeRO (a region's ``zero`` stage): its gradient reduce-scatters ("rs") and weight gathers
    ("ag": stage 3's before every pass, stages 1-2's of the updated shards at the step's head,
    under its first forward computes) run on the DP stream with the DP all-reduces (the same
    links); the optimizer updates this rank's shards only. With micro-batches the first one
    (the gathers), the middle ones and the last (the DP reductions) are simulated apart::

        step = t(first) + (n_micro - 2) * t(middle) + t(last)

    ``reshard_after_forward`` is stage 3's knob of that name.

    Without a timeline the programs are walked compiled (``planner.tape``: ``walk_tape``,
    ``peak_memory_tape``), each program compiled once and each distinct region priced once
    (``plan_costs.price_tape``), to the same numbers; ``tapes=False`` walks the instructions
    themselves (the reference the tests compare with).

    Bytes by dtype (``planner.precision``, the costs' ``precision``): TP all-reduces and
    reshards move activations in the compute dtype, DP all-reduces and ZeRO's reduce-scatters
    gradients in ``grad_reduce``, ZeRO's all-gathers master weights.

    ``memory=False``: the step only (the peak not walked: ``peak_mem_bytes`` nan, no bytes
    in the breakdown), for the search's shorter models, whose step alone it reads."""
    from oases.schedule.program import SPECS

    costs = _CachedCosts(costs)

    plan.check(cfg, world_size)
    if plan.pp > 1:  # the stages' programs walked together
        from oases.planner.pipeline_walk import simulate_pipeline

        return simulate_pipeline(
            cfg, plan, costs, world_size, batch, max_inflight=max_inflight, timeline=timeline
        )
    spec = SPECS[plan.schedule]
    k = plan.n_sub if spec.overlapped else 1
    degrees = [r.tp for r in plan.regions]
    kinds = [region_kind(r.name) for r in plan.regions]
    rows = region_rows(plan, world_size, batch, k)
    n = len(degrees)
    prec = precision_of(costs)
    sp = plan_sp(plan)

    stages = plan.zero_stages()
    state = model_state(cfg, plan, world_size)
    buckets = dp_buckets(cfg, kinds, degrees, world_size, stages)
    n_micro = batch.n_micro()
    whole = not scaled or n_micro == 1
    args = dict(max_inflight=max_inflight, reshard_after_forward=reshard_after_forward)

    def tape(n: int | None, dp: bool, first: bool) -> Tape | None:
        return _tape(
            *_program_args(
                cfg, plan, world_size, batch, n_micro=n, dp=dp, first=first, buckets=buckets, **args
            )
        )

    last = None if timeline or not tapes else tape(None if whole else 1, True, whole)
    program = (
        last.program
        if last is not None
        else plan_program(
            cfg, plan, world_size, batch, n_micro=None if whole else 1, first=whole, **args
        )
    )
    deferring = last.deferring() if last is not None else deferred_regions(program)
    step = plan_step_costs(
        cfg,
        plan,
        costs,
        world_size,
        rows,
        state=state,
        buckets=buckets,
        deferring=deferring,
    )
    fast = last is not None and step.comm_slowdown is None
    tapes = [last] if fast else []
    if fast and not whole:
        tapes.append(tape(1, False, False))
        if any(z in (1, 2) for z in stages):
            tapes.append(tape(1, False, True))
        fast = None not in tapes
    if fast:  # the same walks on compiled programs (``walk_tape``: the same numbers)
        signatures = region_signatures(kinds, degrees, rows, stages, deferring)
        sims = [walk_tape(t, *price_tape(step, t, signatures)) for t in tapes]
        sim = sims[0] if whole else _repeat(sims[-1], sims[1], sims[0], n_micro, k)
    else:
        sim = simulate_program(program, step, rank=rank, record=timeline)
    if not whole and not fast:  # the first micro-batch, n_micro - 2 without DP, the last

        def one(first: bool) -> SimResult:
            micro = plan_program(
                cfg, plan, world_size, batch, n_micro=1, dp=False, first=first, **args
            )
            return simulate_program(micro, step, rank=rank, record=timeline)

        middle = one(first=False)
        head = one(first=True) if any(z in (1, 2) for z in stages) else middle
        sim = _repeat(head, middle, sim, n_micro, k)
    optimizer = getattr(costs, "optimizer_s", None)
    opt_s = optimizer(sum(state.updated(i) for i in range(n))) if optimizer is not None else 0.0
    mem = {"peak": float("nan")}
    if memory:
        mem = (peak_memory_tape if last is not None else peak_memory)(
            cfg,
            last if last is not None else program,
            kinds,
            degrees,
            rows,
            sp_mode(spec.recompute, sp),
            costs,
            state,
            region_uses(cfg, n),
            dp_bucket_bytes(buckets, prec.grad_reduce_bytes),
            repeats=1 if whole else n_micro,
            graph_mode=sp_mode("none", sp),
        )
    events = sim.timeline
    if timeline:
        end = sim.step_s
        if opt_s:
            events.add(Event(rank, "compute", "optimizer", "optimizer", 0, end, end + opt_s))
    return PlanResult(
        sim.step_s + opt_s,
        mem["peak"],
        events,
        {
            "compute_s": sim.compute_busy_s,
            "comm_s": sim.comm_busy_s,
            "optimizer_s": opt_s,
            **{f"exposed_{c}_s": v for c, v in sorted(sim.exposed_s.items())},
            **({f"{k}_bytes": v for k, v in mem.items()} if memory else {}),
        },
    )


def _repeat(first: SimResult, one: SimResult, last: SimResult, n_micro: int, k: int) -> SimResult:
    """Micro-batch ``first``, ``n_micro - 2`` runs of ``one``, then ``last``, back to back
    (each starts when the previous one's collectives are all done); sub-batch ids as the whole
    program numbers them (micro-batch m owns m*k .. m*k+k-1; DP all-reduces keep theirs;
    ZeRO's collectives carry their micro-batch)."""
    runs = [first] + [one] * (n_micro - 2) + [last]
    timeline = Timeline()
    t0 = 0.0
    for m, sim in enumerate(runs):
        for e in sim.timeline.events:
            sub = e.sub if e.phase == "dp" else m if e.phase in ("rs", "ag") else e.sub + m * k
            timeline.add(replace(e, sub=sub, start_s=e.start_s + t0, end_s=e.end_s + t0))
        t0 += sim.step_s
    exposed = {
        c: sum(sim.exposed_s.get(c, 0.0) for sim in runs)
        for c in {c for sim in runs for c in sim.exposed_s}
    }
    return SimResult(
        t0,
        sum(sim.compute_busy_s for sim in runs),
        sum(sim.comm_busy_s for sim in runs),
        timeline,
        exposed,
    )


class _CachedCosts:
    """``costs`` with its pure price methods remembered (the simulator asks the same few
    questions for every region, sub-batch and micro-batch)."""

    def __init__(self, costs: Costs) -> None:
        self._costs = costs
        for name in ("compute_s", "collective_s", "collective_ranks_s", "saved_bytes"):
            method = getattr(costs, name, None)
            if method is not None:
                setattr(self, name, functools.cache(method))

    def __getattr__(self, name: str) -> object:
        return getattr(self._costs, name)
