"""The pipeline search: pipeline stages (``pp``), their boundaries, the pipeline order, the
micro-batch, the TP degree inside the stages, the schedule and its sub-batches, the ZeRO stage
and sequence parallelism, searched together under a memory budget.

A pipeline plan's full walk (``pipeline_walk.simulate_pipeline``: every stage's program walked
together) costs seconds at pp=8 and 64 micro-batches, too slow for every combination. So the
search prices once and composes, and walks only the finalists::

    for each stage size W/pp that fits the servers (a stage is a divisor or a multiple of a
    server's GPUs), TP degree t, schedule, n_sub, ZeRO stage, sp mode, micro-batch:
        the stage's layout, pp=1 on W/pp ranks (simulate_plan, 1 and 2 micro-batches;
        remembered: every pp of one stage size and every pipeline order share it)
            c      = t(2 micro-batches) - t(1)           one micro-batch's pass over the chain
            tail   = t(1) - c                            DP reduction, ZeRO gathers, optimizer
            shares = region_compute_s / its sum          what each region costs of c
        boundaries = balanced_stage_starts(shares, pp)  min over cuts of the largest stage
        screen step = (n_micro + pp - 1) * c * max stage share + tail * max stage share
                      + 2 (pp - 1) point-to-point messages on the link they cross
        screen peak = the layout's peak, its state and activations scaled to the fullest
                      stage (1F1B's first stage: pp micro-batches in flight)
    finalists: the FINALISTS best screens whose screen peak is under SCREEN_SLACK x budget,
        each walked whole in every pipeline order (simulate_pipeline)
    refine:    the best walked plan's boundaries moved a block at a time off its slowest
        stage while the walk says faster and it fits

The screen's formula only orders the combinations; every number a candidate carries is its
full walk's. Not searched: per-region TP degrees inside a stage (every region of a pipeline
plan has the stage's one degree), stage boundaries that split a block, ZeRO 3 (the runtime
runs ZeRO 2 at most under a pipeline), the interleaved order (its model chunks' boundaries
are not priced yet: ``SEARCHED_ORDERS``).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from oases.config import Config, ModelConfig
from oases.plan import ParallelPlan
from oases.planner.batch import BatchShape
from oases.planner.candidate import Candidate, with_zero
from oases.planner.costs import Costs, region_kind, region_param_count
from oases.planner.pipeline_walk import p2p_s
from oases.planner.precision import precision_of
from oases.planner.simulate import PlanResult, _CachedCosts, region_compute_s, simulate_plan
from oases.stages import PIPELINE_SCHEDULES, block_start

FINALISTS = 5  # screened combinations walked whole (each in every pipeline order)
SCREEN_SLACK = 1.25  # the screen's peak may exceed the budget by this much and still be walked
PIPELINE_ZEROS = (0, 1, 2)  # the runtime runs ZeRO 2 at most under a pipeline
SEARCHED_ORDERS = tuple(o for o in PIPELINE_SCHEDULES if o != "interleaved")


@dataclass
class PipelineSearch:
    """What ``search_pipelines`` found: the fastest walked plan that fits (None: none did),
    every walked candidate, how many combinations the screen priced and the wall time."""

    best: Candidate | None
    candidates: list[Candidate]
    screened: int = 0
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


@dataclass(frozen=True)
class _Screen:
    """One combination as the screen priced it."""

    step_s: float
    peak_bytes: float
    plan: ParallelPlan
    batch: BatchShape


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


def balanced_stage_starts(region_s: list[float], pp: int) -> tuple[int, ...]:
    """Stage boundaries at block starts that minimise the largest stage's cost (``region_s``:
    a cost per region of the chain embed, attn, mlp, ..., head), by dynamic programming over
    the blocks; ties go to the earliest cut."""
    n_layers = (len(region_s) - 2) // 2
    if n_layers < pp:
        raise ValueError(f"{n_layers} blocks do not fill {pp} pipeline stages")
    # cost of blocks [a, b) as a stage, the embedding on stage 0 and the head on the last
    prefix = [0.0]
    for layer in range(n_layers):
        prefix.append(prefix[-1] + region_s[2 * layer + 1] + region_s[2 * layer + 2])

    def cost(a: int, b: int) -> float:
        extra = (region_s[0] if a == 0 else 0.0) + (region_s[-1] if b == n_layers else 0.0)
        return prefix[b] - prefix[a] + extra

    inf = float("inf")
    # best[s][b]: the least largest stage of blocks [0, b) cut into s stages
    best = [[inf] * (n_layers + 1) for _ in range(pp + 1)]
    cut = [[0] * (n_layers + 1) for _ in range(pp + 1)]
    best[0][0] = 0.0
    for s in range(1, pp + 1):
        for b in range(s, n_layers + 1):
            for a in range(s - 1, b):
                value = max(best[s - 1][a], cost(a, b))
                if value < best[s][b]:
                    best[s][b], cut[s][b] = value, a
    starts, b = [], n_layers
    for s in range(pp, 1, -1):
        b = cut[s][b]
        starts.append(block_start(b))
    return tuple(reversed(starts))


def stage_shares(region_s: list[float], starts: tuple[int, ...]) -> list[float]:
    """Each stage's share of the chain's cost (``region_s`` per region)."""
    total = sum(region_s) or 1.0
    edges = (0, *starts, len(region_s))
    return [sum(region_s[a:b]) / total for a, b in zip(edges, edges[1:])]


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
) -> PipelineSearch:
    """The fastest pipeline plan of ``cfg`` on ``world_size`` ranks that fits ``budget_bytes``
    (module docstring). ``batch`` and ``micro_batches``: the world's micro-batches, as
    ``solve_plan`` takes them; a pipeline of pp stages feeds each stage 1/pp of it (the same
    sequences per model replica), so it runs pp times the micro-batches."""
    from oases.planner.search import sub_batch_counts

    started = time.perf_counter()
    costs = _CachedCosts(costs)
    cluster = getattr(costs, "cluster", None)
    gps = None if cluster is None else cluster.server.gpus_per_server
    depths = pipeline_depths(world_size, cfg.n_layers, gps, pp_options)
    found = PipelineSearch(None, [])
    if not depths:
        found.notes.append(f"no pipeline depth fits {world_size} ranks of {cfg.n_layers} blocks")
        return found
    # ZeRO 2 at most; a tied embedding's copies at stage 1 at most (``train.pipeline_run``)
    top_zero = 1 if cfg.tie_embeddings else max(PIPELINE_ZEROS)
    zeros = tuple(z for z in zeros if z <= top_zero) or (0,)
    shapes = [batch, *(b for b in micro_batches if b != batch)]
    prec = precision_of(costs)
    layouts: dict[tuple, tuple[float, float, PlanResult, list[float]] | None] = {}
    screens: list[_Screen] = []
    seen: set[tuple] = set()
    for pp in depths:
        stage_world = world_size // pp
        for shape in shapes:
            if shape.micro_rows % pp:
                continue
            stage_shape = BatchShape(shape.global_batch, shape.micro_rows // pp)
            n_micro = stage_shape.n_micro()
            for t in degrees:
                if stage_world % t:
                    continue
                for schedule in schedules:
                    for n_sub in sub_batch_counts(schedule, n_subs, schedules):
                        for zero in zeros:
                            for sp in sps if t > 1 else ("",):
                                base = with_zero(
                                    ParallelPlan.uniform(
                                        cfg,
                                        stage_world,
                                        t,
                                        schedule=schedule,
                                        n_sub=n_sub,
                                        sequence_parallel=sp,
                                    ),
                                    zero if stage_world // t > 1 else 0,
                                )
                                key = (stage_world, stage_shape.micro_rows, _key(base))
                                if key not in layouts:
                                    layouts[key] = _price_layout(
                                        cfg, base, costs, stage_world, stage_shape, max_inflight
                                    )
                                priced = layouts[key]
                                if priced is None or (pp, key) in seen:
                                    continue  # (zero > 0 at dp=1 is the same plan as 0)
                                seen.add((pp, key))
                                found.screened += 1
                                screens.append(
                                    _screen(
                                        cfg, base, priced, costs, pp, stage_shape, n_micro, prec
                                    )
                                )
    screens.sort(key=lambda s: s.step_s)
    under = [s for s in screens if s.peak_bytes <= SCREEN_SLACK * budget_bytes]
    if not under:  # nothing screens under the budget: walk the leanest
        under = sorted(screens, key=lambda s: s.peak_bytes)
    fitted = 0  # combinations of which an order fits
    for s in under[: 3 * finalists]:
        fits = False
        for order in pp_schedules:
            plan = dataclasses.replace(s.plan, pp_schedule=order)
            cand = _walk(cfg, plan, costs, world_size, s.batch, budget_bytes, max_inflight)
            found.walked += 1
            if cand is not None:
                found.candidates.append(cand)
                fits = fits or cand.fits
        fitted += fits
        if fitted >= finalists:
            break
    fitting = [c for c in found.candidates if c.fits]
    if fitting:
        best = min(fitting, key=lambda c: c.result.step_s)
        found.best = _refine(cfg, best, costs, world_size, budget_bytes, max_inflight, found)
    found.wall_s = time.perf_counter() - started
    return found


def _key(plan: ParallelPlan) -> tuple:
    return (
        plan.schedule,
        plan.n_sub,
        plan.sequence_parallel,
        tuple((r.tp, r.zero) for r in plan.regions),
    )


def _price_layout(
    cfg: ModelConfig,
    base: ParallelPlan,
    costs: Costs,
    stage_world: int,
    shape: BatchShape,
    max_inflight: int,
) -> tuple[float, float, PlanResult, list[float]] | None:
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


def _screen(
    cfg: ModelConfig,
    base: ParallelPlan,
    priced: tuple[float, float, PlanResult, list[float]],
    costs: Costs,
    pp: int,
    stage_shape: BatchShape,
    n_micro: int,
    prec: object,
) -> _Screen:
    c, tail, one, region_s = priced
    starts = balanced_stage_starts(region_s, pp)
    top = max(stage_shares(region_s, starts))
    t = base.regions[0].tp
    stage_world = t * base.regions[0].dp
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
    held = stage_shares(_region_params(cfg, base), starts)
    peak = rest + state * max(held) + act * top * min(pp, n_micro)  # 1F1B's first stage
    plan = dataclasses.replace(base, pp=pp, stage_starts=list(starts))
    return _Screen(step, peak, plan, stage_shape)


def _region_params(cfg: ModelConfig, plan: ParallelPlan) -> list[float]:
    """Parameters of every region at its degree (the last stage's tied head: a copy of the
    embedding)."""
    out = [float(region_param_count(cfg, region_kind(r.name), r.tp)) for r in plan.regions]
    if cfg.tie_embeddings:
        out[-1] += out[0]
    return out


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
    the step gets shorter and the plan still fits."""
    assert best.batch is not None
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
    )
    priced = precision_of(costs).describe()
    for c in found.candidates:
        assert c.batch is not None
        c.plan.notes.update(
            world_size=world_size, global_batch=c.batch.global_batch, micro_rows=c.batch.micro_rows
        )
        c.plan.precision = dict(priced)
    return found
