"""Lower bounds on every plan of a chain of the plan search (one micro-batch, schedule,
sub-batch count, ZeRO stage and sequence-parallel mode; a TP degree per region free), which
let the fast search skip a chain that cannot change its answer (``planner.search``).

Every term is a sum over the regions of what region i holds or runs at its degree t,
whatever the other regions' degrees (``region_prices``)::

    c_i(t)  compute: the compute stream runs every piece of every region one after another
            (a wait only adds); the glue a recompute skips at a degree change is left out
    e_i(t)  region i's own TP collectives waited at once (the next instruction is their
            wait): the compute stream idles for each whole. Counted with one sub-batch only
            (the synchronous schedules): there a collective's result is what the next piece
            reads, at any neighbour's degree (checked on random mixed plans by
            ``tests/test_search_bounds.py``); merak's two sub-batches per block wait theirs
            in another order where the degree changes, so sub-batched schedules count none
    p_i(t)  region i's own TP collectives: they run on the one stream of rank 0's TP group at
            degree t, one after another (a stream's flights are chained)
    A_i(t)  weights + Adam moments + the optimizer's copy of what it updates + the gradient
            left at the step's end (whole at stage 0, a shard above): the optimizer step
            (``peak_memory``)
    B_i(t)  weights + Adam moments + the activations region i keeps for one sub-batch (k of
            them without sequence parallelism, whose sub-batches all finish their forward
            before any backward): the turn from the first forward to its backward

so that for every plan x of the chain (``extra``: the baseline and workspace)::

    step >= sum_i c_i(x_i) + e_i(x_i),   step >= sum_{i: x_i = t} p_i(t) for every t
    peak >= extra + max(sum_i A_i(x_i), sum_i B_i(x_i))

``chain_bounds`` returns the least peak of any plan (each region at its leanest degree) and
the least step of any plan that fits the budget: for any weights a, b_t >= 0 summing to 1 and
prices l, m >= 0 (weak duality: a weighted mean of lower bounds is one, and a plan that fits
has ``l (sum A - room) + m (sum B - room) <= 0``)::

    step >= sum_i min_t [a (c_i + e_i)(t) + b_t p_i(t) + l A_i(t) + m B_i(t)] - (l + m) room

with ``room`` = budget - extra. The weights and prices are the duals of the linear relaxation
(HiGHS through ``scipy.optimize.linprog``, over the distinct regions: a model's blocks are
identical); the bound is then evaluated from them directly, so a solver's tolerance never makes
it unsafe, only less tight. (Without a budget it is the best of a = 1, b = 0: the old compute
bound, now with the collectives waited at once.)

Each is computed in floating point in another order than the simulation's, so both are
lowered by ``MARGIN`` (relative to the terms' magnitude) before a comparison.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from oases.config import ModelConfig
from oases.plan import ParallelPlan
from oases.planner.batch import BatchShape, BatchSplitError, region_rows
from oases.planner.candidate import with_zero
from oases.planner.costs import Costs, region_kind, sp_mode
from oases.planner.layout import model_state
from oases.planner.peak_memory import saved_bytes
from oases.planner.precision import precision_of
from oases.planner.region_prices import region_compute_s, region_tp_comm_s
from oases.schedule.program import SPECS

MARGIN = 1e-9


@dataclass(frozen=True)
class ChainPrices:
    """The per-region terms of a chain's bounds (module docstring), one column per degree
    the chain takes (``degrees``): ``compute`` c, ``waited`` e, ``comm`` p (seconds),
    ``state`` A and ``turn`` B (bytes), each [regions, degrees]; ``extra`` the bytes every
    plan holds beside them."""

    degrees: list[int]
    compute: np.ndarray
    waited: np.ndarray
    comm: np.ndarray
    state: np.ndarray
    turn: np.ndarray
    extra: float


def chain_prices(
    cfg: ModelConfig,
    costs: Costs,
    world_size: int,
    batch: BatchShape,
    schedule: str,
    n_sub: int,
    zero: int,
    sp: str,
    degrees: list[int],
    max_inflight: int,
) -> ChainPrices | None:
    """The chain's ``ChainPrices`` at each of ``degrees`` that it takes (each splits the
    batch; above 1 with a ZeRO stage; dividing the sequence with sequence parallelism
    ``sp``), read off its uniform plans; None where no degree does."""
    spec = SPECS[schedule]
    k = n_sub if spec.overlapped else 1
    prec = precision_of(costs)
    w = prec.master_bytes
    seq = sp or ("gathered" if spec.sequence_parallel else "")  # (megatron-sp: always)
    modes = {sp_mode(spec.recompute, seq or None)}
    activations = 1 if seq else k  # sub-batches whose forwards all precede any backward
    taken: list[int] = []
    compute: list[list[float]] = []
    comm: list[list[float]] = []
    waited: list[list[float]] = []
    state_bytes: list[list[float]] = []
    turn_bytes: list[list[float]] = []
    for t in degrees:
        if (zero and t == world_size) or (sp and cfg.seq_len % t):
            continue
        plan = with_zero(
            ParallelPlan.uniform(
                cfg, world_size, t, schedule=schedule, n_sub=n_sub, sequence_parallel=sp
            ),
            zero,
        )
        try:
            rows = region_rows(plan, world_size, batch, k)
        except BatchSplitError:
            continue
        try:
            seconds = region_compute_s(
                cfg, plan, costs, world_size, batch, max_inflight=max_inflight
            )
            tp = region_tp_comm_s(cfg, plan, costs, world_size, batch, max_inflight=max_inflight)
        except ValueError:  # costs that cannot price it: the plan's simulation says so
            seconds = tp = None
        taken.append(t)
        compute.append(seconds if seconds is not None else [0.0] * len(rows))
        comm.append(tp[0] if tp is not None else [0.0] * len(rows))
        # (one sub-batch only: a merak block of two reorders its waits at a degree change)
        waited.append(tp[1] if tp is not None and k == 1 else [0.0] * len(rows))
        state = model_state(cfg, plan, world_size)
        # (the chain's plan of degree 1 everywhere runs without sequence parallelism)
        modes_t = modes | {spec.recompute} if seq and t == 1 else modes
        held, turn = [], []
        for i, r in enumerate(plan.regions):
            stage = state.stages[i]
            updated = state.updated(i)
            weights = (
                state.numel[i] if stage == 0 else state.padded(i) if stage < 3 else state.shard(i)
            )
            resident = w * weights + prec.optimizer_bytes * updated
            grads = state.numel[i] if stage == 0 else state.shard(i)
            held.append(resident + w * updated + w * grads)
            kept = min(
                saved_bytes(costs, cfg, region_kind(r.name), mode, t, rows[i]) for mode in modes_t
            )
            turn.append(resident + activations * kept)
        state_bytes.append(held)
        turn_bytes.append(turn)
    if not taken:
        return None
    extra = float(getattr(costs, "baseline_bytes", 0.0)) + float(
        getattr(costs, "workspace_bytes", 0.0)
    )
    columns = (np.array(x, dtype=float).T for x in (compute, waited, comm, state_bytes, turn_bytes))
    return ChainPrices(taken, *columns, extra)


def chain_bounds(
    cfg: ModelConfig,
    costs: Costs,
    world_size: int,
    batch: BatchShape,
    schedule: str,
    n_sub: int,
    zero: int,
    sp: str,
    degrees: list[int],
    max_inflight: int,
    budget_bytes: float = math.inf,
) -> tuple[float, float]:
    """(step seconds, peak bytes): no plan of the chain that fits ``budget_bytes`` steps
    faster, and no plan at all peaks lower (``chain_prices``'s degrees). (0, 0) where no
    degree splits the batch."""
    found = chain_prices(
        cfg, costs, world_size, batch, schedule, n_sub, zero, sp, degrees, max_inflight
    )
    if found is None:
        return 0.0, 0.0

    def least(per_degree: np.ndarray) -> float:
        return sum(min(row) for row in per_degree.tolist())

    peak = found.extra + max(least(found.state), least(found.turn))
    step = max(
        least(found.compute) * (1 - MARGIN),
        joint_step_bound(
            found.compute + found.waited,
            found.comm,
            found.state,
            found.turn,
            budget_bytes - found.extra,
        ),
    )
    return step, peak * (1 - MARGIN)


def joint_step_bound(
    serial: np.ndarray, streams: np.ndarray, a: np.ndarray, b: np.ndarray, room: float
) -> float:
    """The least step of any plan that fits ``room`` (module docstring): ``serial`` [n, K]
    (c + e), ``streams`` [n, K] (p), ``a``, ``b`` [n, K] (the two moments' bytes), K degrees.
    Lowered by ``MARGIN`` times the magnitude of its terms; -inf where no plan fits at all
    (``chain_bounds`` names the least peak apart)."""
    rows, count = np.unique(
        np.concatenate([serial, streams, a, b], axis=1), axis=0, return_counts=True
    )
    k = serial.shape[1]
    s, p, ma, mb = (rows[:, j * k : (j + 1) * k] for j in range(4))
    weights = _duals(s, p, ma, mb, count, room)
    if weights is None:  # the weights of the compute stream alone
        weights = 1.0, np.zeros(k), 0.0, 0.0
    alpha, beta, lam, mu = weights
    terms = alpha * s + beta[None, :] * p
    if lam or mu:
        terms = terms + lam * ma + mu * mb
    least = terms.min(axis=1)
    price = (lam + mu) * room if (lam or mu) else 0.0
    bound = float((count * least).sum()) - price
    scale = float((count * np.abs(least)).sum()) + abs(price)
    return bound - MARGIN * scale


def _duals(
    s: np.ndarray, p: np.ndarray, ma: np.ndarray, mb: np.ndarray, count: np.ndarray, room: float
) -> tuple[float, np.ndarray, float, float] | None:
    """(a, b, l, m) of ``joint_step_bound`` from the linear relaxation's duals: variables
    y[g, t] (how many regions of distinct row g at degree t) and z, minimize z subject to
    z >= sum y (c + e), z >= sum_g y[g, t] p[g, t] for each t, sum y A <= room, sum y B <=
    room, sum_t y[g, t] = count[g]. None where it has no answer (nothing fits, or HiGHS
    fails)."""
    from scipy.optimize import linprog

    g, k = s.shape
    finite = np.isfinite(s) & np.isfinite(p) & np.isfinite(ma) & np.isfinite(mb)
    n_var = g * k + 1
    memory = np.isfinite(room)
    ub = np.zeros((1 + k + 2 * memory, n_var))
    ub[0, :-1] = np.where(finite, s, 0.0).ravel()
    for t in range(k):
        row = np.zeros((g, k))
        row[:, t] = np.where(finite[:, t], p[:, t], 0.0)
        ub[1 + t, :-1] = row.ravel()
    ub[: 1 + k, -1] = -1.0
    rhs = np.zeros(len(ub))
    if memory:
        ub[1 + k, :-1] = np.where(finite, ma, 0.0).ravel()
        ub[2 + k, :-1] = np.where(finite, mb, 0.0).ravel()
        rhs[1 + k :] = room
    eq = np.zeros((g, n_var))
    for j in range(g):
        eq[j, j * k : (j + 1) * k] = 1.0
    bounds = [(0.0, None if ok else 0.0) for ok in finite.ravel()] + [(None, None)]
    cost = np.zeros(n_var)
    cost[-1] = 1.0
    try:
        res = linprog(cost, A_ub=ub, b_ub=rhs, A_eq=eq, b_eq=count, bounds=bounds, method="highs")
    except ValueError:
        return None
    if res.status != 0:
        return None
    dual = np.maximum(-np.asarray(res.ineqlin.marginals, dtype=float), 0.0)
    total = dual[0] + dual[1 : 1 + k].sum()
    if not total > 0:
        return None
    dual = dual / total
    lam, mu = (float(dual[1 + k]), float(dual[2 + k])) if memory else (0.0, 0.0)
    return float(dual[0]), dual[1 : 1 + k], lam, mu
