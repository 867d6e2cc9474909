"""Each sub-batch's tasks without sequence parallelism: the forward, the backward, the recompute.

Tasks (``list_scheduler.Task``) in priority order: every sub-batch's forward region by region,
then from the head down every sub-batch's (recompute and) backward of each region::

    forward   [epi i-1 + body i] -fwd(i)->                      (the embedding: [body 0])
    backward  [norm i+1 + epi i + tp i] -bwd(i)->               (the head: [tp R-1])

A degree change at region i (``degree_changes``) splits the two tasks that cross it::

    forward   [epi i-1 + body i]               ->  [epi i-1] rsf(i) [body i]
    backward  [norm i + epi i-1 + tp i-1]      ->  [norm i] rsb(i) [epi i-1 + tp i-1]

and the halves of the split tasks run for every sub-batch in turn, so sub-batch a's reshard
runs while sub-batch b computes::

    compute:  [epi i-1](a)  [epi i-1](b)  [body i](a)  [body i](b)
    comm:     .. AR(i-1,b) .. rsf(i,a) .... rsf(i,b) .... AR(i,a) ...

Recompute (``ScheduleSpec.recompute``) before region i's backward: "commfree" recomputes
[epi i-1 + body i] from the saved post-collective (x_i, r_i), no collective; "block" re-runs a
whole block (attention i-1, MLP i) from its saved input before the MLP's backward, repeating
its forward collectives (``_block_recompute_tasks``).

Recompute across a degree change at region i: communication-free recompute never repeats a
collective, so there region i's segment is [body i] alone, from its saved post-reshard input x_i
(epi i-1 keeps its graph from the forward). Block recompute repeats a block's forward
collectives by design: a change inside a block (at its MLP) repeats that block's rsf in the
recompute; a change at a block's start is not repeated (the block input is saved post-reshard).
"""

from __future__ import annotations

from oases.schedule.instructions import Compute
from oases.schedule.list_scheduler import Task


def forward_tasks(n_regions: int, subs: range, changes: frozenset[int]) -> list[Task]:
    tasks = []
    for i in range(n_regions):
        produces = [("fwd", i, j) if i < n_regions - 1 else None for j in subs]
        if i in changes:  # [epi i-1] rsf(i) [body i]
            tasks += [
                Task(
                    Compute("forward", (("epi", i - 1),), j),
                    needs=[("fwd", i - 1, j)],
                    produces=("rsf", i, j),
                )
                for j in subs
            ]
            tasks += [
                Task(Compute("forward", (("body", i),), j), needs=[("rsf", i, j)], produces=out)
                for j, out in zip(subs, produces)
            ]
            continue
        for j, out in zip(subs, produces):
            pieces = ((("epi", i - 1),) if i else ()) + (("body", i),)
            tasks.append(
                Task(
                    Compute("forward", pieces, j),
                    needs=[("fwd", i - 1, j)] if i else [],
                    produces=out,
                )
            )
    return tasks


def _norm_task(i: int, j: int) -> Task:
    """Backward of region i's norm alone, where dx_i moves to region i-1's layout (rsb)."""
    return Task(
        Compute("backward", (("norm", i),), j), needs=[("bwd", i, j)], produces=("rsb", i, j)
    )


def _backward_task(i: int, j: int, n_regions: int, changes: frozenset[int]) -> Task:
    if i == n_regions - 1:
        pieces, needs = (("tp", i),), []
    elif i + 1 in changes:  # norm:i+1 ran in its own task (_norm_task)
        pieces, needs = (("epi", i), ("tp", i)), [("rsb", i + 1, j)]
    else:
        pieces, needs = (("norm", i + 1), ("epi", i), ("tp", i)), [("bwd", i + 1, j)]
    return Task(
        Compute("backward", pieces, j), needs=needs, produces=("bwd", i, j) if i > 0 else None
    )


def _block_recompute_tasks(attn: int, subs: range, changes: frozenset[int]) -> list[Task]:
    """Megatron's recompute of the block (attn, mlp = attn + 1) from its saved input, repeating
    its forward collectives (and its rsf, where the degree changes inside the block)."""
    mlp = attn + 1
    tasks = [
        Task(Compute("recompute", (("body", attn),), j), produces=("fwd", attn, j)) for j in subs
    ]
    if mlp in changes:
        tasks += [
            Task(
                Compute("recompute", (("epi", attn),), j),
                needs=[("fwd", attn, j)],
                produces=("rsf", mlp, j),
            )
            for j in subs
        ]
        tasks += [
            Task(
                Compute("recompute", (("body", mlp),), j),
                needs=[("rsf", mlp, j)],
                produces=("fwd", mlp, j),
            )
            for j in subs
        ]
    else:
        tasks += [
            Task(
                Compute("recompute", (("epi", attn), ("body", mlp)), j),
                needs=[("fwd", attn, j)],
                produces=("fwd", mlp, j),
            )
            for j in subs
        ]
    return tasks


def backward_tasks(
    n_regions: int, subs: range, recompute: str, changes: frozenset[int]
) -> list[Task]:
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
                tasks.append(
                    Task(Compute("recompute", (("epi", mlp),), j), needs=[("fwd", mlp, j)])
                )
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


def degree_changes(n_regions: int, degrees: tuple[int, ...] | None) -> frozenset[int]:
    """The regions i >= 1 whose TP degree differs from region i-1's (ValueError for a degree
    list of the wrong length or with a degree below 1)."""
    if degrees is None:
        return frozenset()
    if len(degrees) != n_regions or min(degrees) < 1:
        raise ValueError(
            f"degrees={tuple(degrees)} must give a positive TP degree for each of "
            f"the {n_regions} regions"
        )
    return frozenset(i for i in range(1, n_regions) if degrees[i] != degrees[i - 1])
