"""The discrete-event walk of one rank's program on costs: the simulator's engine.

``simulate_program`` walks the instruction list the executor runs (``schedule.program``), with
one compute stream and one communication stream per group of ranks (``StepCosts.stream_of``; by
default one for TP collectives and one for data-parallel gradient all-reduces)::

    Compute(c)   compute stream:  start = now;  now += cost(c)
    Start(k)     comm stream:     begins at max(stream free, now); ends after cost(k)
                                  (a zero-cost one, a reshard's slicing direction, is done at once)
    Wait(k)      compute stream:  now = max(now, end of k)

Pipeline stages (``planner.pipeline_walk`` walks every stage's program with ``walk_program``,
side by side): a send ("sf", "sb") is a collective on the sender's "p2p" stream that takes the
transfer; a receive's Start ("rf", "rb") moves nothing on the receiving side, and its Wait waits
until the matching send (same boundary and sub-batch) has arrived (its begin + transfer): the
walk yields until another stage's walk has started that send. The time a stage waits there is
its pipeline bubble (class "pp").

and returns a ``SimResult``: the step time, how long the compute stream computed and waited on
each class of collective (``COMM_CLASS``), and (``record``) a ``Timeline`` in the executor's
format. Contention (``StepCosts.slowdown``, ``comm_slowdown``) stretches a compute that runs
beside a collective in flight (``_stretched``) and a collective that runs beside compute.

What a plan's instructions cost is not this module's business: ``StepCosts`` is a set of
callables (``planner.plan_costs.plan_step_costs`` builds them for a plan; ``bench.runner``
prices a measured run's own).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Hashable
from dataclasses import dataclass, field

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
COLLECTIVE_OP = {
    "fwd": "all_reduce",
    "bwd": "all_reduce",
    "dp": "all_reduce",
    "rs": "reduce_scatter",
    "ag": "all_gather",
    "rsf": "all_gather",
    "rsb": "all_gather",
    "gf": "all_gather",
    "gb": "all_gather",
    "gr": "all_gather",
    "gh": "all_gather",
    "sg": "all_reduce",
    "tie": "all_reduce",
}
# what a collective kind is, in a step's breakdown: TP all-reduces, reshards, DP all-reduces
COMM_CLASS = {
    "fwd": "tp",
    "bwd": "tp",
    "rsf": "reshard",
    "rsb": "reshard",
    "dp": "dp",
    "rs": "dp",
    "ag": "dp",
    "gf": "tp",
    "gb": "tp",
    "gr": "tp",
    "gh": "tp",
    "sg": "tp",
    "tie": "dp",
    "sf": "pp",
    "sb": "pp",
    "rf": "pp",
    "rb": "pp",
}
RECEIVES = {"rf": "sf", "rb": "sb"}  # a receive's kind -> its matching send's
SENDS = frozenset(RECEIVES.values())


def collective_op(kind: str, sp: bool) -> str:
    """The collective a program kind runs: ``COLLECTIVE_OP``, but "fwd"/"bwd" reduce-scatter
    under sequence parallelism."""
    return "reduce_scatter" if sp and kind in ("fwd", "bwd") else COLLECTIVE_OP[kind]


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


def simulate_program(
    program: list[Instr],
    costs: StepCosts,
    *,
    commfree: bool = False,
    rank: int = 0,
    record: bool = True,
) -> SimResult:
    """Predict one step of ``program`` (``walk_program`` to its end: a program of one pipeline
    stage waits for the sends of others, ``pipeline_walk``). ``commfree``: recomputed bodies
    skip their last matmul (as the executor does for communication-free recomputation).
    ``record=False`` leaves the timeline empty (the planner's search needs only the times). The
    result says how long the compute stream waited on each class of collective (``exposed_s``:
    "tp", "reshard", "dp"; "pp" a pipeline stage's point-to-point).

    Contention (``StepCosts.slowdown``, ``comm_slowdown``): a collective is priced as running
    beside compute (``cost x comm factor``) from its Start; when the compute stream waits for
    it, the compute stream is idle, so the collectives of that stream up to the awaited one
    finish at their full rate from then on (a collective issued and waited at once takes its
    own time). Collectives on other streams are priced as if compute ran beside them
    throughout."""
    walk = walk_program(program, costs, commfree=commfree, rank=rank, record=record, sent={})
    try:
        key = next(walk)
    except StopIteration as done:
        return done.value
    raise ValueError(
        f"program waits for {key}, which no other program's walk sends "
        "(a pipeline stage's program: walk the stages with pipeline_walk)"
    )


def walk_program(
    program: list[Instr],
    costs: StepCosts,
    *,
    commfree: bool,
    rank: int,
    record: bool,
    sent: dict[tuple[str, int, int], tuple[float, float]],
) -> Generator[tuple[str, int, int], None, SimResult]:
    """``simulate_program``'s walk, as a generator: at the Wait of a receive whose send
    (``sent``: (kind, index, sub) -> (begin, arrival), shared by the stages' walks) is not
    there yet, it yields that send's key and goes on once it is; a send's Start puts its own
    key there. Returns the ``SimResult``."""
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
            if (
                phase == "recompute"
                and kind == "body"
                and commfree
                and costs.recompute_body_s is not None
            ):
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
            slowing = [
                (f.begin_s, f.end_s, f.compute_factor)
                for f in flights.values()
                if f.compute_factor > 1.0 and f.end_s > now
            ]
            cost = _stretched(now, cost, slowing) if slowing else cost
            if record:
                timeline.add(
                    Event(rank, "compute", label(ins), ins.phase, ins.sub, now, now + cost)
                )
            now += cost
            compute_busy += cost
        elif isinstance(ins, Start):
            if ins.kind in RECEIVES:  # posted: nothing moves on this side until the send
                continue
            stream = (
                ("dp" if ins.kind in ("dp", "rs", "ag") else "tp")
                if costs.stream_of is None
                else costs.stream_of(ins.kind, ins.index)
            )
            cost = costs.collective_s(ins.kind, ins.index)
            key = (ins.kind, ins.index, ins.sub)
            if cost <= 0:  # nothing moves (a reshard's slicing direction): done at once
                done_at[key] = now
                if ins.kind in SENDS:
                    sent[key] = (now, now)
                continue
            queue = queues.setdefault(stream, [])
            begin = max([now, *(f.end_s for f in queue[-1:])])
            plain = ins.kind in SENDS  # a send's link is not the cores' (no contention)
            g = (
                1.0
                if costs.comm_slowdown is None or plain
                else max(1.0, costs.comm_slowdown(ins.kind))
            )
            f = 1.0 if costs.slowdown is None or plain else costs.slowdown(ins.kind)
            fl = _Flight(key, stream, now, cost, begin, begin + cost * g, g, f)
            queue.append(fl)
            flights[key] = fl
            if plain:  # (alone on its stream at factor 1: its times never change)
                sent[key] = (fl.begin_s, fl.end_s)
        elif isinstance(ins, Wait) and ins.kind in RECEIVES:
            key = (RECEIVES[ins.kind], ins.index, ins.sub)
            while key not in sent:
                yield key
            begin, arrival = sent.pop(key)
            if arrival > now:
                exposed["pp"] = exposed.get("pp", 0.0) + arrival - now
                now = arrival
            if record and arrival > begin:
                timeline.add(
                    Event(
                        rank,
                        "comm",
                        comm_name(ins.kind, ins.index),
                        ins.kind,
                        ins.sub,
                        begin,
                        arrival,
                    )
                )
        elif isinstance(ins, Wait):
            key = (ins.kind, ins.index, ins.sub)
            if key in done_at:
                done_at.pop(key)
                continue
            fl = flights.pop(key)
            if fl.end_s > now:
                idle_until_done(fl)
                cls = COMM_CLASS[ins.kind]
                exposed[cls] = exposed.get(cls, 0.0) + fl.end_s - now
                now = fl.end_s
            queues[fl.stream].remove(fl)
            comm_busy += fl.end_s - fl.begin_s
            if record:
                timeline.add(
                    Event(
                        rank,
                        "comm",
                        comm_name(ins.kind, ins.index),
                        ins.kind,
                        ins.sub,
                        fl.begin_s,
                        fl.end_s,
                    )
                )
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
