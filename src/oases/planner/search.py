"""The plan search: every region's TP degree, the schedule and its sub-batch count, under a
memory budget, judged by simulating whole plans (``planner.simulate``).

``solve_plan`` prices a model's chain for the chain solver (``planner.chain``): node and edge
costs from simulating uniform plans of each schedule, memory per region from the same
accounting; the solver's plan is then simulated whole and compared with every uniform plan (and
any seeded one), so the answer is the best plan by the same simulation that predicts every
other. Where nothing fits, the least memory of every plan considered is named.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from oases.config import ModelConfig
from oases.plan import ParallelPlan, RegionPlan, region_names
from oases.planner.batch import BatchShape, BatchSplitError, region_rows
from oases.planner.chain import solve_chain, solve_chain_minmax
from oases.planner.costs import Costs, region_kind, region_param_count, sp_mode
from oases.planner.peak_memory import saved_bytes
from oases.planner.precision import OPTIMIZER_STATES, precision_of
from oases.planner.simulate import PlanResult, simulate_plan
from oases.schedule.program import SPECS


# -------------------------------------------------------------------------- plans of a model
@dataclass
class Candidate:
    """One plan the planner considered, with its simulated step time and peak memory."""

    plan: ParallelPlan
    result: PlanResult
    fits: bool
    kind: str  # "uniform" | "searched" | "leanest" | "seeded" (see solve_plan)
    batch: BatchShape | None = None  # the micro-batch it was simulated with
    micro_label: bool = False  # name the micro-batch in the label (several were searched)

    def label(self) -> str:
        degrees = self.plan.degrees()
        layout = (f"uniform tp={degrees[0]}" if len(degrees) == 1 else
                  "mixed tp " + "/".join(str(d) for d in degrees))
        zero = max(self.plan.zero_stages())
        extra = f", zero={zero}" if zero else ""
        if self.plan.sequence_parallel:
            extra += f", sp={self.plan.sequence_parallel}"
        if self.micro_label and self.batch is not None:
            extra += f", n_micro={self.batch.n_micro()}"  # micro-batches per step
        return f"{layout}, {self.plan.schedule}, n_sub={self.plan.n_sub}{extra}"


def candidate_degrees(cfg: ModelConfig, world_size: int, limit: int | None = None) -> list[int]:
    """Powers of two dividing the world size, heads, kv heads and ffn (up to ``limit``)."""
    out, t = [], 1
    while t <= min(world_size, limit or world_size):
        if not (world_size % t or cfg.n_heads % t or cfg.n_kv_heads % t or cfg.ffn_dim % t):
            out.append(t)
        t *= 2
    return out


BOUND_SLACK = 0.9  # a mixed plan may beat its chain's fastest uniform one by a few percent


def state_factors(zero: int, dp: int) -> tuple[float, float, float]:
    """Bytes per master-weight byte of a region at ZeRO stage ``zero`` over ``dp`` ranks:
    (held through the passes, of which gradients, held at the optimizer step with its
    temporaries) — ``planner.peak_memory``'s table: weights 1 (stage 3: 1/dp), gradients 1
    (stages 2-3: 1/dp; stage 1 accumulates whole ones), Adam moments 2 (from stage 1: 2/dp), a
    copy of what the optimizer updates."""
    w = 1 / dp if zero == 3 else 1.0
    g = 1.0 if zero <= 1 else 1 / dp
    shard = 1.0 if zero == 0 else 1 / dp
    return w + g + OPTIMIZER_STATES * shard, g, w + shard * (2 + OPTIMIZER_STATES)


def with_zero(plan: ParallelPlan, zero: int) -> ParallelPlan:
    """``plan`` with every region at ZeRO stage ``zero`` (0: as unsharded, no stage given)."""
    return dataclasses.replace(plan, regions=[dataclasses.replace(r, zero=zero or None)
                                              for r in plan.regions])


def _simulate(cfg: ModelConfig, plan: ParallelPlan, costs: Costs, world_size: int,
              batch: BatchShape, max_inflight: int,
              why: list[str] | None = None) -> PlanResult | None:
    try:
        return simulate_plan(cfg, plan, costs, world_size, batch, max_inflight=max_inflight,
                             timeline=False)
    except BatchSplitError as exc:  # not a candidate: the batch does not split at these degrees
        if why is not None:
            why.append(str(exc))
        return None


def _node_costs(cfg: ModelConfig, costs: Costs, world_size: int, batch: BatchShape,
                schedule: str, n_sub: int, degrees: list[int], uniform: dict[int, PlanResult],
                max_inflight: int, zero: int = 0, sp: str = ""
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per-region seconds and bytes at each degree, reshard edge seconds, and per-region
    parameter bytes (master dtype, ``inf`` where a degree does not split the batch), for the chain
    solver. A layer's seconds are its marginal in the simulated uniform plan (L layers minus
    L-1), so overlap, exposed collectives and DP synchronization are priced as the schedule
    runs them; the layer is split between attention and MLP by their compute. A region's bytes
    are its parameters, gradients and Adam moments (``state_factors`` at ZeRO stage ``zero``)
    and the activations it keeps. ``sp``: sequence parallelism's mode ("" off): its pieces,
    saved activations, and reshards that gather over the larger degree's group both ways."""
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
    sliced = (("forward", "sp-core"), ("forward", "sp-norm"), ("backward", "tp"),
              ("backward", "sp-norm"))
    for d, t in enumerate(degrees):
        full = uniform.get(t)
        if full is None:
            continue
        plan = with_zero(ParallelPlan.uniform(cfg, world_size, t, schedule=schedule,
                                              n_sub=n_sub, sequence_parallel=sp), zero)
        rows = region_rows(plan, world_size, batch, subs)
        part = {}
        pieces = sliced if sp and t > 1 else whole  # (at degree 1 nothing is sliced)
        for kind in ("attn", "mlp"):
            part[kind] = sum(costs.compute_s(kind, ph, pc, t, rows[1]) for ph, pc in pieces)
        if shorter is not None:
            less = _simulate(shorter, with_zero(ParallelPlan.uniform(
                shorter, world_size, t, schedule=schedule, n_sub=n_sub,
                sequence_parallel=sp), zero), costs, world_size, batch, max_inflight)
            layer_s = full.step_s - less.step_s if less is not None else 0.0
        else:
            layer_s = full.step_s / 2
        ends = max(0.0, full.step_s - cfg.n_layers * layer_s) / 2
        share = part["attn"] / max(part["attn"] + part["mlp"], 1e-30)
        for i, name in enumerate(names):
            kind = region_kind(name)
            node_s[i, d] = {"attn": layer_s * share, "mlp": layer_s * (1 - share)}.get(kind,
                                                                                        ends)
            param_bytes[i, d] = region_param_count(cfg, kind, t) * prec.master_bytes
            kept = saved_bytes(costs, cfg, kind, mode, t, rows[i])
            node_bytes[i, d] = (param_bytes[i, d] * state_factors(zero, world_size // t)[0]
                                + subs * kept)
    # [M, S, H] of the whole world, in the compute dtype
    act = batch.micro_rows * cfg.seq_len * cfg.dim * prec.activation_bytes
    for a, ta in enumerate(degrees):
        for b, tb in enumerate(degrees):
            if ta != tb:
                lo, hi = sorted((ta, tb))
                gathered = act * hi // world_size  # rows a rank holds at the larger degree
                if sp:  # both directions gather the whole over the larger degree's group
                    edge_s[:, a, b] = 2 * batch.n_micro() * costs.collective_s(
                        "all_gather", hi, gathered)
                else:
                    edge_s[:, a, b] = batch.n_micro() * costs.collective_s(
                        "all_gather", hi // lo, gathered)
    return node_s, node_bytes, edge_s, param_bytes


def sub_batch_counts(schedule: str, n_subs: tuple[int, ...],
                     schedules: tuple[str, ...] = ()) -> tuple[int, ...]:
    """The sub-batch counts searched for ``schedule``: 1 for a non-overlapped one; for an
    overlapped one every count of ``n_subs``, 1 included unless ``schedules`` also has the
    non-overlapped schedule of the same recompute (with one sub-batch overlap runs megatron's
    program; oases at one sub-batch differs from commfree-recompute only in starting the next
    recompute before a backward all-reduce ends), and none below the schedule's least
    (``ScheduleSpec.min_sub``: merak, defined by its sub-batches, from 2)."""
    if not SPECS[schedule].overlapped:
        return (1,)
    twin = any(not SPECS[s].overlapped and SPECS[s].recompute == SPECS[schedule].recompute
               for s in schedules)
    return tuple(k for k in n_subs if (k > 1 or not twin) and k >= SPECS[schedule].min_sub)


def solve_plan(cfg: ModelConfig, costs: Costs, world_size: int, batch: BatchShape,
               budget_bytes: float, *, schedules: tuple[str, ...] | None = None,
               n_subs: tuple[int, ...] = (1, 2, 4), degrees: list[int] | None = None,
               max_inflight: int = 1,
               seeds: tuple[tuple[int, ...], ...] = (), zeros: tuple[int, ...] = (0,),
               micro_batches: tuple[BatchShape, ...] = (), sps: tuple[str, ...] = ()
               ) -> tuple[Candidate, list[Candidate]]:
    """The fastest predicted plan under ``budget_bytes`` per device, and every candidate.

    For each micro-batch (``batch``, then each of ``micro_batches``: the same global batch cut
    into other micro-batches), ZeRO stage of ``zeros`` (one stage for every region of a plan),
    schedule and sub-batch count (``sub_batch_counts``): every uniform degree is simulated;
    then the chain solver picks a degree per region (exact for the additive model of
    ``_node_costs``, with memory as a knapsack row), and the plan it returns is simulated as a
    whole. ``seeds`` (a degree per region, e.g. the plans other schedules' searches found) are
    simulated under every schedule and count as well. The answer is the best *simulated* plan,
    so it is never worse than the best uniform or seeded one as predicted.

    Micro-batches are searched from the largest (fewest accumulation steps) down, ZeRO stages
    from 0 up. Stages 0 and 1 are both always searched: stage 1 moves the bytes of stage 0's
    all-reduce, half in its reduce-scatter under the backward and half in the gather of the
    updated weights under the next forward, so it can be faster as well as leaner. A smaller
    micro-batch, and stages 2 and 3, only while memory binds at the one before (the fastest
    uniform plan of a chain does not fit): where it fits, they would only add time.

    Sequence parallelism (``sps``: the modes searched, "gathered" and/or "shards") is one per
    plan as well: beside each uniform plan (degree t dividing the sequence, any ZeRO stage)
    the same plan with each mode is simulated ("shards" only for the communication-free
    recompute schedules, where it differs from "gathered": it keeps slices instead of gathered
    inputs, and gathers again in the recompute), and each mode's chain is solved as another
    chain (its pieces, saved activations and two-way reshards, ``_node_costs``).

    The ZeRO stage is one per plan: it trades memory for traffic on the DP links, which every
    region's gradients cross on one stream, so a region's share of the step is not its own
    (the chain's additive time model cannot price a stage per region); the plan file still
    takes a stage per region.

    Where no plan fits, every chain's leanest plan (``_ChainModel.leanest``: the least peak
    of the additive memory model) is simulated, and the chains near the least peak are searched
    again under it (``_least_memory``); neither depends on the budget, so at a budget of that
    least peak they find the plan that has it. If still nothing fits, ValueError names it."""
    degrees = degrees or candidate_degrees(cfg, world_size)
    if schedules is None:  # megatron-sp is megatron with sequence parallelism (``sps``)
        schedules = tuple(n for n, s in SPECS.items() if not s.sequence_parallel)
    names = region_names(cfg)
    candidates: list[Candidate] = []
    split_errors: list[str] = []
    shapes = [batch, *(b for b in micro_batches if b != batch)]

    def known(plan: ParallelPlan, shape: BatchShape) -> bool:
        return any(c.plan.regions == plan.regions and c.plan.schedule == plan.schedule
                   and c.plan.n_sub == plan.n_sub and c.batch == shape
                   and c.plan.sequence_parallel == plan.sequence_parallel for c in candidates)

    def add(cand: Candidate | None, shape: BatchShape) -> bool:
        """Keep ``cand`` (simulated with ``shape``) unless it is None or known; True if kept."""
        if cand is None or known(cand.plan, shape):
            return False
        cand.batch, cand.micro_label = shape, len(shapes) > 1
        candidates.append(cand)
        return True

    models: list[_ChainModel] = []

    def search(shape: BatchShape, zero: int, schedule: str, n_sub: int) -> tuple[bool, float]:
        """One chain: its uniform plans, the solver's plan, the seeds. Returns whether memory
        binds (the fastest uniform plan does not fit, or none splits the batch) and the least
        step time of its uniform plans less their optimizer step (fitting or not)."""
        uniform = {}
        sp_uniform: dict[str, dict[int, PlanResult]] = {}
        modes = [m for m in sps if m == "gathered" or SPECS[schedule].recompute == "commfree"]
        for t in degrees:
            if zero and t == world_size:
                continue  # no data parallelism to shard over
            plan = with_zero(ParallelPlan.uniform(cfg, world_size, t, schedule=schedule,
                                                  n_sub=n_sub), zero)
            res = _simulate(cfg, plan, costs, world_size, shape, max_inflight, split_errors)
            if res is not None:
                uniform[t] = res
                add(Candidate(plan, res, res.peak_mem_bytes <= budget_bytes, "uniform"), shape)
                for mode in (m for m in modes if cfg.seq_len % t == 0):
                    sp_plan = dataclasses.replace(plan, sequence_parallel=mode, notes={})
                    sp_res = _simulate(cfg, sp_plan, costs, world_size, shape, max_inflight)
                    if sp_res is not None:
                        sp_uniform.setdefault(mode, {})[t] = sp_res
                        if t > 1:  # at degree 1 it is the plan without it
                            add(Candidate(sp_plan, sp_res,
                                          sp_res.peak_mem_bytes <= budget_bytes, "uniform"),
                                shape)
        for mode, results in (("", uniform), *sp_uniform.items()):
            if len(results) >= 2:
                model = _ChainModel(cfg, costs, world_size, shape, schedule, n_sub, degrees,
                                    results, max_inflight, zero, mode)
                models.append(model)
                add(model.fastest(budget_bytes), shape)
        for seed in seeds:
            if len(seed) != len(names) or len(set(seed)) == 1 or not set(seed) <= set(uniform):
                continue  # uniform seeds are simulated above; a degree that does not split
            plan = with_zero(ParallelPlan([RegionPlan(name, t, world_size // t)
                                           for name, t in zip(names, seed)],
                                          n_sub=n_sub, schedule=schedule), zero)
            res = None if known(plan, shape) else _simulate(cfg, plan, costs, world_size,
                                                            shape, max_inflight)
            if res is not None:
                add(Candidate(plan, res, res.peak_mem_bytes <= budget_bytes, "seeded"), shape)
        fastest = min(uniform.values(), key=lambda r: r.step_s, default=None)
        floor = min((r.step_s - r.breakdown["optimizer_s"] for r in uniform.values()),
                    default=float("inf"))
        return fastest is None or fastest.peak_mem_bytes > budget_bytes, floor

    # Largest micro-batch first (fewest accumulation steps); a smaller one, or a ZeRO stage
    # above 1, is searched only while memory binds: where the fastest uniform plan fits, they
    # would only add time (more accumulation steps; more DP collectives). Stage 1 is searched
    # beside stage 0 always (same bytes, placed differently: it may be faster).
    # Nor is a chain searched whose bound cannot beat the fastest plan that fits: a stage
    # above 1 or a smaller micro-batch of a schedule is no faster than its chain already
    # searched (less its optimizer step, which sharding shortens), within ``BOUND_SLACK``.
    floors: dict[tuple[str, int], float] = {}
    for shape in sorted(shapes, key=lambda b: -b.micro_rows):
        binds = False
        for schedule in schedules:
            for n_sub in sub_batch_counts(schedule, n_subs, schedules):
                for zero in sorted(zeros):
                    if zero == 2 and shape.n_micro() == 1 and 1 in zeros:
                        continue  # one micro-batch: stage 2 runs stage 1's program
                    incumbent = min((c.result.step_s for c in candidates if c.fits),
                                    default=float("inf"))
                    if zero != 1 and (floors.get((schedule, n_sub), 0.0) * BOUND_SLACK
                                      >= incumbent):
                        break
                    tight, floor = search(shape, zero, schedule, n_sub)
                    floors[schedule, n_sub] = min(floors.get((schedule, n_sub), floor), floor)
                    binds |= tight
                    if not tight and zero >= 1:
                        break
        if not binds:
            break
    if not candidates:
        raise ValueError(f"no plan splits the batch: {split_errors[0] if split_errors else ''}"
                         f" (degrees {degrees}, sub-batches {sorted(set(n_subs))}; a micro-batch "
                         f"of {batch.micro_rows} sequences gives a TP group of degree t "
                         f"{batch.micro_rows}*t/{world_size} of them, which must be a whole "
                         "multiple of the sub-batch count)")
    fitting = [c for c in candidates if c.fits]
    if not fitting:  # what each chain can do with the least memory, then maybe a plan fits
        for model in models:
            add(model.leanest(budget_bytes), model.batch)
        fitting = [c for c in candidates if c.fits]
    if not fitting:  # and the chains searched again under the least peak (budget-blind)
        least = _least_memory(candidates, models, add, budget_bytes)
        fitting = [c for c in candidates if c.fits]
    if not fitting:
        raise ValueError(f"no plan fits in {budget_bytes / 2**30:.3f} GiB per device; the "
                         f"smallest feasible budget is {least.result.peak_mem_bytes / 2**30:.3f}"
                         f" GiB ({least.label()}): the least peak of the {len(candidates)} "
                         "plans simulated (every schedule and sub-batch count: each uniform "
                         "degree, and per region the chain's least-memory degrees and its "
                         "fastest under that budget), with "
                         f"{batch.micro_rows} sequences per micro-batch across the "
                         f"{world_size} ranks; fewer per micro-batch need less")
    best = min(fitting, key=lambda c: c.result.step_s)
    best.plan.predicted_step_s = best.result.step_s
    best.plan.predicted_peak_mem_bytes = int(best.result.peak_mem_bytes)
    return best, candidates


def _plan_of(cfg: ModelConfig, choice: tuple[int, ...], degrees: list[int], world_size: int,
             schedule: str, n_sub: int, sp: str = "") -> ParallelPlan:
    if all(degrees[d] == 1 for d in choice):
        sp = ""  # nothing to slice: the plan without it
    return ParallelPlan([RegionPlan(name, degrees[d], world_size // degrees[d])
                         for name, d in zip(region_names(cfg), choice)],
                        n_sub=n_sub, schedule=schedule, sequence_parallel=sp)


def _least_memory(candidates: list[Candidate], models: list[_ChainModel],
                  add: Callable[[Candidate | None, BatchShape], bool], budget_bytes: float,
                  rounds: int = 3, near: float = 1.1) -> Candidate:
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


class _ChainModel:
    """One schedule and sub-batch count priced as a chain (``_node_costs``), with the gap
    between the chain's additive memory and the simulated peaks of the uniform plans."""

    def __init__(self, cfg: ModelConfig, costs: Costs, world_size: int, batch: BatchShape,
                 schedule: str, n_sub: int, degrees: list[int], uniform: dict[int, PlanResult],
                 max_inflight: int, zero: int = 0, sp: str = "") -> None:
        self.cfg, self.costs, self.world_size, self.batch = cfg, costs, world_size, batch
        self.schedule, self.n_sub, self.degrees = schedule, n_sub, degrees
        self.max_inflight, self.zero, self.sp = max_inflight, zero, sp
        self.node_s, self.node_bytes, self.edge_s, params = _node_costs(
            cfg, costs, world_size, batch, schedule, n_sub, degrees, uniform, max_inflight,
            zero, sp)
        # what the additive memory model leaves out (baseline, transients), from the uniform
        # plans
        self.extra = min(res.peak_mem_bytes - self.node_bytes[:, degrees.index(t)].sum()
                         for t, res in uniform.items())
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
            self.ties = [[d for d in range(len(degrees)) if d != tied]
                         for tied in range(len(degrees))]
        self.n = n
        self.lean_peak = float("inf")  # the simulated peak of ``leanest``, once asked

    def _tied(self, rows: np.ndarray, other: list[int] | None) -> np.ndarray:
        rows = rows.copy()
        if other is not None:
            rows[0, other] = rows[self.n - 1, other] = np.inf
        return rows

    def _candidate(self, choice: tuple[int, ...], budget_bytes: float,
                   kind: str) -> Candidate | None:
        plan = with_zero(_plan_of(self.cfg, choice, self.degrees, self.world_size,
                                  self.schedule, self.n_sub, self.sp), self.zero)
        res = _simulate(self.cfg, plan, self.costs, self.world_size, self.batch,
                        self.max_inflight)
        return None if res is None else Candidate(plan, res, res.peak_mem_bytes <= budget_bytes,
                                                  kind)

    def fastest(self, limit_bytes: float, budget_bytes: float | None = None) -> Candidate | None:
        """The chain solver's fastest plan under ``limit_bytes`` (tightened by any overshoot, a
        few times), simulated; ``fits`` against ``budget_bytes`` (default: the limit)."""
        budget_bytes = limit_bytes if budget_bytes is None else budget_bytes
        best: Candidate | None = None
        for other in self.ties:
            s = self._tied(self.node_s, other)
            limit = limit_bytes - self.extra
            for _ in range(4):
                try:
                    sol = solve_chain(s, self.node_bytes, self.edge_s, limit)
                except ValueError:
                    break
                cand = self._candidate(sol.choice, budget_bytes, "searched")
                if cand is None:
                    break
                if cand.result.peak_mem_bytes <= limit_bytes:
                    if best is None or best.result.peak_mem_bytes > limit_bytes or \
                            cand.result.step_s < best.result.step_s:
                        best = cand
                    break
                limit -= cand.result.peak_mem_bytes - limit_bytes  # optimistic: tighten
                best = best or cand
        return best

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
