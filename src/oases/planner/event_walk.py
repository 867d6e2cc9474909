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
from math import inf

from oases.planner.tape import CLASSES, COMPUTE, START, Tape
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
    raise ValueError(f"program waits for {key}, which no other program's walk sends "
                     "(a pipeline stage's program: walk the stages with pipeline_walk)")


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
            g = 1.0 if costs.comm_slowdown is None or plain else max(
                1.0, costs.comm_slowdown(ins.kind))
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
                timeline.add(Event(rank, "comm", comm_name(ins.kind, ins.index), ins.kind,
                                   ins.sub, begin, arrival))
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


def walk_tape(
    tape: Tape,
    compute_cost: list[float],
    coll_cost: list[float],
    coll_stream: list[int],
    n_streams: int,
    coll_factor: list[float] | None = None,
) -> SimResult:
    """``simulate_program(program, costs, record=False)`` on the program's ``Tape``
    (``planner.tape``), for costs without a collective's slowdown (``comm_slowdown`` None):
    the same arithmetic in the same order, so the same floats, without the objects.
    ``compute_cost[k]``: compute key k's seconds (its pieces summed in order from 0.0);
    ``coll_cost[c]``, ``coll_stream[c]``: collective key c's seconds and stream (0 ..
    ``n_streams`` - 1); ``coll_factor[c]`` (None: all 1.0): how much slower compute runs
    while collective key c is in flight (``StepCosts.slowdown``).

    Contention: a compute is stretched (``_stretched``) by the flights started, not waited,
    of factor above 1 and ending after ``now``, as the reference walk stretches it (the
    stretch reads them as a set: the order does not matter). ``slowing`` holds the flights
    that may still stretch: one that ends by ``now`` never does again (a flight's end moves
    only while it ends after ``now``, and ``now`` only grows), so it is dropped. Most
    computes end before the first breakpoint (a flight's begin or end after ``now``): that
    first span is computed here as ``_stretched`` computes it (the largest factor in flight
    at ``now``, 1.0 if none), and ``_stretched`` called only where the compute goes on.
    Where every collective slows compute (``every_slows``: a preset's one factor), the
    flights in flight are the queues' own, and a stream's queue is chained (each flight
    begins after the one before ends: ends never decrease along it), so its first flight
    ending after ``now`` gives the stream's first breakpoint and its factor at ``now``; the
    rest of the queue is not read.

    A flight is a slot: its begin ``B``, end ``E``, issue time ``T`` and cost ``C``; ``done``
    marks a zero-cost one (done at once). Without contention every factor is 1.0, which the
    reference multiplies and divides by: ``x * 1.0`` and ``x / 1.0`` are ``x``, so they are
    left out.

    Waiting for a flight re-times every flight queued on its stream (``idle_until_done``): the
    ones up to it settle, the later ones are re-chained (``begin = max(previous end,
    issued)``). A stream of n flights waited one by one would cost n^2 / 2 steps (the DP
    all-reduces of every region waited at the end, ZeRO's gathers of every region at the
    head), so the re-chaining stops where it cannot change anything: at a flight whose
    predecessor's end did not change in this wait and from which on every flight is done
    (``end <= now``: never re-timed again) or already chained to its predecessor (what the
    re-chaining would compute, it holds). ``stable[s]``: the first position of stream s's
    queue from which that holds; a flight appended is chained to the last, a wait leaves
    every flight after the awaited one chained, and removing the awaited one unchains only
    its successor."""
    n = tape.n_slots
    B, E, T, C = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
    stream_of = [0] * n
    done = [False] * n
    queues: list[list[int]] = [[] for _ in range(n_streams)]
    stable = [0] * n_streams
    exposed = [0.0, 0.0, 0.0]
    now = compute_busy = comm_busy = 0.0
    compute_op, start_op = COMPUTE, START  # (locals: the loop's hottest names)
    F = [1.0] * n  # a flight's factor on compute
    waited = [False] * n
    slowing: list[int] = []  # flights of factor above 1 that may still stretch compute
    every_slows = coll_factor is not None and min(coll_factor, default=1.0) > 1.0
    for op, a, b in tape.ops:
        if op == compute_op:
            cost = compute_cost[a]
            if every_slows:  # each stream's first flight ending after now, as below
                first, factor, flying = inf, 1.0, False
                for queue in queues:
                    for g in queue:
                        eg = E[g]
                        if eg <= now:
                            continue
                        bg = B[g]
                        if bg > now:
                            first = min(first, bg)
                        else:
                            if F[g] > factor:
                                factor = F[g]
                            first = min(first, eg)
                        flying = True
                        break
                if flying:
                    if (first - now) / factor >= cost:
                        cost = now + cost * factor - now
                    else:
                        cost = _stretched(now, cost, [(B[g], E[g], F[g]) for queue in queues
                                                      for g in queue if E[g] > now])
            elif slowing:
                slowing = [g for g in slowing if not waited[g] and E[g] > now]
                if slowing:  # ``_stretched``'s first span here; the rest where it goes on
                    first, factor = inf, 1.0
                    for g in slowing:
                        bg, eg = B[g], E[g]
                        if bg > now:
                            if bg < first:
                                first = bg
                        elif F[g] > factor:
                            factor = F[g]
                        if eg < first:
                            first = eg
                    if (first - now) / factor >= cost:
                        cost = now + cost * factor - now
                    else:
                        cost = _stretched(now, cost, [(B[g], E[g], F[g]) for g in slowing])
            now += cost
            compute_busy += cost
        elif op == start_op:
            cost = coll_cost[a]
            if cost <= 0:  # nothing moves: done at once
                done[b] = True
                continue
            s = coll_stream[a]
            queue = queues[s]
            begin = now
            if queue:
                last = E[queue[-1]]
                if last > now:
                    begin = last
            B[b], E[b], T[b], C[b] = begin, begin + cost, now, cost
            stream_of[b] = s
            queue.append(b)
            if coll_factor is not None and coll_factor[a] > 1.0:
                F[b] = coll_factor[a]
                if not every_slows:
                    slowing.append(b)
        else:
            if done[a]:
                done[a] = False
                continue
            end = E[a]
            s = stream_of[a]
            queue = queues[s]
            upto = queue.index(a)
            if end > now:  # idle until it is done: its stream's flights re-timed
                prev, changed, first_stable = 0.0, False, stable[s]
                for pos in range(len(queue)):
                    g = queue[pos]
                    e = E[g]
                    if pos > upto and not changed and pos >= first_stable:
                        break  # from here on nothing changes
                    if e <= now:
                        prev, changed = e, False
                        continue
                    if pos <= upto:
                        if B[g] < now:
                            new = now + (e - now)
                        else:
                            bg = max(prev, T[g], now)
                            B[g] = bg
                            new = bg + C[g]
                    else:
                        bg = max(prev, T[g])
                        B[g] = bg
                        new = bg + C[g]
                    changed = new != e
                    E[g] = prev = new
                end = E[a]
                exposed[b] += end - now
                now = end
                stable[s] = upto + 1
            del queue[upto]
            stable[s] = max(upto + 1, stable[s] - 1)
            comm_busy += end - B[a]
            waited[a] = True
    return SimResult(now, compute_busy, comm_busy, Timeline(),
                     {c: exposed[i] for i, c in enumerate(CLASSES)})
