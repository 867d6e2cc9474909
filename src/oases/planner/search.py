"""Choose the TP degree of every region of the chain: exact, under a memory budget.

The problem (PAPER.md section 3): a chain of N nodes (the attention and MLP regions of every
layer); node n at degree option d costs ``node_s[n, d]`` seconds and ``node_bytes[n, d]`` bytes
of device memory; consecutive nodes at options (d, e) pay ``edge_s[n, d, e]`` for the reshard
between them (zero when d == e). Minimize total time subject to total memory <= budget::

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

``solve_plan`` uses it on a model: node and edge costs from simulating uniform plans of the
schedule, then the solver's plan is simulated whole and compared with every uniform plan, so the
answer is the best plan by the same simulation that predicts every other.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import numpy as np

from oases.config import ModelConfig
from oases.plan import ParallelPlan, RegionPlan, region_names
from oases.planner.costs import (
    BYTES,
    OPTIMIZER_STATES,
    Costs,
    region_kind,
    region_param_count,
)
from oases.planner.simulate import (
    BatchShape,
    BatchSplitError,
    PlanResult,
    region_rows,
    saved_bytes,
    simulate_plan,
)
from oases.schedule.program import SPECS


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


def solve_chain_pareto(node_s: np.ndarray, node_bytes: np.ndarray, edge_s: np.ndarray,
                       budget_bytes: float) -> tuple[int, ...] | None:
    """The minimum-time choice within the budget (``inf`` bans an option), exactly: walk the
    chain keeping, for every option of the current node, the partial choices that no other
    beats in both time and memory. None when a front outgrows ``PARETO_LIMIT`` (or nothing
    fits)."""
    n, k = node_s.shape
    # Bounds that never cut an optimal choice: the fastest way to finish from node i at option
    # e (memory ignored), the leanest memory the nodes after i need, and the time of a choice
    # known to fit (each node at its leanest option, or a uniform choice that fits).
    finish = np.zeros((n, k))
    for i in range(n - 2, -1, -1):
        finish[i] = (edge_s[i] + node_s[i + 1] + finish[i + 1]).min(axis=1)
    lean_after = np.r_[np.cumsum(node_bytes.min(axis=1)[::-1])[::-1][1:], 0.0]
    known = [tuple(int(v) for v in node_bytes.argmin(axis=1))]
    known += [(d,) * n for d in range(k) if node_bytes[:, d].sum() <= budget_bytes]
    upper = min(evaluate(c, node_s, node_bytes, edge_s).time_s for c in known)
    upper = upper * (1 + 1e-12) + 1e-12 if np.isfinite(upper) else np.inf
    # the front of node i: every kept partial choice, its option, time, memory, and where it
    # came from (its index in node i-1's front); fronts are sorted by option
    ok = np.isfinite(node_s[0]) & (node_bytes[0] <= budget_bytes)
    opt = np.flatnonzero(ok)
    t, m, parent = node_s[0, opt], node_bytes[0, opt], np.zeros(len(opt), dtype=int)
    history = [(opt, parent)]
    for i in range(1, n):
        if not len(t):
            return None
        # every extension of every kept choice: [options of node i, kept choices]
        tt = t[None, :] + edge_s[i - 1][opt].T + node_s[i][:, None]
        mm = np.broadcast_to(m[None, :] + node_bytes[i][:, None], tt.shape)
        bound = tt + finish[i][:, None]
        e_idx, j_idx = np.nonzero((bound <= upper) & np.isfinite(bound)
                                  & (mm + lean_after[i] <= budget_bytes))
        tv, mv = tt[e_idx, j_idx], mm[e_idx, j_idx]
        order = np.lexsort((tv, mv, e_idx))  # by option, then memory, then time
        e_idx, j_idx, tv, mv = e_idx[order], j_idx[order], tv[order], mv[order]
        # keep a choice if it is faster than every cheaper-or-equal one of its option
        keep = np.zeros(len(tv), dtype=bool)
        bounds = np.flatnonzero(np.r_[True, e_idx[1:] != e_idx[:-1], True]) if len(tv) else []
        for a, b in zip(bounds[:-1], bounds[1:]):
            keep[a] = True
            keep[a + 1:b] = tv[a + 1:b] < np.minimum.accumulate(tv[a:b])[:-1]
        if keep.sum() > PARETO_LIMIT:
            return None
        opt, parent, t, m = e_idx[keep], j_idx[keep], tv[keep], mv[keep]
        history.append((opt, parent))
    if not len(t):
        return None
    j = int(np.argmin(t))  # (ties: the first, i.e. the lowest option and memory)
    choice = []
    for opt, parent in reversed(history):
        choice.append(int(opt[j]))
        j = int(parent[j])
    return tuple(reversed(choice))


def solve_chain(node_s: np.ndarray, node_bytes: np.ndarray, edge_s: np.ndarray,
                budget_bytes: float, time_limit_s: float = 30.0) -> ChainSolution:
    """Exact minimum-time choice under the budget: the dynamic program's answer when it fits,
    else the Pareto dynamic program's (HiGHS's MILP if the fronts grow too large). Infeasible
    options are given as ``inf`` in node_s or node_bytes. Raises ValueError naming the
    smallest feasible budget."""
    node_s, node_bytes, edge_s = (np.asarray(a, dtype=float) for a in (node_s, node_bytes,
                                                                         edge_s))
    n, k = _check(node_s, node_bytes, edge_s)
    if min_memory_bytes(node_bytes) > budget_bytes:
        raise _infeasible(budget_bytes, node_bytes)
    banned = ~(np.isfinite(node_s) & np.isfinite(node_bytes))
    try:
        free = evaluate(solve_chain_dp(np.where(banned, np.inf, node_s), edge_s), node_s,
                        node_bytes, edge_s)
    except ValueError:
        raise _infeasible(budget_bytes, node_bytes) from None
    if free.memory_bytes <= budget_bytes:  # the memory row does not bind
        return free
    choice = solve_chain_pareto(np.where(banned, np.inf, node_s), node_bytes, edge_s,
                                budget_bytes)
    if choice is not None:
        return evaluate(choice, node_s, node_bytes, edge_s)
    return _solve_chain_milp(node_s, node_bytes, edge_s, banned, budget_bytes, time_limit_s)


def _solve_chain_milp(node_s: np.ndarray, node_bytes: np.ndarray, edge_s: np.ndarray,
                      banned: np.ndarray, budget_bytes: float,
                      time_limit_s: float) -> ChainSolution:
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
    i, d, e = (a.ravel() for a in np.meshgrid(np.arange(n - 1), np.arange(k), np.arange(k),
                                               indexing="ij"))
    y = nx + (i * k + d) * k + e
    r_out, r_in = n + 2 * k * i + d, n + 2 * k * i + k + e
    j, o = (a.ravel() for a in np.meshgrid(np.arange(n - 1), np.arange(k), indexing="ij"))
    r_x_out, r_x_in = n + 2 * k * j + o, n + 2 * k * j + k + o
    row = np.concatenate([r_node, r_out, r_in, r_x_out, r_x_in, np.full(nx, rows - 1)])
    col = np.concatenate([c_node, y, y, j * k + o, (j + 1) * k + o, np.arange(nx)])
    val = np.concatenate([np.ones(nx + 2 * len(y)), -np.ones(2 * len(j)),
                          np.where(banned, 0.0, node_bytes).ravel()])  # memory knapsack
    a = coo_matrix((val, (row, col)), shape=(rows, nx + ne)).tocsr()
    lo, hi = np.zeros(rows), np.zeros(rows)
    lo[:n] = hi[:n] = 1.0
    lo[-1], hi[-1] = -np.inf, budget_bytes
    res = milp(cost, constraints=LinearConstraint(a, lo, hi),
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


# -------------------------------------------------------------------------- plans of a model
@dataclass
class Candidate:
    """One plan the planner considered, with its simulated step time and peak memory."""

    plan: ParallelPlan
    result: PlanResult
    fits: bool
    kind: str  # "uniform" | "searched"

    def label(self) -> str:
        degrees = self.plan.degrees()
        layout = (f"uniform tp={degrees[0]}" if len(degrees) == 1 else
                  "mixed tp " + "/".join(str(d) for d in degrees))
        return f"{layout}, {self.plan.schedule}, n_sub={self.plan.n_sub}"


def candidate_degrees(cfg: ModelConfig, world_size: int, limit: int | None = None) -> list[int]:
    """Powers of two dividing the world size, heads, kv heads and ffn (up to ``limit``)."""
    out, t = [], 1
    while t <= min(world_size, limit or world_size):
        if not (world_size % t or cfg.n_heads % t or cfg.n_kv_heads % t or cfg.ffn_dim % t):
            out.append(t)
        t *= 2
    return out


def _simulate(cfg: ModelConfig, plan: ParallelPlan, costs: Costs, world_size: int,
              batch: BatchShape, max_inflight: int) -> PlanResult | None:
    try:
        return simulate_plan(cfg, plan, costs, world_size, batch, max_inflight=max_inflight,
                             timeline=False)
    except BatchSplitError:  # not a candidate: the batch does not split at these degrees
        return None


def _node_costs(cfg: ModelConfig, costs: Costs, world_size: int, batch: BatchShape,
                schedule: str, n_sub: int, degrees: list[int], uniform: dict[int, PlanResult],
                max_inflight: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-region seconds and bytes at each degree, and reshard edge seconds, for the chain
    solver. A layer's seconds are its marginal in the simulated uniform plan (L layers minus
    L-1), so overlap, exposed collectives and DP synchronization are priced as the schedule
    runs them; the layer is split between attention and MLP by their compute."""
    names = region_names(cfg)
    n, k = len(names), len(degrees)
    node_s = np.full((n, k), np.inf)
    node_bytes = np.full((n, k), np.inf)
    edge_s = np.zeros((max(n - 1, 0), k, k))
    shorter = dataclasses.replace(cfg, n_layers=cfg.n_layers - 1) if cfg.n_layers > 1 else None
    mode = SPECS[schedule].recompute
    subs = n_sub if SPECS[schedule].overlapped else 1
    for d, t in enumerate(degrees):
        full = uniform.get(t)
        if full is None:
            continue
        plan = ParallelPlan.uniform(cfg, world_size, t, schedule=schedule, n_sub=n_sub)
        rows = region_rows(plan, world_size, batch, subs)
        part = {}
        for kind in ("attn", "mlp"):
            part[kind] = sum(costs.compute_s(kind, ph, pc, t, rows[1]) for ph, pc in
                             (("forward", "body"), ("backward", "tp"), ("backward", "norm")))
        if shorter is not None:
            less = _simulate(shorter, ParallelPlan.uniform(shorter, world_size, t,
                                                           schedule=schedule, n_sub=n_sub),
                             costs, world_size, batch, max_inflight)
            layer_s = full.step_s - less.step_s if less is not None else 0.0
        else:
            layer_s = full.step_s / 2
        ends = max(0.0, full.step_s - cfg.n_layers * layer_s) / 2
        share = part["attn"] / max(part["attn"] + part["mlp"], 1e-30)
        for i, name in enumerate(names):
            kind = region_kind(name)
            node_s[i, d] = {"attn": layer_s * share, "mlp": layer_s * (1 - share)}.get(kind,
                                                                                        ends)
            params = region_param_count(cfg, kind, t) * BYTES * (2 + OPTIMIZER_STATES)
            kept = saved_bytes(costs, cfg, kind, mode, t, rows[i])
            node_bytes[i, d] = params + subs * kept
    act = batch.micro_rows * cfg.seq_len * cfg.dim * BYTES  # [M, S, H] of the whole world
    for a, ta in enumerate(degrees):
        for b, tb in enumerate(degrees):
            if ta != tb:
                lo, hi = sorted((ta, tb))
                gathered = act * hi // world_size  # rows a rank holds at the larger degree
                edge_s[:, a, b] = batch.n_micro() * costs.collective_s("all_gather", hi // lo,
                                                                       gathered)
    return node_s, node_bytes, edge_s


def solve_plan(cfg: ModelConfig, costs: Costs, world_size: int, batch: BatchShape,
               budget_bytes: float, *, schedules: tuple[str, ...] = tuple(SPECS),
               n_subs: tuple[int, ...] = (1, 2, 4), degrees: list[int] | None = None,
               max_inflight: int = 1) -> tuple[Candidate, list[Candidate]]:
    """The fastest predicted plan under ``budget_bytes`` per device, and every candidate.

    For each schedule and sub-batch count: every uniform degree is simulated; then the chain
    solver picks a degree per region (exact for the additive model of ``_node_costs``, with
    memory as a knapsack row), and the plan it returns is simulated as a whole. The answer is
    the best *simulated* plan, so it is never worse than the best uniform one as predicted.
    Raises ValueError naming the smallest feasible budget when nothing fits."""
    degrees = degrees or candidate_degrees(cfg, world_size)
    candidates: list[Candidate] = []
    for schedule in schedules:
        # an overlapped schedule with one sub-batch is its non-overlapped twin
        subs = [k for k in n_subs if k > 1] if SPECS[schedule].overlapped else (1,)
        for n_sub in subs:
            uniform = {}
            for t in degrees:
                plan = ParallelPlan.uniform(cfg, world_size, t, schedule=schedule, n_sub=n_sub)
                res = _simulate(cfg, plan, costs, world_size, batch, max_inflight)
                if res is not None:
                    uniform[t] = res
                    candidates.append(Candidate(plan, res, res.peak_mem_bytes <= budget_bytes,
                                                "uniform"))
            if len(uniform) < 2:
                continue
            searched = _search(cfg, costs, world_size, batch, budget_bytes, schedule, n_sub,
                               degrees, uniform, max_inflight)
            if searched is not None and not any(
                    c.plan.regions == searched.plan.regions and c.plan.schedule == schedule
                    and c.plan.n_sub == n_sub for c in candidates):
                candidates.append(searched)
    if not candidates:
        raise ValueError(f"no plan splits the batch ({batch.global_batch} sequences, "
                         f"micro-batch {batch.micro_rows}) over {world_size} ranks at degrees "
                         f"{degrees}")
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        lean = min(candidates, key=lambda c: c.result.peak_mem_bytes)
        raise ValueError(f"no plan fits in {budget_bytes / 2**30:.3f} GiB per device; the "
                         f"smallest feasible budget is {lean.result.peak_mem_bytes / 2**30:.3f}"
                         f" GiB ({lean.label()})")
    best = min(fitting, key=lambda c: c.result.step_s)
    best.plan.predicted_step_s = best.result.step_s
    best.plan.predicted_peak_mem_bytes = int(best.result.peak_mem_bytes)
    return best, candidates


def _search(cfg: ModelConfig, costs: Costs, world_size: int, batch: BatchShape,
            budget_bytes: float, schedule: str, n_sub: int, degrees: list[int],
            uniform: dict[int, PlanResult], max_inflight: int) -> Candidate | None:
    """Chain-solve, simulate, and tighten the solver's budget by any overshoot (a few times)."""
    node_s, node_bytes, edge_s = _node_costs(cfg, costs, world_size, batch, schedule, n_sub,
                                             degrees, uniform, max_inflight)
    # what the additive memory model leaves out (baseline, transients), from the uniform plans
    extra = min(res.peak_mem_bytes - node_bytes[:, degrees.index(t)].sum()
                for t, res in uniform.items())
    names = region_names(cfg)
    options = [None] if not cfg.tie_embeddings else degrees
    best: Candidate | None = None
    for tied in options:
        s = node_s.copy()
        if tied is not None:  # a tied embedding and head share one degree
            for i in (0, len(names) - 1):
                s[i, [d for d, t in enumerate(degrees) if t != tied]] = np.inf
        limit = budget_bytes - extra
        for _ in range(4):
            try:
                sol = solve_chain(s, node_bytes, edge_s, limit)
            except ValueError:
                break
            plan = ParallelPlan([RegionPlan(name, degrees[d], world_size // degrees[d])
                                 for name, d in zip(names, sol.choice)],
                                n_sub=n_sub, schedule=schedule)
            res = _simulate(cfg, plan, costs, world_size, batch, max_inflight)
            if res is None:
                break
            cand = Candidate(plan, res, res.peak_mem_bytes <= budget_bytes, "searched")
            if cand.fits:  # (a plan over the budget never outranks one within it)
                if best is None or not best.fits or res.step_s < best.result.step_s:
                    best = cand
                break
            limit -= res.peak_mem_bytes - budget_bytes  # the model was optimistic: tighten
            best = best or cand
    return best
