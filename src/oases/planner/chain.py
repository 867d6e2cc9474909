"""Choose the TP degree of every region of the chain: exact, under a memory budget.

The problem (the Oases paper's planner, Li et al., IEEE TPDS 2025): a chain of N nodes (the
attention and MLP regions of every layer); node n at degree option d costs ``node_s[n, d]``
seconds and ``node_bytes[n, d]`` bytes of device memory; consecutive nodes at options (d, e)
pay ``edge_s[n, d, e]`` for the reshard between them (zero when d == e).
Minimize total time subject to total memory <= budget::

    min  sum_n node_s[n, x_n] + sum_n edge_s[n, x_n, x_{n+1}]
    s.t. sum_n node_bytes[n, x_n] <= budget_bytes

``solve_chain`` first solves the chain without the memory row by dynamic programming
(``solve_chain_dp``, O(N K^2)): when that answer fits the budget it is the answer. Otherwise a
dynamic program keeps, per node and option, every (time, memory) pair no other pair beats in
both (``solve_chain_pareto``: exact; a few hundred pairs on a model's chain, whose layers cost
the same). Only if a node's fronts grow past ``PARETO_LIMIT`` it writes an integer program
(one-hot x per node, one-hot pair y per edge tied to both ends, one knapsack row) and solves it
with HiGHS through ``scipy.optimize.milp`` (to its default relative gap, 1e-4). Every degree
chosen is kept (no collapse to two degrees). ``solve_chain_brute`` is the slow obvious solver
the tests compare them with.

``planner.search`` uses it on a model. Pure functions over arrays, nothing about models.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from oases.planner import chain_kernel


@dataclass(frozen=True)
class ChainSolution:
    choice: tuple[int, ...]  # option index per node
    time_s: float
    memory_bytes: float


def _check(node_s: np.ndarray, node_bytes: np.ndarray, edge_s: np.ndarray) -> tuple[int, int]:
    n, k = node_s.shape
    if node_bytes.shape != (n, k) or edge_s.shape != (max(n - 1, 0), k, k):
        raise ValueError(
            f"shapes: node_s {node_s.shape}, node_bytes {node_bytes.shape}, "
            f"edge_s {edge_s.shape}; expected (N,K), (N,K), (N-1,K,K)"
        )
    return n, k


def evaluate(
    choice: tuple[int, ...], node_s: np.ndarray, node_bytes: np.ndarray, edge_s: np.ndarray
) -> ChainSolution:
    """The choice's time and memory, summed in one fixed order (the solvers' answers are these
    floats, so the order is part of the contract): the nodes' seconds and bytes by numpy's
    ``sum`` (pairwise), the edges' seconds one after another from 0.0 (``np.add.accumulate``
    is a running sum, the order of the plain ``sum`` over the edges this replaced), then the
    two time totals added."""
    c = np.asarray(choice, dtype=np.intp)
    idx = np.arange(len(c))
    hops = np.add.accumulate(np.concatenate(([0.0], edge_s[idx[:-1], c[:-1], c[1:]])))[-1]
    time = node_s[idx, c].sum() + hops
    return ChainSolution(tuple(int(v) for v in c), float(time), _memory(c, node_bytes))


def _memory(c: np.ndarray, node_bytes: np.ndarray) -> float:
    """``evaluate``'s ``memory_bytes`` alone (the same sum)."""
    return float(node_bytes[np.arange(len(c)), c].sum())


def min_memory_bytes(node_bytes: np.ndarray) -> float:
    """The smallest budget any choice fits in (each node at its leanest option)."""
    masked = np.where(np.isfinite(node_bytes), node_bytes, np.inf)
    return float(masked.min(axis=1).sum())


def _infeasible(budget: float, node_bytes: np.ndarray) -> ValueError:
    need = min_memory_bytes(node_bytes)
    return ValueError(
        f"no plan fits in {budget / 2**30:.2f} GiB per device; the smallest "
        f"feasible budget is {need / 2**30:.2f} GiB"
    )


def solve_chain_dp(node_s: np.ndarray, edge_s: np.ndarray) -> tuple[int, ...]:
    """The minimum-time choice ignoring memory (Viterbi over the chain; ties go to the lower
    option). ``inf`` marks a banned option; ValueError when every choice is banned."""
    n, k = node_s.shape
    cost = node_s[0].copy()  # best time of nodes 0..i with node i at each option
    back = np.zeros((max(n - 1, 0), k), dtype=int)
    for i in range(1, n):
        total = cost[:, None] + edge_s[i - 1]  # [from option d, to option e]
        back[i - 1] = total.argmin(axis=0)
        cost = total[back[i - 1], np.arange(k)] + node_s[i]
    if not np.isfinite(cost.min()):
        raise ValueError("every choice of the chain has a banned option")
    choice = [int(cost.argmin())]
    for i in range(n - 2, -1, -1):
        choice.append(int(back[i, choice[-1]]))
    return tuple(reversed(choice))


PARETO_LIMIT = 100_000  # (time, memory) pairs kept at a node before the MILP takes over


def _viterbi_prices(
    node_s: np.ndarray,
    node_bytes: np.ndarray,
    finite: np.ndarray,
    edge_s: np.ndarray,
    prices: list[float],
) -> tuple[np.ndarray, np.ndarray]:
    """``solve_chain_dp``'s forward pass over ``node_s + price * node_bytes`` (``inf`` where a
    node's bytes are not finite) for several prices in one walk: its back pointers
    [node - 1, price, option] and last costs [price, option] (``_trace`` reads a choice). Every
    float is the one ``solve_chain_dp`` computes for that price alone, the same operations on
    the same operands, so are its argmins (the first of equals); a cost is carried as the
    column's ``min`` rather than the element at its argmin, equal to it."""
    if chain_kernel.VITERBI is not None:  # (compiled: the same floats, ``chain_kernel``)
        return chain_kernel.VITERBI(
            *(np.ascontiguousarray(a) for a in (node_s, node_bytes, finite, edge_s)),
            np.asarray(prices, dtype=float),
        )
    price = np.asarray(prices, dtype=float)[None, :, None]
    priced = node_s[:, None, :] + price * node_bytes[:, None, :]  # [node, price, option]
    cost_all = np.where(finite[:, None, :], priced, np.inf)
    n, p, k = cost_all.shape
    back = np.empty((max(n - 1, 0), p, k), dtype=np.intp)
    edge_t = edge_s.transpose(0, 2, 1)[:, None]  # [node, 1, to option e, from option d]
    cost, total, least = cost_all[0].copy(), np.empty((p, k, k)), np.empty((p, k))
    for i in range(1, n):
        np.add(cost[:, None, :], edge_t[i - 1], out=total)  # [price, to option, from option]
        total.argmin(axis=2, out=back[i - 1])
        np.add(total.min(axis=2, out=least), cost_all[i], out=cost)
    return back, cost


def _trace(back: np.ndarray, cost: np.ndarray, p: int) -> tuple[int, ...] | None:
    """Price ``p``'s choice from ``_viterbi_prices`` (None where ``solve_chain_dp`` raises)."""
    if not np.isfinite(cost[p].min()):
        return None
    c = int(cost[p].argmin())
    choice = [c]
    for row in back[::-1, p].tolist():
        c = row[c]
        choice.append(c)
    return tuple(reversed(choice))


LEVELS = 3  # bisection steps whose every possible price one batched Viterbi walk covers


def _lagrangian_fits(
    node_s: np.ndarray,
    node_bytes: np.ndarray,
    edge_s: np.ndarray,
    budget_bytes: float,
    iterations: int = 30,
) -> tuple[list[tuple[int, ...]], float]:
    """Choices that fit the budget from the Lagrangian relaxation: the fastest chain under
    time + price * memory (``solve_chain_dp``), the price bisected until the memory fits; and
    the least price found to fit (0.0: none). A good fitting choice early, and a price for a
    lower bound, are what let the Pareto walk prune; never the answer itself.

    The search is sequential (each price depends on whether the last one fit), but every
    price it can try in the next ``LEVELS`` steps is known: the next ``LEVELS`` powers of 4
    while no price fits, then the ``2**LEVELS - 1`` midpoints of the bisection's tree. Those
    are solved in one ``_viterbi_prices`` walk and the same steps are then taken through its
    answers: the same prices (the same float expressions), the same choices, the same
    list and price as one Viterbi walk per step."""
    finite = np.isfinite(node_bytes)
    if not finite.any(axis=1).all():
        return [], 0.0
    scale = float(np.nanmax(np.where(np.isfinite(node_s), node_s, np.nan))) or 1.0
    span = float(np.ptp(node_bytes[finite])) or 1.0

    def fits(choice: tuple[int, ...]) -> bool:
        return _memory(np.asarray(choice, dtype=np.intp), node_bytes) <= budget_bytes

    lo, hi, found, left = 0.0, 1.0, [], iterations
    while not found:  # find a price high enough to fit, then bisect below it
        if not left:
            return found, 0.0
        his = [hi]
        while len(his) < min(LEVELS, left):
            his.append(his[-1] * 4)
        back, cost = _viterbi_prices(
            node_s, node_bytes, finite, edge_s, [h * scale / span for h in his]
        )
        for p, h in enumerate(his):
            left -= 1
            choice = _trace(back, cost, p)
            if choice is None:
                return found, 0.0
            if fits(choice):
                found.append(choice)
                break
            lo, hi = h, h * 4
    left = iterations
    while left:
        levels = min(LEVELS, left)
        spans = [(lo, hi)]  # the bisection's tree: node j's halves are 2j + 1 and 2j + 2
        mids = []
        for j in range(2**levels - 1):
            a, b = spans[j]
            mids.append((a + b) / 2)
            spans += [(a, mids[-1]), (mids[-1], b)]
        back, cost = _viterbi_prices(
            node_s, node_bytes, finite, edge_s, [mid * scale / span for mid in mids]
        )
        j = 0
        for _ in range(levels):
            left -= 1
            choice = _trace(back, cost, j)
            if choice is None:
                raise ValueError("every choice of the chain has a banned option")
            if fits(choice):
                found.append(choice)
                hi, j = mids[j], 2 * j + 1
            else:
                lo, j = mids[j], 2 * j + 2
    return found, hi * scale / span


def solve_chain_pareto(
    node_s: np.ndarray, node_bytes: np.ndarray, edge_s: np.ndarray, budget_bytes: float
) -> tuple[int, ...] | None:
    """The minimum-time choice within the budget (``inf`` bans an option), exactly: walk the
    chain keeping, for every option of the current node, the partial choices that no other
    beats in both time and memory. None when a front outgrows ``PARETO_LIMIT`` (or nothing
    fits)."""
    n, k = node_s.shape
    # Bounds that never cut an optimal choice: the fastest way to finish from node i at option
    # e (memory ignored), the leanest memory the nodes after i need, and the time of a choice
    # known to fit (each node at its leanest option, a uniform choice that fits, or the best
    # fitting answer of the Lagrangian relaxation: time + price * memory).
    lean_after = np.r_[np.cumsum(node_bytes.min(axis=1)[::-1])[::-1][1:], 0.0]
    known = [tuple(int(v) for v in node_bytes.argmin(axis=1))]
    known += [(d,) * n for d in range(k) if node_bytes[:, d].sum() <= budget_bytes]
    fits, price = _lagrangian_fits(node_s, node_bytes, edge_s, budget_bytes)
    known += fits
    # and a Lagrangian bound: any completion from node i at option e that fits in what is
    # left takes at least priced[i, e] - price * (budget - memory so far). Both bounds are
    # walked back together: ahead[i, 0] is the fastest finish, ahead[i, 1] the priced one.
    finite_bytes = np.isfinite(node_bytes)
    cost = np.where(finite_bytes, node_s + price * np.where(finite_bytes, node_bytes, 0.0), np.inf)
    step = np.stack((node_s, cost), axis=1)  # [node, bound, option]
    if chain_kernel.AHEAD is not None:  # (compiled: the same floats, ``chain_kernel``)
        ahead = chain_kernel.AHEAD(np.ascontiguousarray(edge_s), step)
    else:
        ahead = np.zeros((n, 2, k))
        for i in range(n - 2, -1, -1):
            ahead[i] = (edge_s[i][None] + step[i + 1][:, None, :] + ahead[i + 1][:, None, :]).min(2)
    finish, priced = ahead[:, 0], ahead[:, 1]
    upper = min(evaluate(c, node_s, node_bytes, edge_s).time_s for c in dict.fromkeys(known))
    upper = upper * (1 + 1e-12) + 1e-12 if np.isfinite(upper) else np.inf
    # the options a choice can take at each node (an option without a finite time there, or
    # a finite time to finish from it, has every extension's bound infinite: all pruned)
    alive = np.isfinite(node_s) & np.isfinite(finish)
    ok = np.isfinite(node_s[0]) & (node_bytes[0] <= budget_bytes)
    opt = np.flatnonzero(ok)
    t, m, parent = node_s[0, opt], node_bytes[0, opt], np.zeros(len(opt), dtype=int)
    if chain_kernel.pareto_ok(node_s, node_bytes, edge_s):  # (compiled: the same walk)
        choice = chain_kernel.PARETO(
            t, m, opt, np.ascontiguousarray(edge_s), np.ascontiguousarray(node_s),
            np.ascontiguousarray(node_bytes), np.ascontiguousarray(finish),
            np.ascontiguousarray(priced), np.ascontiguousarray(alive),
            lean_after, float(price), float(budget_bytes), float(upper), PARETO_LIMIT,
        )  # fmt: skip
        return tuple(choice.tolist()) if len(choice) else None
    # the front of node i: every kept partial choice, its option, time, memory, and where it
    # came from (its index in node i-1's front); fronts are sorted by option, then memory
    edge_t = edge_s.transpose(0, 2, 1)
    live = [np.flatnonzero(row) for row in alive]
    history = [(opt, parent)]
    for i in range(1, n):
        if not len(t):
            return None
        rows = live[i] if len(live[i]) < k else slice(None)
        opt, parent, t, m = _extend(
            t, m, opt, edge_t[i - 1][rows], node_s[i][rows], node_bytes[i][rows],
            finish[i][rows], priced[i][rows], lean_after[i], price, budget_bytes, upper,
        )  # fmt: skip
        if len(live[i]) < k:
            opt = live[i][opt]
        if len(t) > PARETO_LIMIT:
            return None
        history.append((opt, parent))
    if not len(t):
        return None
    j = int(np.argmin(t))  # (ties: the first, i.e. the lowest option and memory)
    choice = []
    for opt, parent in reversed(history):
        choice.append(int(opt[j]))
        j = int(parent[j])
    return tuple(reversed(choice))


def _extend(
    t: np.ndarray,
    m: np.ndarray,
    opt: np.ndarray,
    edge_t: np.ndarray,
    node_s: np.ndarray,
    node_bytes: np.ndarray,
    finish: np.ndarray,
    priced: np.ndarray,
    lean_after: float,
    price: float,
    budget: float,
    upper: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One step of the Pareto walk: every extension of the front (t, m, opt) by the next node
    (``edge_t[e, d]``: the reshard from option d to e) filtered to the pairs no other of the
    same option beats in both time and memory, then to those its bounds keep; returned
    (option, parent, time, memory), sorted by option, memory, time, then parent.

    Exactly what the walk as first written kept, in its order: it pruned by the bounds first,
    then stable-sorted by (option, memory, time) and kept the first of each option and every
    later one faster than all before it in its option. The two filters commute: a pair that
    beats a pair the bounds keep has no more time and memory, so its bounds (sums and a max,
    monotone in both, as rounded floats too) keep it as well. Filtering first leaves a few
    hundred pairs to bound instead of thousands, and a [option, parent] table to sort row by
    row in one call (complex keys memory + i * time: numpy orders complex numbers by real
    part, then imaginary; stable, so equal pairs keep the lower parent). Every float is the
    one computed before, elementwise from the same operands."""
    f = len(t)
    k = len(node_s)
    tt = np.take(edge_t, opt, axis=1)  # [options of node i, kept choices]
    tt += t  # (t + edge) + node, as first written
    tt += node_s[:, None]
    mm = np.add(m, node_bytes[:, None])
    key = np.empty((k, f), dtype=complex)
    key.real, key.imag = mm, tt
    order = np.argsort(key, axis=1, kind="stable")
    order += np.arange(0, k * f, f)[:, None]
    order = order.ravel()
    tv = tt.ravel()[order].reshape(k, f)
    least = np.minimum.accumulate(tv, axis=1)
    keep = np.empty((k, f), dtype=bool)
    keep[:, 0] = True
    np.less(tv[:, 1:], least[:, :-1], out=keep[:, 1:])
    flat = order[np.flatnonzero(keep)]
    e_idx = flat // f
    tv, mv = tt.ravel()[flat], mm.ravel()[flat]
    slack = price * (budget - mv) if price else 0.0  # (0 * an infinite budget)
    bound = np.maximum(tv + finish[e_idx], tv + priced[e_idx] - slack)
    ok = (bound <= upper) & np.isfinite(bound) & (mv + lean_after <= budget)
    e_idx = e_idx[ok]
    return e_idx, flat[ok] - e_idx * f, tv[ok], mv[ok]


def solve_chain(
    node_s: np.ndarray,
    node_bytes: np.ndarray,
    edge_s: np.ndarray,
    budget_bytes: float,
    time_limit_s: float = 30.0,
) -> ChainSolution:
    """Exact minimum-time choice under the budget: the dynamic program's answer when it fits,
    else the Pareto dynamic program's (HiGHS's MILP if the fronts grow too large). Infeasible
    options are given as ``inf`` in node_s or node_bytes. Raises ValueError naming the
    smallest feasible budget."""
    node_s, node_bytes, edge_s = (np.asarray(a, dtype=float) for a in (node_s, node_bytes, edge_s))
    n, k = _check(node_s, node_bytes, edge_s)
    if min_memory_bytes(node_bytes) > budget_bytes:
        raise _infeasible(budget_bytes, node_bytes)
    banned = ~(np.isfinite(node_s) & np.isfinite(node_bytes))
    try:
        free = evaluate(
            solve_chain_dp(np.where(banned, np.inf, node_s), edge_s), node_s, node_bytes, edge_s
        )
    except ValueError:
        raise _infeasible(budget_bytes, node_bytes) from None
    if free.memory_bytes <= budget_bytes:  # the memory row does not bind
        return free
    choice = solve_chain_pareto(np.where(banned, np.inf, node_s), node_bytes, edge_s, budget_bytes)
    if choice is not None:
        return evaluate(choice, node_s, node_bytes, edge_s)
    return _solve_chain_milp(node_s, node_bytes, edge_s, banned, budget_bytes, time_limit_s)


def _solve_chain_milp(
    node_s: np.ndarray,
    node_bytes: np.ndarray,
    edge_s: np.ndarray,
    banned: np.ndarray,
    budget_bytes: float,
    time_limit_s: float,
) -> ChainSolution:
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    n, k = node_s.shape
    nx, ne = n * k, max(n - 1, 0) * k * k
    cost = np.zeros(nx + ne)
    cost[:nx] = np.where(banned, 0.0, node_s).ravel()
    if ne:
        cost[nx:] = np.where(np.isfinite(edge_s), edge_s, 0.0).ravel()
    upper = np.ones(nx + ne)
    upper[:nx][banned.ravel()] = 0.0
    if ne:
        upper[nx:][~np.isfinite(edge_s).ravel()] = 0.0
    rows = n + 2 * (n - 1) * k + 1
    # one option per node: row i holds x[i, :]
    r_node, c_node = np.repeat(np.arange(n), k), np.arange(nx)
    # edge i: row n + 2ki + d holds y[i, d, :] - x[i, d];
    #         row n + 2ki + k + e holds y[i, :, e] - x[i+1, e]
    i, d, e = (
        a.ravel() for a in np.meshgrid(np.arange(n - 1), np.arange(k), np.arange(k), indexing="ij")
    )
    y = nx + (i * k + d) * k + e
    r_out, r_in = n + 2 * k * i + d, n + 2 * k * i + k + e
    j, o = (a.ravel() for a in np.meshgrid(np.arange(n - 1), np.arange(k), indexing="ij"))
    r_x_out, r_x_in = n + 2 * k * j + o, n + 2 * k * j + k + o
    row = np.concatenate([r_node, r_out, r_in, r_x_out, r_x_in, np.full(nx, rows - 1)])
    col = np.concatenate([c_node, y, y, j * k + o, (j + 1) * k + o, np.arange(nx)])
    val = np.concatenate(
        [np.ones(nx + 2 * len(y)), -np.ones(2 * len(j)), np.where(banned, 0.0, node_bytes).ravel()]
    )  # memory knapsack
    a = coo_matrix((val, (row, col)), shape=(rows, nx + ne)).tocsr()
    lo, hi = np.zeros(rows), np.zeros(rows)
    lo[:n] = hi[:n] = 1.0
    lo[-1], hi[-1] = -np.inf, budget_bytes
    res = milp(
        cost,
        constraints=LinearConstraint(a, lo, hi),
        integrality=np.ones(nx + ne),
        bounds=Bounds(0.0, upper),
        options={"time_limit": time_limit_s},
    )
    if res.x is None:
        raise _infeasible(budget_bytes, node_bytes)
    x = res.x[:nx].reshape(n, k)
    return evaluate(tuple(int(v) for v in x.argmax(axis=1)), node_s, node_bytes, edge_s)


def solve_chain_brute(
    node_s: np.ndarray, node_bytes: np.ndarray, edge_s: np.ndarray, budget_bytes: float
) -> ChainSolution:
    """Every combination: the obvious solver the tests check ``solve_chain`` against."""
    node_s, node_bytes, edge_s = (np.asarray(a, dtype=float) for a in (node_s, node_bytes, edge_s))
    n, k = _check(node_s, node_bytes, edge_s)
    best = None
    for choice in itertools.product(range(k), repeat=n):
        sol = evaluate(choice, node_s, node_bytes, edge_s)
        if (
            sol.memory_bytes <= budget_bytes
            and np.isfinite(sol.time_s)
            and (best is None or sol.time_s < best.time_s - 1e-12)
        ):
            best = sol
    if best is None:
        raise _infeasible(budget_bytes, node_bytes)
    return best


def solve_chain_minmax(a: np.ndarray, b: np.ndarray) -> ChainSolution:
    """The choice that minimizes ``max(sum_n a[n, x_n], sum_n b[n, x_n])`` (``inf`` bans an
    option), exactly: the least peak memory when the peak is the larger of two moments, each
    a sum over the nodes (e.g. the forward/backward turn and the optimizer step). No edge
    costs, so one front suffices: walk the nodes keeping every partial choice that no other
    beats in both sums, then take the best of the last front. The result's ``time_s`` is
    ``sum a``, ``memory_bytes`` is ``sum b``."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    n, k = a.shape
    ok = np.isfinite(a) & np.isfinite(b)
    if not ok.any(axis=1).all():
        raise ValueError("a node has every option banned")
    opt = np.flatnonzero(ok[0])
    sa, sb = a[0, opt], b[0, opt]
    history = [(opt, np.zeros(len(opt), dtype=int))]
    for i in range(1, n):
        e = np.flatnonzero(ok[i])
        ta = (sa[:, None] + a[i, e][None, :]).ravel()
        tb = (sb[:, None] + b[i, e][None, :]).ravel()
        parent = np.repeat(np.arange(len(sa)), len(e))
        option = np.tile(e, len(sa))
        order = np.lexsort((tb, ta))  # by sum a, then sum b
        ta, tb, parent, option = ta[order], tb[order], parent[order], option[order]
        keep = np.r_[True, tb[1:] < np.minimum.accumulate(tb)[:-1]]  # b falls as a grows
        sa, sb = ta[keep], tb[keep]
        history.append((option[keep], parent[keep]))
    j = int(np.argmin(np.maximum(sa, sb)))
    choice = []
    for opt, parent in reversed(history):
        choice.append(int(opt[j]))
        j = int(parent[j])
    zero = np.zeros((max(n - 1, 0), k, k))
    return evaluate(tuple(reversed(choice)), a, b, zero)
