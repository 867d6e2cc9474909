"""A pipeline stage's program: ``build_stage_program``, the instructions of one stage for a step.

Stage s holds the regions [lo, hi) of the chain (``oases.stages.StageLayout``; under the
interleaved schedule one range per model chunk, each chunk's passes its own). A boundary b
between two stages is handled like a change of TP degree (``tasks.degree_changes``): the tasks
that cross it split, and where a degree change puts a reshard, the boundary puts a send on one
side and a receive on the other, each a Start/Wait pair of its own kind::

    forward   [epi b-1]  sf(b) ~~~> rf(b)  [body b]        stage s sends x_b, s+1 receives it
    backward  [norm b]   sb(b) ~~~> rb(b)  [epi b-1 + tp b-1]   s+1 sends dx_b, s receives it

(``instructions``: "sf"/"rf" forward, "sb"/"rb" backward, index b, the sub-batch). Each
micro-batch's tasks are today's chain tasks (``tasks``, ``sp_tasks``: every inner schedule,
k sub-batches) restricted to the stage; the pipeline order (``pipeline_order``) arranges
their forward and backward passes in units, and each unit is list-scheduled as one (its
collectives are waited by its end; once per shape of unit, ``_shape_body``, the others
relabelled). Point-to-point is placed around it::

    receives   Start posted one unit ahead (at the start of the unit before the one that
               needs it; the first unit's at its own start), Wait right before the compute
               that reads it
    sends      Start right after the compute that makes the tensor, Wait late: at the end of
               the next unit (the receiver has posted by then; until its wait a send holds
               its tensor), the last ones at the end of the step

On gloo the pairs are matched by tags, on NCCL by order: every stage posts its sends and its
receives of one boundary and direction in micro-batch and sub-batch order (the order test in
``tests/test_pipeline_program.py`` checks that both sides agree, and that no stage waits on
a peer that waits on it).

Under ``sp="shards"`` without recompute each unit gets the backward's re-gathers of h_i
("gh", ``regather.insert_regathers``), as a stage-less program does.

After the units: the data-parallel gradient means of the stage's buckets (``dp_insert``;
stage s > 0's first region's norm bucket closes with its ``[norm lo]``), ZeRO's collectives,
the tied embedding's gradient sum ("tie", first and last stage: Megatron-LM's embedding group)
and sequence parallelism's glue sum ("sg").

Tied embeddings: the first stage's embedding and the last stage's head each hold a copy of the
shared weight; after the last backward that reads it, each copy's (full, accumulated) gradient
is summed over the two stages ("tie"), and only then reduced over data parallelism: the
bucket or ZeRO unit that holds the copy is reduced after the "tie" at the end of the step
(the first stage's embedding bucket is the last one anyway).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from oases.schedule.dp_insert import ZeroLayout, insert_dp, insert_zero
from oases.schedule.instructions import CollKey, Compute, Instr, Start, Wait
from oases.schedule.list_scheduler import Task, block_groups, list_schedule, staggered
from oases.schedule.pipeline_order import Unit, pipeline_order
from oases.schedule.regather import insert_regathers, regathers
from oases.schedule.sp_tasks import sp_chain
from oases.schedule.specs import SP_MODES, SPECS, ScheduleSpec
from oases.schedule.tasks import backward_tasks, degree_changes, forward_tasks
from oases.stages import StageLayout

P2P_KINDS = ("sf", "rf", "sb", "rb")
SEND_KINDS = ("sf", "sb")
SEND_WAIT_UNITS = 2  # a send is waited at the end of the unit this many units after its own


@dataclass(frozen=True)
class _Marked:
    """A stage task and the point-to-point around it: ``recv`` waited before its compute,
    ``send`` started after it."""

    task: Task
    recv: CollKey | None = None
    send: CollKey | None = None


def build_stage_program(
    name: str,
    n_sub: int,
    layout: StageLayout,
    stage: int,
    *,
    n_micro: int,
    pp_schedule: str = "1f1b",
    max_inflight: int = 1,
    dp_tasks: tuple[int, ...] = (),
    degrees: tuple[int, ...] | None = None,
    zero: ZeroLayout | None = None,
    sp: str | None = None,
    defer_weight_grads: bool = True,
    tied: bool = False,
) -> list[Instr]:
    """The instructions of ``stage`` for one optimizer step of ``n_micro`` micro-batches (each
    ``n_sub`` sub-batches under an overlapped inner schedule ``name``; global sub-batch ids as
    ``program.build_program``). ``dp_tasks``, ``degrees``, ``zero``, ``sp``,
    ``defer_weight_grads``: as ``build_program`` (``dp_tasks`` and ``zero`` for this stage's
    regions). ``tied``: the model ties its embedding and head, and this stage holds one of
    them while the other stage holds the other ("tie"). ``pp_schedule``:
    ``pipeline_order.PIPELINE_SCHEDULES``."""
    spec = SPECS.get(name)
    if spec is None:
        raise ValueError(f"unknown schedule {name!r}; valid: {', '.join(SPECS)}")
    k = n_sub if spec.overlapped else 1
    if k < 1 or max_inflight < 1 or n_micro < 1:
        raise ValueError(
            f"n_sub={n_sub}, max_inflight={max_inflight}, n_micro={n_micro} must all be at least 1"
        )
    n = layout.n_regions
    degrees = None if degrees is None else tuple(degrees)
    degree_changes(n, degrees)  # (checks the degrees)
    for b in layout.starts:
        if degrees is not None and degrees[b - 1] != degrees[b]:
            raise ValueError(
                f"regions {b - 1} (tp={degrees[b - 1]}) and {b} (tp={degrees[b]}) "
                "sit on either side of a stage boundary: a boundary needs one TP "
                "degree on both sides (change degrees inside a stage)"
            )
    if zero is not None and (len(zero.stages) != n or len(zero.uses) != n):
        raise ValueError(f"zero layout for {len(zero.stages)} regions, program of {n}")
    if zero is not None and layout.pp > 1 and max(zero.stages) == 3:
        raise ValueError(
            "ZeRO stage 3 inside pipeline stages is not built yet (its gathers "
            "around every pass of interleaved micro-batches)"
        )
    if sp is None and spec.sequence_parallel:
        sp = "gathered"
    if sp is not None and sp not in SP_MODES:
        raise ValueError(f"sp={sp!r}; valid: {', '.join(SP_MODES)} (or None: off)")
    args = (
        spec,
        k,
        layout,
        stage,
        n_micro,
        pp_schedule,
        max_inflight,
        tuple(sorted(dp_tasks)),
        degrees,
        sp,
        defer_weight_grads,
    )
    ranges = layout.chunk_bounds(stage)
    if zero is not None and any(any(zero.stages[lo:hi]) for lo, hi in ranges):
        program = _zeroed(*args, zero)
    else:
        program = _build(*args)
    program = list(program)
    if tied and layout.pp > 1 and stage in (0, layout.pp - 1):
        index = 0 if stage == 0 else n - 1
        sharded = zero is not None and zero.stages[index] > 0
        if sharded and zero.stages[index] > 1:  # (its shards' layouts differ on the stages)
            raise ValueError(
                f"a tied embedding across pipeline stages sums its full gradient "
                f"once a step: ZeRO stage {zero.stages[index]} of region {index} "
                "reduce-scatters it every micro-batch (use stage 1)"
            )
        program = _tie_before_reduce(program, index, sharded, n_micro - 1)
    if sp is not None:  # after every gradient is final (ZeRO's scatters waited too)
        program += [Start("sg", 0), Wait("sg", 0)]
    return program


@functools.lru_cache(maxsize=64)
def _zeroed(*args: object) -> tuple[Instr, ...]:
    """``_build(*args[:-1])``'s program with ZeRO's collectives (``insert_zero``, the layout
    ``args[-1]``), remembered by the arguments (cheaper to hash than the program)."""
    *build, zero = args
    return insert_zero(_build(*build), zero, build[1])


@functools.lru_cache(maxsize=64)
def _build(
    spec: ScheduleSpec,
    k: int,
    layout: StageLayout,
    stage: int,
    n_micro: int,
    pp_schedule: str,
    max_inflight: int,
    dp_tasks: tuple[int, ...],
    degrees: tuple[int, ...] | None,
    sp: str | None,
    defer: bool,
) -> tuple[Instr, ...]:
    """The units' instructions, point-to-point placed, the DP means inserted (remembered: the
    instructions are frozen, callers get their own list)."""
    n = layout.n_regions
    changes = degree_changes(n, degrees) | layout.boundaries
    ranges = layout.chunk_bounds(stage)
    if sp is not None:
        max_inflight = max(max_inflight, 2)
    first = _micro_passes(spec, k, ranges, n, 0, pp_schedule, changes, sp, defer, layout.chunks)
    units = pipeline_order(pp_schedule, layout.pp, stage, n_micro, layout.chunks)
    shapes: dict[Unit, tuple[list[Instr], list[CollKey]]] = {}
    bodies, recvs = [], []
    for unit in units:
        micros = sorted({p[1] for p in unit})
        shape = tuple((p[0], micros.index(p[1]), *p[2:]) for p in unit)
        if shape not in shapes:
            shapes[shape] = _shape_body(shape, first, k, spec, max_inflight, n, ranges, sp)
        body, recv = shapes[shape]
        offsets = [(m - i) * k for i, m in enumerate(micros)]
        bodies.append(_relabelled(body, offsets, k))
        recvs.append([(kind, i, j + offsets[j // k]) for kind, i, j in recv])
    program = _place_p2p(bodies, recvs)
    if dp_tasks:
        first_norm = frozenset(lo - 1 for lo, _ in ranges if lo > 0 and lo - 1 in dp_tasks)
        program = insert_dp(program, set(dp_tasks), n_micro * k - 1, first_norm)
    return tuple(program)


def _micro_passes(
    spec: ScheduleSpec,
    k: int,
    ranges: list[tuple[int, int]],
    n: int,
    m: int,
    pp_schedule: str,
    changes: frozenset[int],
    sp: str | None,
    defer: bool,
    chunks: int,
) -> dict[tuple, list[_Marked]]:
    """Micro-batch ``m``'s passes on the stage (its sub-batches ``m k .. m k + k - 1``): keys
    ("F", m), ("B", m) (with the chunk under the interleaved schedule) and zb-h1's ("W", m).
    Built from the whole chain's tasks, restricted to the stage's regions (``_on_stage``);
    ``_build`` builds micro-batch 0's and relabels them for the others (``_shifted``,
    ``_shape_body``), since a micro-batch's tasks differ from another's only in their
    sub-batch ids (micro-batch 0's: 0 .. k - 1)."""
    passes: dict[tuple, list[_Marked]] = {}
    subs = range(m * k, (m + 1) * k)
    zb = pp_schedule == "zb-h1"  # its W passes take every block's weight gradients
    if sp is not None:
        chains = [
            sp_chain(n, j, spec.recompute, sp, changes, defer and spec.overlapped and not zb)
            for j in subs
        ]
        fwd = staggered([[t for t in c if t.compute.phase == "forward"] for c in chains])
        bwd = staggered([[t for t in c if t.compute.phase != "forward"] for c in chains])
    else:
        fwd = forward_tasks(n, subs, changes)
        bwd = backward_tasks(n, subs, spec.recompute, changes)
    if zb:
        passes["W", m] = _on_stage(weight_grad_tasks(bwd, n), *ranges[0], n)
    if chunks == 1:
        passes["F", m] = _on_stage(fwd, *ranges[0], n)
        passes["B", m] = _on_stage(bwd, *ranges[0], n)
    else:  # the interleaved schedule's passes of each chunk (``pipeline_order``)
        for c, (lo, hi) in enumerate(ranges):
            passes["F", m, c] = _on_stage(fwd, lo, hi, n)
            passes["B", m, c] = _on_stage(bwd, lo, hi, n)
    return passes


def _shifted(marked: _Marked, off: int) -> _Marked:
    """``marked`` for the micro-batch ``off`` sub-batches later: every sub-batch id (the
    compute's, the third field of each collective key) plus ``off``."""

    def key(c: CollKey | None) -> CollKey | None:
        return None if c is None else (c[0], c[1], c[2] + off)

    task = marked.task
    compute = task.compute
    return _Marked(
        Task(
            Compute(compute.phase, compute.pieces, compute.sub + off),
            [(c[0], c[1], c[2] + off) for c in task.needs],
            key(task.produces),
        ),
        key(marked.recv),
        key(marked.send),
    )


def weight_grad_tasks(tasks: list[Task], n: int) -> list[Task]:
    """zb-h1's W pass of one micro-batch whose backward (its B pass, unchanged) is ``tasks``: a
    [dw i] task per backward task that runs block region i's [tp i], in the same order: the
    executor then computes only the input gradient in [tp i] and the TP matmuls' weight
    gradients in [dw i] (``executor_backward``). Not the embedding's and the head's: the
    lookup has no matmul, and the head's [b*S, V/t] logits gradient would be held to its W."""
    return [
        Task(Compute("backward", (("dw", i),), t.compute.sub))
        for t in tasks
        if t.compute.phase == "backward"
        for kind, i in t.compute.pieces
        if kind == "tp" and 0 < i < n - 1
    ]


def _on_stage(tasks: list[Task], lo: int, hi: int, n: int) -> list[_Marked]:
    """The tasks of regions [lo, hi), the boundary reshards turned into sends and receives."""
    out: list[_Marked] = []
    for task in tasks:
        inside = {lo <= i < hi for _, i in task.compute.pieces}
        if inside == {False}:
            continue
        assert inside == {True}, f"task {task.compute} crosses a stage boundary"
        recv = send = None
        needs = []
        for need in task.needs:
            kind, i, j = need
            if kind == "rsf" and i == lo and lo > 0:
                recv = ("rf", i, j)
            elif kind == "rsb" and i == hi and hi < n:
                recv = ("rb", i, j)
            else:
                needs.append(need)
        produces = task.produces
        if produces is not None:
            kind, i, j = produces
            if kind == "rsf" and i == hi and hi < n:
                send, produces = ("sf", i, j), None
            elif kind == "rsb" and i == lo and lo > 0:
                send, produces = ("sb", i, j), None
        out.append(_Marked(Task(task.compute, needs, produces), recv, send))
    return out


def _shape_body(
    shape: Unit,
    first: dict[tuple, list[_Marked]],
    k: int,
    spec: ScheduleSpec,
    max_inflight: int,
    n: int,
    ranges: list[tuple[int, int]],
    sp: str | None,
) -> tuple[list[Instr], list[CollKey]]:
    """The body of a unit whose passes are those of ``shape``, micro-batch i standing for the
    unit's i-th micro-batch in order (``_build``), and its receives in the order they are
    posted (sub-batch, then boundary).

    Why a unit's body is its shape's relabelled (``_relabelled``): a unit's tasks are its
    passes' micro-batch-0 tasks with every sub-batch id shifted (``_shifted``); the list
    scheduler, ``staggered``, ``block_groups``, ``_unit_body`` and ``insert_regathers`` read a
    sub-batch id only to match keys (equal or not), never its value, so relabelling the ids
    one-to-one before or after scheduling gives the same instructions; and the relabelling
    keeps their order (micro-batch i of the shape is the unit's i-th smallest), so the
    receives sort the same too."""
    passes = {
        p: [_shifted(x, p[1] * k) for x in first[(p[0], 0, *p[2:])]]
        if p[1]
        else first[(p[0], 0, *p[2:])]
        for p in shape
    }
    body = _unit_body(_unit_tasks(shape, passes), spec, max_inflight)
    if regathers(spec.recompute, spec.scope, sp):  # sp="shards": "gh" in each unit
        body = insert_regathers(body, n, not spec.overlapped, *ranges[_backward_chunk(shape)])
    recv = sorted(
        (m.recv for p in shape for m in passes[p] if m.recv is not None),
        key=lambda key: (key[2], key[1]),
    )
    return body, recv


def _relabelled(body: list[Instr], offsets: list[int], k: int) -> list[Instr]:
    """``body`` with each sub-batch id j of its shape's micro-batch j // k moved by that
    micro-batch's offset (``_shape_body``); ``body`` itself where no id moves."""
    if not any(offsets):
        return body
    out: list[Instr] = []
    for ins in body:
        off = offsets[ins.sub // k]  # (a unit holds Compute, Start and Wait only)
        if not off:
            out.append(ins)
        elif type(ins) is Compute:
            out.append(Compute(ins.phase, ins.pieces, ins.sub + off))
        else:
            out.append(type(ins)(ins.kind, ins.index, ins.sub + off))
    return out


def _backward_chunk(unit: Unit) -> int:
    """The model chunk of a unit's backward pass (0: none, or one chunk per stage): the range
    of regions whose re-gathers it starts."""
    return next((p[2] for p in unit if p[0] == "B" and len(p) > 2), 0)


def _unit_tasks(unit: Unit, passes: dict[tuple, list[_Marked]]) -> list[_Marked]:
    """A unit's tasks in priority order: one pass, or a forward and a backward alternating,
    the forward first (``pipeline_order``)."""
    if len(unit) == 1:
        return passes[unit[0]]
    return staggered([passes[p] for p in unit])


def _unit_body(tasks: list[_Marked], spec: ScheduleSpec, max_inflight: int) -> list[Instr]:
    """The unit list-scheduled (its collectives waited by its end), each receive waited right
    before the compute that reads it, each send started right after the one that makes it."""
    plain = [m.task for m in tasks]
    if spec.scope == "block":
        body = [ins for group in block_groups(plain) for ins in list_schedule(group, max_inflight)]
    else:
        body = list_schedule(plain, max_inflight, synchronous=not spec.overlapped)
    marks = {m.task.compute: m for m in tasks}
    out: list[Instr] = []
    for ins in body:
        mark = marks.get(ins) if isinstance(ins, Compute) else None
        if mark is not None and mark.recv is not None:
            out.append(Wait(*mark.recv))
        out.append(ins)
        if mark is not None and mark.send is not None:
            out.append(Start(*mark.send))
    return out


def _place_p2p(bodies: list[list[Instr]], recvs: list[list[CollKey]]) -> list[Instr]:
    """Concatenate the units' bodies with their receives (``recvs``, each unit's in order)
    posted one unit ahead and the sends waited ``SEND_WAIT_UNITS`` units later (module
    docstring)."""
    sends = [
        [ins for ins in body if isinstance(ins, Start) and ins.kind in SEND_KINDS]
        for body in bodies
    ]
    program: list[Instr] = []
    for u, body in enumerate(bodies):
        if u == 0:
            program += [Start(*key) for key in recvs[0]]
        if u + 1 < len(bodies):
            program += [Start(*key) for key in recvs[u + 1]]
        program += body
        if u - SEND_WAIT_UNITS + 1 >= 0:
            program += [Wait(s.kind, s.index, s.sub) for s in sends[u - SEND_WAIT_UNITS + 1]]
    for done in sends[max(0, len(bodies) - SEND_WAIT_UNITS + 1) :]:
        program += [Wait(s.kind, s.index, s.sub) for s in done]
    return program


def _tie_before_reduce(
    program: list[Instr], index: int, sharded: bool, last_micro: int
) -> list[Instr]:
    """Sum the tied weight's gradient over the first and last stage ("tie") after the last
    compute, and only then start the reduction of region ``index``'s bucket ("dp") or ZeRO
    unit ("rs" of the last micro-batch), moved there from where it was (module docstring)."""
    key = ("rs", index, last_micro) if sharded else ("dp", index, 0)
    moved_wait = False
    out: list[Instr] = []
    for ins in program:
        if isinstance(ins, Start | Wait) and (ins.kind, ins.index, ins.sub) == key:
            moved_wait = moved_wait or isinstance(ins, Wait)
            continue
        out.append(ins)
    last = max(i for i, ins in enumerate(out) if isinstance(ins, Compute))
    while (
        last + 1 < len(out)
        and isinstance(out[last + 1], Start)
        and (out[last + 1].kind in SEND_KINDS)
    ):  # the last compute's send goes first: the other stage may be waiting for it
        last += 1
    had_start = any(
        isinstance(ins, Start) and (ins.kind, ins.index, ins.sub) == key for ins in program
    )
    tail: list[Instr] = [Start("tie", 0), Wait("tie", 0)]
    if had_start:
        tail.append(Start(*key))
    out[last + 1 : last + 1] = tail
    if moved_wait:
        out.append(Wait(*key))
    return out
