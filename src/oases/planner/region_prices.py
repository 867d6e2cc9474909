"""What each region of a plan costs on its own, for the plan search's bounds
(``planner.search_bounds``) and the pipeline screen's stage shares: the compiled programs
``simulate_plan`` walks, priced (``last_micro_prices``), read region by region instead of
walked (``region_prices``): every region's compute, its own tensor-parallel collectives, and
its share of the DP stream's gathers and reduce-scatters under ZeRO, with the compute on
their far side. Each count over a program's instructions is remembered in its tape's memo
(the search prices the same programs for every degree)."""

from __future__ import annotations

from dataclasses import dataclass

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


def last_micro_prices(
    cfg: ModelConfig,
    plan: ParallelPlan,
    costs: Costs,
    world_size: int,
    batch: BatchShape,
    *,
    max_inflight: int = 1,
    first: bool = False,
    middle: bool = False,
) -> tuple[Tape, StepCosts, list[tuple]] | None:
    """The compiled program ``simulate_plan`` walks last for ``plan`` (the whole step with one
    micro-batch, else the last micro-batch with the DP collectives), its ``StepCosts`` and its
    regions' signatures (``plan_costs.price_tape``'s arguments); None where the program is not
    one a tape walks. For the search's bounds, which price a plan's regions one by one.
    ``first`` (with micro-batches): the first micro-batch's program instead (ZeRO's gathers of
    the updated weights at its head, no DP collectives); ``middle``: one between the first and
    the last (neither)."""
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
            dp=whole or not (first or middle),
            first=whole or first,
            reshard_after_forward=True,
            buckets=buckets,
        )
    )
    if tape is None:
        return None
    deferring = tape.deferring()
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


@dataclass
class RegionPrices:
    """Per region of a plan (``region_prices``): ``compute`` and ``tp_waited`` of one
    micro-batch, ``tp_comm`` of the step, the DP stream's two pairs (None where the walk
    has none: see ``region_prices``) and its ZeRO collectives in the first, a middle and the
    last walk (``dp_walks``; None without a ZeRO stage)."""

    compute: list[float]
    tp_comm: list[float]
    tp_waited: list[float]
    gathers: list[float] | None = None
    after: list[float] | None = None
    scatters: list[float] | None = None
    before: list[float] | None = None
    dp_walks: tuple[list[float], list[float], list[float]] | None = None


class _Priced:
    """One compiled program with its ``StepCosts``: its pieces' and collectives' seconds,
    priced once when first asked."""

    def __init__(self, found: tuple[Tape, StepCosts, list[tuple]]) -> None:
        self.tape, self.step, self.signatures = found
        self._values: np.ndarray | None = None
        self._coll: np.ndarray | None = None

    def values(self) -> np.ndarray:
        if self._values is None:
            self._values = piece_prices(self.step, self.tape, self.signatures)
        return self._values

    def coll(self) -> np.ndarray:
        if self._coll is None:
            self._coll = np.asarray(price_tape(self.step, self.tape, self.signatures)[1])
        return self._coll

    def per_region(self, runs: np.ndarray, n: int) -> np.ndarray:
        """Seconds per region of the pieces run ``runs`` times (``tape.pieces()``'s order)."""
        return np.bincount(_piece_regions(self.tape), weights=runs * self.values(), minlength=n)


def region_prices(
    cfg: ModelConfig,
    plan: ParallelPlan,
    costs: Costs,
    world_size: int,
    batch: BatchShape,
    *,
    max_inflight: int = 1,
) -> RegionPrices | None:
    """Per region of ``plan``, read off the programs ``simulate_plan`` walks (None where the
    last is not one a tape walks):

    - compute (one micro-batch): its pieces as ``simulate_plan`` prices them, leaving out the
      recompute of glue ("epi" in the recompute phase, which a plan that changes degree there
      skips): a lower bound on the compute stream's busy time, region by region. Every plan
      whose region i has this region's degree runs at least region i's share, whatever the
      other regions' degrees (the pieces of a program are the same but for that glue; a
      piece's price reads only its region's kind, degree and rows);
    - tp_comm (the step) and tp_waited (one micro-batch): the seconds of its own TP
      collectives (``TP_KINDS``: the row- and column-parallel linears' reductions and
      sequence parallelism's gathers, which every plan runs at the region's degree and rows,
      whatever its neighbours'), and of those among
      them waited at once (the program's next instruction is their wait: the compute stream
      idles for all of it);
    - with a ZeRO stage: (gathers) its weight gathers ("ag") in the first
      walk (the first micro-batch, or the whole step; stages 1 and 2, which gather each
      region's updated weights once, before its first forward) and (after) its backward and
      recompute there: every backward follows every forward, so every gather's wait, and the
      gathers run one after another on the DP stream, so that walk takes at least the sum of
      both; (scatters) its gradient reduce-scatters ("rs") in the last walk and (before) its
      forward there: a region's gradient follows every sub-batch's forward, so every
      reduce-scatter starts after all of it, and they run one after another, so that walk
      takes at least the sum of both. A pair is None where the walk has none of those
      collectives, or (checked on the program) some of those computes are on the near side;
    - with a ZeRO stage (dp_walks): the seconds of its own ZeRO collectives (``ZERO_KINDS``,
      at its degree's DP group and its padded parameters) in the first, a middle and the last
      walk (each the whole step's with one micro-batch): they share the one DP stream, so a
      walk takes at least their sum over the regions.
    """
    found = last_micro_prices(cfg, plan, costs, world_size, batch, max_inflight=max_inflight)
    if found is None:
        return None
    last, n = _Priced(found), len(plan.regions)
    keys, regions, starts, at_once = _tp_starts(last.tape)
    seconds = last.coll()[keys]
    prices = RegionPrices(
        last.per_region(_piece_runs(last.tape, "all"), n).tolist(),
        (np.bincount(regions, weights=seconds * starts, minlength=n) * batch.n_micro()).tolist(),
        np.bincount(regions, weights=seconds * at_once, minlength=n).tolist(),
    )
    stages = set(plan.zero_stages())
    if stages == {0}:
        return prices

    def walk(**which: bool) -> _Priced | None:
        found = last_micro_prices(
            cfg, plan, costs, world_size, batch, max_inflight=max_inflight, **which
        )
        return _Priced(found) if found is not None else None

    walks = [last, last, last]  # first, middle, last (one micro-batch: the step's walk)
    if batch.n_micro() > 1:  # ``simulate_plan``'s: its own first walk at stages 1-2 only
        walks[1] = walk(middle=True)
        walks[0] = walk(first=True) if stages <= {1, 2} else walks[1]
    if None not in walks:
        prices.dp_walks = tuple(_coll_seconds(w, ZERO_KINDS, n) for w in walks)
    if stages <= {1, 2}:
        first = walks[0]
        if first is not None:
            prices.gathers, prices.after = _dp_share(first, "ag", n)
    prices.scatters, prices.before = _dp_share(last, "rs", n)
    return prices


def region_compute_s(
    cfg: ModelConfig,
    plan: ParallelPlan,
    costs: Costs,
    world_size: int,
    batch: BatchShape,
    *,
    max_inflight: int = 1,
) -> list[float] | None:
    """Seconds of compute every region of ``plan`` runs in a step (``region_prices``' compute
    of one micro-batch, times the micro-batches, and nothing else priced: the pipeline
    screen's shares). None where the program is not one a tape walks."""
    found = last_micro_prices(cfg, plan, costs, world_size, batch, max_inflight=max_inflight)
    if found is None:
        return None
    last = _Priced(found)
    per_micro = last.per_region(_piece_runs(last.tape, "all"), len(plan.regions))
    return (per_micro * batch.n_micro()).tolist()


# a region's own collectives over its TP group: the all-reduces (reduce-scatters under sp), and
# sequence parallelism's gathers (``plan_costs``: each at region i's degree and rows)
TP_KINDS = ("fwd", "bwd", "gf", "gb", "gr", "gh")
ZERO_KINDS = ("rs", "ag")  # a region's own ZeRO collectives over its DP group


def _piece_regions(tape: Tape) -> np.ndarray:
    found = tape.memo.get("piece regions")
    if found is None:
        found = tape.memo["piece regions"] = np.array(
            [r for _, _, r in tape.pieces()], dtype=np.int64
        )
    return found


def _piece_runs(tape: Tape, which: str) -> np.ndarray | None:
    """How many times each (phase, piece, region) of ``tape.pieces()`` runs (0 for a
    recompute's glue): "all" of them; "ag", the backward and recompute after the last ZeRO
    gather's wait; "rs", the forward before the first reduce-scatter's start (None where the
    tape has no such collective, or one of those computes is on the near side). Remembered in
    ``tape.memo``."""
    key = ("piece runs", which)
    if key in tape.memo:
        return tape.memo[key]
    phases = ("forward", "backward", "recompute")
    if which != "all":
        starts, first_start, last_wait = _dp_starts(tape, which)
        if not starts:
            tape.memo[key] = None
            return None
        phases = ("backward", "recompute") if which == "ag" else ("forward",)
    at = {t: j for j, t in enumerate(tape.pieces())}
    runs = np.zeros(len(at))
    for j, (op, cid, _) in enumerate(tape.ops):
        if op != COMPUTE:
            continue
        phase, pieces = tape.compute_keys[cid]
        if phase not in phases:
            continue
        if which != "all" and (j < last_wait if which == "ag" else j > first_start):
            tape.memo[key] = None  # (on the near side: no bound from this pair)
            return None
        for piece, region in pieces:
            if not (phase == "recompute" and piece == "epi"):
                runs[at[phase, piece, region]] += 1
    tape.memo[key] = runs
    return runs


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


def _dp_starts(tape: Tape, kind: str) -> tuple[dict[int, int], int | None, int | None]:
    """``kind``'s collective keys in ``tape`` with how many times each starts, the position of
    the first start and of the last wait (remembered in ``tape.memo``)."""
    key = ("dp starts", kind)
    if key not in tape.memo:
        starts: dict[int, int] = {}
        slots, first_start, last_wait = set(), None, None
        for j, (op, cid, slot) in enumerate(tape.ops):
            if op == START and tape.coll_keys[cid][0] == kind:
                starts[cid] = starts.get(cid, 0) + 1
                slots.add(slot)
                first_start = j if first_start is None else first_start
            elif op == WAIT and cid in slots:
                last_wait = j
        tape.memo[key] = (starts, first_start, last_wait)
    return tape.memo[key]


def _dp_share(priced: _Priced, kind: str, n: int) -> tuple[list[float] | None, list[float] | None]:
    """Per region: the seconds of ``kind``'s collectives in the tape and its compute on their
    far side (``_piece_runs``); (None, None) where there is none."""
    runs = _piece_runs(priced.tape, kind)
    if runs is None:
        return None, None
    return _coll_seconds(priced, (kind,), n), priced.per_region(runs, n).tolist()


def _coll_seconds(priced: _Priced, kinds: tuple[str, ...], n: int) -> list[float]:
    """Per region: the seconds of its collectives of ``kinds`` in the tape, each start."""
    seconds = np.zeros(n)
    coll = priced.coll()
    for kind in kinds:
        for cid, count in _dp_starts(priced.tape, kind)[0].items():
            seconds[priced.tape.coll_keys[cid][1]] += coll[cid] * count
    return seconds.tolist()
