"""Lower bounds on every plan of a chain of the plan search (one micro-batch, schedule,
sub-batch count, ZeRO stage and sequence-parallel mode; a TP degree per region free), which
let the fast search skip a chain that cannot change its answer (``planner.search``).

Every term is a sum over the regions of what region i holds or runs at its degree t,
whatever the other regions' degrees (``region_prices``; ``tests/test_search_bounds.py``
checks each on random mixed plans against the uniform plans it is read from)::

    c_i(t)  compute of one micro-batch: the compute stream runs every piece of every region
            one after another (a wait only adds); the glue a recompute skips at a degree
            change is left out
    e_i(t)  region i's own TP collectives waited at once (the next instruction is their
            wait): the compute stream idles for each whole. Counted with one sub-batch only
            (the synchronous schedules): there a collective's result is what the next piece
            reads, at any neighbour's degree; merak's two sub-batches per block wait theirs in
            another order where the degree changes, so sub-batched schedules count none
    p_i(t)  region i's own TP collectives in the step (sequence parallelism's gathers
            included): they run on the one stream of rank 0's TP group at degree t, one
            after another (a stream's flights are chained). In a synchronous schedule, and
            in an overlapped one without sequence parallelism and one collective in flight,
            no two TP collectives of a program are ever between their starts and their waits
            at once (``tp_serial``), so the second begins after the first's wait: they never
            overlap, whatever their streams
    G_i, g_i  with a ZeRO stage: region i's weight gathers in the first walk (the first
            micro-batch, or the step) and its compute after the last gather's wait there
    S_i, f_i  region i's gradient reduce-scatters in the last walk and its compute before
            the first of them starts (they run one after another on the DP stream from then)
    Z^w_i   with a ZeRO stage: region i's own ZeRO collectives in the first, a middle and the
            last walk (w): every one of them runs on the one DP stream
    A_i(t)  weights + Adam moments + the optimizer's copy of what it updates + the gradient
            left at the step's end (whole at stage 0, a shard above): the optimizer step
            (``peak_memory``)
    B_i(t)  weights + Adam moments + the activations region i keeps for one sub-batch (k of
            them without sequence parallelism, whose sub-batches all finish their forward
            before any backward): the turn from the first forward to its backward

A step of n micro-batches is n walks back to back (``simulate_plan``): the first, n - 2 alike
and the last; each walk takes at least sum (c + e) and its sum Z^w, the first also sum
(G + g), the last sum (S + f); so for every plan x (``extra``: the baseline and workspace)::

    step >= sum_i X_i(x_i) + (n - 2) M_i(x_i) + Y_i(x_i)   X in {c + e, G + g, Z^first},
                                                            M in {c + e, Z^middle},
                                                            Y in {c + e, S + f, Z^last}
            (n = 1: step >= each of sum (c + e), sum (G + g), sum (S + f), sum Z)
    step >= sum_{i: x_i = t} p_i(t) for every degree t
    step >= sum_i p_i(x_i) where ``tp_serial``
    peak >= extra + max(sum_i A_i(x_i), sum_i B_i(x_i))

``chain_bounds`` returns the least peak of any plan (each region at its leanest degree) and
the least step of any plan that fits the budget (``step_bound.joint_step_bound``: the
relaxation's duals weigh the step's bounds against the memory they save).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
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
from oases.planner.region_prices import region_prices
from oases.planner.step_bound import MARGIN, joint_step_bound
from oases.schedule.program import SPECS


@dataclass(frozen=True)
class ChainPrices:
    """The per-region terms of a chain's bounds (module docstring), one column per degree
    the chain takes (``degrees``), each [regions, degrees]: ``compute`` c and ``waited`` e
    of one micro-batch, ``comm`` p of the step (seconds); ``gathers`` G, ``after`` g,
    ``scatters`` S and ``before`` f (None without a ZeRO stage); ``state`` A and ``turn`` B
    (bytes); ``extra`` the bytes every plan holds beside them; ``n_micro`` walks;
    ``zero_walks`` Z of the first, a middle and the last walk (None without a ZeRO stage);
    ``tp_serial``: no two TP collectives overlap (``tp_serial``)."""

    degrees: list[int]
    n_micro: int
    compute: np.ndarray
    waited: np.ndarray
    comm: np.ndarray
    gathers: np.ndarray | None
    after: np.ndarray | None
    scatters: np.ndarray | None
    before: np.ndarray | None
    state: np.ndarray
    turn: np.ndarray
    extra: float
    zero_walks: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    tp_serial: bool = False

    def serial(self) -> list[np.ndarray]:
        """The step's serial bounds (module docstring), one [regions, degrees] each."""
        walk = self.compute + self.waited
        scatters = [self.scatters + self.before] if self.scatters is not None else []
        heads = [walk] + ([self.gathers + self.after] if self.gathers is not None else [])
        mids, tails = [walk], [walk] + scatters
        if self.zero_walks is not None:
            first, middle, last = self.zero_walks
            heads, mids, tails = heads + [first], mids + [middle], tails + [last]
        steps = [self.comm] if self.tp_serial else []
        if self.n_micro == 1:  # one walk: each of its sums once (its Z is in ``heads``)
            return heads + scatters + steps
        if self.n_micro == 2:
            return [x + y for x in heads for y in tails] + steps
        n = self.n_micro - 2
        return [x + n * m + y for x in heads for m in mids for y in tails] + steps


def _degrees(
    cfg: ModelConfig,
    costs: Costs,
    world_size: int,
    batch: BatchShape,
    schedule: str,
    n_sub: int,
    zero: int,
    sp: str,
    degrees: list[int],
) -> Iterator[tuple[int, ParallelPlan, list[float], list[float]]]:
    """Every degree t of ``degrees`` the chain takes (it splits the batch; above 1 with a ZeRO
    stage; dividing the sequence with sequence parallelism ``sp``) with its uniform plan and
    the bytes each region holds at it: ``A_i(t)`` (weights, Adam moments, the optimizer's copy
    and the gradients) and ``T_i(t)`` (what it holds at the turn from forward to backward)."""
    spec = SPECS[schedule]
    k = n_sub if spec.overlapped else 1
    prec = precision_of(costs)
    w = prec.master_bytes
    seq = sp or ("gathered" if spec.sequence_parallel else "")  # (megatron-sp: always)
    modes = {sp_mode(spec.recompute, seq or None)}
    activations = 1 if seq else k  # sub-batches whose forwards all precede any backward
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
        state = model_state(cfg, plan, world_size)
        # (the chain's plan of degree 1 everywhere runs without sequence parallelism)
        modes_t = modes | {spec.recompute} if seq and t == 1 else modes
        held, turn = [], []
        seen: dict[tuple, tuple[float, float]] = {}  # (a model's blocks: a few distinct)
        for i, r in enumerate(plan.regions):
            stage = state.stages[i]
            kind = region_kind(r.name)
            key = (kind, stage, state.numel[i], state.dp[i], rows[i])
            if key not in seen:
                updated = state.updated(i)
                weights = (
                    state.numel[i]
                    if stage == 0
                    else state.padded(i)
                    if stage < 3
                    else state.shard(i)
                )
                resident = w * weights + prec.optimizer_bytes * updated
                grads = state.numel[i] if stage == 0 else state.shard(i)
                kept = min(saved_bytes(costs, cfg, kind, mode, t, rows[i]) for mode in modes_t)
                seen[key] = (resident + w * updated + w * grads, resident + activations * kept)
            held.append(seen[key][0])
            turn.append(seen[key][1])
        yield t, plan, held, turn


def _extra_bytes(costs: Costs) -> float:
    """What every plan holds beside its regions' bytes (the baseline and the workspace)."""
    return float(getattr(costs, "baseline_bytes", 0.0)) + float(
        getattr(costs, "workspace_bytes", 0.0)
    )


def _peak_bound(rows: list[tuple], costs: Costs) -> float:
    """``chain_bounds``' peak bytes, from ``_degrees``' rows alone (no program built or
    priced)."""
    held = np.array([r[2] for r in rows], dtype=float).T
    turn = np.array([r[3] for r in rows], dtype=float).T
    return (_extra_bytes(costs) + max(_least(held), _least(turn))) * (1 - MARGIN)


def _least(per_degree: np.ndarray) -> float:
    """The sum over the regions of each one's least value over the degrees."""
    return sum(min(row) for row in per_degree.tolist())


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
    """The chain's ``ChainPrices`` at each of ``degrees`` that it takes (``_degrees``), read
    off its uniform plans; None where no degree does."""
    rows = list(_degrees(cfg, costs, world_size, batch, schedule, n_sub, zero, sp, degrees))
    return _chain_prices(rows, cfg, costs, world_size, batch, schedule, n_sub, sp, max_inflight)


def _chain_prices(
    rows: list[tuple],
    cfg: ModelConfig,
    costs: Costs,
    world_size: int,
    batch: BatchShape,
    schedule: str,
    n_sub: int,
    sp: str,
    max_inflight: int,
) -> ChainPrices | None:
    """``chain_prices`` on ``_degrees``' rows."""
    k = n_sub if SPECS[schedule].overlapped else 1
    taken: list[int] = []
    compute: list[list[float]] = []
    comm: list[list[float]] = []
    waited: list[list[float]] = []
    zero_terms: list[tuple] = []  # (G, g, S, f) per degree
    zero_walks: list[tuple | None] = []  # (Z first, middle, last) per degree
    state_bytes: list[list[float]] = []
    turn_bytes: list[list[float]] = []
    for t, plan, held, turn in rows:
        try:
            prices = region_prices(cfg, plan, costs, world_size, batch, max_inflight=max_inflight)
        except ValueError:  # costs that cannot price it: the plan's simulation says so
            prices = None
        none = [0.0] * len(held)
        taken.append(t)
        compute.append(prices.compute if prices is not None else none)
        comm.append(prices.tp_comm if prices is not None else none)
        # (one sub-batch only: a merak block of two reorders its waits at a degree change)
        waited.append(prices.tp_waited if prices is not None and k == 1 else none)
        zero_walks.append(prices.dp_walks if prices is not None else None)
        zero_terms.append(
            (prices.gathers, prices.after, prices.scatters, prices.before)
            if prices is not None
            else (None,) * 4
        )
        state_bytes.append(held)
        turn_bytes.append(turn)
    if not taken:
        return None
    extra = _extra_bytes(costs)

    def columns(per_degree: list) -> np.ndarray:
        return np.array(per_degree, dtype=float).T

    # (a ZeRO pair only where every degree has it: its bound is a walk's, over all regions)
    pairs = [
        [columns([z[j] for z in zero_terms]), columns([z[j + 1] for z in zero_terms])]
        if all(z[j] is not None for z in zero_terms)
        else [None, None]
        for j in (0, 2)
    ]
    return ChainPrices(
        taken,
        batch.n_micro(),
        columns(compute),
        columns(waited),
        columns(comm),
        *pairs[0],
        *pairs[1],
        columns(state_bytes),
        columns(turn_bytes),
        extra,
        (  # (where every degree has them: a bound over all regions)
            tuple(columns([z[j] for z in zero_walks]) for j in range(3))
            if all(z is not None for z in zero_walks)
            else None
        ),
        tp_serial(schedule, sp, max_inflight),
    )


def tp_serial(schedule: str, sp: str, max_inflight: int = 1) -> bool:
    """Whether no two TP collectives of a plan's programs are ever between their starts and
    their waits at once, so none overlap (``ChainPrices.tp_serial``): in a synchronous
    schedule, and in an overlapped one without sequence parallelism that keeps one collective
    in flight (``tests/test_search_bounds.py`` checks the claim on random mixed programs of
    every schedule, mode and ``max_inflight``, and that it fails where this says no: an
    overlapped schedule's gather opens before a neighbour's reduction is waited, and with more
    in flight overlap-recompute's recompute starts one while the backward's is open)."""
    spec = SPECS[schedule]
    if not spec.overlapped:
        return True
    return not (sp or spec.sequence_parallel) and max_inflight == 1


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
    stop_at: float = math.inf,
) -> tuple[float, float]:
    """(step seconds, peak bytes): no plan of the chain that fits ``budget_bytes`` steps
    faster, and no plan at all peaks lower (``chain_prices``'s degrees). (0, 0) where no
    degree splits the batch. Where the peak bound alone exceeds ``budget_bytes`` (no plan of
    the chain fits), the step's is 0 (true, and not needed): no program is built or priced.
    Where a cheaper bound on the step (the compute alone, one serial sum alone) reaches
    ``stop_at`` (the search's fastest step that fits, which only falls: the chain is skipped
    whichever bound it is told), that one, without the relaxation's linear program."""
    rows = list(_degrees(cfg, costs, world_size, batch, schedule, n_sub, zero, sp, degrees))
    if not rows:
        return 0.0, 0.0
    peak = _peak_bound(rows, costs)
    if peak > budget_bytes:
        return 0.0, peak
    found = _chain_prices(rows, cfg, costs, world_size, batch, schedule, n_sub, sp, max_inflight)
    compute = _least(found.compute) * found.n_micro * (1 - 2 * MARGIN)
    if compute >= stop_at:
        return compute, peak
    bound = joint_step_bound(
        found.serial(), found.comm, found.state, found.turn, budget_bytes - found.extra, stop_at
    )
    step = max(compute, bound)
    return step, peak
