"""Schedules as data: an instruction set over the chain of regions, and one generator per schedule.

A program is a flat list of instructions for one rank, run by the executor on tensors and by the
planner's simulator on costs. Pieces of the chain (see ``regions.py``) in each phase:

    forward / recompute   ("epi", i)   glue after region i's all-reduce   (x_i, r_i) -> x_{i+1}
                          ("body", i)  norm + TP matmuls of region i       x_i -> p_i
    backward              ("norm", i)  backward of region i's norm (needs the reduced dh_i)
                          ("epi", i)   backward of the glue -> dr_i, residual part of dx_i
                          ("tp", i)    backward of region i's TP matmuls -> partial dh_i
                          ("dw", i)    sequence parallelism: the weight gradients ("tp", i)
                                       left, run under later collectives (``_sp_chain``)

Collectives (``Start``/``Wait`` kind, index, sub-batch):

    "fwd", i    all-reduce of p_i over region i's TP group
    "bwd", i    all-reduce of the partial dh_i over region i's TP group
    "rsf", i    forward reshard of x_i (made by epi:i-1 in region i-1's layout) into region i's
                layout, where the TP degree changes between regions i-1 and i (``degrees``):
                an all-gather along the batch when the degree grows, a local slice when it
                shrinks (a Start/Wait pair all the same, complete at once)
    "rsb", i    backward reshard of dx_i (made by norm:i in region i's layout) back into region
                i-1's layout: the slice when the degree grew, the all-gather when it shrank
    "dp", t     data-parallel gradient mean of backward task t's parameter bucket
    "rs", u, m  ZeRO: reduce-scatter of region u's gradients over its DP group, micro-batch m
    "ag", u, m  ZeRO: all-gather of region u's weights: at stage 3 before each pass
                (``Release(u)`` frees them after it); at stages 1-2 once, at the program's head,
                of the shards the previous step's optimizer updated; see ``_insert_zero``

Sequence parallelism (``sp``, Megatron-LM's ``--sequence-parallel``; see ``_sp_chain``): the
glue and norms run on this rank's S/t slice of the sequence, "fwd" and "bwd" become
reduce-scatters along the sequence (same bytes as half an all-reduce each), and two gathers
along the sequence join them (the other half)::

    "gf", i     all-gather of h_i (norm:i's output slice) before region i's TP matmuls
    "gb", i     all-gather of dr_i (epi:i's input-gradient slice) before tp:i's backward
    "gr", i     "gf" again in a communication-free recompute that keeps only slices
                (``sp="shards"``; ``sp="gathered"`` keeps the gathered h_i and gathers nothing)
    "sg", 0     the sum over the TP group of the gradients of the parameters the glue and norms
                use (each rank's come from its slice of the sequence): one all-reduce at the
                end of the step (after ZeRO's reduce-scatters: it sums their shards' parts
                of those parameters), as Megatron-LM's all-reduce of its layernorm gradients

and the forward piece "body" splits into ("norm", i) on the slice and ("core", i) on the
gathered sequence::

    forward   [epi i-1 + norm i] gf(i) [core i] fwd(i)      (the embedding: [core 0] fwd(0))
    backward  [norm i+1 + epi i] gb(i) [dw i+1] [tp i] bwd(i)  (the head: [tp R-1] bwd(R-1))

where [tp i] computes the input gradient alone and [dw i], the weight gradients, waits until
the next gather has started (``defers_weight_grad``: a block's regions, in the schedules
without communication-free recompute; the others run [tp i] whole)

A degree change at region i splits the two tasks that cross it::

    forward   [epi i-1 + body i]               ->  [epi i-1] rsf(i) [body i]
    backward  [norm i + epi i-1 + tp i-1]      ->  [norm i] rsb(i) [epi i-1 + tp i-1]

Programs are made by a list scheduler from *tasks* in priority order. A task waits for the
collectives it needs, computes, and starts the collective it produces; at most ``max_inflight``
collectives (fwd, bwd, rsf, rsb) are in flight, so with two sub-batches a and b the forward
steady state is::

    compute:  [epi l-1 + body l](a)  [epi l-1 + body l](b)  [epi l + body l+1](a) ...
    comm:     ........ AR(l-1, b) ..... AR(l, a) ............... AR(l, b) ...

and the backward hides each dh all-reduce behind the other sub-batch's recompute + backward. At
a degree change the halves of the split tasks run for every sub-batch in turn, so sub-batch a's
reshard runs while sub-batch b computes::

    compute:  [epi i-1](a)  [epi i-1](b)  [body i](a)  [body i](b)
    comm:     .. AR(i-1,b) .. rsf(i,a) .... rsf(i,b) .... AR(i,a) ...

Schedules (name: sub-batches, overlap, what recompute repeats):

    (the non-overlapped ones wait for every collective right after starting it)

    megatron             1  no   no recompute
    megatron-recompute   1  no   per-block recompute, repeats both forward all-reduces
    commfree-recompute   1  no   recompute from saved post-collective (x_i, r_i): no collective
    overlap              k  yes  no recompute
    overlap-recompute    k  yes  per-block recompute (cross-pass overlap)
    oases                k  yes  communication-free recompute
    merak (baseline)     k  yes, inside a block and a pass only; per-block recompute
    megatron-sp (base.)  1  no   no recompute; always sequence-parallel (Megatron-LM's
                                 ``--sequence-parallel``); any schedule can be, with ``sp``

Merak's sub-pipelined TMP (Lai et al., "Merak", IEEE TPDS 2023), the paper's strongest
baseline, is rebuilt as a program for comparison (``BASELINES``; not one of the paper's
ablation schedules). It uses activation checkpointing as Merak does (block recompute that
repeats both forward collectives), and its sub-batches overlap only inside one block and one
pass: every collective is waited before the next block starts, and the recompute of a block
finishes its collectives before that block's backward starts (no cross-block and no
cross-pass overlap). Per block and pass, with sub-batches a and b::

    compute:  attn(a)  attn(b)        mlp(a)        mlp(b) |           | next block
    comm:     ....... AR attn(a) .... AR attn(b) .. AR mlp(a) .. AR mlp(b) |

so one collective per block and pass is exposed (oases hides it behind the next block).

Recompute across a degree change at region i: communication-free recompute never repeats a
collective, so there region i's segment is [body i] alone, from its saved post-reshard input x_i
(epi i-1 keeps its graph from the forward). Block recompute repeats a block's forward
collectives by design: a change inside a block (at its MLP) repeats that block's rsf in the
recompute; a change at a block's start is not repeated (the block input is saved post-reshard).
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass, field

Piece = tuple[str, int]  # ("epi" | "body" | "norm" | "core" | "tp" | "dw", region index)
CollKey = tuple[str, int, int]  # (kind, region or task index, sub-batch)


@dataclass(frozen=True)
class Compute:
    phase: str  # "forward" | "recompute" | "backward"
    pieces: tuple[Piece, ...]
    sub: int


@dataclass(frozen=True)
class Start:
    kind: str  # "fwd" | "bwd" | "rsf" | "rsb" | "dp" | "rs" | "ag" | "gf" | "gb" | "gr"
    index: int
    sub: int = 0


@dataclass(frozen=True)
class Wait:
    kind: str
    index: int
    sub: int = 0


@dataclass(frozen=True)
class Release:
    """Free region ``index``'s gathered weights (ZeRO stage 3) after their last use in a pass."""

    index: int


Instr = Compute | Start | Wait | Release


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
                kind in ("tp", "dw") and phase == "backward"):
            return self.uses[i]
        return (i,)


@dataclass(frozen=True)
class ScheduleSpec:
    """The knobs that tell the named schedules apart."""

    name: str
    overlapped: bool  # k sub-batches (else 1)
    recompute: str  # "none" | "block" | "commfree"
    scope: str = "chain"  # "chain": collectives overlap anything; "block": within a block+pass
    sequence_parallel: bool = False  # always sequence-parallel (the megatron-sp baseline)
    min_sub: int = 1  # the fewest sub-batches it is defined with (merak: 2)

    def check_n_sub(self, n_sub: int) -> None:
        """ValueError where ``n_sub`` is below what the schedule is defined with: Merak is
        sub-pipelined TMP, and with one sub-batch it is megatron-recompute's program."""
        if n_sub < self.min_sub:
            raise ValueError(f"{self.name} overlaps {self.min_sub} or more sub-batches inside "
                             f"each block (schedule.n_sub={n_sub}); with one it is "
                             "megatron-recompute's program: use that, or n_sub >= "
                             f"{self.min_sub}")


SPECS = {
    s.name: s
    for s in (
        ScheduleSpec("megatron", False, "none"),
        ScheduleSpec("megatron-recompute", False, "block"),
        ScheduleSpec("commfree-recompute", False, "commfree"),
        ScheduleSpec("overlap", True, "none"),
        ScheduleSpec("overlap-recompute", True, "block"),
        ScheduleSpec("oases", True, "commfree"),
        ScheduleSpec("merak", True, "block", scope="block", min_sub=2),
        ScheduleSpec("megatron-sp", False, "none", sequence_parallel=True),
    )
}
# other systems' schedules, rebuilt as programs (not the ablation set)
BASELINES = ("merak", "megatron-sp")
SP_MODES = ("gathered", "shards")  # what a communication-free recompute keeps under ``sp``


@dataclass
class Task:
    compute: Compute
    needs: list[CollKey] = field(default_factory=list)
    produces: CollKey | None = None


def list_schedule(tasks: list[Task], max_inflight: int, synchronous: bool = False) -> list[Instr]:
    """Tasks in priority order -> instructions, with at most ``max_inflight`` collectives open.
    ``synchronous``: every collective is waited right after it starts (no overlap at all)."""
    out: list[Instr] = []
    inflight: deque[CollKey] = deque()
    for task in tasks:
        if synchronous:
            out.append(task.compute)
            if task.produces is not None:
                out += [Start(*task.produces), Wait(*task.produces)]
            continue
        for need in task.needs:
            if need in inflight:
                # Collectives on one group complete in issue order: wait up to ``need``.
                while True:
                    key = inflight.popleft()
                    out.append(Wait(*key))
                    if key == need:
                        break
        out.append(task.compute)
        if task.produces is not None:
            if len(inflight) >= max_inflight:
                out.append(Wait(*inflight.popleft()))
            out.append(Start(*task.produces))
            inflight.append(task.produces)
    out.extend(Wait(*key) for key in inflight)
    return out


def _forward_tasks(n_regions: int, subs: range, changes: frozenset[int]) -> list[Task]:
    tasks = []
    for i in range(n_regions):
        produces = [("fwd", i, j) if i < n_regions - 1 else None for j in subs]
        if i in changes:  # [epi i-1] rsf(i) [body i]
            tasks += [Task(Compute("forward", (("epi", i - 1),), j), needs=[("fwd", i - 1, j)],
                           produces=("rsf", i, j)) for j in subs]
            tasks += [Task(Compute("forward", (("body", i),), j), needs=[("rsf", i, j)],
                           produces=out) for j, out in zip(subs, produces)]
            continue
        for j, out in zip(subs, produces):
            pieces = ((("epi", i - 1),) if i else ()) + (("body", i),)
            tasks.append(Task(Compute("forward", pieces, j),
                              needs=[("fwd", i - 1, j)] if i else [], produces=out))
    return tasks


def _norm_task(i: int, j: int) -> Task:
    """Backward of region i's norm alone, where dx_i moves to region i-1's layout (rsb)."""
    return Task(Compute("backward", (("norm", i),), j), needs=[("bwd", i, j)],
                produces=("rsb", i, j))


def _backward_task(i: int, j: int, n_regions: int, changes: frozenset[int]) -> Task:
    if i == n_regions - 1:
        pieces, needs = (("tp", i),), []
    elif i + 1 in changes:  # norm:i+1 ran in its own task (_norm_task)
        pieces, needs = (("epi", i), ("tp", i)), [("rsb", i + 1, j)]
    else:
        pieces, needs = (("norm", i + 1), ("epi", i), ("tp", i)), [("bwd", i + 1, j)]
    return Task(Compute("backward", pieces, j), needs=needs,
                produces=("bwd", i, j) if i > 0 else None)


def _block_recompute_tasks(attn: int, subs: range, changes: frozenset[int]) -> list[Task]:
    """Megatron's recompute of the block (attn, mlp = attn + 1) from its saved input, repeating
    its forward collectives (and its rsf, where the degree changes inside the block)."""
    mlp = attn + 1
    tasks = [Task(Compute("recompute", (("body", attn),), j), produces=("fwd", attn, j))
             for j in subs]
    if mlp in changes:
        tasks += [Task(Compute("recompute", (("epi", attn),), j), needs=[("fwd", attn, j)],
                       produces=("rsf", mlp, j)) for j in subs]
        tasks += [Task(Compute("recompute", (("body", mlp),), j), needs=[("rsf", mlp, j)],
                       produces=("fwd", mlp, j)) for j in subs]
    else:
        tasks += [Task(Compute("recompute", (("epi", attn), ("body", mlp)), j),
                       needs=[("fwd", attn, j)], produces=("fwd", mlp, j)) for j in subs]
    return tasks


def _backward_tasks(n_regions: int, subs: range, recompute: str,
                    changes: frozenset[int]) -> list[Task]:
    tasks: list[Task] = []
    last = n_regions - 1
    i = last
    while i >= 0:
        if i + 1 in changes:  # dx_{i+1} first, so its rsb runs beside the next computes
            tasks += [_norm_task(i + 1, j) for j in subs]
        if recompute == "block" and 0 < i < last:  # i is a block's MLP region: i-1 its attention
            attn, mlp = i - 1, i
            tasks += _block_recompute_tasks(attn, subs, changes)
            for j in subs:
                tasks.append(Task(Compute("recompute", (("epi", mlp),), j),
                                  needs=[("fwd", mlp, j)]))
                tasks.append(_backward_task(mlp, j, n_regions, changes))
            if mlp in changes:
                tasks += [_norm_task(mlp, j) for j in subs]
            tasks.extend(_backward_task(attn, j, n_regions, changes) for j in subs)
            i -= 2
            continue
        for j in subs:
            if recompute == "commfree" and 0 < i < last:  # the head keeps its graph
                pieces = (("body", i),) if i in changes else (("epi", i - 1), ("body", i))
                tasks.append(Task(Compute("recompute", pieces, j)))
            tasks.append(_backward_task(i, j, n_regions, changes))
        i -= 1
    return tasks


def build_program(
    name: str, n_regions: int, n_sub: int, *, n_micro: int = 1, max_inflight: int = 1,
    dp_tasks: tuple[int, ...] = (), degrees: tuple[int, ...] | None = None,
    zero: ZeroLayout | None = None, sp: str | None = None, defer_weight_grads: bool = True,
) -> list[Instr]:
    """The instruction list of one optimizer step (``n_micro`` micro-batches of ``n_sub``
    sub-batches each; sub-batch ids are global: micro m owns ids m*n_sub .. m*n_sub+n_sub-1).

    ``dp_tasks``: backward tasks after which a data-parallel gradient bucket is final; their
    all-reduces start right after that task of the last micro-batch and are waited at the end.
    ``degrees``: the TP degree of every region (None: one degree for all); reshards ("rsf",
    "rsb") sit where it changes.
    ``zero``: the sharded regions (``ZeroLayout``): gradient reduce-scatters ("rs") and, at
    stage 3, weight gathers ("ag") and releases (``_insert_zero``).
    ``sp``: sequence parallelism, naming what a communication-free recompute keeps
    (``SP_MODES``: "gathered" or "shards"; ``_sp_chain``); None: off, unless the schedule is
    always sequence-parallel (megatron-sp, then "gathered": it recomputes nothing).
    ``defer_weight_grads``: under ``sp``, split each block region's TP backward into "tp" and
    "dw" (``defers_weight_grad``); False keeps it whole (for comparison).
    """
    spec = SPECS.get(name)
    if spec is None:
        raise ValueError(f"unknown schedule {name!r}; valid: {', '.join(SPECS)}")
    k = n_sub if spec.overlapped else 1
    if k < 1 or max_inflight < 1 or n_micro < 1:
        raise ValueError(f"n_sub={n_sub}, max_inflight={max_inflight}, n_micro={n_micro} "
                         "must all be at least 1")
    degrees = None if degrees is None else tuple(degrees)
    degree_changes(n_regions, degrees)  # (checks the degrees)
    if zero is not None and (len(zero.stages) != n_regions or len(zero.uses) != n_regions):
        raise ValueError(f"zero layout for {len(zero.stages)} regions, program of {n_regions}")
    if sp is None and spec.sequence_parallel:
        sp = "gathered"
    if sp is not None and sp not in SP_MODES:
        raise ValueError(f"sp={sp!r}; valid: {', '.join(SP_MODES)} (or None: off)")
    program = _build_program(spec, k, n_regions, n_micro, max_inflight, tuple(dp_tasks),
                             degrees, sp, defer_weight_grads)
    if zero is not None and any(zero.stages):
        program = _insert_zero(program, zero, k)
    if sp is not None:  # after every gradient is final (ZeRO's scatters waited too)
        program += (Start("sg", 0), Wait("sg", 0))
    return list(program)


@functools.lru_cache(maxsize=64)
def _build_program(spec: ScheduleSpec, k: int, n_regions: int, n_micro: int, max_inflight: int,
                   dp_tasks: tuple[int, ...], degrees: tuple[int, ...] | None,
                   sp: str | None = None, defer: bool = True) -> tuple[Instr, ...]:
    """``build_program``'s instructions, remembered (the planner asks for the same programs
    many times; instructions are frozen, and callers get their own list)."""
    changes = degree_changes(n_regions, degrees)
    if sp is not None:  # a sub-batch's gather and scatter of one region fly together
        max_inflight = max(max_inflight, 2)
    program: list[Instr] = []
    for m in range(n_micro):
        subs = range(m * k, (m + 1) * k)
        if sp is not None:
            defer_here = defer and spec.overlapped  # (a synchronous program hides nothing)
            tasks = _staggered([_sp_chain(n_regions, j, spec.recompute, sp, changes,
                                          defer_here) for j in subs])
        else:
            tasks = (_forward_tasks(n_regions, subs, changes)
                     + _backward_tasks(n_regions, subs, spec.recompute, changes))
        if spec.scope == "block":  # every group's collectives are waited at its end
            body = [ins for group in _block_groups(tasks)
                    for ins in list_schedule(group, max_inflight)]
        else:
            body = list_schedule(tasks, max_inflight, synchronous=not spec.overlapped)
        if m == n_micro - 1 and dp_tasks:
            body = _insert_dp(body, set(dp_tasks), subs[-1])
        program.extend(body)
    return tuple(program)


def _sp_chain(n_regions: int, j: int, recompute: str, keep: str,
              changes: frozenset[int] = frozenset(), defer: bool = True) -> list[Task]:
    """Sub-batch ``j``'s tasks of one micro-batch under sequence parallelism, in order.

    Forward, per region i (the embedding's region 0 is its lookup alone)::

        [epi i-1 + norm i] -gf(i)-> [core i] -fwd(i): reduce-scatter-> [epi i + norm i+1] ...

    Backward, from the head (whose graph is kept)::

        [tp R-1] -bwd-> [norm R-1 + epi R-2] -gb(R-2)-> [tp R-2] -bwd-> ...
            ... -gb(0)-> [dw 1] [tp 0]

    where, without communication-free recompute, a block's region i splits its TP matmuls'
    backward (``defers_weight_grad``): [tp i]
    computes the input gradient dh_i alone and bwd(i) starts at once; [dw i], the weight
    gradients, runs after the next task that starts a backward gather, [norm i + epi i-1]
    with gb(i-1), so nothing delays a collective's issue and dw runs under two of them
    (``_defer_weight_grads``)::

        [tp i] -bwd(i)-> [norm i + epi i-1] -gb(i-1)-> [dw i] [tp i-1] -bwd(i-1)-> ...

    With two sub-batches, one task apart, a link-bound step then always has a collective
    queued (2026-12-03 deferred-weight-grads report)::

        compute:  [tp i](a) [norm+epi](b) [norm+epi](a) [tp i](b) [dw i](a) [norm+epi](b) ...
        comm:     .. bwd(i, a) .. gb(i, b) .. gb(i-1, a) .. bwd(i, b) .. gb(i-1, b) ...

    A degree change at region i (``changes``) splits the tasks that cross it, as without
    sequence parallelism: [epi i-1] rsf(i) [norm i] forward, [norm i] rsb(i) [epi i-1]
    backward (a reshard moves rows and sequence slices: ``comm.reshard_seq_async``).

    Recompute of region i (0 < i < R-1) before its backward ``tp:i``:
      commfree, ``keep="gathered"``: [epi i-1, norm i, core i] from the saved post-collective
        (x, r) slices and the saved gathered h_i: no collective ([norm i, core i] from the
        saved post-reshard x_i at a degree change).
      commfree, ``keep="shards"``: [epi i-1, norm i] -gr(i)-> [core i]: h_i gathered again.
      block: the block (attention i-1, MLP i) from its saved input slice, repeating its
        forward gathers and reduce-scatters (and a reshard at its MLP), before the MLP's
        backward.
    The recompute runs while the gather ``gb(i)`` is in flight."""
    last = n_regions - 1

    def glue_norm(phase: str, i: int, needs: list[CollKey]) -> list[Task]:
        """[epi i-1 + norm i] -gf(i)->, or [epi i-1] -rsf(i)-> [norm i] -gf(i)->."""
        if i in changes:
            return [Task(Compute(phase, (("epi", i - 1),), j), needs=needs,
                         produces=("rsf", i, j)),
                    Task(Compute(phase, (("norm", i),), j), needs=[("rsf", i, j)],
                         produces=("gf", i, j))]
        return [Task(Compute(phase, (("epi", i - 1), ("norm", i)), j), needs=needs,
                     produces=("gf", i, j))]

    tasks = [Task(Compute("forward", (("core", 0),), j), produces=("fwd", 0, j))]
    for i in range(1, n_regions):
        tasks += glue_norm("forward", i, [("fwd", i - 1, j)])
        tasks.append(Task(Compute("forward", (("core", i),), j), needs=[("gf", i, j)],
                          produces=("fwd", i, j) if i < last else None))

    def backward(i: int) -> tuple[list[Task], list[Task]]:
        """([norm i+1 + epi i] -gb(i)-> [dw i+1], [tp i] -bwd(i)->): the tasks before and
        from the TP matmuls' backward (a recompute goes between). Region i+1's deferred
        weight gradients run once the gather they are to hide under has started."""
        tail = [Task(Compute("backward", (("tp", i),), j), needs=[("gb", i, j)],
                     produces=("bwd", i, j) if i > 0 else None)]
        if i + 1 in changes:
            return [Task(Compute("backward", (("norm", i + 1),), j), needs=[("bwd", i + 1, j)],
                         produces=("rsb", i + 1, j)),
                    Task(Compute("backward", (("epi", i),), j), needs=[("rsb", i + 1, j)],
                         produces=("gb", i, j))], tail
        return [Task(Compute("backward", (("norm", i + 1), ("epi", i)), j),
                     needs=[("bwd", i + 1, j)], produces=("gb", i, j))], tail

    tasks.append(Task(Compute("backward", (("tp", last),), j), produces=("bwd", last, j)))
    i = last - 1
    while i >= 0:
        if recompute == "block" and 0 < i < last:  # i: a block's MLP, i - 1 its attention
            attn, mlp = i - 1, i
            tasks += [
                Task(Compute("recompute", (("norm", attn),), j), produces=("gf", attn, j)),
                Task(Compute("recompute", (("core", attn),), j), needs=[("gf", attn, j)],
                     produces=("fwd", attn, j)),
                *glue_norm("recompute", mlp, [("fwd", attn, j)]),
                Task(Compute("recompute", (("core", mlp),), j), needs=[("gf", mlp, j)],
                     produces=("fwd", mlp, j)),
                Task(Compute("recompute", (("epi", mlp),), j), needs=[("fwd", mlp, j)]),
            ]
            for region in (mlp, attn):
                tasks += [task for part in backward(region) for task in part]
            i -= 2
            continue
        first, second = backward(i)
        tasks += first
        if recompute == "commfree" and 0 < i < last:
            head = (("norm", i),) if i in changes else (("epi", i - 1), ("norm", i))
            if keep == "gathered":
                tasks.append(Task(Compute("recompute", (*head, ("core", i)), j)))
            else:
                tasks += [Task(Compute("recompute", head, j), produces=("gr", i, j)),
                          Task(Compute("recompute", (("core", i),), j), needs=[("gr", i, j)])]
        tasks += second
        i -= 1
    return _defer_weight_grads(tasks, n_regions, recompute, j) if defer else tasks


def _defer_weight_grads(tasks: list[Task], n_regions: int, recompute: str, j: int
                        ) -> list[Task]:
    """Cut each deferring region's backward [tp i] (``defers_weight_grad``) into [tp i], the
    input gradient, and [dw i], placed right after the [norm + epi] that starts the next
    backward gather: nothing delays a collective's issue. In a block recompute the
    attention's [dw] thus waits through the next block's recompute, whose gaps it fills
    (measured, 2026-12-03 deferred-weight-grads report: placed right after that recompute's
    first task instead, overlap-recompute@sp went from +2-3% to +8% against the all-reduce
    version, and its peak from +0.8% to -1.8%)."""
    out: list[Task] = []
    pending: list[Task] = []
    for task in tasks:
        out.append(task)
        (kind, i), = task.compute.pieces[-1:]
        if task.compute.phase == "backward" and kind == "tp" and defers_weight_grad(
                i, n_regions, recompute):
            pending.append(Task(Compute("backward", (("dw", i),), j)))
        elif pending and task.produces is not None and task.produces[0] == "gb":
            out += pending
            pending = []
    return out + pending


def defers_weight_grad(i: int, n_regions: int, recompute: str) -> bool:
    """Does a sequence-parallel program split region i's TP matmuls' backward into ("tp", i),
    the input gradient, and ("dw", i), the weight gradients, run after the sub-batch's next
    collective has started (``_defer_weight_grads``)? A block's attention or MLP (not the
    embedding: no collective follows its lookup's backward; nor the head: its logits'
    gradient [b*S, V/t] would be held across tasks) in a schedule without
    communication-free recompute, when it overlaps (``build_program``: a synchronous program
    waits for every collective at once, so the split would hide nothing and only hold
    memory longer). There a region's backward
    chain is [norm + epi] -gb-> [tp] -bwd->: one large task, and with two sub-batches, one
    task apart, a collective of one has only the other's next task to hide under, often the
    small one; the split gives a second large task. A communication-free recompute already
    runs the region's core between the gather and [tp]; a "dw" there took a slot that needs a
    large task (measured, 2026-12-03 deferred-weight-grads report: with two sub-batches
    overlap@sp +5.4% -> -0.1% and overlap-recompute@sp +9.3% -> +2.3% against the all-reduce
    version, oases@sp +2.3% -> +4.0%)."""
    return 0 < i < n_regions - 1 and recompute != "commfree"


def deferred_regions(program: list[Instr]) -> frozenset[int]:
    """The regions whose weight gradients ``program`` defers (has a "dw" piece for)."""
    return frozenset(i for ins in program if isinstance(ins, Compute)
                     for kind, i in ins.pieces if kind == "dw")


def _staggered(chains: list[list[Task]]) -> list[Task]:
    """Interleave the sub-batches' task chains, sub-batch j one task behind sub-batch j-1::

        a0  a1 b0  a2 b1 c0  a3 b2 c1  ...

    so the collective that ends a task of one sub-batch runs under the next tasks of the
    others. Under sequence parallelism every region's forward chain alternates a small task
    (glue and norm on a slice) and a large one (the TP matmuls) with a collective between any
    two: with two sub-batches each collective has only the other's next task to hide under,
    and a small one leaves the compute waiting. The backward's deferred weight gradients
    (``defers_weight_grad``) shorten the task between a gather and the scatter that follows
    it, and run while both fly."""
    out: list[Task] = []
    for r in range(max(len(c) for c in chains) + len(chains) - 1):
        for j, chain in enumerate(chains):
            if 0 <= r - j < len(chain):
                out.append(chain[r - j])
    return out


def _block_groups(tasks: list[Task]) -> list[list[Task]]:
    """Consecutive tasks of one block and one pass. A task belongs to the block of the region
    of its last piece (region r -> block (r + 1) // 2: the embedding 0, block l's attention and
    MLP l + 1, the head L + 1) and to one of three passes: forward, a recompute that starts a
    collective, and the backward (with the recompute of glue that starts none)."""
    def key(task: Task) -> tuple[int, str]:
        c = task.compute
        step = "backward" if c.phase == "recompute" and task.produces is None else c.phase
        return (c.pieces[-1][1] + 1) // 2, step

    groups: list[list[Task]] = []
    last: tuple[int, str] | None = None
    for task in tasks:
        k = key(task)
        if k != last:
            groups.append([])
            last = k
        groups[-1].append(task)
    return groups


def degree_changes(n_regions: int, degrees: tuple[int, ...] | None) -> frozenset[int]:
    """The regions i >= 1 whose TP degree differs from region i-1's (ValueError for a degree
    list of the wrong length or with a degree below 1)."""
    if degrees is None:
        return frozenset()
    if len(degrees) != n_regions or min(degrees) < 1:
        raise ValueError(f"degrees={tuple(degrees)} must give a positive TP degree for each of "
                         f"the {n_regions} regions")
    return frozenset(i for i in range(1, n_regions) if degrees[i] != degrees[i - 1])


def _insert_dp(body: list[Instr], dp_tasks: set[int], last_sub: int) -> list[Instr]:
    """Start each DP bucket's all-reduce once its last backward task is done, but after the TP
    gradient all-reduce that task starts (the next compute waits on that one, not on DP)."""
    out: list[Instr] = []
    pending: int | None = None
    deferred = deferred_regions(body)
    for ins in body:
        if pending is not None and not (isinstance(ins, Start | Wait) and ins.kind == "bwd"):
            out.append(Start("dp", pending))
            pending = None
        out.append(ins)
        if isinstance(ins, Compute) and ins.phase == "backward" and ins.sub == last_sub:
            kind, task = ins.pieces[-1]  # ("tp", i), or its deferred ("dw", i), closes task i
            if task in dp_tasks and kind == ("dw" if task in deferred else "tp"):
                pending = task
    if pending is not None:
        out.append(Start("dp", pending))
    out.extend(Wait("dp", t) for t in sorted(dp_tasks, reverse=True))
    return out


ZERO_GRAD_INFLIGHT = 2  # gradient reduce-scatters in flight at once (each holds a flat copy)


@functools.lru_cache(maxsize=64)
def _insert_zero(program: tuple[Instr, ...], zero: ZeroLayout, k: int) -> tuple[Instr, ...]:
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
    computes = [i for i, ins in enumerate(program) if isinstance(ins, Compute)]
    n_micro = 1 + max(program[i].sub for i in computes) // k
    before: dict[int, list[Instr]] = {}
    after: dict[int, list[Instr]] = {}
    # ------------------------------------------------------------------ weight gathers
    live: dict[tuple[int, tuple], list[int]] = {}  # (unit, pass) -> compute positions
    for pos, i in enumerate(computes):
        ins = program[i]
        m = ins.sub // k
        pass_key = (m,) if not zero.reshard_after_forward else (
            m, ins.phase == "forward")
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
            if ins.phase == "forward" and ins.sub // k == 0:
                for piece in ins.pieces:
                    for u in zero.units(piece, ins.phase):
                        if zero.stages[u] in (1, 2):
                            first_use.setdefault(u, pos)
        for u, pos in sorted(first_use.items()):
            before.setdefault(0, []).append(Start("ag", u, 0))
            before.setdefault(pos, []).append(Wait("ag", u, 0))
    if before.get(0):  # at the head: every gather starts (chain order) before the first wait
        head = before[0]
        before[0] = (sorted((s for s in head if isinstance(s, Start)), key=lambda s: s.index)
                     + [w for w in head if not isinstance(w, Start)])
    # ------------------------------------------------------------- gradient reduce-scatters
    last_use: dict[tuple[int, int], int] = {}
    for pos, i in enumerate(computes):
        ins = program[i]
        m = ins.sub // k
        if ins.phase != "backward":
            continue
        for piece in ins.pieces:
            for u in zero.units(piece, "backward"):
                if zero.stages[u] >= 2 or (zero.stages[u] == 1 and m == n_micro - 1
                                           and zero.ends_step):
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

    position = {i: pos for pos, i in enumerate(computes)}
    micro_of_pos = [program[i].sub // k for i in computes]
    for i, ins in enumerate(program):
        if pending and not (isinstance(ins, Start | Wait) and ins.kind == "bwd"):
            flush()
        pos = position.get(i)
        if pos is not None:
            if inflight and micro_of_pos[pos] > inflight[0][1]:  # a micro-batch ended
                while inflight and inflight[0][1] < micro_of_pos[pos]:
                    out.append(Wait("rs", *inflight.popleft()))
            out += before.get(pos, [])
        out.append(ins)
        if pos is not None:
            out += after.get(pos, [])
            pending += grads_after.get(pos, [])
    flush()
    out.extend(Wait("rs", *key) for key in inflight)
    return tuple(out)


def sub_batches(name: str, n_sub: int) -> int:
    """How many sub-batches a micro-batch is cut into under this schedule."""
    return n_sub if SPECS[name].overlapped else 1


def label(ins: Compute) -> str:
    """A compute instruction's name in timelines and profiles, e.g. ``"epi:2 body:3"``."""
    return " ".join(f"{kind}:{index}" for kind, index in ins.pieces)


def comm_name(kind: str, index: int) -> str:
    """A collective's name in timelines, e.g. ``"fwd AR 3"``, ``"rsf 3"`` (a reshard), ``"rs 3"``
    (a ZeRO gradient reduce-scatter), ``"ag 3"`` (a ZeRO weight gather) or ``"gf 3"`` (a
    sequence-parallel gather; its "fwd"/"bwd" reduce-scatters are named like the all-reduces)."""
    return (f"{kind} {index}" if kind in ("rsf", "rsb", "rs", "ag", "gf", "gb", "gr")
            else f"{kind} AR {index}")
