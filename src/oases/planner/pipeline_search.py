"""The pipeline search: pipeline stages (``pp``), their boundaries, the pipeline order, the
micro-batch, the TP degree inside the stages, the schedule and its sub-batches, the ZeRO stage
and sequence parallelism, searched together under a memory budget.

A pipeline plan's full walk (``pipeline_walk.simulate_pipeline``: every stage's program walked
together) costs seconds at pp=8 and 64 micro-batches, too slow for every combination. So the
search prices once and composes, and walks only the finalists::

    for each stage size W/pp that fits the servers (a stage is a divisor or a multiple of a
    server's GPUs), micro-batch and stage layout -- every uniform one (TP degree t, schedule,
    n_sub, ZeRO stage, sp mode) and the plan search's mixed ones for a stage of W/pp ranks
    (``pipeline_mixed``: a TP degree per region):
        the stage's layout, pp=1 on W/pp ranks (simulate_plan, 1 and 2 micro-batches;
        remembered: every pp of one stage size and every pipeline order share it)
            c      = t(2 micro-batches) - t(1)           one micro-batch's pass over the chain
            tail   = t(1) - c                            DP reduction, ZeRO gathers, optimizer
            shares = region_compute_s / its sum          what each region costs of c
        boundaries = balanced_stage_starts(shares, pp)  min over cuts of the largest stage
                     (a mixed layout: only where both sides have one degree)
        screen step = (n_micro + pp - 1) * c * max stage share + tail * max stage share
                      + 2 (pp - 1) point-to-point messages on the link they cross
        screen peak = the layout's peak, its state and activations scaled to the fullest
                      stage (1F1B's first stage: pp micro-batches in flight)
    finalists: the best screen of every depth, then the FINALISTS best other screens, whose
        screen peak is under SCREEN_SLACK x budget (``finalist_order``), each walked whole
        in every pipeline order (simulate_pipeline; the interleaved order with
        INTERLEAVED_CHUNKS model chunks a stage, its pp x chunks virtual stages' boundaries
        balanced_stage_starts(shares, pp x chunks): ``ordered``)
    refine:    the best walked plan's boundaries moved a block at a time off its slowest
        stage while the walk says faster and it fits (not for an interleaved plan)

The search keeps every tape the simulator builds until it ends (``tape.tapes_kept``: the
screen's layouts and the plan searches of ``pipeline_mixed`` share programs, a tape's key has
no world size), and freezes what it built out of the cycle collector after each full walk
(``gc.freeze``; ``tapes_kept`` thaws at its end): a walk's stage programs are hundreds of
thousands of objects, and full collections walking them and all that is kept took ~10 s of
the 96-layer case's ~35 s (benchmarks/2026-12-04-search, round 10). Neither changes a number.

The screen's formula only orders the combinations (``pipeline_screen``; the boundaries:
``pipeline_boundaries``); every number a candidate carries is its full walk's. Not searched:
a stage's degrees solved for its own regions (a mixed layout is the whole chain's answer for a
stage of W/pp ranks, every stage keeping its regions' degrees), stage boundaries that split a
block, ZeRO 3 (the runtime runs ZeRO 2 at most under a pipeline), the interleaved order's
chunk count (always ``INTERLEAVED_CHUNKS``).
"""

from __future__ import annotations

import dataclasses
import gc
import time
from dataclasses import dataclass, field

from oases.config import Config, ModelConfig
from oases.plan import ParallelPlan
from oases.planner.batch import BatchShape
from oases.planner.candidate import Candidate, with_zero
from oases.planner.costs import Costs
from oases.planner.pipeline_boundaries import balanced_stage_starts
from oases.planner.pipeline_mixed import mixed_layouts, stage_cuts
from oases.planner.pipeline_screen import (
    LayoutPrice,
    Screen,
    layout_key,
    pipeline_depths,
    price_layout,
    screen_layout,
)
from oases.planner.precision import precision_of
from oases.planner.simulate import _CachedCosts, simulate_plan
from oases.planner.tape import tapes_kept
from oases.stages import PIPELINE_SCHEDULES

FINALISTS = 5  # screened combinations walked whole (each in every pipeline order)
SCREEN_SLACK = 1.25  # the screen's peak may exceed the budget by this much and still be walked
PIPELINE_ZEROS = (0, 1, 2)  # the runtime runs ZeRO 2 at most under a pipeline
SEARCHED_ORDERS = PIPELINE_SCHEDULES
INTERLEAVED_CHUNKS = 2  # model chunks per stage the search gives the interleaved order


@dataclass
class PipelineSearch:
    """What ``search_pipelines`` found: the fastest walked plan that fits (None: none did),
    every walked candidate, how many combinations the screen priced and the wall time."""

    best: Candidate | None
    candidates: list[Candidate]
    screened: int = 0
    mixed: int = 0  # mixed-degree stage layouts the plan search of a stage gave
    walked: int = 0
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)


class PipelineCandidate(Candidate):
    """A pipeline plan the search walked: its label names the stages and their order."""

    def label(self) -> str:
        starts = ",".join(map(str, self.plan.stage_layout().starts))
        return f"pp={self.plan.pp} {self.plan.pp_schedule} (stages at {starts}), " + (
            super().label()
        )


def choose(flat: Candidate, piped: PipelineSearch) -> Candidate:
    """The plan to run: the pipeline search's best where it fits and is faster than the best
    plan without a pipeline (or that one does not fit), else that one."""
    best = piped.best
    if best is None or (flat.fits and flat.result.step_s <= best.result.step_s):
        return flat
    return best


def search_pipelines(
    cfg: ModelConfig,
    costs: Costs,
    world_size: int,
    batch: BatchShape,
    budget_bytes: float,
    *,
    schedules: tuple[str, ...],
    degrees: list[int],
    n_subs: tuple[int, ...] = (1, 2),
    zeros: tuple[int, ...] = PIPELINE_ZEROS,
    sps: tuple[str, ...] = ("", "shards"),
    micro_batches: tuple[BatchShape, ...] = (),
    pp_options: tuple[int, ...] = (),
    pp_schedules: tuple[str, ...] = SEARCHED_ORDERS,
    max_inflight: int = 1,
    finalists: int = FINALISTS,
    mixed: bool = True,
) -> PipelineSearch:
    """The fastest pipeline plan of ``cfg`` on ``world_size`` ranks that fits ``budget_bytes``
    (module docstring). ``batch`` and ``micro_batches``: the world's micro-batches, as
    ``solve_plan`` takes them; a pipeline of pp stages feeds each stage 1/pp of it (the same
    sequences per model replica), so it runs pp times the micro-batches."""
    from oases.planner.search import sub_batch_counts

    started = time.perf_counter()
    with tapes_kept():  # (module docstring: what the search keeps, and why)
        costs = _CachedCosts(costs)
        cluster = getattr(costs, "cluster", None)
        gps = None if cluster is None else cluster.server.gpus_per_server
        depths = pipeline_depths(world_size, cfg.n_layers, gps, pp_options)
        found = PipelineSearch(None, [])
        if not depths:
            found.notes.append(
                f"no pipeline depth fits {world_size} ranks of {cfg.n_layers} blocks"
            )
            return found
        # ZeRO 2 at most; a tied embedding's copies at stage 1 at most (``train.pipeline_run``)
        top_zero = 1 if cfg.tie_embeddings else max(PIPELINE_ZEROS)
        zeros = tuple(z for z in zeros if z <= top_zero) or (0,)
        shapes = [batch, *(b for b in micro_batches if b != batch)]
        prec = precision_of(costs)
        layouts: dict[tuple, LayoutPrice | None] = {}
        screens: list[Screen] = []
        seen: set[tuple] = set()

        def add(
            pp: int, base: ParallelPlan, stage_shape: BatchShape, cuts: set[int] | None
        ) -> None:
            """Screen ``base`` (one stage's layout) at depth ``pp`` (its price remembered)."""
            key = (
                base.regions[0].tp * base.regions[0].dp,
                stage_shape.micro_rows,
                layout_key(base),
            )
            if key not in layouts:
                layouts[key] = price_layout(cfg, base, costs, key[0], stage_shape, max_inflight)
            priced = layouts[key]
            if priced is None or (pp, key) in seen:
                return  # (zero > 0 at dp=1 is the same plan as 0)
            seen.add((pp, key))
            try:
                screen = screen_layout(
                    cfg, base, priced, costs, pp, stage_shape, stage_shape.n_micro(), prec, cuts
                )
            except ValueError:  # a mixed layout's degrees leave no pp stages
                return
            found.screened += 1
            screens.append(screen)

        for pp in depths:
            stage_world = world_size // pp
            for shape in shapes:
                if shape.micro_rows % pp:
                    continue
                stage_shape = BatchShape(shape.global_batch, shape.micro_rows // pp)
                for t in degrees:
                    if stage_world % t:
                        continue
                    for schedule in schedules:
                        for n_sub in sub_batch_counts(schedule, n_subs, schedules):
                            for zero in zeros:
                                for sp in sps if t > 1 else ("",):
                                    base = ParallelPlan.uniform(
                                        cfg,
                                        stage_world,
                                        t,
                                        schedule=schedule,
                                        n_sub=n_sub,
                                        sequence_parallel=sp,
                                    )
                                    add(
                                        pp,
                                        with_zero(base, zero if stage_world > t else 0),
                                        stage_shape,
                                        None,
                                    )
                if not mixed:
                    continue
                for base in mixed_layouts(
                    cfg,
                    costs,
                    stage_world,
                    stage_shape,
                    budget_bytes,
                    pp,
                    schedules=schedules,
                    degrees=degrees,
                    n_subs=n_subs,
                    zeros=zeros,
                    sps=sps,
                    max_inflight=max_inflight,
                ):
                    found.mixed += 1
                    add(pp, base, stage_shape, stage_cuts(base))
        order = finalist_order(screens, budget_bytes, finalists)
        fitted = 0  # combinations of which an order fits
        for s in order:
            if fitted >= finalists and not s.depth_best:
                break
            fits = False
            for pp_order in pp_schedules:
                plan = ordered(s, pp_order)
                if plan is None:
                    continue
                cand = _walk(cfg, plan, costs, world_size, s.batch, budget_bytes, max_inflight)
                found.walked += 1
                if cand is not None:
                    found.candidates.append(cand)
                    fits = fits or cand.fits
            fitted += fits and not s.depth_best
        fitting = [c for c in found.candidates if c.fits]
        if fitting:
            best = min(fitting, key=lambda c: c.result.step_s)
            found.best = _refine(cfg, best, costs, world_size, budget_bytes, max_inflight, found)
        found.wall_s = time.perf_counter() - started
        return found


def ordered(s: Screen, order: str) -> ParallelPlan | None:
    """The screened plan under the pipeline order ``order``. The interleaved order gets
    ``INTERLEAVED_CHUNKS`` model chunks a stage and the boundaries of its ``pp x chunks``
    virtual stages balanced on the screen's region costs (and cuts) as the stages' were; None
    where the blocks do not fill them."""
    if order != "interleaved":
        return dataclasses.replace(s.plan, pp_schedule=order)
    virtual = s.plan.pp * INTERLEAVED_CHUNKS
    try:
        starts = balanced_stage_starts(list(s.region_s), virtual, s.cuts)
    except ValueError:  # fewer blocks (or cuts) than virtual stages
        return None
    return dataclasses.replace(
        s.plan, pp_schedule=order, pp_chunks=INTERLEAVED_CHUNKS, stage_starts=list(starts)
    )


def finalist_order(screens: list[Screen], budget_bytes: float, finalists: int) -> list[Screen]:
    """The screens to walk, in order: the best screen of every depth (``depth_best`` set:
    each is walked, whatever the others), then the others by their screen step, at most
    ``3 x finalists`` (the walk stops once ``finalists`` of these others have an order that
    fits).
    Only screens whose peak is under ``SCREEN_SLACK x budget_bytes`` (none: the leanest).

    Why every depth: the screen prices a stage's DP reduction as the whole chain's scaled by
    the stage's compute share, so it cannot tell a stage inside one server (no gradient
    crosses a port) from one spanning two; at H=1024 on 10 GbE that hid pp=8 behind pp=4."""
    under = sorted(
        (s for s in screens if s.peak_bytes <= SCREEN_SLACK * budget_bytes),
        key=lambda s: s.step_s,
    )
    if not under:  # nothing screens under the budget: walk the leanest
        under = sorted(screens, key=lambda s: s.peak_bytes)
    firsts: dict[int, Screen] = {}
    for s in under:
        firsts.setdefault(s.plan.pp, s)
    heads = sorted(firsts.values(), key=lambda s: s.step_s)
    rest = [s for s in under if all(s is not h for h in heads)]
    return [dataclasses.replace(s, depth_best=True) for s in heads] + rest[: 3 * finalists]


def _walk(
    cfg: ModelConfig,
    stage_plan: ParallelPlan,
    costs: Costs,
    world_size: int,
    shape: BatchShape,
    budget_bytes: float,
    max_inflight: int,
) -> Candidate | None:
    """``stage_plan`` (its regions laid out on one stage) as a plan of ``world_size`` ranks,
    walked whole."""
    plan = dataclasses.replace(
        stage_plan,
        regions=[
            dataclasses.replace(r, dp=world_size // (stage_plan.pp * r.tp))
            for r in stage_plan.regions
        ],
        notes=dict(stage_plan.notes),
    )
    try:
        res = simulate_plan(
            cfg, plan, costs, world_size, shape, max_inflight=max_inflight, timeline=False
        )
    except ValueError:  # the batch does not split (BatchSplitError), or the stages refuse it
        return None
    gc.freeze()  # (its stage programs: out of the collector's full collections, ``tapes_kept``)
    return PipelineCandidate(plan, res, res.peak_mem_bytes <= budget_bytes, "pipeline", shape, True)


def _refine(
    cfg: ModelConfig,
    best: Candidate,
    costs: Costs,
    world_size: int,
    budget_bytes: float,
    max_inflight: int,
    found: PipelineSearch,
) -> Candidate:
    """Move one block at a time off the bounding stage (to a neighbour) while the walk says
    the step gets shorter and the plan still fits. Not for the interleaved order: a stage's
    regions are several virtual stages there, which this does not move."""
    assert best.batch is not None
    if best.plan.pp_chunks > 1:
        return best
    for _ in range(2 * best.plan.pp):
        stage = int(best.result.breakdown.get("bound_stage", 0))
        starts = list(best.plan.stage_layout().starts)
        moves = []
        if stage > 0:  # its first block to the stage before
            moves.append((stage - 1, starts[stage - 1] + 2))
        if stage < len(starts):  # its last block to the stage after
            moves.append((stage, starts[stage] - 2))
        improved = False
        for at, value in moves:
            trial = list(starts)
            trial[at] = value
            lo = trial[at - 1] if at else 1
            hi = trial[at + 1] if at + 1 < len(trial) else 2 * cfg.n_layers + 1
            if not lo < value < hi:
                continue
            plan = dataclasses.replace(best.plan, stage_starts=trial)
            cand = _walk(cfg, plan, costs, world_size, best.batch, budget_bytes, max_inflight)
            found.walked += 1
            if cand is None:
                continue
            found.candidates.append(cand)
            if cand.fits and cand.result.step_s < best.result.step_s:
                best, improved = cand, True
                break
        if not improved:
            break
    return best


def search_config_pipelines(
    cfg: Config,
    world_size: int,
    costs: Costs,
    budget_bytes: float,
    *,
    pp_options: tuple[int, ...] = (),
    pp_schedules: tuple[str, ...] = SEARCHED_ORDERS,
    schedules: tuple[str, ...] = ("megatron", "oases"),
    zeros: tuple[int, ...] = PIPELINE_ZEROS,
    sps: tuple[str, ...] = ("shards",),
    search_micro_batch: bool = True,
    max_tp: int | None = None,
    mixed: bool = True,
) -> PipelineSearch:
    """``search_pipelines`` for a run file, as ``planner.search_plans`` plans it: the config's
    batch (and ``micro_batch_options`` of it with ``search_micro_batch``), TP degrees up to
    ``max_tp`` (default: a server's GPUs: a stage's TP stays inside a server), ``sps`` beside
    no sequence parallelism. Every candidate's plan notes what it assumed (world size, global
    batch, a stage's micro-batch ``micro_rows``) and the precision it was priced in."""
    from oases.planner import batch_shape, micro_batch_options
    from oases.planner.search import candidate_degrees

    cluster = getattr(costs, "cluster", None)
    if max_tp is None and cluster is not None:
        max_tp = cluster.server.gpus_per_server
    batch = batch_shape(cfg, world_size)
    found = search_pipelines(
        cfg.model,
        costs,
        world_size,
        batch,
        budget_bytes,
        schedules=schedules,
        degrees=candidate_degrees(cfg.model, world_size, max_tp),
        zeros=zeros,
        sps=("", *(s for s in sps if s)),
        micro_batches=micro_batch_options(batch) if search_micro_batch else (),
        pp_options=pp_options,
        pp_schedules=pp_schedules,
        max_inflight=cfg.schedule.max_inflight,
        mixed=mixed,
    )
    priced = precision_of(costs).describe()
    for c in found.candidates:
        assert c.batch is not None
        c.plan.notes.update(
            world_size=world_size, global_batch=c.batch.global_batch, micro_rows=c.batch.micro_rows
        )
        c.plan.precision = dict(priced)
    return found
