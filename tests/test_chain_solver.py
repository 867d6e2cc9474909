"""The chain solver's fast paths give the same answers as the algorithm as first written.

``solve_chain_pareto`` and ``_lagrangian_fits`` (planner/chain.py) were rewritten for speed
(round 9, issue 29): the Pareto walk filters before it bounds and sorts with one stable
argsort, the Lagrangian bisection solves several prices in one Viterbi walk, ``evaluate``
sums the edges with ``np.add.accumulate``. The plan chosen must not change, so this module
keeps the solver as it was before (``_reference_*``, frozen: do not "improve" it) and checks
that the new one returns the same choice and the same float bits on seeded random chains
built like a model's: an embedding, identical (attention, MLP) blocks, a head; 2 to 6
options, some banned (``inf``), integer-valued times (ties), budgets tight and loose.
``solve_chain_brute`` (tests/test_search.py) checks both against every combination.

Every test runs twice (``walks``): on the numpy walks, and on the compiled ones
(``planner.chain_kernel``, where numba is installed), which must give the same bits too.
"""

import struct

import numpy as np
import pytest

from oases.planner import chain
from oases.planner.chain import ChainSolution, evaluate, min_memory_bytes, solve_chain_dp

pytestmark = pytest.mark.exact


@pytest.fixture(autouse=True, params=["numpy", "compiled"])
def walks(request, monkeypatch):
    """The chain solver's walks: numpy's (the compiled ones unset here), or the compiled
    ones (``jit.load``; skipped without numba or with ``OASES_NO_JIT``)."""
    from oases.planner import chain_kernel, jit

    if request.param == "numpy":
        for name in ("VITERBI", "AHEAD", "PARETO"):
            monkeypatch.setattr(chain_kernel, name, None)
    elif not jit.load():
        pytest.skip("no compiled walks here (numba missing, or OASES_NO_JIT)")
    return request.param


# --- the reference: the solver as it was at b614cc2 (planner/chain.py), unchanged ---------


def _reference_evaluate(choice, node_s, node_bytes, edge_s):
    idx = np.arange(len(choice))
    c = np.asarray(choice)
    time = node_s[idx, c].sum() + sum(edge_s[i, c[i], c[i + 1]] for i in range(len(c) - 1))
    return ChainSolution(tuple(int(v) for v in c), float(time), float(node_bytes[idx, c].sum()))


def _reference_lagrangian_fits(node_s, node_bytes, edge_s, budget_bytes, iterations=30):
    finite = np.isfinite(node_bytes)
    if not finite.any(axis=1).all():
        return [], 0.0
    scale = float(np.nanmax(np.where(np.isfinite(node_s), node_s, np.nan))) or 1.0
    span = float(np.ptp(node_bytes[finite])) or 1.0
    lo, hi, found = 0.0, 1.0, []
    for _ in range(iterations):
        price = hi * scale / span
        try:
            choice = solve_chain_dp(np.where(finite, node_s + price * node_bytes, np.inf), edge_s)
        except ValueError:
            return found, 0.0
        if _reference_evaluate(choice, node_s, node_bytes, edge_s).memory_bytes <= budget_bytes:
            found.append(choice)
            break
        lo, hi = hi, hi * 4
    else:
        return found, 0.0
    for _ in range(iterations):
        mid = (lo + hi) / 2
        choice = solve_chain_dp(
            np.where(finite, node_s + mid * scale / span * node_bytes, np.inf), edge_s
        )
        if _reference_evaluate(choice, node_s, node_bytes, edge_s).memory_bytes <= budget_bytes:
            found.append(choice)
            hi = mid
        else:
            lo = mid
    return found, hi * scale / span


def _reference_pareto(node_s, node_bytes, edge_s, budget_bytes):
    n, k = node_s.shape
    finish = np.zeros((n, k))
    for i in range(n - 2, -1, -1):
        finish[i] = (edge_s[i] + node_s[i + 1] + finish[i + 1]).min(axis=1)
    lean_after = np.r_[np.cumsum(node_bytes.min(axis=1)[::-1])[::-1][1:], 0.0]
    known = [tuple(int(v) for v in node_bytes.argmin(axis=1))]
    known += [(d,) * n for d in range(k) if node_bytes[:, d].sum() <= budget_bytes]
    fits, price = _reference_lagrangian_fits(node_s, node_bytes, edge_s, budget_bytes)
    known += fits
    priced = np.zeros((n, k))
    finite_bytes = np.isfinite(node_bytes)
    cost = np.where(finite_bytes, node_s + price * np.where(finite_bytes, node_bytes, 0.0), np.inf)
    for i in range(n - 2, -1, -1):
        priced[i] = (edge_s[i] + cost[i + 1] + priced[i + 1]).min(axis=1)
    upper = min(_reference_evaluate(c, node_s, node_bytes, edge_s).time_s for c in known)
    upper = upper * (1 + 1e-12) + 1e-12 if np.isfinite(upper) else np.inf
    ok = np.isfinite(node_s[0]) & (node_bytes[0] <= budget_bytes)
    opt = np.flatnonzero(ok)
    t, m, parent = node_s[0, opt], node_bytes[0, opt], np.zeros(len(opt), dtype=int)
    history = [(opt, parent)]
    for i in range(1, n):
        if not len(t):
            return None
        tt = t[None, :] + edge_s[i - 1][opt].T + node_s[i][:, None]
        mm = np.broadcast_to(m[None, :] + node_bytes[i][:, None], tt.shape)
        slack = price * (budget_bytes - mm) if price else 0.0
        bound = np.maximum(tt + finish[i][:, None], tt + priced[i][:, None] - slack)
        e_idx, j_idx = np.nonzero(
            (bound <= upper) & np.isfinite(bound) & (mm + lean_after[i] <= budget_bytes)
        )
        tv, mv = tt[e_idx, j_idx], mm[e_idx, j_idx]
        order = np.lexsort((tv, mv, e_idx))
        e_idx, j_idx, tv, mv = e_idx[order], j_idx[order], tv[order], mv[order]
        keep = np.zeros(len(tv), dtype=bool)
        bounds = np.flatnonzero(np.r_[True, e_idx[1:] != e_idx[:-1], True]) if len(tv) else []
        for a, b in zip(bounds[:-1], bounds[1:]):
            keep[a] = True
            keep[a + 1 : b] = tv[a + 1 : b] < np.minimum.accumulate(tv[a:b])[:-1]
        if keep.sum() > chain.PARETO_LIMIT:
            return None
        opt, parent, t, m = e_idx[keep], j_idx[keep], tv[keep], mv[keep]
        history.append((opt, parent))
    if not len(t):
        return None
    j = int(np.argmin(t))
    choice = []
    for opt, parent in reversed(history):
        choice.append(int(opt[j]))
        j = int(parent[j])
    return tuple(reversed(choice))


def _reference_solve_chain(node_s, node_bytes, edge_s, budget_bytes):
    """``solve_chain`` as it was, without the MILP fallback (None there)."""
    if min_memory_bytes(node_bytes) > budget_bytes:
        return "infeasible"
    banned = ~(np.isfinite(node_s) & np.isfinite(node_bytes))
    try:
        choice = solve_chain_dp(np.where(banned, np.inf, node_s), edge_s)
    except ValueError:
        return "infeasible"
    free = _reference_evaluate(choice, node_s, node_bytes, edge_s)
    if free.memory_bytes <= budget_bytes:
        return free
    choice = _reference_pareto(np.where(banned, np.inf, node_s), node_bytes, edge_s, budget_bytes)
    return None if choice is None else _reference_evaluate(choice, node_s, node_bytes, edge_s)


# --- chains built like a model's ------------------------------------------------------------


def _model_chain(rng, layers, k, integer, banned):
    """An embedding, ``layers`` identical (attention, MLP) blocks, a head: node rows and edge
    slices repeat as a model's do. Times in [1, 20) (integers where ``integer``: ties), bytes
    falling with the option (more sharding, less memory) with noise, reshards zero on the
    diagonal. ``banned``: the last options of the blocks are ``inf`` (time and bytes)."""

    def times(size):
        return rng.integers(1, 20, size).astype(float) if integer else rng.uniform(1, 20, size)

    rows_s = {r: times(k) for r in ("embed", "attn", "mlp", "head")}
    rows_b = {r: np.sort(rng.uniform(1e8, 4e9, k))[::-1] * rng.uniform(0.9, 1.1, k) for r in rows_s}
    if integer:
        rows_b = {r: np.round(b / 1e6) * 1e6 for r, b in rows_b.items()}
    for r in ("attn", "mlp"):
        for d in range(k - banned, k):
            rows_s[r][d] = rows_b[r][d] = np.inf

    def reshard():
        e = times((k, k)) / 4
        np.fill_diagonal(e, 0.0)
        return e

    edges = {pair: reshard() for pair in ("ea", "am", "ma", "mh")}
    kinds = ["embed"] + ["attn", "mlp"] * layers + ["head"]
    node_s = np.stack([rows_s[r] for r in kinds])
    node_bytes = np.stack([rows_b[r] for r in kinds])
    pairs = ["ea"] + ["am", "ma"] * layers
    pairs[-1] = "mh"
    edge_s = np.stack([edges[p] for p in pairs])
    return node_s, node_bytes, edge_s


def _budgets(node_s, node_bytes, edge_s):
    """Budgets from the leanest choice to just under the memory-blind optimum's memory (where
    the Pareto walk runs), tight and loose, and one above it (where the plain DP answers)."""
    lo = min_memory_bytes(node_bytes)
    banned = ~(np.isfinite(node_s) & np.isfinite(node_bytes))
    free = evaluate(
        solve_chain_dp(np.where(banned, np.inf, node_s), edge_s), node_s, node_bytes, edge_s
    )
    hi = free.memory_bytes
    return [lo, lo + 0.02 * (hi - lo), lo + 0.3 * (hi - lo), lo + 0.8 * (hi - lo), hi * 0.999, hi]


def _bits(sol):
    if isinstance(sol, str) or sol is None:
        return sol
    return sol.choice, struct.pack("<dd", sol.time_s, sol.memory_bytes)


def _new_solve_chain(node_s, node_bytes, edge_s, budget):
    try:
        return chain.solve_chain(node_s, node_bytes, edge_s, budget)
    except ValueError:
        return "infeasible"


CASES = [(seed, 2 + seed % 7, 2 + seed % 5) for seed in range(36)]  # (seed, layers 2-8, K 2-6)


@pytest.mark.parametrize("seed,layers,k", CASES)
def test_same_choice_and_floats_as_the_solver_as_first_written(seed, layers, k):
    rng = np.random.default_rng(seed)
    integer = seed % 2 == 0
    banned = int(rng.integers(0, k)) if seed % 3 else 0
    node_s, node_bytes, edge_s = _model_chain(rng, layers, k, integer, banned)
    walked = 0
    for budget in _budgets(node_s, node_bytes, edge_s):
        want = _reference_solve_chain(node_s, node_bytes, edge_s, budget)
        if want is None:  # the reference hands over to the MILP: not this test's business
            continue
        assert _bits(_new_solve_chain(node_s, node_bytes, edge_s, budget)) == _bits(want)
        # the parts too, on the inputs solve_chain hands them
        banned_any = ~(np.isfinite(node_s) & np.isfinite(node_bytes))
        masked = np.where(banned_any, np.inf, node_s)
        got = chain._lagrangian_fits(masked, node_bytes, edge_s, budget)
        assert got == _reference_lagrangian_fits(masked, node_bytes, edge_s, budget)
        got = chain.solve_chain_pareto(masked, node_bytes, edge_s, budget)
        assert got == _reference_pareto(masked, node_bytes, edge_s, budget)
        walked += got is not None and not isinstance(want, str)
    assert walked >= 2  # the Pareto walk ran on this chain (tight budgets)


def test_same_on_a_48_layer_chain():
    rng = np.random.default_rng(48)
    node_s, node_bytes, edge_s = _model_chain(rng, 48, 6, integer=True, banned=1)
    budgets = _budgets(node_s, node_bytes, edge_s)
    for budget in (budgets[1], budgets[3]):
        want = _reference_solve_chain(node_s, node_bytes, edge_s, budget)
        assert want is not None and not isinstance(want, str)
        assert _bits(_new_solve_chain(node_s, node_bytes, edge_s, budget)) == _bits(want)


@pytest.mark.parametrize("seed", range(20))
def test_same_on_unstructured_chains_with_ties_and_bans(seed):
    """Every node its own: small integer times (many ties), banned options scattered."""
    rng = np.random.default_rng(1000 + seed)
    n, k = int(rng.integers(2, 30)), int(rng.integers(2, 7))
    node_s = rng.integers(0, 4, (n, k)).astype(float)
    node_bytes = rng.integers(1, 6, (n, k)).astype(float)
    edge_s = rng.integers(0, 3, (n - 1, k, k)).astype(float)
    for i in range(n - 1):
        np.fill_diagonal(edge_s[i], 0.0)
    node_s[rng.random((n, k)) < 0.15] = np.inf
    node_bytes[rng.random((n, k)) < 0.05] = np.inf
    if not (np.isfinite(node_s) & np.isfinite(node_bytes)).any(axis=1).all():
        node_s[:, 0] = node_bytes[:, 0] = 1.0  # keep every node one option
    for budget in _budgets(node_s, node_bytes, edge_s):
        want = _reference_solve_chain(node_s, node_bytes, edge_s, budget)
        if want is not None:
            assert _bits(_new_solve_chain(node_s, node_bytes, edge_s, budget)) == _bits(want)


@pytest.mark.parametrize("seed", range(10))
def test_evaluate_sums_as_before(seed):
    """The same bits as the plain ``sum`` over the edges: magnitudes far apart, so any other
    order of the additions rounds differently."""
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(20, 200)), 4
    node_s, node_bytes = rng.uniform(0, 1e3, (n, k)), rng.uniform(0, 1e10, (n, k))
    edge_s = rng.uniform(0, 1, (n - 1, k, k)) * 10.0 ** rng.integers(-8, 8, (n - 1, k, k))
    choice = tuple(int(c) for c in rng.integers(0, k, n))
    got, want = (f(choice, node_s, node_bytes, edge_s) for f in (evaluate, _reference_evaluate))
    assert _bits(got) == _bits(want)


def _reference_step(
    t, m, opt, edge, node_s, node_bytes, finish, priced, lean, price, budget, upper
):
    """One node of ``_reference_pareto``'s walk, as it was (the body of its loop)."""
    tt = t[None, :] + edge[opt].T + node_s[:, None]
    mm = np.broadcast_to(m[None, :] + node_bytes[:, None], tt.shape)
    slack = price * (budget - mm) if price else 0.0
    bound = np.maximum(tt + finish[:, None], tt + priced[:, None] - slack)
    e_idx, j_idx = np.nonzero((bound <= upper) & np.isfinite(bound) & (mm + lean <= budget))
    tv, mv = tt[e_idx, j_idx], mm[e_idx, j_idx]
    order = np.lexsort((tv, mv, e_idx))
    e_idx, j_idx, tv, mv = e_idx[order], j_idx[order], tv[order], mv[order]
    keep = np.zeros(len(tv), dtype=bool)
    bounds = np.flatnonzero(np.r_[True, e_idx[1:] != e_idx[:-1], True]) if len(tv) else []
    for a, b in zip(bounds[:-1], bounds[1:]):
        keep[a] = True
        keep[a + 1 : b] = tv[a + 1 : b] < np.minimum.accumulate(tv[a:b])[:-1]
    return e_idx[keep], j_idx[keep], tv[keep], mv[keep]


@pytest.mark.parametrize("seed", range(30))
def test_one_step_keeps_the_same_pairs_in_the_same_order(seed):
    """``_extend`` against one step of the walk as first written, on fronts with many equal
    times and memories (small integers): the same options, parents, times, memories, in the
    same order (the order is what later steps' parents and the final tie-break read)."""
    rng = np.random.default_rng(seed)
    k, f = int(rng.integers(2, 7)), int(rng.integers(1, 60))
    opt = np.sort(rng.integers(0, k, f))
    t, m = rng.integers(0, 8, f).astype(float), rng.integers(0, 8, f).astype(float)
    edge = rng.integers(0, 3, (k, k)).astype(float)
    np.fill_diagonal(edge, 0.0)
    node_s, node_bytes = rng.integers(0, 4, k).astype(float), rng.integers(0, 4, k).astype(float)
    node_s[rng.random(k) < 0.2] = np.inf
    finish, priced = rng.integers(0, 5, k).astype(float), rng.integers(0, 9, k).astype(float)
    price = float(rng.choice([0.0, 0.5, 1.0]))
    lean, budget, upper = 2.0, float(rng.integers(8, 16)), float(rng.integers(6, 20))
    args = (t, m, opt, edge, node_s, node_bytes, finish, priced, lean, price, budget, upper)
    want = _reference_step(*args)
    live = np.flatnonzero(np.isfinite(node_s) & np.isfinite(finish))
    got = list(chain._extend(*args[:3], edge.T[live], *(a[live] for a in args[4:8]), *args[8:]))
    got[0] = live[got[0]]
    for g, w in zip(got, want):
        assert g.tobytes() == w.astype(g.dtype).tobytes()


@pytest.mark.parametrize("seed", range(20))
def test_batched_viterbi_is_solve_chain_dp_at_every_price(seed):
    """``_viterbi_prices`` then ``_trace`` give ``solve_chain_dp``'s choice at each price,
    ties included (small integers and integer prices: many equal sums; the lower option wins),
    and None exactly where it raises."""
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(1, 40)), int(rng.integers(1, 7))
    node_s = rng.integers(0, 3, (n, k)).astype(float)
    node_bytes = rng.integers(0, 3, (n, k)).astype(float)
    edge_s = rng.integers(0, 2, (max(n - 1, 0), k, k)).astype(float)
    node_bytes[rng.random((n, k)) < 0.1] = np.inf
    finite = np.isfinite(node_bytes)
    prices = [0.25, 0.5, 1.0, 2.0, 3.0]
    back, cost = chain._viterbi_prices(node_s, node_bytes, finite, edge_s, prices)
    for p, price in enumerate(prices):
        try:
            want = solve_chain_dp(np.where(finite, node_s + price * node_bytes, np.inf), edge_s)
        except ValueError:
            want = None
        assert chain._trace(back, cost, p) == want


@pytest.mark.parametrize("seed", range(40))
def test_compiled_sort_orders_as_numpys_stable_lexsort(seed, walks):
    """``chain_kernel._sort`` (the compiled walk's stable sort of a node's extensions by
    memory, then time) orders as ``np.lexsort`` does (the lower position first among equals), on
    keys in sorted runs like a front's and on random ones, with many ties."""
    from oases.planner import chain_kernel

    rng = np.random.default_rng(seed)
    f = int(rng.integers(1, 80))
    mm, tt = rng.integers(0, 6, f).astype(float), rng.integers(0, 6, f).astype(float)
    if seed % 2:  # a front: runs sorted by memory with time falling, as options' groups are
        cuts = np.sort(rng.integers(0, f + 1, int(rng.integers(0, 5))))
        for part in np.split(np.arange(f), cuts):
            mm[part], tt[part] = np.sort(mm[part]), np.sort(tt[part])[::-1]
    idx, tmp = np.empty(f, dtype=np.intp), np.empty(f, dtype=np.intp)
    got = chain_kernel._sort(mm, tt, idx, tmp, f)
    assert got.tolist() == np.lexsort((tt, mm)).tolist()


def test_pareto_ok_leaves_nan_and_minus_inf_to_numpy(walks):
    """The compiled Pareto walk takes finite and +inf inputs only (numpy orders NaNs its own
    way): with a NaN or a -inf the numpy walk runs."""
    from oases.planner import chain_kernel

    ok = np.array([[1.0, np.inf], [2.0, 3.0]])
    assert chain_kernel.pareto_ok(ok) == (walks == "compiled")
    for bad in (np.nan, -np.inf):
        assert not chain_kernel.pareto_ok(ok, np.array([0.0, bad]))
