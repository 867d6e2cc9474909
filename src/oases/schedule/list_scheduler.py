"""The list scheduler: tasks in priority order -> a program, with a bound on open collectives.

A *task* (``Task``) waits for the collectives it needs, computes, and starts the collective it
produces. ``list_schedule`` turns tasks in priority order into instructions with at most
``max_inflight`` collectives (fwd, bwd, rsf, rsb, ...) in flight: a task's needs are waited
just before its compute (collectives on one group complete in issue order, so everything
issued before a need is waited with it), and a task whose collective would be one too many
waits for the oldest after its compute. With two sub-batches a and b the forward steady
state is::

    compute:  [epi l-1 + body l](a)  [epi l-1 + body l](b)  [epi l + body l+1](a) ...
    comm:     ........ AR(l-1, b) ..... AR(l, a) ............... AR(l, b) ...

The priority order comes from the task generators (``tasks``, ``sp_tasks``); two helpers
shape it: ``staggered`` interleaves the sub-batches' chains one task apart, and
``block_groups`` cuts tasks into one group per block and pass for a schedule whose collectives
overlap only inside them (merak: each group is list-scheduled alone, so its collectives are
waited at its end).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from oases.schedule.instructions import CollKey, Compute, Instr, Start, Wait


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


def staggered(chains: list[list[Task]]) -> list[Task]:
    """Interleave the sub-batches' task chains, sub-batch j one task behind sub-batch j-1::

        a0  a1 b0  a2 b1 c0  a3 b2 c1  ...

    so the collective that ends a task of one sub-batch runs under the next tasks of the
    others. Under sequence parallelism every region's forward chain alternates a small task
    (glue and norm on a slice) and a large one (the TP matmuls) with a collective between any
    two: with two sub-batches each collective has only the other's next task to hide under,
    and a small one leaves the compute waiting. The backward's deferred weight gradients
    (``dw_tasks.defers_weight_grad``) shorten the task between a gather and the scatter that
    follows it, and run while both fly."""
    out: list[Task] = []
    for r in range(max(len(c) for c in chains) + len(chains) - 1):
        for j, chain in enumerate(chains):
            if 0 <= r - j < len(chain):
                out.append(chain[r - j])
    return out


def block_groups(tasks: list[Task]) -> list[list[Task]]:
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
