"""Deferred weight gradients: which regions split their TP matmuls' backward [tp i] into the
input gradient [tp i] and the weight gradients [dw i], and where a chain's [dw i] tasks go.

Under sequence parallelism (``sp_tasks``) a block region's backward chain, without
communication-free recompute, becomes::

    [tp i] -bwd(i)-> [norm i + epi i-1] -gb(i-1)-> [dw i] [tp i-1] -bwd(i-1)-> ...

so bwd(i) starts as soon as dh_i exists, and [dw i] runs under two collectives. The executor
runs a "dw" piece from what the column-parallel layers recorded in [tp i]
(``layers.deferred_weight_grads``); ``instructions.deferred_regions`` reads a program's.
"""

from __future__ import annotations

from oases.schedule.instructions import Compute
from oases.schedule.list_scheduler import Task


def place_weight_grads(tasks: list[Task], n_regions: int, recompute: str, j: int) -> list[Task]:
    """Cut each deferring region's backward [tp i] (``defers_weight_grad``) into [tp i], the
    input gradient, and [dw i], placed right after the [norm + epi] that starts the next
    backward gather: nothing delays a collective's issue. In a block recompute the
    attention's [dw] runs before the next block's recompute instead (right after [tp i],
    under bwd(i)): waiting through it, as until 2026-12-04, kept region i's graph (the
    gathered h_i and dr_i, the layers' dY) alive beside the two rebuilt regions' graphs,
    which set the step's peak (benchmarks/2026-12-04b-actmem: the issue's 6-layer GPT-2 held
    more live bytes with sequence parallelism than without). The 2026-12-03
    deferred-weight-grads report measured the wait through the recompute as the faster
    placement (+2-3% against the all-reduce version; right after the recompute's first
    task +8%); 2026-12-04b-actmem measures this one."""
    out: list[Task] = []
    pending: list[Task] = []
    for task in tasks:
        if pending and task.compute.phase == "recompute":
            out += pending  # (block recompute: before the next block's graphs are rebuilt)
            pending = []
        out.append(task)
        ((kind, i),) = task.compute.pieces[-1:]
        if (
            task.compute.phase == "backward"
            and kind == "tp"
            and defers_weight_grad(i, n_regions, recompute)
        ):
            pending.append(Task(Compute("backward", (("dw", i),), j)))
        elif pending and task.produces is not None and task.produces[0] == "gb":
            out += pending
            pending = []
    return out + pending


def defers_weight_grad(i: int, n_regions: int, recompute: str) -> bool:
    """Does a sequence-parallel program split region i's TP matmuls' backward into ("tp", i),
    the input gradient, and ("dw", i), the weight gradients, run after the sub-batch's next
    collective has started (``place_weight_grads``)? A block's attention or MLP (not the
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
