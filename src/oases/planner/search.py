"""Choose the TP degree of every region of the chain: exact, under a memory budget.

The problem (PAPER.md section 3): a chain of N nodes (the attention and MLP regions of every
layer); node n at degree option d costs ``node_s[n, d]`` seconds and ``node_bytes[n, d]`` bytes
of device memory; consecutive nodes at options (d, e) pay ``edge_s[n, d, e]`` for the reshard
between them (zero when d == e). Minimize total time subject to total memory <= budget::

    min  sum_n node_s[n, x_n] + sum_n edge_s[n, x_n, x_{n+1}]
    s.t. sum_n node_bytes[n, x_n] <= budget_bytes

``solve_chain`` writes it as an integer program (one-hot x per node, one-hot pair y per edge
tied to both ends, one knapsack row) and solves it with HiGHS through ``scipy.optimize.milp``:
exact, and every degree it picks is kept (no collapse to two degrees). ``solve_chain_brute``
is the slow obvious solver the tests compare it with.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ChainSolution:
    choice: tuple[int, ...]  # option index per node
    time_s: float
    memory_bytes: float


def _check(node_s: np.ndarray, node_bytes: np.ndarray, edge_s: np.ndarray) -> tuple[int, int]:
    n, k = node_s.shape
    if node_bytes.shape != (n, k) or edge_s.shape != (max(n - 1, 0), k, k):
        raise ValueError(f"shapes: node_s {node_s.shape}, node_bytes {node_bytes.shape}, "
                         f"edge_s {edge_s.shape}; expected (N,K), (N,K), (N-1,K,K)")
    return n, k


def evaluate(choice: tuple[int, ...], node_s: np.ndarray, node_bytes: np.ndarray,
             edge_s: np.ndarray) -> ChainSolution:
    idx = np.arange(len(choice))
    c = np.asarray(choice)
    time = node_s[idx, c].sum() + sum(edge_s[i, c[i], c[i + 1]] for i in range(len(c) - 1))
    return ChainSolution(tuple(int(v) for v in c), float(time), float(node_bytes[idx, c].sum()))


def min_memory_bytes(node_bytes: np.ndarray) -> float:
    """The smallest budget any choice fits in (each node at its leanest option)."""
    masked = np.where(np.isfinite(node_bytes), node_bytes, np.inf)
    return float(masked.min(axis=1).sum())


def _infeasible(budget: float, node_bytes: np.ndarray) -> ValueError:
    need = min_memory_bytes(node_bytes)
    return ValueError(f"no plan fits in {budget / 2**30:.2f} GiB per device; the smallest "
                      f"feasible budget is {need / 2**30:.2f} GiB")


def solve_chain(node_s: np.ndarray, node_bytes: np.ndarray, edge_s: np.ndarray,
                budget_bytes: float, time_limit_s: float = 30.0) -> ChainSolution:
    """Exact minimum-time choice under the budget (HiGHS MILP). Infeasible options are given
    as ``inf`` in node_s or node_bytes. Raises ValueError naming the smallest feasible budget."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import lil_matrix

    node_s, node_bytes, edge_s = (np.asarray(a, dtype=float) for a in (node_s, node_bytes,
                                                                         edge_s))
    n, k = _check(node_s, node_bytes, edge_s)
    if min_memory_bytes(node_bytes) > budget_bytes:
        raise _infeasible(budget_bytes, node_bytes)
    banned = ~(np.isfinite(node_s) & np.isfinite(node_bytes))
    nx, ne = n * k, max(n - 1, 0) * k * k

    def xi(i: int, d: int) -> int:
        return i * k + d

    def yi(i: int, d: int, e: int) -> int:
        return nx + (i * k + d) * k + e

    cost = np.zeros(nx + ne)
    cost[:nx] = np.where(banned, 0.0, node_s).ravel()
    if ne:
        cost[nx:] = np.where(np.isfinite(edge_s), edge_s, 0.0).ravel()
    upper = np.ones(nx + ne)
    upper[:nx][banned.ravel()] = 0.0
    if ne:
        upper[nx:][~np.isfinite(edge_s).ravel()] = 0.0
    rows = n + 2 * (n - 1) * k + 1
    a = lil_matrix((rows, nx + ne))
    lo, hi = np.zeros(rows), np.zeros(rows)
    r = 0
    for i in range(n):  # one option per node
        for d in range(k):
            a[r, xi(i, d)] = 1.0
        lo[r] = hi[r] = 1.0
        r += 1
    for i in range(n - 1):  # each edge's pair agrees with both of its nodes
        for d in range(k):
            for e in range(k):
                a[r, yi(i, d, e)] = 1.0
            a[r, xi(i, d)] = -1.0
            r += 1
        for e in range(k):
            for d in range(k):
                a[r, yi(i, d, e)] = 1.0
            a[r, xi(i + 1, e)] = -1.0
            r += 1
    a[r, :nx] = np.where(banned, 0.0, node_bytes).ravel()  # memory knapsack
    lo[r], hi[r] = -np.inf, budget_bytes
    res = milp(cost, constraints=LinearConstraint(a.tocsr(), lo, hi),
               integrality=np.ones(nx + ne), bounds=Bounds(0.0, upper),
               options={"time_limit": time_limit_s})
    if res.x is None:
        raise _infeasible(budget_bytes, node_bytes)
    x = res.x[:nx].reshape(n, k)
    return evaluate(tuple(int(v) for v in x.argmax(axis=1)), node_s, node_bytes, edge_s)


def solve_chain_brute(node_s: np.ndarray, node_bytes: np.ndarray, edge_s: np.ndarray,
                      budget_bytes: float) -> ChainSolution:
    """Every combination: the obvious solver the tests check ``solve_chain`` against."""
    node_s, node_bytes, edge_s = (np.asarray(a, dtype=float) for a in (node_s, node_bytes,
                                                                         edge_s))
    n, k = _check(node_s, node_bytes, edge_s)
    best = None
    for choice in itertools.product(range(k), repeat=n):
        sol = evaluate(choice, node_s, node_bytes, edge_s)
        if sol.memory_bytes <= budget_bytes and np.isfinite(sol.time_s) and (
                best is None or sol.time_s < best.time_s - 1e-12):
            best = sol
    if best is None:
        raise _infeasible(budget_bytes, node_bytes)
    return best
