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
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace

from oases.config import ModelConfig
from oases.plan import ParallelPlan
from oases.planner.costs import (
    BYTES,
    OPTIMIZER_STATES,
    Costs,
    analytic_saved_bytes,
    region_kind,
    region_param_count,
)
from oases.schedule.program import Compute, Instr, Piece, Start, Wait, comm_name, label
from oases.schedule.timeline import Event, Timeline


@dataclass(frozen=True)
class StepCosts:
    """Seconds for every instruction of a program.

    ``piece_s(phase, kind, region)``: one sub-batch's piece ("epi" | "body" | "norm" | "tp") of a
    region in a phase ("forward" | "recompute" | "backward"); ``recompute_body_s(region)`` is the
    body's recompute when its last (row-parallel) matmul is skipped (communication-free mode);
    ``collective_s(kind, index)``: one sub-batch's TP all-reduce ("fwd" | "bwd") after region
    ``index``, its reshard into region ``index`` ("rsf" forward, "rsb" backward), or the DP
    all-reduce of gradient bucket ``index`` ("dp").
    ``compute_s(instruction)``, when given, prices a whole Compute instruction directly (a
    profile measured per instruction) and overrides the per-piece costs.
    """

    piece_s: Callable[[str, str, int], float]
    collective_s: Callable[[str, int], float]
    recompute_body_s: Callable[[int], float] | None = None
    compute_s: Callable[[Compute], float] | None = None
    stream_of: Callable[[str, int], Hashable] | None = None  # default: "tp" or "dp"


# what a collective kind is, in a step's breakdown: TP all-reduces, reshards, DP all-reduces
COMM_CLASS = {"fwd": "tp", "bwd": "tp", "rsf": "reshard", "rsb": "reshard", "dp": "dp"}


@dataclass(frozen=True)
class SimResult:
    """``step_s = compute_busy_s + sum(exposed_s.values())``: the compute stream is either
    computing or waiting at a ``Wait`` for a collective of one class (``COMM_CLASS``)."""

    step_s: float
    compute_busy_s: float
    comm_busy_s: float
    timeline: Timeline
    exposed_s: dict[str, float] = field(default_factory=dict)


def simulate_program(program: list[Instr], costs: StepCosts, *, commfree: bool = False,
                     rank: int = 0, record: bool = True) -> SimResult:
    """Predict one step of ``program``. ``commfree``: recomputed bodies skip their last matmul
    (as the executor does for communication-free recomputation). ``record=False`` leaves the
    timeline empty (the planner's search needs only the times). The result says how long the
    compute stream waited on each class of collective (``exposed_s``: "tp", "reshard", "dp")."""
    timeline = Timeline()
    now = 0.0
    exposed = dict.fromkeys(("tp", "reshard", "dp"), 0.0)
    free: dict[Hashable, float] = {}
    ends: dict[tuple[str, int, int], float] = {}
    compute_busy = comm_busy = 0.0
    priced: dict[tuple[str, tuple[Piece, ...]], float] = {}  # per-piece costs ignore the sub

    def pieces_s(phase: str, pieces: tuple[Piece, ...]) -> float:
        cost = 0.0
        for kind, region in pieces:
            if (phase == "recompute" and kind == "body" and commfree
                    and costs.recompute_body_s is not None):
                cost += costs.recompute_body_s(region)
            else:
                cost += costs.piece_s(phase, kind, region)
        return cost

    for ins in program:
        if isinstance(ins, Compute):
            if costs.compute_s is not None:
                cost = costs.compute_s(ins)
            else:
                key = (ins.phase, ins.pieces)
                cost = priced.get(key)
                if cost is None:
                    cost = priced[key] = pieces_s(ins.phase, ins.pieces)
            if record:
                timeline.add(Event(rank, "compute", label(ins), ins.phase, ins.sub, now,
                                   now + cost))
            now += cost
            compute_busy += cost
        elif isinstance(ins, Start):
            stream = (("dp" if ins.kind == "dp" else "tp") if costs.stream_of is None
                      else costs.stream_of(ins.kind, ins.index))
            cost = costs.collective_s(ins.kind, ins.index)
            if cost <= 0:  # nothing moves (a reshard's slicing direction): done at once
                ends[ins.kind, ins.index, ins.sub] = now
                continue
            begin = max(free.get(stream, 0.0), now)
            free[stream] = ends[ins.kind, ins.index, ins.sub] = begin + cost
            if record:
                timeline.add(Event(rank, "comm", comm_name(ins.kind, ins.index), ins.kind,
                                   ins.sub, begin, begin + cost))
            comm_busy += cost
        elif isinstance(ins, Wait):
            end = ends.pop((ins.kind, ins.index, ins.sub))
            if end > now:
                exposed[COMM_CLASS[ins.kind]] += end - now
                now = end
    if ends:
        raise ValueError(f"program leaves collectives unwaited: {sorted(ends)}")
    return SimResult(max([now, *free.values()]), compute_busy, comm_busy, timeline, exposed)


# ------------------------------------------------------------------------------ whole plans
@dataclass(frozen=True)
class PlanResult:
    step_s: float
    peak_mem_bytes: float
    timeline: Timeline
    breakdown: dict[str, float]  # seconds and bytes by cause, for reports

    def step_parts(self) -> dict[str, float]:
        """The step cut into what the compute stream did: compute, waiting on each class of
        collective (exposed communication), the optimizer. The parts add up to ``step_s``."""
        b = self.breakdown
        return {"compute": b.get("compute_s", 0.0), "TP comm": b.get("exposed_tp_s", 0.0),
                "DP comm": b.get("exposed_dp_s", 0.0), "reshard": b.get("exposed_reshard_s", 0.0),
                "optimizer": b.get("optimizer_s", 0.0)}

    def bound(self) -> str:
        """What bounds the step: its largest part."""
        parts = self.step_parts()
        return max(parts, key=parts.__getitem__)


@dataclass(frozen=True)
class BatchShape:
    """How a step's batch is cut: ``global_batch`` sequences per optimizer step, fed
    ``micro_rows`` sequences at a time across the whole world (each rank sees
    ``micro_rows * t / world_size`` of them in a region of degree t)."""

    global_batch: int
    micro_rows: int

    def n_micro(self) -> int:
        return self.global_batch // self.micro_rows


class BatchSplitError(ValueError):
    """The batch does not split over a plan's degrees and sub-batches (the plan is not a
    candidate, rather than a mistake)."""


def region_rows(plan: ParallelPlan, world_size: int, batch: BatchShape, n_sub: int) -> list[int]:
    """Rows of one sub-batch in every region (BatchSplitError where they do not divide)."""
    if batch.global_batch % batch.micro_rows:
        raise BatchSplitError(f"global batch {batch.global_batch} is not a multiple of the "
                              f"micro-batch {batch.micro_rows}")
    rows = []
    for r in plan.regions:
        local, left = divmod(batch.micro_rows * r.tp, world_size)
        if left or local % n_sub or local == 0:
            raise BatchSplitError(f"region {r.name} at tp={r.tp}: a micro-batch of "
                                  f"{batch.micro_rows} "
                             f"sequences over dp={r.dp} does not split into {n_sub} sub-batches")
        rows.append(local // n_sub)
    return rows


@functools.lru_cache(maxsize=1024)
def _group_ranks(kind: str, a: int, b: int, world_size: int) -> tuple[int, ...]:
    """Rank 0's group: TP at degree a, DP at degree a, or the merge group of degrees a < b."""
    if kind == "tp":
        return tuple(range(a))
    if kind == "dp":
        return tuple(range(0, world_size, a))
    return tuple(j * a for j in range(b // a))


def _dp_buckets(cfg: ModelConfig, kinds: list[str], degrees: list[int],
                world_size: int) -> dict[int, list[tuple[int, int]]]:
    """{backward task: [(dp degree, parameters)]}, as ``schedule.regions.dp_buckets`` groups
    them: task i finalizes region i's own parameters and region i+1's norm (a tied head's
    weight is the embedding's, final at task 0). Empty when no region is data-parallel."""
    if all(t == world_size for t in degrees):
        return {}
    norm = 2 * cfg.dim if cfg.arch == "gpt2" else cfg.dim
    buckets: dict[int, list[tuple[int, int]]] = {}
    for i, (kind, t) in enumerate(zip(kinds, degrees)):
        own = region_param_count(cfg, kind, t) - (norm if kind != "embed" else 0)
        parts = {world_size // t: own}  # one all-reduce per DP group, as the executor issues
        if i + 1 < len(kinds):
            dp = world_size // degrees[i + 1]
            parts[dp] = parts.get(dp, 0) + norm
        if any(parts.values()):
            buckets[i] = [(dp, numel) for dp, numel in parts.items() if numel]
    return buckets


def plan_program(cfg: ModelConfig, plan: ParallelPlan, world_size: int, batch: BatchShape,
                 *, max_inflight: int = 1, n_micro: int | None = None,
                 dp: bool = True) -> list[Instr]:
    """The instruction list one rank runs for a step of ``plan``: the executor's very program
    (``Schedule.program`` builds the same from a parallelized model). ``n_micro``: build only
    that many micro-batches (default: the batch's); ``dp=False``: without the data-parallel
    gradient all-reduces (a micro-batch that is not the last)."""
    from oases.schedule.program import build_program

    degrees = tuple(r.tp for r in plan.regions)
    kinds = [region_kind(r.name) for r in plan.regions]
    buckets = _dp_buckets(cfg, kinds, list(degrees), world_size) if dp else {}
    return build_program(plan.schedule, len(degrees), plan.n_sub,
                         n_micro=batch.n_micro() if n_micro is None else n_micro,
                         max_inflight=max_inflight, dp_tasks=tuple(sorted(buckets)),
                         degrees=None if len(set(degrees)) == 1 else degrees)


def simulate_plan(cfg: ModelConfig, plan: ParallelPlan, costs: Costs, world_size: int,
                  batch: BatchShape, *, max_inflight: int = 1, rank: int = 0,
                  timeline: bool = True, scaled: bool = True) -> PlanResult:
    """Predict one optimizer step of ``plan`` (its ``schedule`` and ``n_sub``): time, timeline
    (``timeline=False``: none, faster) and peak memory per device.

    Micro-batches run one after another and each waits for all of its collectives before the
    next one starts; the DP all-reduces start only in the last. So every micro-batch but the
    last takes the same time, and ``scaled`` (the default) simulates one micro-batch without
    and one with the DP all-reduces and adds them up::

        step = (n_micro - 1) * t(micro-batch) + t(last micro-batch, with DP)

    ``scaled=False`` simulates the whole program instead (the slow obvious reference)."""
    from oases.schedule.program import SPECS

    costs = _CachedCosts(costs)

    plan.check(cfg, world_size)
    spec = SPECS[plan.schedule]
    k = plan.n_sub if spec.overlapped else 1
    degrees = [r.tp for r in plan.regions]
    kinds = [region_kind(r.name) for r in plan.regions]
    rows = region_rows(plan, world_size, batch, k)
    n = len(degrees)
    act_bytes = [rows[i] * cfg.seq_len * cfg.dim * BYTES for i in range(n)]  # [b, S, H] fp32

    buckets = _dp_buckets(cfg, kinds, degrees, world_size)
    n_micro = batch.n_micro()
    whole = not scaled or n_micro == 1
    program = plan_program(cfg, plan, world_size, batch, max_inflight=max_inflight,
                           n_micro=None if whole else 1)

    def reshard(i: int, backward: bool) -> tuple[int, tuple[int, ...]]:
        """(bytes, rank 0's group) of the all-gather a reshard into region i moves."""
        a, b = degrees[i - 1], degrees[i]
        grows = b > a
        lo, hi = min(a, b), max(a, b)
        if grows == backward:  # the slicing direction moves nothing
            return 0, (0,)
        return act_bytes[i if grows else i - 1], _group_ranks("merge", lo, hi, world_size)

    def priced(op: str, ranks: tuple[int, ...], nbytes: float) -> float:
        if len(ranks) <= 1 or nbytes <= 0:
            return 0.0
        by_ranks = getattr(costs, "collective_ranks_s", None)  # topology-aware costs
        if by_ranks is not None:
            return by_ranks(op, ranks, int(nbytes))
        return costs.collective_s(op, len(ranks), int(nbytes))

    def collective_s(kind: str, index: int) -> float:
        if kind == "dp":
            return sum(priced("all_reduce", _group_ranks("dp", world_size // dp, 0, world_size),
                              numel * BYTES) for dp, numel in buckets[index])
        if kind in ("rsf", "rsb"):
            return priced("all_gather", *reversed(reshard(index, kind == "rsb")))
        return priced("all_reduce", _group_ranks("tp", degrees[index], 0, world_size),
                      act_bytes[index])

    def stream_of(kind: str, index: int) -> Hashable:
        if kind == "dp":  # every DP group's all-reduce crosses the same links: one stream
            return "dp"
        if kind in ("rsf", "rsb"):
            lo, hi = sorted((degrees[index - 1], degrees[index]))
            return _group_ranks("merge", lo, hi, world_size)
        return _group_ranks("tp", degrees[index], 0, world_size)

    commfree = spec.recompute == "commfree"
    overlap_aware = getattr(costs, "measures_overlap", False)

    def piece_s(phase: str, piece: str, i: int) -> float:
        if phase == "recompute" and piece == "body" and commfree:
            piece = "body-commfree"
        if overlap_aware:
            return costs.compute_s(kinds[i], phase, piece, degrees[i], rows[i],
                                   overlapped=spec.overlapped)
        return costs.compute_s(kinds[i], phase, piece, degrees[i], rows[i])

    step = StepCosts(piece_s=functools.cache(piece_s), collective_s=functools.cache(collective_s),
                     stream_of=functools.cache(stream_of))
    sim = simulate_program(program, step, rank=rank, record=timeline)
    if not whole:  # n_micro - 1 micro-batches without DP, then the last one (``program``)
        earlier = plan_program(cfg, plan, world_size, batch, max_inflight=max_inflight,
                               n_micro=1, dp=False)
        sim = _repeat(simulate_program(earlier, step, rank=rank, record=timeline), sim,
                      n_micro, k)
    local_params = sum(region_param_count(cfg, kind, t) for kind, t in zip(kinds, degrees))
    optimizer = getattr(costs, "optimizer_s", None)
    opt_s = optimizer(local_params) if optimizer is not None else 0.0
    mem = _peak_memory(cfg, program, kinds, degrees, rows, spec.recompute, costs, local_params,
                       repeats=1 if whole else n_micro)
    events = sim.timeline
    if opt_s and timeline:
        end = sim.step_s
        events.add(Event(rank, "compute", "optimizer", "optimizer", 0, end, end + opt_s))
    return PlanResult(sim.step_s + opt_s, mem["peak"], events,
                      {"compute_s": sim.compute_busy_s, "comm_s": sim.comm_busy_s,
                       "optimizer_s": opt_s,
                       **{f"exposed_{c}_s": v for c, v in sorted(sim.exposed_s.items())},
                       **{f"{k}_bytes": v for k, v in mem.items()}})


def _repeat(one: SimResult, last: SimResult, n_micro: int, k: int) -> SimResult:
    """``n_micro - 1`` runs of micro-batch ``one`` then ``last``, back to back (each starts
    when the previous one's collectives are all done); sub-batch ids as the whole program
    numbers them (micro-batch m owns m*k .. m*k+k-1; DP all-reduces keep theirs)."""
    t = one.step_s
    timeline = Timeline()
    for m, sim in [(m, one) for m in range(n_micro - 1)] + [(n_micro - 1, last)]:
        for e in sim.timeline.events:
            timeline.add(replace(e, sub=e.sub if e.phase == "dp" else e.sub + m * k,
                                 start_s=e.start_s + m * t, end_s=e.end_s + m * t))
    exposed = {c: (n_micro - 1) * one.exposed_s.get(c, 0.0) + last.exposed_s.get(c, 0.0)
               for c in {*one.exposed_s, *last.exposed_s}}
    return SimResult((n_micro - 1) * t + last.step_s,
                     (n_micro - 1) * one.compute_busy_s + last.compute_busy_s,
                     (n_micro - 1) * one.comm_busy_s + last.comm_busy_s, timeline, exposed)


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


def saved_bytes(costs: Costs, cfg: ModelConfig, kind: str, mode: str, t: int,
                rows: int) -> float:
    """Activations a region keeps forward -> backward: the costs' measurement where they have
    one (a profile), else ``analytic_saved_bytes``."""
    measured = getattr(costs, "saved_bytes", None)
    value = measured(kind, mode, t, rows) if measured is not None else None
    return analytic_saved_bytes(cfg, kind, mode, t, rows) if value is None else value


def _peak_memory(cfg: ModelConfig, program: list[Instr], kinds: list[str], degrees: list[int],
                 rows: list[int], mode: str, costs: Costs, local_params: int,
                 repeats: int = 1) -> dict[str, float]:
    """Walk the program: forward pieces keep their region's activations until its backward
    (task "tp"); a recompute holds the region's full graph until then; gradients appear at the
    first backward of each region and stay; parameters and Adam moments are always there.
    ``repeats``: the program is one micro-batch of that many run back to back (each frees its
    activations; from the second on every gradient is there)."""
    static = local_params * BYTES * (1 + OPTIMIZER_STATES)
    grads = {i: region_param_count(cfg, kinds[i], degrees[i]) * BYTES for i in range(len(kinds))}
    kept = {i: saved_bytes(costs, cfg, kinds[i], mode, degrees[i], rows[i])
            for i in range(len(kinds))}
    graph = {i: saved_bytes(costs, cfg, kinds[i], "none", degrees[i], rows[i])
             for i in range(len(kinds))}
    alive: dict[tuple[int, int], float] = {}
    grads_alive: set[int] = set()
    peak = peak_act = act = grads_now = 0.0
    for ins in program:
        if not isinstance(ins, Compute):
            continue
        for piece, i in ins.pieces:
            if ins.phase == "forward" and piece == "body":
                alive[i, ins.sub] = alive.get((i, ins.sub), 0.0) + kept[i]
                act += kept[i]
            elif ins.phase == "recompute" and piece == "body":
                alive[i, ins.sub] = alive.get((i, ins.sub), 0.0) + graph[i] - kept[i]
                act += graph[i] - kept[i]
            elif ins.phase == "backward" and piece == "tp":
                act -= alive.pop((i, ins.sub), 0.0)
                if i not in grads_alive:
                    grads_alive.add(i)
                    grads_now += grads[i]
        peak = max(peak, static + act + grads_now)
        peak_act = max(peak_act, act)
    total_grads = sum(grads.values())
    if repeats > 1:  # the later micro-batches hold every gradient
        peak = max(peak, static + total_grads + peak_act)
    # the optimizer step: every gradient alive, plus foreach temporaries of about one copy
    opt_peak = static + total_grads + local_params * BYTES
    baseline = float(getattr(costs, "baseline_bytes", 0.0))
    return {"peak": baseline + max(peak, opt_peak), "baseline": baseline,
            "params": local_params * BYTES, "grads": total_grads,
            "optimizer_state": local_params * BYTES * OPTIMIZER_STATES,
            "activations_peak": peak_act}
