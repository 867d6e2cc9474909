"""The chain solver's loops (``planner.chain``) compiled to machine code (numba), for the plan
search: the same floats and the same choices as the numpy walks they replace, without a numpy
call per node (a 96-layer model's chain is 194 nodes; the 24 GB search solves ~150 of them).
Loaded with the planner's other kernels (``planner.jit``); where they are not, ``chain`` runs
its numpy code, to the same answers (``tests/test_chain_solver.py`` runs both).

    _viterbi    ``chain._viterbi_prices``: the memory-blind dynamic program at several prices
    _ahead      ``solve_chain_pareto``'s two bounds walked back from the chain's end
    _pareto     ``solve_chain_pareto``'s walk (``chain._extend`` node after node) and its
                trace back to a choice

Why the floats are the same: every sum is the numpy one, the same operands in the same order,
on IEEE doubles, compiled without fast-math (no reassociation, no fused multiply-add); a
minimum is numpy's (the first of equals; a NaN wins, as numpy's ``min`` and ``argmin`` let it).
Why the fronts are the same: ``_extend`` sorts each option's extensions by (memory, time),
stably (ties keep the lower parent), and keeps each one faster than every one before it; this
sorts the same keys the same way (``_sort``: a stable merge of the runs the front is already
in) and keeps the same ones. Inputs with a NaN or a -inf are left to the numpy code
(``pareto_ok``), whose complex sort orders NaNs its own way.
"""

from __future__ import annotations

from collections.abc import Callable
from math import inf

import numpy as np


def _viterbi(
    node_s: np.ndarray,
    node_bytes: np.ndarray,
    finite: np.ndarray,
    edge_s: np.ndarray,
    price: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """``chain._viterbi_prices``: back pointers [node - 1, price, option] and last costs
    [price, option]. A cost is ``node_s + price * node_bytes`` (inf where not ``finite``);
    node i's at option e: the least over d of (cost[d] + edge_s[i - 1, d, e]) (its argmin the
    pointer) plus its own."""
    n, k = node_s.shape
    p = price.shape[0]
    back = np.empty((max(n - 1, 0), p, k), dtype=np.intp)
    cost = np.empty((p, k))
    nxt = np.empty((p, k))
    for q in range(p):
        for o in range(k):
            cost[q, o] = node_s[0, o] + price[q] * node_bytes[0, o] if finite[0, o] else inf
    for i in range(1, n):
        for q in range(p):
            for e in range(k):
                best = cost[q, 0] + edge_s[i - 1, 0, e]
                arg = 0
                if best == best:  # (numpy: the first NaN is the min)
                    for d in range(1, k):
                        v = cost[q, d] + edge_s[i - 1, d, e]
                        if v != v:
                            best, arg = v, d
                            break
                        if v < best:
                            best, arg = v, d
                back[i - 1, q, e] = arg
                own = node_s[i, e] + price[q] * node_bytes[i, e] if finite[i, e] else inf
                nxt[q, e] = best + own
        cost, nxt = nxt, cost
    return back, cost


def _ahead(edge_s: np.ndarray, step: np.ndarray) -> np.ndarray:
    """``solve_chain_pareto``'s ``ahead`` [node, bound, option]: from node i at option d, the
    least over e of (edge_s[i, d, e] + step[i + 1, b, e]) + ahead[i + 1, b, e]; 0 at the end."""
    n, two, k = step.shape
    ahead = np.zeros((n, two, k))
    for i in range(n - 2, -1, -1):
        for b in range(two):
            for d in range(k):
                best = (edge_s[i, d, 0] + step[i + 1, b, 0]) + ahead[i + 1, b, 0]
                if best == best:
                    for e in range(1, k):
                        v = (edge_s[i, d, e] + step[i + 1, b, e]) + ahead[i + 1, b, e]
                        if v != v:
                            best = v
                            break
                        if v < best:
                            best = v
                ahead[i, b, d] = best
    return ahead


def _before(a: int, b: int, mm: np.ndarray, tt: np.ndarray) -> bool:
    """Does pair a sort strictly before pair b: less memory, or as much and less time?"""
    return mm[a] < mm[b] or (mm[a] == mm[b] and tt[a] < tt[b])


def _sort(mm: np.ndarray, tt: np.ndarray, idx: np.ndarray, tmp: np.ndarray, f: int) -> np.ndarray:
    """The positions 0..f-1 sorted by (mm, tt), stably: a merge sort of the runs they are in
    already (a front is sorted by option, then memory: one run per option the parents took, a
    few more where a sum rounds two memories equal). Returns the buffer holding the order."""
    for j in range(f):
        idx[j] = j
    starts = np.empty(f + 1, dtype=np.intp)
    runs = 0
    for j in range(f):
        if j == 0 or _before(j, j - 1, mm, tt):
            starts[runs] = j
            runs += 1
    starts[runs] = f
    src, dst = idx, tmp
    while runs > 1:
        merged = 0
        for r in range(0, runs, 2):
            lo, mid = starts[r], starts[r + 1]
            hi = starts[r + 2] if r + 2 <= runs else mid
            a, b, out = lo, mid, lo
            while a < mid and b < hi:
                if _before(src[b], src[a], mm, tt):  # (equal: the left, the lower parent)
                    dst[out] = src[b]
                    b += 1
                else:
                    dst[out] = src[a]
                    a += 1
                out += 1
            while a < mid:
                dst[out] = src[a]
                a += 1
                out += 1
            while b < hi:
                dst[out] = src[b]
                b += 1
                out += 1
            starts[merged] = lo
            merged += 1
        starts[merged] = f
        runs = merged
        src, dst = dst, src
    return src


def _pareto(
    t0: np.ndarray,
    m0: np.ndarray,
    opt0: np.ndarray,
    edge_s: np.ndarray,
    node_s: np.ndarray,
    node_bytes: np.ndarray,
    finish: np.ndarray,
    priced: np.ndarray,
    live: np.ndarray,
    lean_after: np.ndarray,
    price: float,
    budget: float,
    upper: float,
    limit: int,
) -> np.ndarray:
    """``solve_chain_pareto``'s walk from node 0's front (t0, m0, opt0): node by node, each
    live option e's extensions (time (edge_s[i - 1, d, e] + t) + node_s[i, e], memory m +
    node_bytes[i, e]) sorted by (memory, time), each kept that is faster than all before it
    and whose bounds keep it (``chain._extend``); then the fastest of the last front (the
    first of equals) traced back. Returns the choice, or an empty array where a front empties
    or outgrows ``limit`` (``solve_chain_pareto``'s None)."""
    n, k = node_s.shape
    t, m, opt = t0.copy(), m0.copy(), opt0.copy()
    cap = max(64, 4 * len(t0))
    h_opt = np.empty(cap, dtype=np.intp)
    h_parent = np.empty(cap, dtype=np.intp)
    offsets = np.empty(n + 1, dtype=np.intp)
    offsets[0] = 0
    size = len(t)
    h_opt[:size] = opt
    h_parent[:size] = 0
    offsets[1] = size
    none = np.empty(0, dtype=np.intp)
    for i in range(1, n):
        f = len(t)
        if f == 0:
            return none
        tt = np.empty(f)
        mm = np.empty(f)
        idx = np.empty(f, dtype=np.intp)
        tmp = np.empty(f, dtype=np.intp)
        out_t = np.empty(f * k)
        out_m = np.empty(f * k)
        out_o = np.empty(f * k, dtype=np.intp)
        out_p = np.empty(f * k, dtype=np.intp)
        count = 0
        for e in range(k):
            if not live[i, e]:
                continue
            for j in range(f):
                tt[j] = (edge_s[i - 1, opt[j], e] + t[j]) + node_s[i, e]
                mm[j] = m[j] + node_bytes[i, e]
            order = _sort(mm, tt, idx, tmp, f)
            least = inf
            for r in range(f):
                j = order[r]
                tv = tt[j]
                if r > 0 and not tv < least:
                    continue  # (``_extend``'s keep: the first, then faster than all before)
                least = tv
                mv = mm[j]
                slack = price * (budget - mv) if price else 0.0
                a = tv + finish[i, e]
                b = (tv + priced[i, e]) - slack
                if a != a or b != b:  # (np.maximum's NaN: not finite, dropped)
                    continue
                bound = a if a >= b else b
                if bound <= upper and -inf < bound < inf and mv + lean_after[i] <= budget:
                    out_t[count], out_m[count] = tv, mv
                    out_o[count], out_p[count] = e, j
                    count += 1
        if count > limit:
            return none
        if size + count > cap:
            cap = 2 * (size + count)
            grown = np.empty(cap, dtype=np.intp)
            grown[:size] = h_opt[:size]
            h_opt = grown
            grown = np.empty(cap, dtype=np.intp)
            grown[:size] = h_parent[:size]
            h_parent = grown
        h_opt[size : size + count] = out_o[:count]
        h_parent[size : size + count] = out_p[:count]
        size += count
        offsets[i + 1] = size
        t, m, opt = out_t[:count].copy(), out_m[:count].copy(), out_o[:count].copy()
    if len(t) == 0:
        return none
    j = 0
    for r in range(1, len(t)):
        if t[r] < t[j]:
            j = r
    choice = np.empty(n, dtype=np.intp)
    for i in range(n - 1, -1, -1):
        choice[i] = h_opt[offsets[i] + j]
        j = h_parent[offsets[i] + j]
    return choice


VITERBI = None  # the compiled ``_viterbi``, ``_ahead`` and ``_pareto``, once ``compile`` ran
AHEAD = None
PARETO = None
_PYTHON = (_before, _sort)  # the helpers as written (``compile`` compiles these)


def compile(njit: Callable, cache: bool) -> None:  # noqa: A001 (numba's word)
    """Compile the three with ``njit`` (``planner.jit.load``), each run once on a small chain
    (so a failure shows here, not in a search); ``VITERBI``, ``AHEAD``, ``PARETO`` set. A
    failure leaves the module as written (``reset``)."""
    global VITERBI, AHEAD, PARETO, _before, _sort
    try:
        _before, _sort = (njit(cache=cache)(f) for f in _PYTHON)
        viterbi, ahead, pareto = (njit(cache=cache)(f) for f in (_viterbi, _ahead, _pareto))
        one = np.ones((2, 2))
        edge = np.zeros((1, 2, 2))
        viterbi(one, one, one > 0, edge, np.ones(1))
        ahead(edge, np.ones((2, 2, 2)))
        pareto(
            np.ones(2), np.ones(2), np.arange(2), edge, one, one, one, one, one > 0,
            np.zeros(2), 0.0, 9.0, 9.0, 10,
        )  # fmt: skip
    except Exception:
        reset()
        raise
    VITERBI, AHEAD, PARETO = viterbi, ahead, pareto


def reset() -> None:
    """No kernels: the helpers as written, ``VITERBI``, ``AHEAD``, ``PARETO`` None."""
    global VITERBI, AHEAD, PARETO, _before, _sort
    VITERBI = AHEAD = PARETO = None
    _before, _sort = _PYTHON


def pareto_ok(*arrays: np.ndarray) -> bool:
    """Whether the compiled walks may take these inputs: loaded, and no NaN or -inf in them
    (the numpy code's complex sort orders NaNs its own way)."""
    return PARETO is not None and all(
        not np.isnan(a).any() and a.min(initial=0.0) > -inf for a in arrays
    )
