"""The compiled walk: ``event_walk.simulate_program``'s arithmetic on a ``Tape``
(``planner.tape``), for the plan search, which walks the same few programs for hundreds of
plans and needs only the times (no timeline). The same floats as the reference walk
(``tests/test_search_exact.py``), without the instruction objects::

    tape op                       walk
    (COMPUTE, key, 0)             now += compute_cost[key], stretched by the flights in flight
    (START, key, slot)            slot begins at max(stream free, now), ends after its cost
    (WAIT, slot, class)           now = max(now, end of slot); the stream's queue re-timed

``event_walk`` owns the reference walk, ``StepCosts`` and ``_stretched`` (the contention
arithmetic both walks share); this module owns the tape's walk: ``walk_tape`` checks its
arguments and runs the machine-code loop (``tape_kernel``) where it is loaded, else this
module's Python loop (``walk_tape_py``), which the kernel mirrors line for line.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from math import inf
from time import perf_counter

import numpy as np

from oases.planner import jit, tape_kernel
from oases.planner.event_walk import SimResult, _stretched
from oases.planner.tape import CLASSES, COMPUTE, START, Tape
from oases.schedule.timeline import Timeline


def walk_tape(
    tape: Tape,
    compute_cost: Sequence[float],
    coll_cost: Sequence[float],
    coll_stream: Sequence[int],
    n_streams: int,
    coll_factor: Sequence[float] | None = None,
) -> SimResult:
    """``simulate_program(program, costs, record=False)`` on the program's ``Tape``: compiled
    (``tape_kernel``) where numba is installed and loaded (``jit.ready``), else
    ``walk_tape_py``; the same floats either way (``tests/test_search_exact.py`` compares
    them)."""
    coll_stream = np.asarray(coll_stream, dtype=np.int64)
    # (the kernel reads no bounds: what it would read past, refused here, for both loops)
    if len(coll_stream) and not 0 <= coll_stream.min() <= coll_stream.max() < n_streams:
        raise ValueError(f"a collective's stream is not one of {n_streams}")
    if coll_factor is not None and len(coll_factor) != len(coll_cost):
        raise ValueError("one compute slowdown per collective key, please")
    compiled = tape_kernel.KERNEL if jit.ready() else None
    if compiled is None:
        started = perf_counter()
        res = walk_tape_py(tape, compute_cost, coll_cost, coll_stream, n_streams, coll_factor)
        jit.walked(perf_counter() - started)
        return res
    ops = tape.memo.get("ops array")
    if ops is None:
        flat = list(chain.from_iterable(tape.ops))  # (flat: numpy reads ints faster than tuples)
        ops = tape.memo["ops array"] = np.array(flat, dtype=np.int64).reshape(-1, 3)
    factor = np.asarray(coll_factor if coll_factor is not None else (), dtype=np.float64)
    now, compute_busy, comm_busy, exposed = compiled(
        ops,
        np.asarray(compute_cost, dtype=np.float64),
        np.asarray(coll_cost, dtype=np.float64),
        coll_stream,
        n_streams,
        factor,
        coll_factor is not None,
        tape.n_slots,
    )
    return SimResult(now, compute_busy, comm_busy, Timeline(), dict(zip(CLASSES, exposed.tolist())))


def walk_tape_py(
    tape: Tape,
    compute_cost: Sequence[float],
    coll_cost: Sequence[float],
    coll_stream: Sequence[int],
    n_streams: int,
    coll_factor: Sequence[float] | None = None,
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
    compute_cost, coll_cost, coll_stream = _lists(compute_cost, coll_cost, coll_stream)
    if coll_factor is not None:
        (coll_factor,) = _lists(coll_factor)
    n = tape.n_slots
    B, E, T, C = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
    stream_of = [0] * n
    done = [False] * n
    queues: list[list[int]] = [[] for _ in range(n_streams)]
    stable = [0] * n_streams
    lo = [0] * n_streams  # per stream: its first flight that may end after now
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
                for s, queue in enumerate(queues):
                    pos, m = lo[s], len(queue)
                    while pos < m and E[queue[pos]] <= now:
                        pos += 1
                    lo[s] = pos
                    if pos < m:
                        g = queue[pos]
                        bg = B[g]
                        if bg > now:
                            if bg < first:
                                first = bg
                        else:
                            if F[g] > factor:
                                factor = F[g]
                            if E[g] < first:
                                first = E[g]
                        flying = True
                if flying:
                    if (first - now) / factor >= cost:
                        cost = now + cost * factor - now
                    else:
                        cost = _stretched_queues(now, cost, queues, lo, B, E, F)
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
            # (the flights before ``lo[s]`` end by now: one ending after now comes later)
            upto = queue.index(a, lo[s]) if end > now else queue.index(a)
            if end > now:  # idle until it is done: its stream's flights re-timed
                start = lo[s]  # (the ones before it: done, skipped as below)
                prev = E[queue[start - 1]] if start else 0.0
                changed, first_stable = False, stable[s]
                for pos in range(start, len(queue)):
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
            if upto < lo[s]:
                lo[s] -= 1
            stable[s] = max(upto + 1, stable[s] - 1)
            comm_busy += end - B[a]
            waited[a] = True
    return SimResult(
        now, compute_busy, comm_busy, Timeline(), {c: exposed[i] for i, c in enumerate(CLASSES)}
    )


def _lists(*values: Sequence) -> list[list]:
    """Arrays as lists (the Python loop reads lists fastest); lists as they are."""
    return [v.tolist() if isinstance(v, np.ndarray) else v for v in values]


def _stretched_queues(
    start: float,
    work: float,
    queues: list[list[int]],
    lo: list[int],
    begins: list[float],
    ends: list[float],
    factors: list[float],
) -> float:
    """``_stretched(start, work, flights)`` for the flights of ``queues`` ending after
    ``start`` (each queue's from position ``lo`` on, the ones before it ending by ``start``),
    without building their list: a queue is chained (a flight begins after the one before
    it ends), so at any time t at most one flight of a queue is in flight (its first ending
    after t, if it has begun), and the next breakpoint after t is the least, over the queues,
    of that flight's begin (not begun) or end (begun). The same breakpoints in the same order
    and the same largest factor at each: the same floats."""
    pos = list(lo)
    t, left = start, work
    while True:
        p, factor = inf, 1.0
        for s, queue in enumerate(queues):
            i, m = pos[s], len(queue)
            while i < m and ends[queue[i]] <= t:
                i += 1
            pos[s] = i
            if i < m:
                g = queue[i]
                if begins[g] <= t:
                    if factors[g] > factor:
                        factor = factors[g]
                    if ends[g] < p:
                        p = ends[g]
                elif begins[g] < p:
                    p = begins[g]
        if p == inf:
            return t + left - start
        span = (p - t) / factor
        if span >= left:
            return t + left * factor - start
        left -= span
        t = p
