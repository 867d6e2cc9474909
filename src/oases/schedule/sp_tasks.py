"""Each sub-batch's tasks under sequence parallelism (Megatron-LM's ``--sequence-parallel``).

The glue and norms run on this rank's S/t slice of the sequence, the forward piece "body"
splits into ("norm", i) on the slice and ("core", i) on the gathered sequence, and each
region's collective becomes a reduce-scatter plus a gather (``instructions``: "gf", "gb",
"gr")::

    forward   [epi i-1 + norm i] gf(i) [core i] fwd(i)      (the embedding: [core 0] fwd(0))
    backward  [norm i+1 + epi i] gb(i) [dw i+1] [tp i] bwd(i)  (the head: [tp R-1] bwd(R-1))

where [tp i] computes the input gradient alone and [dw i], the weight gradients, waits until
the next gather has started (``dw_tasks.defers_weight_grad``: a block's regions, in the
schedules without communication-free recompute; the others run [tp i] whole). Every
sub-batch's chain is one list (``sp_chain``); ``program`` interleaves them one task apart
(``list_scheduler.staggered``).
"""

from __future__ import annotations

from oases.schedule.dw_tasks import place_weight_grads
from oases.schedule.instructions import CollKey, Compute
from oases.schedule.list_scheduler import Task


def sp_chain(
    n_regions: int,
    j: int,
    recompute: str,
    keep: str,
    changes: frozenset[int] = frozenset(),
    defer: bool = True,
) -> list[Task]:
    """Sub-batch ``j``'s tasks of one micro-batch under sequence parallelism, in order.

    Forward, per region i (the embedding's region 0 is its lookup alone)::

        [epi i-1 + norm i] -gf(i)-> [core i] -fwd(i): reduce-scatter-> [epi i + norm i+1] ...

    Backward, from the head (whose graph is kept)::

        [tp R-1] -bwd-> [norm R-1 + epi R-2] -gb(R-2)-> [tp R-2] -bwd-> ...
            ... -gb(0)-> [dw 1] [tp 0]

    where, without communication-free recompute, a block's region i splits its TP matmuls'
    backward (``dw_tasks.defers_weight_grad``): [tp i] computes the input gradient dh_i alone
    and bwd(i) starts at once; [dw i], the weight gradients, runs after the next task that
    starts a backward gather, [norm i + epi i-1] with gb(i-1), so nothing delays a
    collective's issue and dw runs under two of them (``dw_tasks.place_weight_grads``)::

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
            return [
                Task(Compute(phase, (("epi", i - 1),), j), needs=needs, produces=("rsf", i, j)),
                Task(
                    Compute(phase, (("norm", i),), j), needs=[("rsf", i, j)], produces=("gf", i, j)
                ),
            ]
        return [
            Task(
                Compute(phase, (("epi", i - 1), ("norm", i)), j), needs=needs, produces=("gf", i, j)
            )
        ]

    tasks = [Task(Compute("forward", (("core", 0),), j), produces=("fwd", 0, j))]
    for i in range(1, n_regions):
        tasks += glue_norm("forward", i, [("fwd", i - 1, j)])
        tasks.append(
            Task(
                Compute("forward", (("core", i),), j),
                needs=[("gf", i, j)],
                produces=("fwd", i, j) if i < last else None,
            )
        )

    def backward(i: int) -> tuple[list[Task], list[Task]]:
        """([norm i+1 + epi i] -gb(i)-> [dw i+1], [tp i] -bwd(i)->): the tasks before and
        from the TP matmuls' backward (a recompute goes between). Region i+1's deferred
        weight gradients run once the gather they are to hide under has started."""
        tail = [
            Task(
                Compute("backward", (("tp", i),), j),
                needs=[("gb", i, j)],
                produces=("bwd", i, j) if i > 0 else None,
            )
        ]
        if i + 1 in changes:
            return [
                Task(
                    Compute("backward", (("norm", i + 1),), j),
                    needs=[("bwd", i + 1, j)],
                    produces=("rsb", i + 1, j),
                ),
                Task(
                    Compute("backward", (("epi", i),), j),
                    needs=[("rsb", i + 1, j)],
                    produces=("gb", i, j),
                ),
            ], tail
        return [
            Task(
                Compute("backward", (("norm", i + 1), ("epi", i)), j),
                needs=[("bwd", i + 1, j)],
                produces=("gb", i, j),
            )
        ], tail

    tasks.append(Task(Compute("backward", (("tp", last),), j), produces=("bwd", last, j)))
    i = last - 1
    while i >= 0:
        if recompute == "block" and 0 < i < last:  # i: a block's MLP, i - 1 its attention
            attn, mlp = i - 1, i
            tasks += [
                Task(Compute("recompute", (("norm", attn),), j), produces=("gf", attn, j)),
                Task(
                    Compute("recompute", (("core", attn),), j),
                    needs=[("gf", attn, j)],
                    produces=("fwd", attn, j),
                ),
                *glue_norm("recompute", mlp, [("fwd", attn, j)]),
                Task(
                    Compute("recompute", (("core", mlp),), j),
                    needs=[("gf", mlp, j)],
                    produces=("fwd", mlp, j),
                ),
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
                tasks += [
                    Task(Compute("recompute", head, j), produces=("gr", i, j)),
                    Task(Compute("recompute", (("core", i),), j), needs=[("gr", i, j)]),
                ]
        tasks += second
        i -= 1
    return place_weight_grads(tasks, n_regions, recompute, j) if defer else tasks
