"""One chain of the plan search: a schedule, sub-batch count, ZeRO stage, sequence-parallel
mode and micro-batch, with a TP degree per region to choose (``ChainModel``).

``node_costs`` prices the chain for the chain solver (``planner.chain``) from simulated uniform
plans: a layer's seconds at a degree are its marginal in the uniform plan (L layers minus L-1),
a region's bytes its state and kept activations, an edge's seconds the reshard between two
degrees. ``ChainModel.fastest`` solves it under a memory limit and simulates the answer
(tightening the limit by the simulated overshoot, a few times); ``ChainModel.leanest`` finds
its least-memory plan; ``least_memory`` asks the chains near the least peak of a search for
their fastest plan under it. Every simulation goes through the ``simulate`` the search gives
(``(cfg, plan, batch) -> PlanResult | None``, None where the batch does not split).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from oases.config import ModelConfig
from oases.plan import ParallelPlan, region_names
from oases.planner.batch import BatchShape, region_rows
from oases.planner.candidate import Candidate, plan_of, state_factors, with_zero
from oases.planner.chain import ChainSolution, solve_chain, solve_chain_minmax
from oases.planner.costs import Costs, region_kind, region_param_count, sp_mode
from oases.planner.peak_memory import saved_bytes
from oases.planner.precision import precision_of
from oases.planner.simulate import PlanResult
from oases.schedule.program import SPECS

Simulate = Callable[[ModelConfig, ParallelPlan, BatchShape], "PlanResult | None"]


def node_costs(
    cfg: ModelConfig,
    costs: Costs,
    world_size: int,
    batch: BatchShape,
    schedule: str,
    n_sub: int,
    degrees: list[int],
    uniform: dict[int, PlanResult],
    simulate: Simulate,
    zero: int = 0,
    sp: str = "",
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per-region seconds and bytes at each degree, reshard edge seconds, and per-region
    parameter bytes (master dtype, ``inf`` where a degree does not split the batch), for the chain
    solver. A layer's seconds are its marginal in the simulated uniform plan (L layers minus
    L-1), so overlap, exposed collectives and DP synchronization are priced as the schedule
    runs them; the layer is split between attention and MLP by their compute. A region's bytes
    are its parameters, gradients and Adam moments (``state_factors`` at ZeRO stage ``zero``)
    and the activations it keeps. ``sp``: sequence parallelism's mode ("" off): its pieces,
    saved activations, and reshards that gather over the larger degree's group both ways.
    ``simulate`` simulates the uniform plans of one layer less."""
    names = region_names(cfg)
    n, k = len(names), len(degrees)
    prec = precision_of(costs)
    node_s = np.full((n, k), np.inf)
    node_bytes = np.full((n, k), np.inf)
    param_bytes = np.full((n, k), np.inf)
    edge_s = np.zeros((max(n - 1, 0), k, k))
    shorter = dataclasses.replace(cfg, n_layers=cfg.n_layers - 1) if cfg.n_layers > 1 else None
    mode = sp_mode(SPECS[schedule].recompute, sp or None)
    subs = n_sub if SPECS[schedule].overlapped else 1
    whole = (("forward", "body"), ("backward", "tp"), ("backward", "norm"))
    sliced = (
        ("forward", "sp-core"),
        ("forward", "sp-norm"),
        ("backward", "tp"),
        ("backward", "sp-norm"),
    )
    for d, t in enumerate(degrees):
        full = uniform.get(t)
        if full is None:
            continue
        plan = with_zero(
            ParallelPlan.uniform(
                cfg, world_size, t, schedule=schedule, n_sub=n_sub, sequence_parallel=sp
            ),
            zero,
        )
        rows = region_rows(plan, world_size, batch, subs)
        part = {}
        pieces = sliced if sp and t > 1 else whole  # (at degree 1 nothing is sliced)
        for kind in ("attn", "mlp"):
            part[kind] = sum(costs.compute_s(kind, ph, pc, t, rows[1]) for ph, pc in pieces)
        if shorter is not None:
            less = simulate(
                shorter,
                with_zero(
                    ParallelPlan.uniform(
                        shorter, world_size, t, schedule=schedule, n_sub=n_sub, sequence_parallel=sp
                    ),
                    zero,
                ),
                batch,
            )
            layer_s = full.step_s - less.step_s if less is not None else 0.0
        else:
            layer_s = full.step_s / 2
        ends = max(0.0, full.step_s - cfg.n_layers * layer_s) / 2
        share = part["attn"] / max(part["attn"] + part["mlp"], 1e-30)
        for i, name in enumerate(names):
            kind = region_kind(name)
            node_s[i, d] = {"attn": layer_s * share, "mlp": layer_s * (1 - share)}.get(kind, ends)
            param_bytes[i, d] = region_param_count(cfg, kind, t) * prec.master_bytes
            kept = saved_bytes(costs, cfg, kind, mode, t, rows[i])
            node_bytes[i, d] = (
                param_bytes[i, d] * state_factors(zero, world_size // t)[0] + subs * kept
            )
    # [M, S, H] of the whole world, in the compute dtype
    act = batch.micro_rows * cfg.seq_len * cfg.dim * prec.activation_bytes
    for a, ta in enumerate(degrees):
        for b, tb in enumerate(degrees):
            if ta != tb:
                lo, hi = sorted((ta, tb))
                gathered = act * hi // world_size  # rows a rank holds at the larger degree
                if sp:  # both directions gather the whole over the larger degree's group
                    edge_s[:, a, b] = (
                        2 * batch.n_micro() * costs.collective_s("all_gather", hi, gathered)
                    )
                else:
                    edge_s[:, a, b] = batch.n_micro() * costs.collective_s(
                        "all_gather", hi // lo, gathered
                    )
    return node_s, node_bytes, edge_s, param_bytes


def least_memory(
    candidates: list[Candidate],
    models: list[ChainModel],
    add: Callable[[Candidate | None, BatchShape], bool],
    budget_bytes: float,
    rounds: int = 3,
    near: float = 1.1,
) -> Candidate:
    """The candidate of least peak memory, after asking the chain models whose own leanest
    plan comes within ``near`` of it for their fastest plan under that peak (a few rounds,
    while one comes out leaner): so that the budget named is one the search itself meets
    (the chain's memory row is a model of the peak, not the simulated peak)."""
    least = min(candidates, key=lambda c: c.result.peak_mem_bytes)
    close = [m for m in models if m.lean_peak <= near * least.result.peak_mem_bytes]
    for _ in range(rounds):
        leaner = None
        for model in close:
            cand = model.fastest(least.result.peak_mem_bytes, budget_bytes)
            if cand is not None and cand.result.peak_mem_bytes < least.result.peak_mem_bytes:
                if not add(cand, model.batch):
                    continue  # known already
                if leaner is None or cand.result.peak_mem_bytes < leaner.result.peak_mem_bytes:
                    leaner = cand
        if leaner is None:
            break
        least = leaner
    return least


class ChainModel:
    """One schedule and sub-batch count priced as a chain (``_node_costs``), with the gap
    between the chain's additive memory and the simulated peaks of the uniform plans."""

    def __init__(
        self,
        cfg: ModelConfig,
        costs: Costs,
        world_size: int,
        batch: BatchShape,
        schedule: str,
        n_sub: int,
        degrees: list[int],
        uniform: dict[int, PlanResult],
        simulate: Simulate,
        zero: int = 0,
        sp: str = "",
        solves: dict | None = None,
    ) -> None:
        self.cfg, self.costs, self.world_size, self.batch = cfg, costs, world_size, batch
        self.schedule, self.n_sub, self.degrees = schedule, n_sub, degrees
        self.simulate, self.zero, self.sp = simulate, zero, sp
        # ``fastest``'s solves, kept by their whole input (the search's, shared with its
        # worker: ``search_prefetch``); None: not kept
        self.solves = solves
        self.node_s, self.node_bytes, self.edge_s, params = node_costs(
            cfg, costs, world_size, batch, schedule, n_sub, degrees, uniform, simulate, zero, sp
        )
        # what the additive memory model leaves out (baseline, transients), from the uniform
        # plans
        self.extra = min(
            res.peak_mem_bytes - self.node_bytes[:, degrees.index(t)].sum()
            for t, res in uniform.items()
        )
        # the peak is the larger of two moments: the turn from forward to backward (weights,
        # Adam moments and every kept activation; every gradient too after a first
        # micro-batch) and the optimizer step (weights, gradients, moments, one more copy)
        factors = [state_factors(zero, world_size // t) for t in degrees]
        grads = np.where(np.isfinite(params), params * [f[1] for f in factors], 0.0)
        turn = self.node_bytes - grads if batch.n_micro() == 1 else self.node_bytes
        self.peak_rows = (turn, params * [f[2] for f in factors])
        n = len(region_names(cfg))
        self.ties: list[list[int] | None] = [None]
        if cfg.tie_embeddings:  # a tied embedding and head share one degree
            self.ties = [
                [d for d in range(len(degrees)) if d != tied] for tied in range(len(degrees))
            ]
        self.n = n
        self.lean_peak = float("inf")  # the simulated peak of ``leanest``, once asked

    def _tied(self, rows: np.ndarray, other: list[int] | None) -> np.ndarray:
        rows = rows.copy()
        if other is not None:
            rows[0, other] = rows[self.n - 1, other] = np.inf
        return rows

    def _candidate(
        self, choice: tuple[int, ...], budget_bytes: float, kind: str
    ) -> Candidate | None:
        plan = with_zero(
            plan_of(
                self.cfg, choice, self.degrees, self.world_size, self.schedule, self.n_sub, self.sp
            ),
            self.zero,
        )
        res = self.simulate(self.cfg, plan, self.batch)
        return (
            None if res is None else Candidate(plan, res, res.peak_mem_bytes <= budget_bytes, kind)
        )

    def fastest(self, limit_bytes: float, budget_bytes: float | None = None) -> Candidate | None:
        """The chain solver's fastest plan under ``limit_bytes`` (tightened by any overshoot, a
        few times), simulated; ``fits`` against ``budget_bytes`` (default: the limit)."""
        budget_bytes = limit_bytes if budget_bytes is None else budget_bytes
        best: Candidate | None = None
        for other in self.ties:
            s = self._tied(self.node_s, other)
            limit = limit_bytes - self.extra
            for _ in range(4):
                sol = self._solve(s, limit)
                if sol is None:
                    break
                cand = self._candidate(sol.choice, budget_bytes, "searched")
                if cand is None:
                    break
                if cand.result.peak_mem_bytes <= limit_bytes:
                    if (
                        best is None
                        or best.result.peak_mem_bytes > limit_bytes
                        or cand.result.step_s < best.result.step_s
                    ):
                        best = cand
                    break
                limit -= cand.result.peak_mem_bytes - limit_bytes  # optimistic: tighten
                best = best or cand
        return best

    def _solve(self, node_s: np.ndarray, limit: float) -> ChainSolution | None:
        """``solve_chain`` under ``limit`` (None where nothing fits), kept in ``solves``."""
        key = None
        if self.solves is not None:
            arrays = (node_s, self.node_bytes, self.edge_s)
            key = (*(a.tobytes() for a in arrays), node_s.shape, limit)
            if key in self.solves:
                return self.solves[key]
        try:
            sol = solve_chain(node_s, self.node_bytes, self.edge_s, limit)
        except ValueError:
            sol = None
        if key is not None:
            self.solves[key] = sol
        return sol

    def leanest(self, budget_bytes: float) -> Candidate | None:
        """The chain's least-memory plan (``solve_chain_minmax`` over the two moments of the
        peak), simulated."""
        best: tuple[float, tuple[int, ...]] | None = None
        for other in self.ties:
            turn, step = (self._tied(r, other) for r in self.peak_rows)
            try:
                sol = solve_chain_minmax(turn, step)
            except ValueError:
                continue
            score = max(sol.time_s, sol.memory_bytes)
            if best is None or score < best[0]:
                best = (score, sol.choice)
        cand = None if best is None else self._candidate(best[1], budget_bytes, "leanest")
        if cand is not None:
            self.lean_peak = cand.result.peak_mem_bytes
        return cand
