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
from oases.planner.costs import Costs, region_kind, region_param_count, sp_mode, sp_piece
from oases.planner.peak_memory import ModelState, peak_memory
from oases.planner.precision import precision_of
from oases.schedule.program import (
    Compute,
    Instr,
    Piece,
    Start,
    Wait,
    ZeroLayout,
    comm_name,
    deferred_regions,
    label,
)
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
    ``slowdown(kind)``, when given: how much slower compute runs while a collective of that kind
    is in flight (>= 1; CPU ranks share their cores with the communication threads). A compute
    then advances at 1 / (the largest factor of the collectives in flight) of its rate::

        compute  [====== c ======]          alone: c seconds
        comm        [== ar ==]              ar in flight, factor f:
        compute  [==|==========|====]       c + (f - 1) x the overlap (up to the stretch)

    ``comm_slowdown(kind)``, when given: how much slower a collective of that kind runs while
    the compute stream computes (>= 1; the same cores again), as ``simulate_program`` applies
    it.
    """

    piece_s: Callable[[str, str, int], float]
    collective_s: Callable[[str, int], float]
    recompute_body_s: Callable[[int], float] | None = None
    compute_s: Callable[[Compute], float] | None = None
    stream_of: Callable[[str, int], Hashable] | None = None  # default: "tp" or "dp"
    slowdown: Callable[[str], float] | None = None  # compute slowed by a collective in flight
    comm_slowdown: Callable[[str], float] | None = None  # a collective slowed by compute


# the collective each program kind runs (what a profile measures its contention by)
# (under sequence parallelism "fwd" and "bwd" are reduce-scatters: ``collective_op``)
COLLECTIVE_OP = {"fwd": "all_reduce", "bwd": "all_reduce", "dp": "all_reduce",
                 "rs": "reduce_scatter", "ag": "all_gather", "rsf": "all_gather",
                 "rsb": "all_gather", "gf": "all_gather", "gb": "all_gather",
                 "gr": "all_gather", "sg": "all_reduce"}
# what a collective kind is, in a step's breakdown: TP all-reduces, reshards, DP all-reduces
COMM_CLASS = {"fwd": "tp", "bwd": "tp", "rsf": "reshard", "rsb": "reshard", "dp": "dp",
              "rs": "dp", "ag": "dp", "gf": "tp", "gb": "tp", "gr": "tp", "sg": "tp"}


def collective_op(kind: str, sp: bool) -> str:
    """The collective a program kind runs: ``COLLECTIVE_OP``, but "fwd"/"bwd" reduce-scatter
    under sequence parallelism."""
    return "reduce_scatter" if sp and kind in ("fwd", "bwd") else COLLECTIVE_OP[kind]


def glue_param_count(cfg: ModelConfig) -> int:
    """Parameters of the glue and norms (each norm, the biases added after the row-parallel
    matmuls): what sequence parallelism's "sg" sums over the TP group. Not GPT-2's positions:
    every rank computes their whole gradient from the gathered embedding gradient."""
    norm = 2 * cfg.dim if cfg.arch == "gpt2" else cfg.dim
    n = (2 * cfg.n_layers + 1) * norm
    if cfg.arch == "gpt2":
        n += 2 * cfg.n_layers * cfg.dim
    return n


@dataclass(frozen=True)
class SimResult:
    """``step_s = compute_busy_s + sum(exposed_s.values())``: the compute stream is either
    computing or waiting at a ``Wait`` for a collective of one class (``COMM_CLASS``)."""

    step_s: float
    compute_busy_s: float
    comm_busy_s: float
    timeline: Timeline
    exposed_s: dict[str, float] = field(default_factory=dict)


@dataclass
class _Flight:
    """A collective in flight on a communication stream: ``cost_s`` alone; begins when its
    stream is free and its Start has come (``issued_s``)."""

    key: tuple[str, int, int]
    stream: Hashable
    issued_s: float
    cost_s: float
    begin_s: float
    end_s: float
    comm_factor: float  # how much slower it runs while the compute stream computes
    compute_factor: float  # how much slower compute runs while it is in flight


def simulate_program(program: list[Instr], costs: StepCosts, *, commfree: bool = False,
                     rank: int = 0, record: bool = True) -> SimResult:
    """Predict one step of ``program``. ``commfree``: recomputed bodies skip their last matmul
    (as the executor does for communication-free recomputation). ``record=False`` leaves the
    timeline empty (the planner's search needs only the times). The result says how long the
    compute stream waited on each class of collective (``exposed_s``: "tp", "reshard", "dp").

    Contention (``StepCosts.slowdown``, ``comm_slowdown``): a collective is priced as running
    beside compute (``cost x comm factor``) from its Start; when the compute stream waits for
    it, the compute stream is idle, so the collectives of that stream up to the awaited one
    finish at their full rate from then on (a collective issued and waited at once takes its
    own time). Collectives on other streams are priced as if compute ran beside them
    throughout."""
    timeline = Timeline()
    now = 0.0
    exposed = dict.fromkeys(("tp", "reshard", "dp"), 0.0)
    queues: dict[Hashable, list[_Flight]] = {}  # per stream, in issue order, not yet waited
    flights: dict[tuple[str, int, int], _Flight] = {}
    done_at: dict[tuple[str, int, int], float] = {}  # zero-cost collectives: done at once
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

    def idle_until_done(fl: _Flight) -> None:
        """The compute stream waits from ``now`` for ``fl``: its stream's collectives up to
        ``fl`` run at their full rate from now on; the later ones again beside compute."""
        queue = queues[fl.stream]
        upto = queue.index(fl)
        prev_end = 0.0
        for i, g in enumerate(queue):
            if g.end_s <= now:
                prev_end = g.end_s
                continue
            if i <= upto:  # beside an idle compute stream from now on
                if g.begin_s < now:  # part of it ran beside compute already
                    g.end_s = now + (g.end_s - now) / g.comm_factor
                else:
                    g.begin_s = max(prev_end, g.issued_s, now)
                    g.end_s = g.begin_s + g.cost_s
            else:  # the compute stream runs again once ``fl`` is done
                g.begin_s = max(prev_end, g.issued_s)
                g.end_s = g.begin_s + g.cost_s * g.comm_factor
            prev_end = g.end_s

    for ins in program:
        if isinstance(ins, Compute):
            if costs.compute_s is not None:
                cost = costs.compute_s(ins)
            else:
                key = (ins.phase, ins.pieces)
                cost = priced.get(key)
                if cost is None:
                    cost = priced[key] = pieces_s(ins.phase, ins.pieces)
            slowing = [(f.begin_s, f.end_s, f.compute_factor) for f in flights.values()
                       if f.compute_factor > 1.0 and f.end_s > now]
            cost = _stretched(now, cost, slowing) if slowing else cost
            if record:
                timeline.add(Event(rank, "compute", label(ins), ins.phase, ins.sub, now,
                                   now + cost))
            now += cost
            compute_busy += cost
        elif isinstance(ins, Start):
            stream = (("dp" if ins.kind in ("dp", "rs", "ag") else "tp")
                      if costs.stream_of is None
                      else costs.stream_of(ins.kind, ins.index))
            cost = costs.collective_s(ins.kind, ins.index)
            key = (ins.kind, ins.index, ins.sub)
            if cost <= 0:  # nothing moves (a reshard's slicing direction): done at once
                done_at[key] = now
                continue
            queue = queues.setdefault(stream, [])
            begin = max([now, *(f.end_s for f in queue[-1:])])
            g = 1.0 if costs.comm_slowdown is None else max(1.0, costs.comm_slowdown(ins.kind))
            f = 1.0 if costs.slowdown is None else costs.slowdown(ins.kind)
            fl = _Flight(key, stream, now, cost, begin, begin + cost * g, g, f)
            queue.append(fl)
            flights[key] = fl
        elif isinstance(ins, Wait):
            key = (ins.kind, ins.index, ins.sub)
            if key in done_at:
                done_at.pop(key)
                continue
            fl = flights.pop(key)
            if fl.end_s > now:
                idle_until_done(fl)
                exposed[COMM_CLASS[ins.kind]] += fl.end_s - now
                now = fl.end_s
            queues[fl.stream].remove(fl)
            comm_busy += fl.end_s - fl.begin_s
            if record:
                timeline.add(Event(rank, "comm", comm_name(ins.kind, ins.index), ins.kind,
                                   ins.sub, fl.begin_s, fl.end_s))
    if flights or done_at:
        raise ValueError(f"program leaves collectives unwaited: {sorted([*flights, *done_at])}")
    return SimResult(now, compute_busy, comm_busy, timeline, exposed)


def _stretched(start: float, work: float, flights: list[tuple[float, float, float]]) -> float:
    """How long ``work`` seconds of compute take from ``start`` while ``flights`` (begin, end,
    factor) run: between breakpoints the rate is 1 / the largest factor in flight."""
    points = sorted({p for b, e, _ in flights for p in (b, e) if p > start})
    t, left = start, work
    for p in points:
        factor = max((f for b, e, f in flights if b <= t < e), default=1.0)
        span = (p - t) / factor
        if span >= left:
            return t + left * factor - start
        left -= span
        t = p
    return t + left - start


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
                "DP comm": b.get("exposed_dp_s", 0.0),
                "reshard": b.get("exposed_reshard_s", 0.0),
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


def _dp_buckets(cfg: ModelConfig, kinds: list[str], degrees: list[int], world_size: int,
                stages: tuple[int, ...] | None = None) -> dict[int, list[tuple[int, int]]]:
    """{backward task: [(dp degree, parameters)]}, as ``schedule.regions.dp_buckets`` groups
    them: task i finalizes region i's own parameters and region i+1's norm (a tied head's
    weight is the embedding's, final at task 0). Regions sharded by ZeRO (``stages`` >= 1)
    reduce-scatter their own parameters instead ("rs"). Empty when no region is
    data-parallel."""
    if all(t == world_size for t in degrees):
        return {}
    stages = stages or (0,) * len(kinds)
    norm = 2 * cfg.dim if cfg.arch == "gpt2" else cfg.dim
    buckets: dict[int, list[tuple[int, int]]] = {}
    for i, (kind, t) in enumerate(zip(kinds, degrees)):
        own = region_param_count(cfg, kind, t) - (norm if kind != "embed" else 0)
        parts = {world_size // t: 0 if stages[i] else own}  # one all-reduce per DP group
        if i + 1 < len(kinds) and not stages[i + 1]:
            dp = world_size // degrees[i + 1]
            parts[dp] = parts.get(dp, 0) + norm
        if any(parts.values()):
            buckets[i] = [(dp, numel) for dp, numel in parts.items() if numel]
    return buckets


def dp_bucket_bytes(buckets: dict[int, list[tuple[int, int]]],
                    element_bytes: float = 4) -> dict[int, float]:
    """{backward task: bytes of its flat gradient copy} (``comm.gradient_mean_async``
    concatenates a bucket's gradients over each DP group into one buffer, in the dtype it
    reduces in, ``element_bytes`` an element, that lives from the bucket's Start to its Wait);
    a DP group of one rank copies nothing."""
    return {t: float(sum(numel for dp, numel in parts if dp > 1) * element_bytes)
            for t, parts in buckets.items()}


def zero_layout(cfg: ModelConfig, stages: tuple[int, ...],
                reshard_after_forward: bool = True, *, gather_updated: bool = True,
                ends_step: bool = True) -> ZeroLayout | None:
    """The program's view of a plan's ZeRO stages (as ``executor._zero_layout`` derives it
    from a sharded model): region i's TP pieces read region i's parameters, and a tied head
    also the embedding's, when the embedding is sharded. None when nothing is sharded.
    ``gather_updated``, ``ends_step``: ``ZeroLayout``'s knobs for one micro-batch of many."""
    if not any(stages):
        return None
    return ZeroLayout(tuple(stages), region_uses(cfg, len(stages), tied=bool(stages[0])),
                      reshard_after_forward, gather_updated, ends_step)


def region_uses(cfg: ModelConfig, n: int, tied: bool = True) -> tuple[tuple[int, ...], ...]:
    """Per region i of n, the regions whose parameters its TP pieces read and make gradients
    for: its own, and for a head tied to the embedding (``tied``) also region 0's."""
    uses = [(i,) for i in range(n)]
    if tied and cfg.tie_embeddings:
        uses[-1] = (0, n - 1)
    return tuple(uses)


def plan_sp(plan: ParallelPlan) -> str | None:
    """The sequence parallelism a plan is simulated with (``ParallelPlan.sp``): none where
    every region has degree 1 (megatron-sp at tp=1 runs megatron's program: nothing to
    slice)."""
    return plan.sp() if max(r.tp for r in plan.regions) > 1 else None


def model_state(cfg: ModelConfig, plan: ParallelPlan, world_size: int) -> ModelState:
    """Every region's own parameter count, DP degree and ZeRO stage under ``plan``."""
    return ModelState(tuple(region_param_count(cfg, region_kind(r.name), r.tp)
                            for r in plan.regions),
                      tuple(world_size // r.tp for r in plan.regions), plan.zero_stages())


def plan_program(cfg: ModelConfig, plan: ParallelPlan, world_size: int, batch: BatchShape,
                 *, max_inflight: int = 1, n_micro: int | None = None,
                 dp: bool = True, first: bool = True,
                 reshard_after_forward: bool = True) -> list[Instr]:
    """The instruction list one rank runs for a step of ``plan``: the executor's very program
    (``Schedule.program`` builds the same from a parallelized model), ZeRO's instructions
    included where the plan's regions carry a stage. ``n_micro``: build only that many
    micro-batches (default: the batch's); ``dp=False``: a micro-batch that is not the last
    (without the data-parallel gradient all-reduces, and stage 1's reduce-scatters, which come
    only in the last); ``first=False``: one that is not the first (without the stages 1-2
    gathers of the updated weights, which come at the step's head)."""
    from oases.schedule.program import build_program

    degrees = tuple(r.tp for r in plan.regions)
    kinds = [region_kind(r.name) for r in plan.regions]
    stages = plan.zero_stages()
    buckets = _dp_buckets(cfg, kinds, list(degrees), world_size, stages) if dp else {}
    return build_program(plan.schedule, len(degrees), plan.n_sub,
                         n_micro=batch.n_micro() if n_micro is None else n_micro,
                         max_inflight=max_inflight, dp_tasks=tuple(sorted(buckets)),
                         degrees=None if len(set(degrees)) == 1 else degrees,
                         zero=zero_layout(cfg, stages, reshard_after_forward,
                                          gather_updated=first, ends_step=dp),
                         sp=plan_sp(plan))


def simulate_plan(cfg: ModelConfig, plan: ParallelPlan, costs: Costs, world_size: int,
                  batch: BatchShape, *, max_inflight: int = 1, rank: int = 0,
                  timeline: bool = True, scaled: bool = True,
                  reshard_after_forward: bool = True) -> PlanResult:
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

    Bytes by dtype (``planner.precision``, the costs' ``precision``): TP all-reduces and
    reshards move activations in the compute dtype, DP all-reduces and ZeRO's reduce-scatters
    gradients in ``grad_reduce``, ZeRO's all-gathers master weights."""
    from oases.schedule.program import SPECS

    costs = _CachedCosts(costs)

    plan.check(cfg, world_size)
    spec = SPECS[plan.schedule]
    k = plan.n_sub if spec.overlapped else 1
    degrees = [r.tp for r in plan.regions]
    kinds = [region_kind(r.name) for r in plan.regions]
    rows = region_rows(plan, world_size, batch, k)
    n = len(degrees)
    prec = precision_of(costs)
    # [b, S, H] in the compute dtype
    act_bytes = [rows[i] * cfg.seq_len * cfg.dim * prec.activation_bytes for i in range(n)]

    stages = plan.zero_stages()
    state = model_state(cfg, plan, world_size)
    buckets = _dp_buckets(cfg, kinds, degrees, world_size, stages)
    n_micro = batch.n_micro()
    whole = not scaled or n_micro == 1
    program = plan_program(cfg, plan, world_size, batch, max_inflight=max_inflight,
                           n_micro=None if whole else 1, first=whole,
                           reshard_after_forward=reshard_after_forward)

    deferring = deferred_regions(program)

    def reshard(i: int, backward: bool) -> tuple[int, tuple[int, ...]]:
        """(bytes, rank 0's group) of the all-gather a reshard into region i moves. Under
        sequence parallelism both directions gather over the larger degree's TP group (its
        whole [rows, S, H]: ``comm.reshard_seq_async``)."""
        a, b = degrees[i - 1], degrees[i]
        grows = b > a
        lo, hi = min(a, b), max(a, b)
        if sp:
            return act_bytes[i if grows else i - 1], _group_ranks("tp", hi, 0, world_size)
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

    sp = plan_sp(plan)

    def collective_s(kind: str, index: int) -> float:
        if kind in ("gf", "gb", "gr"):  # sequence parallelism: [b, S, H] gathered
            return priced("all_gather", _group_ranks("tp", degrees[index], 0, world_size),
                          act_bytes[index])
        if kind == "sg":
            return priced("all_reduce", _group_ranks("tp", degrees[0], 0, world_size),
                          glue_param_count(cfg) * prec.master_bytes)  # fp32 gradients
        if sp and kind in ("fwd", "bwd"):
            return priced("reduce_scatter", _group_ranks("tp", degrees[index], 0, world_size),
                          act_bytes[index])
        if kind == "dp":
            return sum(priced("all_reduce", _group_ranks("dp", world_size // dp, 0, world_size),
                              numel * prec.grad_reduce_bytes) for dp, numel in buckets[index])
        if kind in ("rsf", "rsb"):
            return priced("all_gather", *reversed(reshard(index, kind == "rsb")))
        if kind in ("rs", "ag"):  # ZeRO: region index's padded flat buffer over its DP group
            return priced("reduce_scatter" if kind == "rs" else "all_gather",
                          _group_ranks("dp", degrees[index], 0, world_size),
                          state.padded(index) * (prec.grad_reduce_bytes if kind == "rs"
                                                 else prec.master_bytes))
        return priced("all_reduce", _group_ranks("tp", degrees[index], 0, world_size),
                      act_bytes[index])

    def stream_of(kind: str, index: int) -> Hashable:
        if kind in ("dp", "rs", "ag"):  # every DP group's traffic crosses the same links
            return "dp"
        if kind in ("rsf", "rsb"):
            lo, hi = sorted((degrees[index - 1], degrees[index]))
            return (_group_ranks("tp", hi, 0, world_size) if sp
                    else _group_ranks("merge", lo, hi, world_size))
        return _group_ranks("tp", degrees[index], 0, world_size)

    commfree = spec.recompute == "commfree"
    overlap_aware = getattr(costs, "measures_overlap", False)

    def piece_s(phase: str, piece: str, i: int) -> float:
        """A piece as the profile timed it beside collectives like its own: an overlapped
        schedule cut into one sub-batch overlaps no TP collective, and runs the synchronous
        one's program (its pieces timed at these very rows). Sequence parallelism's pieces are
        the costs' "sp-" ones (a recompute of a norm or glue is priced as its forward)."""
        if phase == "recompute" and piece == "body" and commfree:
            piece = "body-commfree"
        if piece == "dw" and degrees[i] == 1:  # a degree-1 region's "tp" is priced whole
            return 0.0
        if sp and degrees[i] == 1 and piece in ("norm", "core") and phase != "backward":
            if piece == "norm":  # a degree-1 region's slice is the whole sequence: its norm
                return 0.0  # and core are the body (priced whole with the core)
            piece = "body-commfree" if phase == "recompute" and commfree else "body"
        elif sp and degrees[i] > 1:
            piece = sp_piece(piece, phase, i, commfree, i in deferring)
            if phase == "recompute" and piece in ("sp-norm", "sp-epi", "sp-core"):
                phase = "forward"
        if overlap_aware:
            return costs.compute_s(kinds[i], phase, piece, degrees[i], rows[i],
                                   overlapped=k > 1)
        return costs.compute_s(kinds[i], phase, piece, degrees[i], rows[i])

    contention = getattr(costs, "contention", None)  # a profile's measured slowdowns
    slowdown = None if contention is None else functools.cache(
        lambda kind: contention(collective_op(kind, bool(sp))))
    comm_contention = getattr(costs, "comm_contention", None)
    comm_slowdown = None if comm_contention is None else functools.cache(
        lambda kind: comm_contention(collective_op(kind, bool(sp))))
    step = StepCosts(piece_s=functools.cache(piece_s), collective_s=functools.cache(collective_s),
                     stream_of=functools.cache(stream_of), slowdown=slowdown,
                     comm_slowdown=comm_slowdown)
    sim = simulate_program(program, step, rank=rank, record=timeline)
    if not whole:  # the first micro-batch, n_micro - 2 without DP, the last (``program``)
        def one(first: bool) -> SimResult:
            micro = plan_program(cfg, plan, world_size, batch, max_inflight=max_inflight,
                                 n_micro=1, dp=False, first=first,
                                 reshard_after_forward=reshard_after_forward)
            return simulate_program(micro, step, rank=rank, record=timeline)

        middle = one(first=False)
        head = one(first=True) if any(z in (1, 2) for z in stages) else middle
        sim = _repeat(head, middle, sim, n_micro, k)
    optimizer = getattr(costs, "optimizer_s", None)
    n = len(degrees)
    opt_s = optimizer(sum(state.updated(i) for i in range(n))) if optimizer is not None else 0.0
    mem = peak_memory(cfg, program, kinds, degrees, rows, sp_mode(spec.recompute, sp), costs,
                      state, region_uses(cfg, n), dp_bucket_bytes(buckets, prec.grad_reduce_bytes),
                      repeats=1 if whole else n_micro, graph_mode=sp_mode("none", sp))
    events = sim.timeline
    if timeline:
        end = sim.step_s
        if opt_s:
            events.add(Event(rank, "compute", "optimizer", "optimizer", 0, end, end + opt_s))
    return PlanResult(sim.step_s + opt_s, mem["peak"], events,
                      {"compute_s": sim.compute_busy_s, "comm_s": sim.comm_busy_s,
                       "optimizer_s": opt_s,
                       **{f"exposed_{c}_s": v for c, v in sorted(sim.exposed_s.items())},
                       **{f"{k}_bytes": v for k, v in mem.items()}})


def _repeat(first: SimResult, one: SimResult, last: SimResult, n_micro: int, k: int
            ) -> SimResult:
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
    exposed = {c: sum(sim.exposed_s.get(c, 0.0) for sim in runs)
               for c in {c for sim in runs for c in sim.exposed_s}}
    return SimResult(t0, sum(sim.compute_busy_s for sim in runs),
                     sum(sim.comm_busy_s for sim in runs), timeline, exposed)


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
