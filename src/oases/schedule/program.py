"""Schedules as data: ``build_program``, the program of every named schedule for one rank.

A program is a flat list of instructions for one rank, run by the executor on tensors and by the
planner's simulator on costs. Its parts, each in its own module::

    instructions.py    the instruction set: Compute(phase, pieces, sub), Start/Wait(kind, index,
                       sub) of collectives, Release; the pieces and every collective kind
    specs.py           the knobs that tell the schedules below apart (``SPECS``)
    tasks.py           each sub-batch's tasks: a task waits for the collectives it needs,
                       computes pieces of the chain, starts the collective it produces
    sp_tasks.py        the same under sequence parallelism (``sp``)
    dw_tasks.py        which backward tasks leave their weight gradients to a later "dw" task
    list_scheduler.py  tasks in priority order -> instructions, ``max_inflight`` collectives open
    regather.py        sp="shards" without recompute: h_i gathered again in the backward ("gh")
    dp_insert.py       the data-parallel and ZeRO gradient and weight collectives, placed after

and ``build_program`` assembles them, per micro-batch::

    tasks (tasks.py, or sp_tasks.py staggered)  ->  list_schedule  ->  (shards) insert_regathers
    ->  insert_dp (last micro)
    ... every micro-batch ...  ->  insert_zero  ->  + Start/Wait "sg" (sp: the glue's gradients)

With two sub-batches a and b the forward steady state is::

    compute:  [epi l-1 + body l](a)  [epi l-1 + body l](b)  [epi l + body l+1](a) ...
    comm:     ........ AR(l-1, b) ..... AR(l, a) ............... AR(l, b) ...

and the backward hides each dh all-reduce behind the other sub-batch's recompute + backward. A
change of TP degree between regions puts reshards ("rsf", "rsb") between the halves of the
tasks that cross it (``tasks.py``).

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

Pipeline stages (``parallel.pp``): a stage's program is these same per-micro-batch tasks,
restricted to the stage's regions, with sends and receives where a boundary cuts them and the
passes in a pipeline order (``pipeline_order``: gpipe, 1f1b, 1f1b-pair);
``pipeline_program.build_stage_program`` assembles it::

    stage 0:    F0 | F1 B0 | F2 B1 | F3 B2 | B3        (1f1b, P = 2, M = 4)
                [epi b-1] sf(b) ~~> stage s+1: rf(b) [body b]     (and back: sb(b) ~~> rb(b))

The instruction set, the specs and the queries on programs are re-exported here: this module
is where the rest of the library and its users import a schedule's program from.
"""

from __future__ import annotations

import functools

from oases.schedule.dp_insert import ZeroLayout, insert_dp, insert_zero
from oases.schedule.dw_tasks import defers_weight_grad
from oases.schedule.instructions import (
    CollKey,
    Compute,
    Instr,
    Piece,
    Release,
    Start,
    Wait,
    comm_name,
    deferred_regions,
    label,
)
from oases.schedule.list_scheduler import Task, block_groups, list_schedule, staggered
from oases.schedule.regather import insert_regathers, regathers
from oases.schedule.sp_tasks import sp_chain
from oases.schedule.specs import BASELINES, SP_MODES, SPECS, ScheduleSpec, sub_batches
from oases.schedule.tasks import backward_tasks, degree_changes, forward_tasks

__all__ = [
    "BASELINES",
    "SPECS",
    "SP_MODES",
    "CollKey",
    "Compute",
    "Instr",
    "Piece",
    "Release",
    "ScheduleSpec",
    "Start",
    "Wait",
    "ZeroLayout",
    "build_program",
    "comm_name",
    "deferred_regions",
    "defers_weight_grad",
    "degree_changes",
    "label",
    "sub_batches",
]


def build_program(
    name: str,
    n_regions: int,
    n_sub: int,
    *,
    n_micro: int = 1,
    max_inflight: int = 1,
    dp_tasks: tuple[int, ...] = (),
    degrees: tuple[int, ...] | None = None,
    zero: ZeroLayout | None = None,
    sp: str | None = None,
    defer_weight_grads: bool = True,
) -> list[Instr]:
    """The instruction list of one optimizer step (``n_micro`` micro-batches of ``n_sub``
    sub-batches each; sub-batch ids are global: micro m owns ids m*n_sub .. m*n_sub+n_sub-1).

    ``dp_tasks``: backward tasks after which a data-parallel gradient bucket is final; their
    all-reduces start right after that task of the last micro-batch and are waited at the end.
    ``degrees``: the TP degree of every region (None: one degree for all); reshards ("rsf",
    "rsb") sit where it changes.
    ``zero``: the sharded regions (``ZeroLayout``): gradient reduce-scatters ("rs") and, at
    stage 3, weight gathers ("ag") and releases (``dp_insert.insert_zero``).
    ``sp``: sequence parallelism, naming what a TP region keeps of its gathered input
    (``SP_MODES``): "gathered" keeps it whole (no collective in the backward or the
    recompute); "shards" keeps norm:i's slice and gathers it again, in the backward without
    recompute ("gh", ``regather``) or in a communication-free recompute ("gr",
    ``sp_tasks.sp_chain``); block recompute is the same either way. None: off, unless the
    schedule is always sequence-parallel (megatron-sp, then "gathered", as everywhere; with
    "shards" it keeps what Megatron-LM's keeps).
    ``defer_weight_grads``: under ``sp``, split each block region's TP backward into "tp" and
    "dw" (``defers_weight_grad``); False keeps it whole (for comparison).
    """
    spec = SPECS.get(name)
    if spec is None:
        raise ValueError(f"unknown schedule {name!r}; valid: {', '.join(SPECS)}")
    k = n_sub if spec.overlapped else 1
    if k < 1 or max_inflight < 1 or n_micro < 1:
        raise ValueError(
            f"n_sub={n_sub}, max_inflight={max_inflight}, n_micro={n_micro} must all be at least 1"
        )
    degrees = None if degrees is None else tuple(degrees)
    degree_changes(n_regions, degrees)  # (checks the degrees)
    if zero is not None and (len(zero.stages) != n_regions or len(zero.uses) != n_regions):
        raise ValueError(f"zero layout for {len(zero.stages)} regions, program of {n_regions}")
    if sp is None and spec.sequence_parallel:
        sp = "gathered"
    if sp is not None and sp not in SP_MODES:
        raise ValueError(f"sp={sp!r}; valid: {', '.join(SP_MODES)} (or None: off)")
    args = (spec, k, n_regions, n_micro, max_inflight, tuple(dp_tasks), degrees, sp)
    if zero is not None and any(zero.stages):
        program = _zeroed(*args, defer_weight_grads, zero)
    else:
        program = _build_program(*args, defer_weight_grads)
    if sp is not None:  # after every gradient is final (ZeRO's scatters waited too)
        program += (Start("sg", 0), Wait("sg", 0))
    return list(program)


@functools.lru_cache(maxsize=64)
def _build_program(
    spec: ScheduleSpec,
    k: int,
    n_regions: int,
    n_micro: int,
    max_inflight: int,
    dp_tasks: tuple[int, ...],
    degrees: tuple[int, ...] | None,
    sp: str | None = None,
    defer: bool = True,
) -> tuple[Instr, ...]:
    """``build_program``'s instructions, remembered (the planner asks for the same programs
    many times; instructions are frozen, and callers get their own list). Each micro-batch's
    body is ``_micro_body``'s, the DP all-reduces inserted into the last one's."""
    program: list[Instr] = []
    for m in range(n_micro):
        body = _micro_body(spec, k, n_regions, m, max_inflight, degrees, sp, defer)
        if m == n_micro - 1 and dp_tasks:
            body = insert_dp(list(body), set(dp_tasks), (m + 1) * k - 1)
        program.extend(body)
    return tuple(program)


@functools.lru_cache(maxsize=64)
def _zeroed(
    spec: ScheduleSpec,
    k: int,
    n_regions: int,
    n_micro: int,
    max_inflight: int,
    dp_tasks: tuple[int, ...],
    degrees: tuple[int, ...] | None,
    sp: str | None,
    defer: bool,
    zero: ZeroLayout,
) -> tuple[Instr, ...]:
    """``_build_program``'s program with ZeRO's collectives (``insert_zero``), remembered by
    the arguments (hashing them is cheaper than hashing the program they build)."""
    args = (spec, k, n_regions, n_micro, max_inflight, dp_tasks, degrees, sp, defer)
    return insert_zero(_build_program(*args), zero, k)


@functools.lru_cache(maxsize=64)
def _micro_body(
    spec: ScheduleSpec,
    k: int,
    n_regions: int,
    m: int,
    max_inflight: int,
    degrees: tuple[int, ...] | None,
    sp: str | None,
    defer: bool,
) -> tuple[Instr, ...]:
    """Micro-batch ``m``'s instructions without the DP all-reduces, remembered: the search
    walks every plan's last micro-batch (with them) and a middle one (without) back to back,
    and the DP buckets of one program differ between degrees; both share this body."""
    changes = degree_changes(n_regions, degrees)
    if sp is not None:  # a sub-batch's gather and scatter of one region fly together
        max_inflight = max(max_inflight, 2)
    subs = range(m * k, (m + 1) * k)
    if sp is not None:
        defer_here = defer and spec.overlapped  # (a synchronous program hides nothing)
        defer_here = defer_here and spec.recompute != "commfree"  # (no region defers there)
        tasks = staggered(
            [list(_sp_chain(n_regions, j, spec.recompute, sp, changes, defer_here)) for j in subs]
        )
    else:
        tasks = forward_tasks(n_regions, subs, changes) + backward_tasks(
            n_regions, subs, spec.recompute, changes
        )
    if spec.scope == "block":  # every group's collectives are waited at its end
        body = [ins for group in block_groups(tasks) for ins in list_schedule(group, max_inflight)]
    else:
        body = list_schedule(tasks, max_inflight, synchronous=not spec.overlapped)
    if regathers(spec.recompute, spec.scope, sp):
        body = insert_regathers(body, n_regions, synchronous=not spec.overlapped)
    return tuple(body)


@functools.lru_cache(maxsize=64)
def _sp_chain(
    n_regions: int, j: int, recompute: str, keep: str, changes: frozenset[int], defer: bool
) -> tuple[Task, ...]:
    """``sp_tasks.sp_chain``'s tasks, remembered: the programs of one chain's schedules share
    them (the list scheduler only reads a task). ``defer`` is dropped where no region defers
    its weight gradients (``_micro_body``: the same tasks either way)."""
    return tuple(sp_chain(n_regions, j, recompute, keep, changes, defer))


def clear_program_caches() -> None:
    """Forget the programs and parts of programs built so far (the builders' caches): a
    process that will build no more (``oases plan`` once it has written its plan) frees them
    at once, which takes a fraction of what the interpreter's exit takes to tear them down
    (the 96-layer search at 24 GB: 0.3 s against 1.4 s)."""
    from oases.schedule import pipeline_program

    for cached in (
        _build_program,
        _zeroed,
        _micro_body,
        _sp_chain,
        pipeline_program._build,
        pipeline_program._zeroed,
    ):
        cached.cache_clear()
