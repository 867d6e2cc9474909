"""What every instruction of one rank's program of a plan costs: ``plan_step_costs`` turns a
``planner.costs.Costs`` (a measured profile or a hardware preset) into the ``StepCosts`` that
``planner.event_walk.simulate_program`` walks, every region at its own TP degree and sub-batch
rows. Rank 0's groups stand for every rank's (``planner.layout.group_ranks``)::

    kind         collective       over                          bytes
    fwd, bwd     all-reduce (*)   region i's TP group           [b, S, H] in the compute dtype
    gf, gb, gr   all-gather       region i's TP group           [b, S, H]   (sequence parallel)
    sg           all-reduce       region 0's TP group           the glue's fp32 gradients
    rsf, rsb     all-gather       the merge group of i-1 and i  [b, S, H] of the larger batch
                                  (sequence parallel: the larger degree's TP group; else the
                                  slicing direction moves nothing and costs nothing)
    dp           all-reduce       each DP group of bucket i     its gradients in grad_reduce
    rs, ag       reduce-scatter,  region i's DP group           its padded flat parameters
                 all-gather                                     (rs: grad_reduce; ag: master)

    (*) a reduce-scatter under sequence parallelism

Streams (``stream_of``): collectives over the same ranks share one (one link); every DP
all-reduce and ZeRO collective shares the "dp" stream, whatever its group. Pieces are priced as
the costs timed them (``piece_s``): sequence parallelism's as the costs' "sp-" pieces, a
communication-free recompute's body without its last matmul. A profile's measured contention
(``contention``, ``comm_contention``) becomes ``StepCosts.slowdown`` and ``comm_slowdown``.
Shape legend: b sub-batch rows, S sequence, H hidden.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from oases.config import ModelConfig
from oases.plan import ParallelPlan
from oases.planner.costs import Costs, region_kind, sp_piece
from oases.planner.event_walk import StepCosts, collective_op
from oases.planner.layout import glue_param_count, group_ranks, plan_sp
from oases.planner.peak_memory import ModelState
from oases.planner.precision import precision_of
from oases.planner.tape import Tape


def plan_step_costs(
    cfg: ModelConfig,
    plan: ParallelPlan,
    costs: Costs,
    world_size: int,
    rows: list[int],
    *,
    state: ModelState,
    buckets: dict[int, list[tuple[int, int]]],
    deferring: frozenset[int],
) -> StepCosts:
    """The ``StepCosts`` of ``plan``'s programs on ``world_size`` ranks: ``rows`` of a
    sub-batch in every region (``planner.batch.region_rows``), every region's parameter
    ``state`` (``layout.model_state``), the DP gradient ``buckets`` (``layout.dp_buckets``)
    and the regions whose weight gradients the program defers (``deferring``:
    ``schedule.program.deferred_regions``). Every price is remembered (``functools.cache``):
    ``simulate_plan`` walks several programs of one plan on the same ``StepCosts``."""
    from oases.schedule.program import SPECS

    spec = SPECS[plan.schedule]
    k = plan.n_sub if spec.overlapped else 1
    degrees = [r.tp for r in plan.regions]
    kinds = [region_kind(r.name) for r in plan.regions]
    n = len(degrees)
    prec = precision_of(costs)
    # [b, S, H] in the compute dtype
    act_bytes = [rows[i] * cfg.seq_len * cfg.dim * prec.activation_bytes for i in range(n)]

    def reshard(i: int, backward: bool) -> tuple[int, tuple[int, ...]]:
        """(bytes, rank 0's group) of the all-gather a reshard into region i moves. Under
        sequence parallelism both directions gather over the larger degree's TP group (its
        whole [rows, S, H]: ``comm.reshard_seq_async``)."""
        a, b = degrees[i - 1], degrees[i]
        grows = b > a
        lo, hi = min(a, b), max(a, b)
        if sp:
            return act_bytes[i if grows else i - 1], group_ranks("tp", hi, 0, world_size)
        if grows == backward:  # the slicing direction moves nothing
            return 0, (0,)
        return act_bytes[i if grows else i - 1], group_ranks("merge", lo, hi, world_size)

    def priced(op: str, ranks: tuple[int, ...], nbytes: float) -> float:
        if len(ranks) <= 1 or nbytes <= 0:
            return 0.0
        by_ranks = getattr(costs, "collective_ranks_s", None)  # topology-aware costs
        if by_ranks is not None:
            return by_ranks(op, ranks, int(nbytes))
        return costs.collective_s(op, len(ranks), int(nbytes))

    sp = plan_sp(plan)

    def collective_s(kind: str, index: int) -> float:
        if kind in ("gf", "gb", "gr", "gh"):  # sequence parallelism: [b, S, H] gathered
            return priced(
                "all_gather", group_ranks("tp", degrees[index], 0, world_size), act_bytes[index]
            )
        if kind == "sg":
            return priced(
                "all_reduce",
                group_ranks("tp", degrees[0], 0, world_size),
                glue_param_count(cfg) * prec.master_bytes,
            )  # fp32 gradients
        if sp and kind in ("fwd", "bwd"):
            return priced(
                "reduce_scatter", group_ranks("tp", degrees[index], 0, world_size), act_bytes[index]
            )
        if kind == "dp":
            return sum(
                priced(
                    "all_reduce",
                    group_ranks("dp", world_size // dp, 0, world_size),
                    numel * prec.grad_reduce_bytes,
                )
                for dp, numel in buckets[index]
            )
        if kind in ("rsf", "rsb"):
            return priced("all_gather", *reversed(reshard(index, kind == "rsb")))
        if kind in ("rs", "ag"):  # ZeRO: region index's padded flat buffer over its DP group
            return priced(
                "reduce_scatter" if kind == "rs" else "all_gather",
                group_ranks("dp", degrees[index], 0, world_size),
                state.padded(index)
                * (prec.grad_reduce_bytes if kind == "rs" else prec.master_bytes),
            )
        return priced(
            "all_reduce", group_ranks("tp", degrees[index], 0, world_size), act_bytes[index]
        )

    def stream_of(kind: str, index: int) -> Hashable:
        if kind in ("dp", "rs", "ag"):  # every DP group's traffic crosses the same links
            return "dp"
        if kind in ("rsf", "rsb"):
            lo, hi = sorted((degrees[index - 1], degrees[index]))
            return (
                group_ranks("tp", hi, 0, world_size)
                if sp
                else group_ranks("merge", lo, hi, world_size)
            )
        return group_ranks("tp", degrees[index], 0, world_size)

    commfree = spec.recompute == "commfree"
    overlap_aware = getattr(costs, "measures_overlap", False)

    def piece_s(phase: str, piece: str, i: int) -> float:
        """A piece as the profile timed it beside collectives like its own: an overlapped
        schedule cut into one sub-batch overlaps no TP collective, and runs the synchronous
        one's program (its pieces timed at these very rows). Sequence parallelism's pieces are
        the costs' "sp-" ones (a recompute of a norm or glue is priced as its forward)."""
        if phase == "recompute" and piece == "body" and commfree:
            piece = "body-commfree"
        if piece == "dw" and degrees[i] == 1 and sp:  # a degree-1 region's "tp" is whole
            return 0.0
        if not sp and i in deferring and phase == "backward" and piece in ("tp", "dw"):
            piece = "sp-dx" if piece == "tp" else "sp-dw"  # zb-h1's B and W (the same split)
        elif sp and degrees[i] == 1 and piece in ("norm", "core") and phase != "backward":
            if piece == "norm":  # a degree-1 region's slice is the whole sequence: its norm
                return 0.0  # and core are the body (priced whole with the core)
            piece = "body-commfree" if phase == "recompute" and commfree else "body"
        elif sp and degrees[i] > 1:
            piece = sp_piece(piece, phase, i, commfree, i in deferring)
            if phase == "recompute" and piece in ("sp-norm", "sp-epi", "sp-core"):
                phase = "forward"
        if overlap_aware:
            return costs.compute_s(kinds[i], phase, piece, degrees[i], rows[i], overlapped=k > 1)
        return costs.compute_s(kinds[i], phase, piece, degrees[i], rows[i])

    contention = getattr(costs, "contention", None)  # a profile's measured slowdowns
    slowdown = (
        None
        if contention is None
        else functools.cache(lambda kind: contention(collective_op(kind, bool(sp))))
    )
    comm_contention = getattr(costs, "comm_contention", None)
    comm_slowdown = (
        None
        if comm_contention is None
        else functools.cache(lambda kind: comm_contention(collective_op(kind, bool(sp))))
    )
    return StepCosts(
        piece_s=functools.cache(piece_s),
        collective_s=functools.cache(collective_s),
        stream_of=functools.cache(stream_of),
        slowdown=slowdown,
        comm_slowdown=comm_slowdown,
    )


class Signatures(list):
    """``region_signatures``' list, numbering its distinct signatures (first seen first) once
    for every tape priced with it (``_signature_ids``)."""

    ids: tuple[np.ndarray, int] | None = None


def region_signatures(
    kinds: list[str],
    degrees: list[int],
    rows: list[int],
    stages: tuple[int, ...],
    deferring: frozenset[int],
) -> Signatures:
    """Per region i, everything ``plan_step_costs``'s prices of region i read about the plan
    (``piece_s(phase, piece, i)``, ``collective_s(kind, i)``, ``stream_of(kind, i)``): its kind,
    degree, rows and stage, whether it defers its weight gradients and is the first, its
    predecessor's degree and rows (a reshard into it) and its successor's degree and stage
    (the norm its DP bucket carries). Two regions of one signature cost the same, so
    ``price_tape`` prices each signature once: a model's blocks repeat."""
    n = len(kinds)
    return Signatures(
        (
            kinds[i],
            degrees[i],
            rows[i],
            stages[i],
            i in deferring,
            i == 0,
            (degrees[i - 1], rows[i - 1]) if i else None,
            (degrees[i + 1], stages[i + 1]) if i + 1 < n else None,
        )
        for i in range(n)
    )


@dataclass
class _TapeIndex:
    """A tape's prices to look up: its (phase, piece, region) triples (``Tape.pieces``) as
    (phase-piece id, region), each compute key as a row of triple indices (padded with the
    index of a zero), each collective key as (kind id, index)."""

    piece_names: list[tuple[str, str]]
    piece_id: np.ndarray
    piece_region: np.ndarray
    key_pieces: np.ndarray
    kind_names: list[str]
    coll_kind: np.ndarray
    coll_index: np.ndarray


def _tape_index(tape: Tape) -> _TapeIndex:
    found = tape.memo.get("price index")
    if found is not None:
        return found
    triples = tape.pieces()
    at = {t: j for j, t in enumerate(triples)}
    names: dict[tuple[str, str], int] = {}
    piece_id = np.array(
        [names.setdefault((p, k), len(names)) for p, k, _ in triples], dtype=np.int64
    )
    width = max((len(pieces) for _, pieces in tape.compute_keys), default=0)
    key_pieces = np.full((len(tape.compute_keys), width), len(triples), dtype=np.int64)
    for row, (phase, pieces) in enumerate(tape.compute_keys):
        for col, (kind, region) in enumerate(pieces):
            key_pieces[row, col] = at[phase, kind, region]
    kinds: dict[str, int] = {}
    coll_kind = np.array(
        [kinds.setdefault(k, len(kinds)) for k, _ in tape.coll_keys], dtype=np.int64
    )
    found = tape.memo["price index"] = _TapeIndex(
        list(names),
        piece_id,
        np.array([r for _, _, r in triples], dtype=np.int64),
        key_pieces,
        list(kinds),
        coll_kind,
        np.array([i for _, i in tape.coll_keys], dtype=np.int64),
    )
    return found


def _signature_ids(signatures: list[tuple]) -> tuple[np.ndarray, int]:
    known = getattr(signatures, "ids", None)
    if known is not None:
        return known
    ids: dict[tuple, int] = {}
    sig = np.array([ids.setdefault(s, len(ids)) for s in signatures], dtype=np.int64)
    found = sig, max(len(ids), 1)
    if isinstance(signatures, Signatures):
        signatures.ids = found
    return found


def piece_prices(step: StepCosts, tape: Tape, signatures: list[tuple]) -> np.ndarray:
    """Seconds of every (phase, piece, region) of ``tape.pieces()`` under ``step``, each
    distinct (piece, region signature) priced once (``region_signatures``)."""
    index = _tape_index(tape)
    sig, n_sig = _signature_ids(signatures)
    triples = tape.pieces()
    code = index.piece_id * n_sig + sig[index.piece_region]
    _, first, inverse = np.unique(code, return_index=True, return_inverse=True)
    priced = np.array([step.piece_s(*triples[j]) for j in first.tolist()] + [0.0])
    return priced[inverse.ravel()]


def price_tape(
    step: StepCosts, tape: Tape, signatures: list[tuple]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray | None]:
    """``tape``'s prices under ``step`` (``tape_walk.walk_tape``'s arguments): every compute
    key's seconds (its pieces summed in order from 0.0, as ``simulate_program`` sums them),
    every collective key's seconds and stream id, the number of streams, and every collective
    key's slowdown of compute (``step.slowdown``; None without one). Each distinct
    (piece, region signature) and (collective kind, region signature) is priced once, at the
    first region of that signature (``region_signatures``)."""
    index = _tape_index(tape)
    sig, n_sig = _signature_ids(signatures)
    values = np.append(piece_prices(step, tape, signatures), 0.0)
    parts = values[index.key_pieces]
    compute = np.zeros(len(tape.compute_keys))
    for col in range(parts.shape[1]):
        compute = compute + parts[:, col]
    code = index.coll_kind * n_sig + sig[index.coll_index]
    _, first, inverse = np.unique(code, return_index=True, return_inverse=True)
    streams: dict[Hashable, int] = {}
    seconds, stream, factor = [], [], []
    for j in first.tolist():
        kind, i = tape.coll_keys[j]
        seconds.append(step.collective_s(kind, i))
        stream.append(streams.setdefault(step.stream_of(kind, i), len(streams)))
        if step.slowdown is not None:
            factor.append(float(step.slowdown(kind)))
    inverse = inverse.ravel()
    factors = np.array(factor + [1.0])[inverse] if step.slowdown is not None else None
    return (
        compute,
        np.array(seconds + [0.0])[inverse],
        np.array(stream + [0], dtype=np.int64)[inverse],
        len(streams),
        factors,
    )
