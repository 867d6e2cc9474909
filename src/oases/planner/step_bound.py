"""The least step of any plan of a chain that fits a memory budget, from per-region lower
bounds (``search_bounds``): pure functions over arrays, nothing about models.

A plan x gives region i a degree x_i. For every plan, each of several "serial" sums bounds
the step from below (``serial[j][i, t]``: e.g. the compute stream's work, or a walk's DP
stream's), and so does each degree's stream sum (``streams[i, t]`` summed over the regions
at degree t: their collectives share that group's stream, one after another); a plan fits
only if both memory sums stay within ``room``::

    step >= sum_i serial_j[i, x_i]                  for every j
    step >= sum_{i: x_i = t} streams[i, t]          for every degree t
    sum_i a[i, x_i] <= room,  sum_i b[i, x_i] <= room

For any weights w_j, v_t >= 0 summing to 1 and prices l, m >= 0 (weak duality: a weighted
mean of lower bounds is one, and a plan that fits has l (sum a - room) + m (sum b - room)
<= 0), every plan that fits has::

    step >= sum_i min_t [sum_j w_j serial_j[i, t] + v_t streams[i, t] + l a[i, t] + m b[i, t]]
            - (l + m) room

The weights and prices are the duals of the linear relaxation (HiGHS through
``scipy.optimize.linprog``, over the distinct regions: a model's blocks are identical); the
bound is then evaluated from them directly, so a solver's tolerance never makes it unsafe,
only less tight; where the relaxation has no answer, w = 1 on the first serial sum.
"""

from __future__ import annotations

import numpy as np

MARGIN = 1e-9  # relative to the terms' magnitude: the sums' rounding in another order


def joint_step_bound(
    serials: list[np.ndarray],
    streams: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    room: float,
    stop_at: float = np.inf,
) -> float:
    """The bound of the module docstring: ``serials`` each [n, K], ``streams``, ``a``, ``b``
    [n, K] (n regions, K degrees; every entry finite), ``room`` (inf: no memory rows).
    Lowered by ``MARGIN`` times the magnitude of its terms. Where one serial sum alone (w = 1
    on it: ``serial_step_bound``) reaches ``stop_at``, that bound, without the relaxation."""
    cheap = serial_step_bound(serials)
    if cheap >= stop_at:
        return cheap
    k = streams.shape[1]
    rows, count = _distinct_rows(np.concatenate([*serials, streams, a, b], axis=1))
    parts = [rows[:, j * k : (j + 1) * k] for j in range(len(serials) + 3)]
    s, p, ma, mb = parts[:-3], parts[-3], parts[-2], parts[-1]
    weights = _duals(s, p, ma, mb, count.astype(float), room)
    if weights is None:
        weights = np.eye(1, len(s))[0], np.zeros(k), 0.0, 0.0
    w, v, lam, mu = weights
    terms = v[None, :] * p
    for wj, sj in zip(w.tolist(), s):
        if wj:
            terms = terms + wj * sj
    price = 0.0
    if lam or mu:
        terms = terms + lam * ma + mu * mb
        price = (lam + mu) * room
    least = terms.min(axis=1)
    bound = float((count * least).sum()) - price
    scale = float((count * np.abs(least)).sum()) + abs(price)
    # (never below one serial sum's own bound: the relaxation's optimum is at least each, but
    # its duals' bound may round a few ulps under, or be the fallback's first sum only; so a
    # chain ``stop_at`` skipped by ``cheap`` is one this bound skips too)
    return max(bound - MARGIN * scale, cheap)


def _distinct_rows(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(table, axis=0, return_counts=True)``, the same rows in the same order, by
    a dictionary of the rows' bytes (a model's blocks repeat byte for byte) and one lexsort of
    the few distinct ones: numpy's sorts every row as a record, ten times slower here."""
    seen: dict[bytes, int] = {}
    first: list[int] = []
    counts: list[int] = []
    keys = np.ascontiguousarray(table + 0.0)  # (-0.0 + 0.0 is 0.0: equal rows, equal bytes)
    for i, row in enumerate(keys):
        j = seen.setdefault(row.tobytes(), len(first))
        if j == len(first):
            first.append(i)
            counts.append(1)
        else:
            counts[j] += 1
    rows = table[first]
    order = np.lexsort(rows.T[::-1])  # (the first column the primary key, as numpy's records)
    return rows[order], np.array(counts)[order]


def serial_step_bound(serials: list[np.ndarray]) -> float:
    """The module docstring's bound with w = 1 on the serial sum that gives the most and no
    memory rows (every plan runs each sum: step >= sum_i min_t serial_j[i, t]), lowered by
    ``MARGIN`` as ``joint_step_bound`` is; -inf without a sum."""
    best = -np.inf
    for sj in serials:
        least = sj.min(axis=1)
        best = max(best, float(least.sum()) - MARGIN * float(np.abs(least).sum()))
    return best


def _duals(
    s: list[np.ndarray],
    p: np.ndarray,
    ma: np.ndarray,
    mb: np.ndarray,
    count: np.ndarray,
    room: float,
) -> tuple[np.ndarray, np.ndarray, float, float] | None:
    """(w, v, l, m) from the linear relaxation's duals: variables y[g, t] (how many regions of
    distinct row g at degree t) and z; minimize z subject to z >= sum y s_j for each j,
    z >= sum_g y[g, t] p[g, t] for each t, sum y a <= room, sum y b <= room,
    sum_t y[g, t] = count[g]. None where it has no answer (nothing fits; HiGHS fails)."""
    from scipy.optimize import linprog

    g, k = p.shape
    n_serial, memory = len(s), bool(np.isfinite(room))
    n_var = g * k + 1
    ub = np.zeros((n_serial + k + 2 * memory, n_var))
    for j, sj in enumerate(s):
        ub[j, :-1] = sj.ravel()
    for t in range(k):
        row = np.zeros((g, k))
        row[:, t] = p[:, t]
        ub[n_serial + t, :-1] = row.ravel()
    ub[: n_serial + k, -1] = -1.0
    rhs = np.zeros(len(ub))
    if memory:
        ub[n_serial + k, :-1] = ma.ravel()
        ub[n_serial + k + 1, :-1] = mb.ravel()
        rhs[n_serial + k :] = room
    eq = np.zeros((g, n_var))
    for j in range(g):
        eq[j, j * k : (j + 1) * k] = 1.0
    cost = np.zeros(n_var)
    cost[-1] = 1.0
    bounds = [(0.0, None)] * (n_var - 1) + [(None, None)]
    try:
        res = linprog(cost, A_ub=ub, b_ub=rhs, A_eq=eq, b_eq=count, bounds=bounds, method="highs")
    except ValueError:
        return None
    if res.status != 0:
        return None
    dual = np.maximum(-np.asarray(res.ineqlin.marginals, dtype=float), 0.0)
    total = dual[: n_serial + k].sum()
    if not total > 0:
        return None
    dual = dual / total
    lam, mu = (float(dual[-2]), float(dual[-1])) if memory else (0.0, 0.0)
    return dual[:n_serial], dual[n_serial : n_serial + k], lam, mu
