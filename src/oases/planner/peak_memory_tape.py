"""``peak_memory``'s walk compiled on a tape: the same numbers as ``peak_memory.peak_memory``,
for the search, which prices many layouts of one program.

    _compile_memory(program, ...)   once per program and layout: every change of a running
                                    total (activations, gradients, moving, held) in walk order,
                                    an index into a table of values, and where the peak is taken
    _memory_values(bytes, ...)      that table, from one plan's per-region bytes
    _walk_events(events, table)     the running sums and their peak (numpy)
    peak_memory_tape(...)           the three, the compiled events remembered on the tape

Split from ``peak_memory`` (one concern a module): what a rank holds and when is documented
there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from oases.config import ModelConfig
from oases.planner.costs import Costs
from oases.planner.peak_memory import ModelState, _Bytes, _region_bytes, _with_step
from oases.planner.precision import precision_of
from oases.planner.tape import Tape
from oases.schedule.program import Compute, Instr, Release, Start, Wait

ACT, GRADS, MOVING, HELD = range(4)
# the per-region value rows of ``_memory_values``, in order (then one row per alive pattern)
_ROWS = (
    "kept",
    "graph",
    "graph-kept",
    "full",
    "shard",
    "padded",
    "scattering",
    "gather_copy",
    "shard+gather_copy",
    "seq0",
    "seq1",
    "deferred",
    "bucket",
)
_ROW = {name: r for r, name in enumerate(_ROWS)}


@dataclass(frozen=True)
class _MemoryEvents:
    """``peak_memory``'s walk of one program, compiled for one layout: every change of a
    running total (``var``: ACT, GRADS, MOVING or HELD) in walk order, its value (an index
    into ``_memory_values``'s table) and sign; the events after which the walk takes its
    peak (``checkpoints``, -1: before any), and the reduce-scatters that take it before their
    own changes, with the padded buffer they add (``rs_before``, ``rs_value``): the states the
    walk takes its peak in (an instruction that changes nothing repeats the state before it).
    """

    var: np.ndarray
    value: np.ndarray
    sign: np.ndarray
    checkpoints: np.ndarray
    rs_before: np.ndarray
    rs_value: np.ndarray
    patterns: tuple[str, ...]  # what a (region, sub-batch)'s activations were built by
    whole: set[int]  # regions whose gradient is whole at the start (a later micro-batch)
    shards: set[int]


def _compile_memory(
    program: tuple[Instr, ...],
    n: int,
    stages: tuple[int, ...],
    uses: tuple[tuple[int, ...], ...],
    sp: bool,
    later: bool,
    deferring: frozenset[int],
) -> _MemoryEvents:
    """The events of ``peak_memory``'s ``walk(later)`` on ``program`` (which sets hold which
    region depends on the program and the stages only, never on the bytes); ``deferring``:
    ``Tape.deferring``."""
    var: list[int] = []
    value: list[int] = []
    sign: list[float] = []
    checkpoints: list[int] = []
    rs_before: list[int] = []
    rs_value: list[int] = []
    patterns: dict[str, int] = {}
    at = {name: r * n for r, name in enumerate(_ROWS)}  # a row's offset in the table
    kept, graph_kept, deferred_at = at["kept"], at["graph-kept"], at["deferred"]
    full_at, shard_at, padded_at = at["full"], at["shard"], at["padded"]
    put_var, put_value, put_sign = var.append, value.append, sign.append

    def pattern_at(p: str) -> int:
        return (len(_ROWS) + patterns.setdefault(p, len(patterns))) * n

    whole = {i for i in range(n) if stages[i] <= 1} if later else set()
    shards = {i for i in range(n) if stages[i] >= 2} if later else set()
    start_whole, start_shards = set(whole), set(shards)
    alive: dict[tuple[int, int], str] = {}  # (region, sub) -> how its bytes were built
    inflight: dict[tuple[str, int, int], int] = {}  # collective -> the row offset it holds
    gathered: set[int] = set()
    moving_kinds = {
        "dp": at["bucket"],
        "gf": at["seq0"],
        "gb": at["seq0"],
        "gr": at["seq0"],
        "gh": at["seq0"],
        "fwd": at["seq1"],
        "bwd": at["seq1"],
    }
    # what moves bytes: ZeRO's, the DP all-reduces, sequence parallelism's ("gf", "gb", "gr",
    # "gh" and its reduce-scatters "fwd", "bwd")
    tracked = {"rs", "ag", *moving_kinds} if sp else {"rs", "ag", "dp"}
    scattering, shard_gather = at["scattering"], at["shard+gather_copy"]
    gather_copy = at["gather_copy"]
    put_check = checkpoints.append
    for ins in program:
        before = len(var)
        kind = type(ins)
        if kind is Compute:
            phase, sub = ins.phase, ins.sub
            if phase == "backward":
                for piece, i in ins.pieces:
                    if piece != "tp" and piece != "dw":
                        continue
                    p = alive.pop((i, sub), "")  # (the activations its backward read, freed)
                    if p:
                        put_var(ACT)
                        put_value(pattern_at(p) + i)
                        put_sign(-1.0)
                    if piece == "tp":
                        if i in deferring:
                            alive[i, sub] = "D"
                            put_var(ACT)
                            put_value(deferred_at + i)
                            put_sign(1.0)
                        for u in uses[i]:
                            if u not in whole:
                                whole.add(u)
                                put_var(GRADS)
                                put_value(full_at + u)
                                put_sign(1.0)
            elif phase == "forward" or phase == "recompute":
                mark, row = ("F", kept) if phase == "forward" else ("R", graph_kept)
                for piece, i in ins.pieces:
                    if piece == "body" or piece == "core":
                        alive[i, sub] = alive.get((i, sub), "") + mark
                        put_var(ACT)
                        put_value(row + i)
                        put_sign(1.0)
        elif kind is Start:
            name = ins.kind
            if name in tracked:
                u = ins.index
                if name == "rs":
                    rs_before.append(len(var) - 1)
                    rs_value.append(padded_at + u)
                    if u in whole:
                        whole.discard(u)
                        put_var(GRADS)
                        put_value(full_at + u)
                        put_sign(-1.0)
                    inflight[name, u, ins.sub] = scattering
                    put_var(MOVING)
                    put_value(scattering + u)
                    put_sign(1.0)
                elif name == "ag":
                    row = None
                    if stages[u] < 3:
                        row = inflight[name, u, ins.sub] = shard_gather
                    elif u not in gathered:
                        gathered.add(u)
                        put_var(HELD)
                        put_value(padded_at + u)
                        put_sign(1.0)
                        row = inflight[name, u, ins.sub] = gather_copy
                    else:
                        row = inflight.get((name, u, ins.sub))
                    if row is not None:
                        put_var(MOVING)
                        put_value(row + u)
                        put_sign(1.0)
                else:  # "dp", or sequence parallelism's
                    row = inflight[name, u, ins.sub] = moving_kinds[name]
                    put_var(MOVING)
                    put_value(row + u)
                    put_sign(1.0)
        elif kind is Wait:
            name = ins.kind
            if name in tracked:
                u = ins.index
                row = inflight.pop((name, u, ins.sub), None)
                if row is not None:
                    put_var(MOVING)
                    put_value(row + u)
                    put_sign(-1.0)
                if name == "rs" and u not in shards:  # accumulated into the one shard
                    shards.add(u)
                    put_var(GRADS)
                    put_value(shard_at + u)
                    put_sign(1.0)
        elif kind is Release and ins.index in gathered:
            gathered.discard(ins.index)
            put_var(HELD)
            put_value(padded_at + ins.index)
            put_sign(-1.0)
        if len(var) > before:
            put_check(len(var) - 1)
        elif not checkpoints:  # the state the walk starts in, taken after this instruction
            put_check(-1)
    return _MemoryEvents(
        np.array(var, dtype=np.int8),
        np.array(value, dtype=np.int64),
        np.array(sign),
        np.array(checkpoints, dtype=np.int64),
        np.array(rs_before, dtype=np.int64),
        np.array(rs_value, dtype=np.int64),
        tuple(patterns),
        start_whole,
        start_shards,
    )


def _memory_values(
    b: _Bytes, bucket_bytes: dict[int, float], patterns: tuple[str, ...]
) -> np.ndarray:
    """The table the events index: ``_ROWS`` then one row per alive pattern, each a value per
    region, computed as the walk computes it (``alive[i, sub]`` grows by ``kept`` in a
    forward, by ``graph`` less ``kept`` in a recompute, is set to ``deferred``)."""
    n = len(b.kept)
    kept, graph = np.array(b.kept, dtype=float), np.array(b.graph, dtype=float)
    shard, gather_copy = np.array(b.shard, dtype=float), np.array(b.gather_copy, dtype=float)
    deferred = np.array(b.deferred, dtype=float)
    rows = [
        kept,
        graph,
        graph - kept,
        np.array(b.full, dtype=float),
        shard,
        np.array(b.padded, dtype=float),
        np.array(b.scattering, dtype=float),
        gather_copy,
        shard + gather_copy,
        np.array(b.seq[0], dtype=float),
        np.array(b.seq[1], dtype=float),
        deferred,
        np.array([bucket_bytes.get(t, 0.0) for t in range(n)], dtype=float),
    ]
    for p in patterns:
        v = np.zeros(n)
        for c in p:
            v = v + kept if c == "F" else (v + graph) - kept if c == "R" else deferred.copy()
        rows.append(v)
    return np.concatenate(rows) if n else np.zeros(0)


def _walk_events(
    ev: _MemoryEvents, table: np.ndarray, static: float, b: _Bytes
) -> tuple[float, float, float]:
    """``walk`` on compiled events: each running total is the running sum of its own changes
    (``np.cumsum`` adds in order, as the walk does), the peak taken where the walk takes it."""
    grads0 = sum(b.full[u] for u in ev.whole) + sum(b.shard[u] for u in ev.shards)
    m = len(ev.var)
    changes = table[ev.value] * ev.sign
    totals = []
    for v, start in ((ACT, 0.0), (GRADS, grads0), (MOVING, 0.0), (HELD, 0.0)):
        steps = np.zeros(m + 1)
        steps[0] = start
        mine = ev.var == v
        steps[1:][mine] = changes[mine]
        totals.append(np.cumsum(steps))
    act, grads, moving, held = totals
    peak = peak_act = 0.0
    if len(ev.checkpoints):
        at = ev.checkpoints + 1
        peak = max(peak, float((static + act[at] + grads[at] + moving[at] + held[at]).max()))
        peak_act = max(peak_act, float(act[at].max()))
    if len(ev.rs_before):
        at = ev.rs_before + 1
        peak = max(
            peak,
            float(
                (static + act[at] + grads[at] + moving[at] + held[at] + table[ev.rs_value]).max()
            ),
        )
    return peak, peak_act, float(grads[-1])


def peak_memory_tape(
    cfg: ModelConfig,
    tape: Tape,
    kinds: list[str],
    degrees: list[int],
    rows: list[int],
    mode: str,
    costs: Costs,
    state: ModelState,
    uses: tuple[tuple[int, ...], ...],
    bucket_bytes: dict[int, float],
    repeats: int = 1,
    graph_mode: str = "none",
) -> dict[str, float]:
    """``peak_memory`` of ``tape.program``, the same numbers: the walk compiled once per
    program and layout (``_compile_memory``, remembered on the tape), then run on every plan's
    bytes as running sums (``_walk_events``)."""
    prec = precision_of(costs)
    by_kind = state.bytes_by_kind(prec)
    static = by_kind["weights"] + by_kind["optimizer"]
    b = _region_bytes(cfg, kinds, degrees, rows, mode, graph_mode, costs, state)
    sp = mode.startswith("sp-")
    walks = []
    for later in (False, True)[: 2 if repeats > 1 else 1]:
        key = ("memory", state.stages, uses, sp, later)
        ev = tape.memo.get(key)
        if ev is None:
            ev = tape.memo[key] = _compile_memory(
                tape.program, len(kinds), state.stages, uses, sp, later, tape.deferring()
            )
        walks.append(_walk_events(ev, _memory_values(b, bucket_bytes, ev.patterns), static, b))
    peak, peak_act, end = walks[0]
    if repeats > 1:
        later_peak, later_act, end = walks[1]
        peak, peak_act = max(peak, later_peak), max(peak_act, later_act)
    return _with_step(peak, peak_act, end, static, by_kind, b.shard, state, costs)
