"""Lower bounds on every plan of a chain of the plan search (one micro-batch, schedule,
sub-batch count, ZeRO stage and sequence-parallel mode; a TP degree per region free), which
let the fast search skip a chain that cannot change its answer (``planner.search``).

Both bounds are sums over the regions of the least, over the chain's degrees, of what region
i holds or runs at that degree, whatever the other regions' degrees::

    step >= sum_i min_t compute_i(t)     the compute stream runs every piece of every region
                                         one after another (a wait only adds); the glue a
                                         recompute skips at a degree change is left out
                                         (``simulate.region_compute_s``)
    peak >= baseline + workspace + max(sum_i min_t A_i(t), sum_i min_t B_i(t))
        A_i: weights + Adam moments + the optimizer's copy of what it updates + the
             gradient left at the step's end (whole at stage 0, a shard above): the
             optimizer step (``peak_memory``)
        B_i: weights + Adam moments + the activations region i keeps for one sub-batch (k of
             them without sequence parallelism, whose sub-batches all finish their forward
             before any backward): the turn from the first forward to its backward

Each is computed in floating point in another order than the simulation's, so both are
lowered by ``MARGIN`` (relative) before a comparison.
"""

from __future__ import annotations

from oases.config import ModelConfig
from oases.plan import ParallelPlan
from oases.planner.batch import BatchShape, BatchSplitError, region_rows
from oases.planner.candidate import with_zero
from oases.planner.costs import Costs, region_kind, sp_mode
from oases.planner.layout import model_state
from oases.planner.peak_memory import saved_bytes
from oases.planner.precision import precision_of
from oases.planner.simulate import region_compute_s
from oases.schedule.program import SPECS

MARGIN = 1e-9


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
) -> tuple[float, float]:
    """(step seconds, peak bytes) no plan of the chain goes below: its regions at any of
    ``degrees`` that the chain takes (each splits the batch; above 1 with a ZeRO stage; dividing
    the sequence with sequence parallelism ``sp``). (0, 0) where no degree does."""
    spec = SPECS[schedule]
    k = n_sub if spec.overlapped else 1
    prec = precision_of(costs)
    w = prec.master_bytes
    seq = sp or ("gathered" if spec.sequence_parallel else "")  # (megatron-sp: always)
    modes = {sp_mode(spec.recompute, seq or None)}
    activations = 1 if seq else k  # sub-batches whose forwards all precede any backward
    compute: list[list[float]] = []
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
        except ValueError:  # costs that cannot price it: the plan's simulation says so
            seconds = None
        compute.append(seconds if seconds is not None else [0.0] * len(rows))
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
    if not compute:
        return 0.0, 0.0

    def least(per_degree: list[list[float]]) -> float:
        return sum(min(column) for column in zip(*per_degree))

    extra = float(getattr(costs, "baseline_bytes", 0.0)) + float(
        getattr(costs, "workspace_bytes", 0.0)
    )
    peak = extra + max(least(state_bytes), least(turn_bytes))
    return least(compute) * (1 - MARGIN), peak * (1 - MARGIN)
