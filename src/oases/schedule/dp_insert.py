"""The data-parallel gradient collectives and ZeRO's, placed into a program after scheduling.

A program of the TP chain (``list_scheduler.list_schedule``) gets, without moving any of its
instructions:

    "dp", t     (``insert_dp``) the all-reduce of backward task t's gradient bucket, started
                right after that task of the last micro-batch (after the TP collective the
                task starts) and waited at the end of the step
    "rs", u, m  (``insert_zero``) region u's gradient reduce-scatter after micro-batch m's last
                backward compute reading u's parameters
    "ag", u, m  (``insert_zero``) region u's weight all-gather: at stage 3 before each pass,
                prefetched one compute ahead, and ``Release(u)`` after the pass; at stages 1-2
                once, at the program's head, waited before the first forward compute that reads
                u's weights

``ZeroLayout`` says which regions are sharded at which stage and whose weights each piece
reads (``parallel/shard.py`` owns the shards; the executor's ``_zero_layout`` and the
planner's ``simulate.zero_layout`` build the layout).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from oases.schedule.instructions import (
    Compute,
    Instr,
    Piece,
    Release,
    Start,
    Wait,
    deferred_regions,
)


@dataclass(frozen=True)
class ZeroLayout:
    """Where sharded data parallelism (``parallel/shard.py``) enters a program.

    ``stages``: the ZeRO stage of every region's parameters (0: reduced by the "dp"
    all-reduces; 1-3: by "rs" reduce-scatters; 3: weights also gathered by "ag").
    ``uses``: per region i, the regions whose parameters its TP pieces (body:i, tp:i) read:
    ``(i,)``, or ``(i, 0)`` for a head tied to the embedding. A glue or norm piece of region i
    reads region i's. ``reshard_after_forward``: stage 3 frees a region's weights after the
    forward and gathers them again for the backward (else they stay from one to the other,
    like FSDP's knob of that name).

    Two knobs let the simulator build a step's micro-batches one at a time (a program of the
    whole step keeps both True): ``gather_updated``, the program begins with the stages 1-2
    gathers of the weights the previous step updated (the step's first micro-batch);
    ``ends_step``, its last micro-batch is the step's last, where stage 1 reduce-scatters."""

    stages: tuple[int, ...]
    uses: tuple[tuple[int, ...], ...]
    reshard_after_forward: bool = True
    gather_updated: bool = True
    ends_step: bool = True

    def units(self, piece: Piece, phase: str) -> tuple[int, ...]:
        kind, i = piece
        if (kind in ("body", "core") and phase != "backward") or (
            kind in ("tp", "dw") and phase == "backward"
        ):
            return self.uses[i]
        return (i,)


def insert_dp(
    body: list[Instr],
    dp_tasks: set[int],
    last_sub: int,
    closed_by_norm: frozenset[int] = frozenset(),
) -> list[Instr]:
    """Start each DP bucket's all-reduce once its last backward task is done, but after the TP
    gradient all-reduce (or the pipeline's gradient send, "sb") that task starts (the next
    compute waits on that one, not on DP). ``closed_by_norm``: buckets t that close with the
    piece ("norm", t + 1) (a pipeline stage's first region, whose norm's backward runs alone
    before the send of dx: ``pipeline_program``)."""
    out: list[Instr] = []
    pending: int | None = None
    deferred = deferred_regions(body)
    for ins in body:
        if pending is not None and not (
            (isinstance(ins, Start | Wait) and ins.kind == "bwd")
            or (isinstance(ins, Start) and ins.kind == "sb")
        ):
            out.append(Start("dp", pending))
            pending = None
        out.append(ins)
        if isinstance(ins, Compute) and ins.phase == "backward" and ins.sub == last_sub:
            kind, task = ins.pieces[-1]  # ("tp", i), or its deferred ("dw", i), closes task i
            if kind == "norm" and task - 1 in closed_by_norm:
                pending = task - 1
            elif task in dp_tasks and kind == ("dw" if task in deferred else "tp"):
                pending = task
    if pending is not None:
        out.append(Start("dp", pending))
    out.extend(Wait("dp", t) for t in sorted(dp_tasks, reverse=True))
    return out


def _keeps_pending(ins: Instr) -> bool:
    """Whether a "dp" or "rs" gradient collective due waits past ``ins``: the TP gradient
    all-reduce the task starts ("bwd"), or a pipeline's gradient send ("sb"), comes first."""
    kind = type(ins)
    return ((kind is Start or kind is Wait) and ins.kind == "bwd") or (
        kind is Start and ins.kind == "sb"
    )


ZERO_GRAD_INFLIGHT = 2  # gradient reduce-scatters in flight at once (each holds a flat copy)


def insert_zero(program: tuple[Instr, ...], zero: ZeroLayout, k: int) -> tuple[Instr, ...]:
    """Add the sharded regions' collectives to a program (``k`` sub-batches per micro-batch).

    Gradients: region u's reduce-scatter ("rs", u, m) starts right after the last backward
    compute of micro-batch m that reads u's parameters (after the TP collective that compute
    starts, as "dp" does); stage 1 only in the last micro-batch (gradients accumulate in full
    until then), stages 2-3 in every one. At most ``ZERO_GRAD_INFLIGHT`` are in flight; the
    rest are waited at the end of their micro-batch.

    Weights, stages 1-2 (Megatron-LM's overlapped parameter gather): the optimizer updated
    only this rank's shards, so the program begins with every such region's all-gather ("ag",
    u, 0), in chain order on the DP stream, and waits for each right before the first forward
    compute that reads it: region u's gather runs under the forward of regions before u::

        compute:  [embed](a) [embed](b) [epi 0, body 1](a) ...     [epi 1, body 2](a) ...
        comm:     ag 0 | ag 1 ................ | ag 2 ......... | ag 3 ...
                       ^ wait ag 0             ^ wait ag 1      ^ wait ag 2

    Weights (stage 3): in each pass (a micro-batch's forward; its recompute + backward) region
    u's weights are live from the first compute reading them to the last. Their all-gather
    ("ag", u, m) starts before the compute that precedes the first use (prefetch: it runs
    under that compute), is waited right before the first use, and ``Release(u)`` follows the
    last use. With ``reshard_after_forward`` false the forward and backward of a micro-batch are
    one pass; a pass that starts at the compute right after the previous one ended is merged
    with it (no release and gather in between)::

        compute:  [body 2](a) [body 2](b) [epi 2, body 3](a) [epi 2, body 3](b) ...
        comm:     ag 3 ...... | wait ag 3 ; release 2 after its last use
    """
    computes = [i for i, ins in enumerate(program) if type(ins) is Compute]
    n_micro = 1 + max(program[i].sub for i in computes) // k
    stages, uses = zero.stages, zero.uses
    before: dict[int, list[Instr]] = {}
    after: dict[int, list[Instr]] = {}
    # ------------------------------------------------------------------ weight gathers
    live: dict[tuple[int, tuple], list[int]] = {}  # (unit, pass) -> compute positions
    for pos, i in enumerate(computes if 3 in zero.stages else ()):  # (stage 3's only)
        ins = program[i]
        m = ins.sub // k
        pass_key = (m,) if not zero.reshard_after_forward else (m, ins.phase == "forward")
        for piece in ins.pieces:
            for u in zero.units(piece, ins.phase):
                if zero.stages[u] == 3:
                    live.setdefault((u, pass_key), []).append(pos)
    intervals: dict[int, list[list[int]]] = {}
    for (u, _), positions in sorted(live.items(), key=lambda kv: (kv[0][0], kv[1][0])):
        first, last = positions[0], positions[-1]
        runs = intervals.setdefault(u, [])
        if runs and first <= runs[-1][1] + 1:
            runs[-1][1] = max(runs[-1][1], last)
        else:
            runs.append([first, last])
    for u, runs in sorted(intervals.items()):
        for first, last in runs:
            m = program[computes[first]].sub // k
            before.setdefault(max(first - 1, 0), []).append(Start("ag", u, m))
            before.setdefault(first, []).append(Wait("ag", u, m))
            after.setdefault(last, []).append(Release(u))
    if zero.gather_updated:  # stages 1-2: the updated weights, gathered at the head
        first_use: dict[int, int] = {}
        for pos, i in enumerate(computes):
            ins = program[i]
            if ins.phase == "forward" and ins.sub < k:
                for kind, r in ins.pieces:  # (``ZeroLayout.units`` in the forward)
                    for u in uses[r] if kind == "body" or kind == "core" else (r,):
                        if stages[u] == 1 or stages[u] == 2:
                            first_use.setdefault(u, pos)
        for u, pos in sorted(first_use.items()):
            before.setdefault(0, []).append(Start("ag", u, 0))
            before.setdefault(pos, []).append(Wait("ag", u, 0))
    if before.get(0):  # at the head: every gather starts (chain order) before the first wait
        head = before[0]
        before[0] = sorted((s for s in head if isinstance(s, Start)), key=lambda s: s.index) + [
            w for w in head if not isinstance(w, Start)
        ]
    # ------------------------------------------------------------- gradient reduce-scatters
    last_use: dict[tuple[int, int], int] = {}
    scatters = max(zero.stages, default=0) >= 2 or (zero.ends_step and 1 in zero.stages)
    for pos, i in enumerate(computes if scatters else ()):
        ins = program[i]
        if ins.phase != "backward":
            continue
        m = ins.sub // k
        last_micro = m == n_micro - 1 and zero.ends_step
        for kind, r in ins.pieces:  # (``ZeroLayout.units`` in the backward)
            for u in uses[r] if kind == "tp" or kind == "dw" else (r,):
                if stages[u] >= 2 or (stages[u] == 1 and last_micro):
                    last_use[u, m] = pos
    grads_after: dict[int, list[tuple[int, int]]] = {}
    for (u, m), pos in sorted(last_use.items(), key=lambda kv: (kv[1], kv[0][0])):
        grads_after.setdefault(pos, []).append((u, m))
    # ------------------------------------------------------------------------ assemble
    out: list[Instr] = []
    inflight: deque[tuple[int, int]] = deque()
    pending: list[tuple[int, int]] = []

    def flush() -> None:
        for u, m in pending:
            if len(inflight) >= ZERO_GRAD_INFLIGHT:
                out.append(Wait("rs", *inflight.popleft()))
            out.append(Start("rs", u, m))
            inflight.append((u, m))
        pending.clear()

    def copy(lo: int, hi: int) -> None:
        """``program[lo:hi]`` (no compute among them) into ``out``, the pending scatters
        started before the first that is not the TP gradient's (or a pipeline's send)."""
        if pending:
            while lo < hi and _keeps_pending(program[lo]):
                out.append(program[lo])
                lo += 1
            if lo < hi:
                flush()
        out.extend(program[lo:hi])

    done = 0
    for pos, i in enumerate(computes):
        copy(done, i)
        flush()  # (a compute is not the TP gradient's collective: what is pending starts)
        ins = program[i]
        m = ins.sub // k
        if inflight and m > inflight[0][1]:  # a micro-batch ended
            while inflight and inflight[0][1] < m:
                out.append(Wait("rs", *inflight.popleft()))
        found = before.get(pos)
        if found:
            out += found
        out.append(ins)
        found = after.get(pos)
        if found:
            out += found
        found = grads_after.get(pos)
        if found:
            pending += found
        done = i + 1
    copy(done, len(program))
    flush()
    out.extend(Wait("rs", *key) for key in inflight)
    return tuple(out)
