"""What each region of a plan costs on its own, for the plan search's bounds
(``planner.search_bounds``) and the pipeline screen's stage shares: the compiled program
``simulate_plan`` walks last, priced (``last_micro_prices``), read region by region instead of
walked: every region's compute (``region_compute_s``) and its own tensor-parallel collectives
(``region_tp_comm_s``)."""

from __future__ import annotations

import numpy as np

from oases.config import ModelConfig
from oases.plan import ParallelPlan
from oases.planner.batch import BatchShape, region_rows
from oases.planner.costs import Costs, region_kind
from oases.planner.event_walk import StepCosts
from oases.planner.layout import dp_buckets, model_state
from oases.planner.plan_costs import piece_prices, plan_step_costs, price_tape, region_signatures
from oases.planner.simulate import _CachedCosts, _program_args, _tape
from oases.planner.tape import COMPUTE, START, WAIT, Tape
from oases.schedule.program import deferred_regions


def last_micro_prices(
    cfg: ModelConfig,
    plan: ParallelPlan,
    costs: Costs,
    world_size: int,
    batch: BatchShape,
    *,
    max_inflight: int = 1,
    first: bool = False,
) -> tuple[Tape, StepCosts, list[tuple]] | None:
    """The compiled program ``simulate_plan`` walks last for ``plan`` (the whole step with one
    micro-batch, else the last micro-batch with the DP collectives), its ``StepCosts`` and its
    regions' signatures (``plan_costs.price_tape``'s arguments); None where the program is not
    one a tape walks. For the search's bounds, which price a plan's regions one by one.
    ``first`` (with micro-batches): the first micro-batch's program instead (ZeRO's gathers of
    the updated weights at its head, no DP collectives)."""
    from oases.schedule.program import SPECS

    costs = _CachedCosts(costs)
    k = plan.n_sub if SPECS[plan.schedule].overlapped else 1
    degrees = [r.tp for r in plan.regions]
    kinds = [region_kind(r.name) for r in plan.regions]
    rows = region_rows(plan, world_size, batch, k)
    stages = plan.zero_stages()
    buckets = dp_buckets(cfg, kinds, degrees, world_size, stages)
    whole = batch.n_micro() == 1
    tape = _tape(
        *_program_args(
            cfg,
            plan,
            world_size,
            batch,
            max_inflight=max_inflight,
            n_micro=None if whole else 1,
            dp=whole or not first,
            first=whole or first,
            reshard_after_forward=True,
            buckets=buckets,
        )
    )
    if tape is None:
        return None
    deferring = tape.memo.get("deferring")
    if deferring is None:
        deferring = tape.memo["deferring"] = deferred_regions(tape.program)
    step = plan_step_costs(
        cfg,
        plan,
        costs,
        world_size,
        rows,
        state=model_state(cfg, plan, world_size),
        buckets=buckets,
        deferring=deferring,
    )
    return tape, step, region_signatures(kinds, degrees, rows, stages, deferring)


def region_compute_s(
    cfg: ModelConfig,
    plan: ParallelPlan,
    costs: Costs,
    world_size: int,
    batch: BatchShape,
    *,
    max_inflight: int = 1,
) -> list[float] | None:
    """Seconds of compute every region of ``plan`` runs in a step (its pieces in every
    micro-batch, as ``simulate_plan`` prices them), leaving out the recompute of glue ("epi"
    in the recompute phase, which a plan that changes degree there skips): a lower bound on
    the compute stream's busy time, region by region. Every plan whose region i has this
    region's degree runs at least region i's share, whatever the other regions' degrees (the
    pieces of a program are the same but for that glue; a piece's price reads only its
    region's kind, degree and rows). None where the program is not one a tape walks."""
    found = last_micro_prices(cfg, plan, costs, world_size, batch, max_inflight=max_inflight)
    if found is None:
        return None
    tape, step, signatures = found
    values = piece_prices(step, tape, signatures)
    counts, regions = _piece_counts(tape)
    per_micro = np.bincount(regions, weights=counts * values, minlength=len(plan.regions))
    return (per_micro * batch.n_micro()).tolist()


def _piece_counts(tape: Tape) -> tuple[np.ndarray, np.ndarray]:
    """How many times each (phase, piece, region) of ``tape.pieces()`` runs (0 for a
    recompute's glue), and its region."""
    return _piece_runs(tape, 0, len(tape.ops))


def _piece_runs(tape: Tape, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """``_piece_counts`` of the instructions ``lo`` .. ``hi`` - 1 of ``tape`` alone
    (remembered in ``tape.memo``)."""
    found = tape.memo.get(("piece runs", lo, hi))
    if found is None:
        at = {t: j for j, t in enumerate(tape.pieces())}
        runs = np.zeros(len(at))
        for op, key, _ in tape.ops[lo:hi]:
            if op == COMPUTE:
                phase, pieces = tape.compute_keys[key]
                for piece, region in pieces:
                    if not (phase == "recompute" and piece == "epi"):
                        runs[at[phase, piece, region]] += 1
        regions = np.array([r for _, _, r in tape.pieces()], dtype=np.int64)
        found = tape.memo[("piece runs", lo, hi)] = (runs, regions)
    return found


TP_KINDS = ("fwd", "bwd")  # a region's own all-reduces (reduce-scatters under sp) over its group


def region_tp_comm_s(
    cfg: ModelConfig,
    plan: ParallelPlan,
    costs: Costs,
    world_size: int,
    batch: BatchShape,
    *,
    max_inflight: int = 1,
) -> tuple[list[float], list[float]] | None:
    """Per region of ``plan``, in a step (every micro-batch): the seconds of its own TP
    collectives (``TP_KINDS``: the row- and column-parallel linears' reductions, which every
    plan runs at the region's degree and rows, whatever its neighbours'), and the part of them
    waited at once (the program's next instruction is their wait: the compute stream idles
    for all of it). The pieces of the search's time bound (``search_bounds``): every region
    at degree t puts its collectives on the one stream of rank 0's group at degree t, whose
    flights run one after another, and a collective waited at once adds its whole time to the
    compute stream's. None where the program is not one a tape walks."""
    found = last_micro_prices(cfg, plan, costs, world_size, batch, max_inflight=max_inflight)
    if found is None:
        return None
    tape, step, signatures = found
    _, coll_s, _, _, _ = price_tape(step, tape, signatures)
    keys, regions, starts, at_once = _tp_starts(tape)
    seconds = np.asarray(coll_s)[keys]
    n, m = len(plan.regions), batch.n_micro()
    total = np.bincount(regions, weights=seconds * starts, minlength=n) * m
    waited = np.bincount(regions, weights=seconds * at_once, minlength=n) * m
    return total.tolist(), waited.tolist()


def _tp_starts(tape: Tape) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every ``TP_KINDS`` collective key of ``tape``: its id, its region, how many times it
    starts and how many of those its wait follows at once (remembered in ``tape.memo``)."""
    found = tape.memo.get("tp starts")
    if found is None:
        ops = tape.ops
        starts: dict[int, list[int]] = {}
        for j, (op, key, slot) in enumerate(ops):
            if op == START and tape.coll_keys[key][0] in TP_KINDS:
                counts = starts.setdefault(key, [0, 0])
                counts[0] += 1
                if j + 1 < len(ops) and ops[j + 1][0] == WAIT and ops[j + 1][1] == slot:
                    counts[1] += 1
        keys = np.array(list(starts), dtype=np.int64)
        regions = np.array([tape.coll_keys[k][1] for k in starts], dtype=np.int64)
        counts = np.array(list(starts.values()), dtype=float).reshape(-1, 2)
        found = tape.memo["tp starts"] = (keys, regions, counts[:, 0], counts[:, 1])
    return found


def region_zero_terms(
    cfg: ModelConfig,
    plan: ParallelPlan,
    costs: Costs,
    world_size: int,
    batch: BatchShape,
    *,
    max_inflight: int = 1,
) -> tuple[list[float] | None, list[float] | None, list[float] | None, list[float] | None]:
    """Per region of ``plan`` with a ZeRO stage, the DP stream's share of two walks
    (``search_bounds``): (G) the seconds of its weight gathers ("ag") in the first walk
    (the first micro-batch, or the whole step; stages 1 and 2, which gather each region's
    updated weights once, before its first forward) and (g) its backward compute there (the
    recompute's too): every backward follows every forward, so every gather's wait, and the
    gathers run one after another on the DP stream, so that walk takes at least sum G +
    sum g; (S) the seconds of its gradient reduce-scatters ("rs") in the last walk and (f) its
    forward compute there: a region's gradient follows every sub-batch's forward, so every
    reduce-scatter starts after all of it, and they run one after another, so that walk takes
    at least sum f + sum S. Each pair is None where the walk has none of those collectives,
    or (checked on the program) its computes are not all on that side of them."""
    first = batch.n_micro() > 1
    gathers = after = None
    if set(plan.zero_stages()) <= {1, 2}:
        found = last_micro_prices(
            cfg, plan, costs, world_size, batch, max_inflight=max_inflight, first=first
        )
        if found is not None:
            gathers, after = _dp_share(found, "ag", plan)
    found = last_micro_prices(cfg, plan, costs, world_size, batch, max_inflight=max_inflight)
    if found is None:
        return gathers, after, None, None
    return (gathers, after, *_dp_share(found, "rs", plan))


def _dp_share(
    found: tuple[Tape, StepCosts, list[tuple]], kind: str, plan: ParallelPlan
) -> tuple[list[float] | None, list[float] | None]:
    """Per region: the seconds of ``kind``'s collectives in the tape and its compute on their
    far side: "ag", the backward and recompute after the last gather's wait; "rs", the
    forward before the first reduce-scatter's start. (None, None) where the tape has none,
    or some of those computes are on the near side."""
    tape, step, signatures = found
    mark = tape.memo.get(("dp share", kind))
    if mark is None:
        starts: dict[int, int] = {}
        slots, first_start, last_wait = set(), None, None
        for j, (op, key, slot) in enumerate(tape.ops):
            if op == START and tape.coll_keys[key][0] == kind:
                starts[key] = starts.get(key, 0) + 1
                slots.add(slot)
                first_start = j if first_start is None else first_start
            elif op == WAIT and key in slots:
                last_wait = j
        phases = ("backward", "recompute") if kind == "ag" else ("forward",)
        at = {t: j for j, t in enumerate(tape.pieces())}
        runs = np.zeros(len(at))
        for j, (op, key, _) in enumerate(tape.ops):
            if op == COMPUTE and tape.compute_keys[key][0] in phases:
                if starts and (j < last_wait if kind == "ag" else j > first_start):
                    starts = {}  # (on the near side: no bound from this pair)
                    break
                phase, pieces = tape.compute_keys[key]
                for piece, region in pieces:
                    if not (phase == "recompute" and piece == "epi"):
                        runs[at[phase, piece, region]] += 1
        mark = tape.memo[("dp share", kind)] = (starts, runs)
    starts, runs = mark
    if not starts:
        return None, None
    n = len(plan.regions)
    _, coll_s, _, _, _ = price_tape(step, tape, signatures)
    seconds = [0.0] * n
    for key, count in starts.items():
        seconds[tape.coll_keys[key][1]] += coll_s[key] * count
    regions = np.array([r for _, _, r in tape.pieces()], dtype=np.int64)
    values = piece_prices(step, tape, signatures)
    return seconds, np.bincount(regions, weights=runs * values, minlength=n).tolist()
