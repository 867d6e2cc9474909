"""The plan search: every region's TP degree, the schedule and its sub-batch count, the ZeRO
stage, sequence parallelism and the micro-batch, under a memory budget, judged by simulating
whole plans (``planner.simulate``).

``solve_plan`` walks the chains (``planner.chain_model``: one per micro-batch, schedule,
sub-batch count, ZeRO stage and sequence-parallel mode) in a fixed order: each chain's uniform
plans are simulated, its chain solved for a degree per region and the answer simulated whole;
the answer is the best *simulated* plan. Where nothing fits, the least memory of every plan
considered is named.

Two searches, one walk, the same answer:

    exhaustive=True    every chain of the order below, every plan simulated by walking its
                       instructions (the reference; ``planner.simulate``'s ``tapes=False``)
    exhaustive=False   (default) the same order and decisions, skipping only work that cannot
                       change the answer:
      - a plan already simulated is not simulated again (the simulation is a pure function);
      - a chain none of whose plans can fit (``search_bounds.chain_bounds``: a lower bound on
        the peak of every plan of the chain, from the state and activations every one holds)
        or beat the fastest plan found so far that fits (a lower bound on the step of every
        plan of the chain that fits the budget: the compute and the collectives waited at
        once every plan runs, the TP collectives each group's stream carries, weighed against
        the memory they save) is not solved, nor its sequence-parallel uniform plans
        simulated;
      - prices are remembered across the whole search, and programs compiled once
        (``planner.tape``).

Why the answer is the same: the walk's decisions (which micro-batches, stages and chains come
next) read only the uniform plans without sequence parallelism (simulated by both) and the
fastest plan that fits so far; no plan skipped both fits and beats that plan, so the
fastest fitting plan at every decision, and at the end, is the same plan (a tie goes to the
one found first, which both keep). Where nothing fits, the fast search runs the exhaustive one
(the least-memory search needs every chain).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from oases.config import ModelConfig
from oases.plan import ParallelPlan, RegionPlan, region_names
from oases.planner.batch import BatchShape, BatchSplitError
from oases.planner.candidate import Candidate, state_factors, with_zero
from oases.planner.chain_model import ChainModel, least_memory
from oases.planner.costs import Costs
from oases.planner.jit import load_for
from oases.planner.search_bounds import chain_bounds
from oases.planner.search_prefetch import Prefetch
from oases.planner.simulate import PlanResult, _CachedCosts, simulate_plan
from oases.planner.space import candidate_degrees, sub_batch_counts
from oases.planner.tape import tapes_kept
from oases.schedule.program import SPECS
from oases.schedule.specs import shards_differ

__all__ = [
    "BOUND_SLACK",
    "Candidate",
    "SearchStats",
    "candidate_degrees",
    "solve_plan",
    "state_factors",
    "sub_batch_counts",
    "with_zero",
]

BOUND_SLACK = 0.9  # a mixed plan may beat its chain's fastest uniform one by a few percent


@dataclass
class SearchStats:
    """What a search did: plans simulated (every simulation, the shorter models of the chains'
    prices included), candidates kept, chains solved and skipped by the bounds, seconds."""

    simulated: int = 0
    chains: int = 0
    skipped_chains: int = 0
    wall_s: float = 0.0
    best: Candidate | None = field(default=None, repr=False)


Progress = Callable[[SearchStats, int], None]  # (stats so far, candidates so far)


def solve_plan(
    cfg: ModelConfig,
    costs: Costs,
    world_size: int,
    batch: BatchShape,
    budget_bytes: float,
    *,
    schedules: tuple[str, ...] | None = None,
    n_subs: tuple[int, ...] = (1, 2, 4),
    degrees: list[int] | None = None,
    max_inflight: int = 1,
    seeds: tuple[tuple[int, ...], ...] = (),
    zeros: tuple[int, ...] = (0,),
    micro_batches: tuple[BatchShape, ...] = (),
    sps: tuple[str, ...] = (),
    exhaustive: bool = False,
    progress: Progress | None = None,
    stats: SearchStats | None = None,
) -> tuple[Candidate, list[Candidate]]:
    """The fastest predicted plan under ``budget_bytes`` per device, and every candidate.

    For each micro-batch (``batch``, then each of ``micro_batches``: the same global batch cut
    into other micro-batches), ZeRO stage of ``zeros`` (one stage for every region of a plan),
    schedule and sub-batch count (``sub_batch_counts``): every uniform degree is simulated;
    then the chain solver picks a degree per region (exact for the additive model of
    ``chain_model.node_costs``, with memory as a knapsack row), and the plan it returns is
    simulated as a whole. ``seeds`` (a degree per region, e.g. the plans other schedules'
    searches found) are simulated under every schedule and count as well. The answer is the
    best *simulated* plan, so it is never worse than the best uniform or seeded one as
    predicted.

    Micro-batches are searched from the largest (fewest accumulation steps) down, ZeRO stages
    from 0 up. Stages 0 and 1 are both always searched: stage 1 moves the bytes of stage 0's
    all-reduce, half in its reduce-scatter under the backward and half in the gather of the
    updated weights under the next forward, so it can be faster as well as leaner. A smaller
    micro-batch, and stages 2 and 3, only while memory binds at the one before (the fastest
    uniform plan of a chain does not fit): where it fits, they would only add time.

    Sequence parallelism (``sps``: the modes searched, "gathered" and/or "shards") is one per
    plan as well: beside each uniform plan (degree t dividing the sequence, any ZeRO stage)
    the same plan with each mode is simulated ("shards" only where it differs from
    "gathered", ``specs.shards_differ``: it keeps slices instead of gathered inputs, and
    gathers again in the backward, "gh", or in the communication-free recompute, "gr"), and
    each mode's chain is solved as another chain (its pieces, saved activations and two-way
    reshards, ``chain_model.node_costs``).

    The ZeRO stage is one per plan: it trades memory for traffic on the DP links, which every
    region's gradients cross on one stream, so a region's share of the step is not its own
    (the chain's additive time model cannot price a stage per region); the plan file still
    takes a stage per region.

    Where no plan fits, every chain's leanest plan (``ChainModel.leanest``: the least peak
    of the additive memory model) is simulated, and the chains near the least peak are searched
    again under it (``chain_model.least_memory``); neither depends on the budget, so at a
    budget of that least peak they find the plan that has it. If still nothing fits,
    ValueError names it.

    ``exhaustive``: the reference search (see the module docstring); the default skips what
    cannot change the answer. ``progress`` is called after every chain with the ``stats`` so
    far (``stats``: filled in when given) and the number of candidates."""
    started = time.perf_counter()
    stats = stats if stats is not None else SearchStats()
    kw = dict(
        schedules=schedules,
        n_subs=n_subs,
        degrees=degrees,
        max_inflight=max_inflight,
        seeds=seeds,
        zeros=zeros,
        micro_batches=micro_batches,
        sps=sps,
        progress=progress,
        stats=stats,
        started=started,
    )
    search = _Search(cfg, costs, world_size, batch, budget_bytes, exhaustive=exhaustive, **kw)
    search.walk()
    if not exhaustive and not search.fitting() and search.skipped:  # the least-memory search
        search = _Search(cfg, costs, world_size, batch, budget_bytes, exhaustive=True, **kw)
        search.walk()
    try:
        return search.finish()
    finally:
        stats.wall_s = time.perf_counter() - started


class _Search:
    """One search's state: the candidates in the order found, the chains solved, what was
    simulated (``solve_plan`` for the order and what the fast search skips)."""

    def __init__(
        self,
        cfg: ModelConfig,
        costs: Costs,
        world_size: int,
        batch: BatchShape,
        budget_bytes: float,
        *,
        schedules: tuple[str, ...] | None,
        n_subs: tuple[int, ...],
        degrees: list[int] | None,
        max_inflight: int,
        seeds: tuple[tuple[int, ...], ...],
        zeros: tuple[int, ...],
        micro_batches: tuple[BatchShape, ...],
        sps: tuple[str, ...],
        exhaustive: bool,
        progress: Progress | None,
        stats: SearchStats,
        started: float,
    ) -> None:
        self.cfg, self.world_size, self.batch, self.budget = cfg, world_size, batch, budget_bytes
        # a search's prices never change: remember them for the whole search
        self.costs = costs if exhaustive else _CachedCosts(costs)
        self.degrees = degrees or candidate_degrees(cfg, world_size)
        if schedules is None:  # megatron-sp is megatron with sequence parallelism (``sps``)
            schedules = tuple(n for n, s in SPECS.items() if not s.sequence_parallel)
        self.schedules, self.n_subs, self.max_inflight = schedules, n_subs, max_inflight
        self.seeds, self.zeros, self.sps, self.exhaustive = seeds, zeros, sps, exhaustive
        self.shapes = [batch, *(b for b in micro_batches if b != batch)]
        self.names = region_names(cfg)
        self.candidates: list[Candidate] = []
        self.keys: set[tuple] = set()
        self.memo: dict[tuple, PlanResult | None] = {}
        self.models: list[ChainModel] = []
        self.split_errors: list[str] = []
        self.incumbent = float("inf")  # the fastest step of a plan that fits, so far
        self.skipped = False  # a chain was skipped (its bounds)
        self.progress, self.stats, self.started = progress, stats, started
        # pure answers kept or handed back by the worker (``search_prefetch``)
        self.prefetched: dict[tuple, tuple[PlanResult | None, str]] = {}
        self.bounds: dict[tuple, tuple[float, float]] = {}
        self.solves: dict[tuple, object] = {}
        self.fresh: dict[tuple, tuple[PlanResult | None, str]] | None = None  # (the worker's)
        self.prefetch: Prefetch | None = None

    # ------------------------------------------------------------------ plans and candidates
    def simulate(
        self,
        cfg: ModelConfig,
        plan: ParallelPlan,
        shape: BatchShape,
        why: list[str] | None = None,
        memory: bool = True,
    ) -> PlanResult | None:
        """``plan`` simulated with ``shape`` (None where the batch does not split: not a
        candidate); the fast search remembers every answer. ``memory=False``: the step only
        (``simulate_plan``'s), for a chain's shorter models."""
        key = (cfg.n_layers, _plan_key(plan), shape, memory)
        if not self.exhaustive and key in self.memo:
            res = self.memo[key]
            if res is None and why is not None:
                why.append(self.split_errors[-1] if self.split_errors else "")
            return res
        self.stats.simulated += 1
        ready = self.prefetched.pop(key, None)
        if ready is not None:  # the worker's answer (``search_prefetch``)
            res, error = ready
            if res is None and why is not None:
                why.append(error)
            self.memo[key] = res
            return res
        error = ""
        try:
            res = simulate_plan(
                cfg,
                plan,
                self.costs,
                self.world_size,
                shape,
                max_inflight=self.max_inflight,
                timeline=False,
                tapes=not self.exhaustive,
                memory=memory,
            )
        except BatchSplitError as exc:  # not a candidate: the batch does not split
            error = str(exc)
            if why is not None:
                why.append(error)
            res = None
        if not self.exhaustive:
            self.memo[key] = res
        if self.fresh is not None:
            self.fresh[key] = (res, error)
        return res

    def _simulate_model(
        self, cfg: ModelConfig, plan: ParallelPlan, shape: BatchShape
    ) -> PlanResult | None:
        """A chain's plan (``ChainModel``), or its shorter model's (``node_costs``: a model
        of one layer less, whose step alone is read)."""
        return self.simulate(cfg, plan, shape, memory=cfg.n_layers == self.cfg.n_layers)

    def known(self, plan: ParallelPlan, shape: BatchShape) -> bool:
        return (_plan_key(plan), shape) in self.keys

    def add(self, cand: Candidate | None, shape: BatchShape) -> bool:
        """Keep ``cand`` (simulated with ``shape``) unless it is None or known; True if kept."""
        if cand is None or self.known(cand.plan, shape):
            return False
        cand.batch, cand.micro_label = shape, len(self.shapes) > 1
        self.candidates.append(cand)
        self.keys.add((_plan_key(cand.plan), shape))
        if cand.fits and cand.result.step_s < self.incumbent:
            self.incumbent = cand.result.step_s
            self.stats.best = cand
        return True

    def fitting(self) -> list[Candidate]:
        return [c for c in self.candidates if c.fits]

    # ---------------------------------------------------------------------------- the walk
    def walk(self) -> None:
        """Largest micro-batch first (fewest accumulation steps); a smaller one, or a ZeRO
        stage above 1, is searched only while memory binds: where the fastest uniform plan
        fits, they would only add time (more accumulation steps; more DP collectives). Stage 1
        is searched beside stage 0 always (same bytes, placed differently: it may be faster).
        Nor is a chain searched whose bound cannot beat the fastest plan that fits: a stage
        above 1 or a smaller micro-batch of a schedule is no faster than its chain already
        searched (less its optimizer step, which sharding shortens), within
        ``BOUND_SLACK``."""
        floors: dict[tuple[str, int], float] = {}
        with tapes_kept():  # (the worker forked below keeps its own)
            load_for(len(self.names))  # (the compiled walk, once, before the worker's fork)
            self.prefetch = None if self.exhaustive else Prefetch.start(self)
            try:
                self._walk(floors)
            finally:
                if self.prefetch is not None:
                    self.prefetch.close()
                self.prefetch = None

    def _walk(self, floors: dict[tuple[str, int], float]) -> None:
        tight = False
        for shape in sorted(self.shapes, key=lambda b: -b.micro_rows):
            binds = False
            for schedule in self.schedules:
                for n_sub in sub_batch_counts(schedule, self.n_subs, self.schedules):
                    for zero in sorted(self.zeros):
                        if zero == 2 and shape.n_micro() == 1 and 1 in self.zeros:
                            continue  # one micro-batch: stage 2 runs stage 1's program
                        if zero != 1 and (
                            floors.get((schedule, n_sub), 0.0) * BOUND_SLACK >= self.incumbent
                        ):
                            break
                        if self.prefetch is not None:
                            chain = (shape, zero, schedule, n_sub)
                            self.prefetch.before(self, chain, tight, binds, floors)
                        tight, floor = self.search(shape, zero, schedule, n_sub)
                        floors[schedule, n_sub] = min(floors.get((schedule, n_sub), floor), floor)
                        binds |= tight
                        if self.progress is not None:
                            self.stats.wall_s = time.perf_counter() - self.started
                            self.progress(self.stats, len(self.candidates))
                        if not tight and zero >= 1:
                            break
            if not binds:
                break

    def search(self, shape: BatchShape, zero: int, schedule: str, n_sub: int) -> tuple[bool, float]:
        """One chain: its uniform plans, the solver's plan, the seeds. Returns whether memory
        binds (the fastest uniform plan does not fit, or none splits the batch) and the least
        step time of its uniform plans less their optimizer step (fitting or not)."""
        cfg, world_size, budget = self.cfg, self.world_size, self.budget
        uniform: dict[int, PlanResult] = {}
        sp_uniform: dict[str, dict[int, PlanResult]] = {}
        modes = [m for m in self.sps if m == "gathered" or shards_differ(SPECS[schedule].recompute)]
        live = {m: not self.skip(shape, zero, schedule, n_sub, m) for m in modes}
        for t in self.degrees:
            if zero and t == world_size:
                continue  # no data parallelism to shard over
            plan = with_zero(
                ParallelPlan.uniform(cfg, world_size, t, schedule=schedule, n_sub=n_sub), zero
            )
            res = self.simulate(cfg, plan, shape, self.split_errors)
            if res is None:
                continue
            uniform[t] = res
            self.add(Candidate(plan, res, res.peak_mem_bytes <= budget, "uniform"), shape)
            for mode in (m for m in modes if cfg.seq_len % t == 0 and live[m]):
                sp_plan = dataclasses.replace(plan, sequence_parallel=mode, notes={})
                sp_res = self.simulate(cfg, sp_plan, shape)
                if sp_res is not None:
                    sp_uniform.setdefault(mode, {})[t] = sp_res
                    if t > 1:  # at degree 1 it is the plan without it
                        self.add(
                            Candidate(sp_plan, sp_res, sp_res.peak_mem_bytes <= budget, "uniform"),
                            shape,
                        )
        for mode, results in (("", uniform), *sp_uniform.items()):
            if len(results) < 2:
                continue
            if not mode and self.skip(shape, zero, schedule, n_sub, mode):
                continue
            self.stats.chains += 1
            model = ChainModel(
                cfg,
                self.costs,
                world_size,
                shape,
                schedule,
                n_sub,
                self.degrees,
                results,
                self._simulate_model,
                zero,
                mode,
                solves=None if self.exhaustive else self.solves,
            )
            self.models.append(model)
            self.add(model.fastest(budget), shape)
        for seed in self.seeds:
            if len(seed) != len(self.names) or len(set(seed)) == 1 or not set(seed) <= set(uniform):
                continue  # uniform seeds are simulated above; a degree that does not split
            plan = with_zero(
                ParallelPlan(
                    [RegionPlan(name, t, world_size // t) for name, t in zip(self.names, seed)],
                    n_sub=n_sub,
                    schedule=schedule,
                ),
                zero,
            )
            res = None if self.known(plan, shape) else self.simulate(cfg, plan, shape)
            if res is not None:
                self.add(Candidate(plan, res, res.peak_mem_bytes <= budget, "seeded"), shape)
        fastest = min(uniform.values(), key=lambda r: r.step_s, default=None)
        floor = min(
            (r.step_s - r.breakdown["optimizer_s"] for r in uniform.values()), default=float("inf")
        )
        return fastest is None or fastest.peak_mem_bytes > budget, floor

    def skip(self, shape: BatchShape, zero: int, schedule: str, n_sub: int, sp: str) -> bool:
        """Can no plan of this chain fit, or beat the fastest plan that fits so far? (Never,
        for the exhaustive search.)"""
        if self.exhaustive:
            return False
        key = (shape, schedule, n_sub, zero, sp)
        if key not in self.bounds:
            self.bounds[key] = chain_bounds(
                self.cfg,
                self.costs,
                self.world_size,
                shape,
                schedule,
                n_sub,
                zero,
                sp,
                self.degrees,
                self.max_inflight,
                self.budget,
                self.incumbent,  # (skipped whatever bound reaches it: it only falls)
            )
        time_lb, memory_lb = self.bounds[key]
        if memory_lb > self.budget or time_lb >= self.incumbent:
            self.stats.skipped_chains += 1
            self.skipped = True
            return True
        return False

    # ------------------------------------------------------------------------------ the end
    def finish(self) -> tuple[Candidate, list[Candidate]]:
        """The best plan that fits (after the least-memory search where none does)."""
        candidates, batch, world_size = self.candidates, self.batch, self.world_size
        if not candidates:
            errors = self.split_errors
            raise ValueError(
                f"no plan splits the batch: {errors[0] if errors else ''}"
                f" (degrees {self.degrees}, sub-batches "
                f"{sorted(set(self.n_subs))}; a micro-batch of "
                f"{batch.micro_rows} sequences gives a TP group of degree t "
                f"{batch.micro_rows}*t/{world_size} of them, which must be a "
                "whole multiple of the sub-batch count)"
            )
        fitting = self.fitting()
        if not fitting:  # what each chain can do with the least memory, then maybe a plan fits
            for model in self.models:
                self.add(model.leanest(self.budget), model.batch)
            fitting = self.fitting()
        if not fitting:  # and the chains searched again under the least peak (budget-blind)
            least = least_memory(candidates, self.models, self.add, self.budget)
            fitting = self.fitting()
        if not fitting:
            raise ValueError(
                f"no plan fits in {self.budget / 2**30:.3f} GiB per device; the smallest "
                f"feasible budget is {least.result.peak_mem_bytes / 2**30:.3f} GiB "
                f"({least.label()}): the least peak of the {len(candidates)} plans simulated "
                "(every schedule and sub-batch count: each uniform degree, and per region "
                "the chain's least-memory degrees and its fastest under that budget), with "
                f"{batch.micro_rows} sequences per micro-batch across the {world_size} "
                "ranks; fewer per micro-batch need less"
            )
        best = min(fitting, key=lambda c: c.result.step_s)
        best.plan.predicted_step_s = best.result.step_s
        best.plan.predicted_peak_mem_bytes = int(best.result.peak_mem_bytes)
        self.stats.best = best
        return best, candidates


def _plan_key(plan: ParallelPlan) -> tuple:
    """What tells two plans of one model apart in a search: every region's degree and stage,
    the schedule, sub-batch count and sequence parallelism."""
    return (
        tuple((r.tp, r.zero) for r in plan.regions),
        plan.schedule,
        plan.n_sub,
        plan.sequence_parallel,
    )
