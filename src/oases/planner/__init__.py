"""The planner: predict a plan's step time by simulating its schedule program on costs, and
choose every region's TP degree and the schedule knobs under a memory budget.

    costs     = load_costs("profile.json" | "hw:PRESET" | "hw:cluster.toml", cfg.model,
                           cfg.train.precision, cfg.parallel.grad_reduce_dtype)
    budget    = costs_budget(memory_gb, costs)      # GB in, GiB out; 0: the default
    best, all = plan_model(cfg, world_size, costs, budget.bytes)
    print(format_candidates(best, all, budget.bytes))

Modules: ``costs`` (the interface, parameter and activation sizes), ``precision`` (bytes per tensor
kind by dtype), ``profile`` (a measured profile; ``bench.profile_runner`` measures it),
``hardware``/``clusters`` (presets), ``models`` (the paper's models), ``simulate`` (a plan's step on
costs: ``event_walk`` walks one program, ``plan_costs`` prices its instructions, ``layout`` places
groups, buckets and shards; ``tape`` compiles a program for the search's fast walks,
``tape_walk`` walks it), ``chain``
(the chain solvers), ``search`` (the plan search: ``chain_model`` one chain of it, ``candidate``
the plans it considers, ``search_bounds`` the bounds that let it skip a chain), ``space`` (what
a search covers and what its flags kept out), ``batch`` (a step's batch, what a micro-batch
counts, each region's rows), ``budget`` (the memory budget: unit and default), ``report`` (what
plan and simulate print), ``verify`` (prediction against measurement), ``whatif``
(``oases simulate``).
Nothing here calls ``torch.distributed``: what needs ranks lives in ``oases.bench``.
"""

from __future__ import annotations

from dataclasses import dataclass

from oases.config import Config, ModelConfig
from oases.planner.batch import BatchShape, config_batch
from oases.planner.budget import costs_budget
from oases.planner.costs import Costs
from oases.planner.report import format_candidates
from oases.planner.search import Candidate, Progress, SearchStats, solve_plan

__all__ = [
    "PlanSearch",
    "auto_plan",
    "batch_shape",
    "costs_budget",
    "format_candidates",
    "load_costs",
    "plan_model",
    "search_plans",
]


def load_costs(
    source: str, model: ModelConfig, precision: str | None = None, grad_reduce: str = "fp32"
) -> Costs:
    """A profile file (checked against the model's shape), or ``hw:PRESET`` / ``hw:FILE`` for
    a named or described cluster (analytic compute and links).

    ``precision``: the run's ``train.precision`` (with ``parallel.grad_reduce_dtype``
    ``grad_reduce``). A preset prices it as the run would resolve it on GPUs
    (``planner.precision.resolve_plan_precision``: "auto" is bf16); a profile must have been
    measured in it (``Profile.check_precision``: an error otherwise, not a silent reuse of
    another dtype's compute times), except for "auto", which takes the profile's own (the
    dtype "auto" resolved to where it was measured). None: fp32 for a preset, the profile's
    own for a profile."""
    from oases.planner.precision import resolve_plan_precision

    if source.startswith("hw:"):
        from oases.planner.hardware import HardwareCosts
        from oases.planner.sim_inputs import load_any_cluster

        cluster = load_any_cluster(source[3:])
        if precision is None:
            return HardwareCosts(cluster, model)
        wanted = resolve_plan_precision(precision, grad_reduce, gpu=True)
        if wanted.compute == "fp64":
            raise ValueError(
                f"train.precision={precision}: the hardware presets price fp32 "
                "and bf16 (and tf32/fp16 in oases simulate), not fp64"
            )
        return HardwareCosts(cluster, model, wanted.compute, wanted.grad_reduce)
    from oases.planner.profile import Profile

    profile = Profile.load(source)
    profile.check_model(model)
    if precision is not None and precision != "auto":
        profile.check_precision(resolve_plan_precision(precision, grad_reduce))
    return profile


def batch_shape(cfg: Config, world_size: int) -> BatchShape:
    """The config's batch as the planner sees it (``planner.batch``): ``train.global_batch``
    sequences per step, fed ``train.micro_batch`` per model replica at ``parallel.tp``, so
    ``micro_batch * world / tp`` across the world per micro-batch, which every plan keeps."""
    return config_batch(cfg).shape(world_size)


def micro_batch_options(batch: BatchShape, spread: int = 3) -> tuple[BatchShape, ...]:
    """The micro-batches the planner searches under a fixed global batch: the given one and
    those ``2**j`` times it (|j| <= ``spread``) that divide the global batch, smallest first
    (fewer sequences per micro-batch: less activation memory, more accumulation steps)."""
    out = []
    for j in range(-spread, spread + 1):
        rows = batch.micro_rows * 2**j if j >= 0 else batch.micro_rows / 2**-j
        if rows >= 1 and rows == int(rows) and batch.global_batch % int(rows) == 0:
            out.append(BatchShape(batch.global_batch, int(rows)))
    return tuple(out)


def _prices_zero(costs: Costs, world_size: int, degrees: list[int]) -> bool:
    """Can ``costs`` price a reduce-scatter and an all-gather over every DP group size?"""
    try:
        for t in degrees:
            if world_size // t > 1:
                costs.collective_s("reduce_scatter", world_size // t, 1 << 20)
                costs.collective_s("all_gather", world_size // t, 1 << 20)
    except (ValueError, KeyError):
        return False
    return True


def _prices_sp(costs: Costs, degrees: list[int]) -> bool:
    """Can ``costs`` price sequence parallelism's pieces (a profile measures them since
    ``oases profile`` runs sequence-parallel programs) at every degree above 1?"""
    try:
        for t in degrees:
            if t > 1:
                costs.compute_s("attn", "forward", "sp-core", t, 1)
                costs.compute_s("attn", "backward", "sp-norm", t, 1)
    except (ValueError, KeyError):
        return False
    return True


@dataclass
class PlanSearch:
    """What ``search_plans`` found: the ``best`` plan, every candidate simulated, and what the
    flags or the costs kept out of the search (``planner.space``), a line each."""

    best: Candidate
    candidates: list[Candidate]
    excluded: list[str]


def plan_model(
    cfg: Config,
    world_size: int,
    costs: Costs,
    budget_bytes: float,
    schedules: tuple[str, ...] | None = None,
    n_subs: tuple[int, ...] = (1, 2, 4),
    zeros: tuple[int, ...] = (0, 1, 2, 3),
    search_micro_batch: bool = True,
    max_tp: int | None = None,
    sps: tuple[str, ...] = ("gathered", "shards"),
    progress: Progress | None = None,
    stats: SearchStats | None = None,
    exhaustive: bool = False,
) -> tuple[Candidate, list[Candidate]]:
    """``search_plans``' best plan and candidates."""
    found = search_plans(
        cfg,
        world_size,
        costs,
        budget_bytes,
        schedules,
        n_subs,
        zeros,
        search_micro_batch,
        max_tp,
        sps,
        progress=progress,
        stats=stats,
        exhaustive=exhaustive,
    )
    return found.best, found.candidates


def search_plans(
    cfg: Config,
    world_size: int,
    costs: Costs,
    budget_bytes: float,
    schedules: tuple[str, ...] | None = None,
    n_subs: tuple[int, ...] = (1, 2, 4),
    zeros: tuple[int, ...] = (0, 1, 2, 3),
    search_micro_batch: bool = True,
    max_tp: int | None = None,
    sps: tuple[str, ...] = ("gathered", "shards"),
    progress: Progress | None = None,
    stats: SearchStats | None = None,
    exhaustive: bool = False,
) -> PlanSearch:
    """Plan ``cfg`` for ``world_size`` ranks: every schedule, sub-batch count, ZeRO stage of
    ``zeros``, sequence-parallel mode of ``sps`` and (``search_micro_batch``) micro-batch of
    ``micro_batch_options`` under the config's global batch (``solve_plan``), TP degrees up to
    ``max_tp`` (default: all). Costs that cannot price ZeRO's collectives (a profile from
    before ``oases profile`` measured reduce-scatters) plan without it, and costs that cannot
    price sequence parallelism's pieces (a profile from before it measured them) without that;
    each such narrowing, and what a fixed ZeRO stage or mode leaves out, is a line of
    ``excluded``. Every candidate's plan notes the batch it assumed, so a run reproduces it,
    and the precision it was priced in. ``progress``, ``stats``, ``exhaustive``:
    ``solve_plan``'s."""
    from oases.planner.precision import precision_of
    from oases.planner.search import candidate_degrees
    from oases.planner.space import SearchSpace
    from oases.schedule.program import SPECS

    cluster = getattr(costs, "cluster", None)
    if cluster is not None:
        from oases.planner.clusters import check_world_size

        check_world_size(cluster, world_size)
    if schedules is not None:
        unknown = [s for s in schedules if s not in SPECS]
        if unknown or not schedules:
            raise ValueError(f"unknown schedule(s) {unknown}; valid: {', '.join(SPECS)}")
    every = tuple(n for n, s in SPECS.items() if not s.sequence_parallel)
    space = SearchSpace(
        world_size,
        candidate_degrees(cfg.model, world_size),
        tuple(zeros),
        tuple(sps),
        schedules or every,
    )
    degrees = getattr(costs, "degrees", None)
    if degrees is not None:  # a profile prices only the degrees it measured
        measured = degrees()
        if not any(t in measured for t in space.degrees):
            raise ValueError(
                f"the profile measured tp {measured}, none of which fits "
                f"{world_size} ranks and this model: profile with this world size"
            )
        space.narrow_degrees(
            lambda t: t in measured, "the profile", f"it measured tp {'/'.join(map(str, measured))}"
        )
    if max_tp is not None:
        space.narrow_degrees(lambda t: t <= max_tp, f"--max-tp={max_tp}", "above it")
    space.narrow_zeros(_prices_zero(costs, world_size, space.degrees))
    space.narrow_sps(_prices_sp(costs, space.degrees))
    zero_flag = f"--zero {'/'.join(map(str, space.zeros))}"
    sp_flag = f"--sequence-parallel {'/'.join(space.sps)}"
    space.note_flag_effects(cfg.model, zero_flag, sp_flag)
    kw: dict = {"schedules": schedules} if schedules is not None else {}
    batch = batch_shape(cfg, world_size)
    best, candidates = solve_plan(
        cfg.model,
        costs,
        world_size,
        batch,
        budget_bytes,
        n_subs=n_subs,
        max_inflight=cfg.schedule.max_inflight,
        zeros=space.zeros,
        sps=space.sps,
        micro_batches=micro_batch_options(batch) if search_micro_batch else (),
        degrees=space.degrees,
        progress=progress,
        stats=stats,
        exhaustive=exhaustive,
        **kw,
    )
    priced = precision_of(costs).describe()
    for c in candidates:  # what the prediction assumed, so a run reproduces it
        shape = c.batch or batch
        c.plan.notes.update(
            world_size=world_size, global_batch=shape.global_batch, micro_rows=shape.micro_rows
        )
        c.plan.precision = dict(priced)
    return PlanSearch(best, candidates, space.excluded)


def auto_plan(cfg: Config, world_size: int):  # noqa: ANN201 - ParallelPlan
    """``parallel.plan = "auto"``: plan with ``parallel.profile`` under ``parallel.memory_gb``
    GB per device (0: the default of ``planner.budget``, as ``oases plan``)."""
    source = cfg.parallel.profile
    if not source:
        raise ValueError(
            'parallel.plan = "auto" needs parallel.profile: a file written by '
            "`oases profile`, or hw:PRESET"
        )
    costs = load_costs(source, cfg.model, cfg.train.precision, cfg.parallel.grad_reduce_dtype)
    best, _ = plan_model(cfg, world_size, costs, costs_budget(cfg.parallel.memory_gb, costs).bytes)
    return best.plan
