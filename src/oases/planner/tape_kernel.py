"""``tape_walk.walk_tape``'s loop compiled to machine code (numba), for the plan search: the
same arithmetic on arrays instead of Python lists, so the same floats, about 8 times faster
with its calls (``benchmarks/2026-12-04-search``, round 13).

Loaded with the planner's other compiled loops (``planner.jit``: numba is optional, loaded
only where it pays); where it is not, ``KERNEL`` stays None and ``walk_tape`` runs its Python
loop, to the same numbers (the tests compare both, float for float).

The state, as in ``walk_tape`` (its docstring explains the walk)::

    B, E, T, C, F   per slot: begin, end, issue time, cost, factor on compute
    queues[s, :qlen[s]]   stream s's flights in order (a Python list there)
    lo[s], stable[s]      the first flight that may end after now; the first chained one
    slowing[:n_slowing]   flights of factor above 1 that may still stretch compute

Why the floats are the same: every expression is the Python one, in the same order, on IEEE
doubles, and numba compiles it without fast-math (no reassociation, no fused multiply-add).
"""

from __future__ import annotations

from collections.abc import Callable
from math import inf

import numpy as np


def _stretched_queues(
    start: float,
    work: float,
    queues: np.ndarray,
    qlen: np.ndarray,
    lo: np.ndarray,
    begins: np.ndarray,
    ends: np.ndarray,
    factors: np.ndarray,
) -> float:
    """``tape_walk._stretched_queues`` on the array queues (the same breakpoints, in order)."""
    n_streams = qlen.shape[0]
    pos = lo.copy()
    t, left = start, work
    while True:
        p, factor = inf, 1.0
        for s in range(n_streams):
            i, m = pos[s], qlen[s]
            while i < m and ends[queues[s, i]] <= t:
                i += 1
            pos[s] = i
            if i < m:
                g = queues[s, i]
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


def _stretched(
    start: float,
    work: float,
    slowing: np.ndarray,
    n_slowing: int,
    begins: np.ndarray,
    ends: np.ndarray,
    factors: np.ndarray,
) -> float:
    """``event_walk._stretched(start, work, flights)`` for the flights ``slowing[:n_slowing]``:
    the breakpoints after ``start`` sorted without repeats, the largest factor in flight
    between them (1.0 where none is)."""
    points = np.empty(2 * n_slowing)
    n = 0
    for j in range(n_slowing):
        g = slowing[j]
        if begins[g] > start:
            points[n] = begins[g]
            n += 1
        if ends[g] > start:
            points[n] = ends[g]
            n += 1
    points = np.unique(points[:n])
    t, left = start, work
    for p in points:
        factor, found = 1.0, False
        for j in range(n_slowing):
            g = slowing[j]
            if begins[g] <= t < ends[g] and (not found or factors[g] > factor):
                factor, found = factors[g], True
        span = (p - t) / factor
        if span >= left:
            return t + left * factor - start
        left -= span
        t = p
    return t + left - start


def _walk(
    ops: np.ndarray,
    compute_cost: np.ndarray,
    coll_cost: np.ndarray,
    coll_stream: np.ndarray,
    n_streams: int,
    coll_factor: np.ndarray,
    has_factor: bool,
    n: int,
) -> tuple[float, float, float, np.ndarray]:
    """``walk_tape``'s loop: ``ops`` the tape's (op, a, b) rows, ``n`` its slots. Returns
    (step, compute busy, comm busy, exposed per class)."""
    B, E, T, C = np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n)
    F = np.ones(n)
    stream_of = np.zeros(n, np.int64)
    done = np.zeros(n, np.bool_)
    waited = np.zeros(n, np.bool_)
    queues = np.empty((n_streams, max(n, 1)), np.int64)
    qlen = np.zeros(n_streams, np.int64)
    stable = np.zeros(n_streams, np.int64)
    lo = np.zeros(n_streams, np.int64)
    slowing = np.empty(max(n, 1), np.int64)
    n_slowing = 0
    exposed = np.zeros(3)
    now = compute_busy = comm_busy = 0.0
    every_slows = False
    if has_factor and coll_factor.shape[0] > 0:
        every_slows = coll_factor.min() > 1.0
    for i in range(ops.shape[0]):
        op, a, b = ops[i, 0], ops[i, 1], ops[i, 2]
        if op == 0:
            cost = compute_cost[a]
            if every_slows:
                first, factor, flying = inf, 1.0, False
                for s in range(n_streams):
                    pos, m = lo[s], qlen[s]
                    while pos < m and E[queues[s, pos]] <= now:
                        pos += 1
                    lo[s] = pos
                    if pos < m:
                        g = queues[s, pos]
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
                        cost = _stretched_queues(now, cost, queues, qlen, lo, B, E, F)
            elif n_slowing > 0:
                k = 0
                for j in range(n_slowing):
                    g = slowing[j]
                    if not waited[g] and E[g] > now:
                        slowing[k] = g
                        k += 1
                n_slowing = k
                if n_slowing > 0:
                    first, factor = inf, 1.0
                    for j in range(n_slowing):
                        g = slowing[j]
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
                        cost = _stretched(now, cost, slowing, n_slowing, B, E, F)
            now += cost
            compute_busy += cost
        elif op == 1:
            cost = coll_cost[a]
            if cost <= 0:
                done[b] = True
                continue
            s = coll_stream[a]
            begin = now
            if qlen[s] > 0:
                last = E[queues[s, qlen[s] - 1]]
                if last > now:
                    begin = last
            B[b], E[b], T[b], C[b] = begin, begin + cost, now, cost
            stream_of[b] = s
            queues[s, qlen[s]] = b
            qlen[s] += 1
            if has_factor and coll_factor[a] > 1.0:
                F[b] = coll_factor[a]
                if not every_slows:
                    slowing[n_slowing] = b
                    n_slowing += 1
        else:
            if done[a]:
                done[a] = False
                continue
            end = E[a]
            s = stream_of[a]
            m = qlen[s]
            upto = lo[s] if end > now else 0
            while upto < m and queues[s, upto] != a:
                upto += 1
            if upto == m:
                raise ValueError("a wait for a collective not in its stream's queue")
            if end > now:
                start = lo[s]
                prev = E[queues[s, start - 1]] if start > 0 else 0.0
                changed, first_stable = False, stable[s]
                for pos in range(start, m):
                    g = queues[s, pos]
                    e = E[g]
                    if pos > upto and not changed and pos >= first_stable:
                        break
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
                    E[g] = new
                    prev = new
                end = E[a]
                exposed[b] += end - now
                now = end
                stable[s] = upto + 1
            for pos in range(upto, m - 1):
                queues[s, pos] = queues[s, pos + 1]
            qlen[s] = m - 1
            if upto < lo[s]:
                lo[s] -= 1
            stable[s] = max(upto + 1, stable[s] - 1)
            comm_busy += end - B[a]
            waited[a] = True
    return now, compute_busy, comm_busy, exposed


KERNEL = None  # the compiled walk, once ``compile`` ran (None before, or without numba)
_PYTHON = (_stretched_queues, _stretched)  # the helpers as written (``compile`` compiles these)


def compile(njit: Callable, cache: bool) -> None:  # noqa: A001 (numba's word)
    """Compile the walk with ``njit`` (``planner.jit.load``), run once on an empty tape (so a
    failure shows here, not in a search); ``KERNEL`` set. (``_walk`` calls the helpers by
    their module names: compiled ones.) A failure leaves the module as written (``reset``)."""
    global KERNEL, _stretched_queues, _stretched
    try:
        _stretched_queues, _stretched, walk = (njit(cache=cache)(f) for f in (*_PYTHON, _walk))
        none = np.zeros(0)
        walk(np.zeros((0, 3), np.int64), none, none, np.zeros(0, np.int64), 0, none, False, 0)
    except Exception:
        reset()
        raise
    KERNEL = walk


def reset() -> None:
    """No kernel: the helpers as written, ``KERNEL`` None."""
    global KERNEL, _stretched_queues, _stretched
    KERNEL = None
    _stretched_queues, _stretched = _PYTHON
