"""Which pieces of a program the executor runs as one autograd graph (one engine call).

Every piece runs on detached inputs, so each backward piece is one ``torch.autograd.backward``
call, and each call pays the engine's set-up (about 10-100 us on a CPU host: more than the
kernels of a small piece). Where no collective separates two pieces, the executor links their
graphs instead, and the backward of the linked pieces is one call from all their roots::

    x-link at i    forward (or recompute) Compute [.., epi:i-1, body:i, ..] with both graphs
                   kept: norm:i reads epi:i-1's output itself, not a detached leaf; the backward
                   Compute [.., norm:i, epi:i-1, ..] then hands its roots on
                   (h_i <- dh_i, x_i <- the residual part of dx_i) to epi:i-1
    p-link at i    body:i's row-parallel partial p_i keeps its graph and is all-reduced in place
                   (its storage is r_i): epi:i reads p_i itself as r_i, so the backward Compute
                   [.., epi:i, tp:i] is one call that runs on through the row-parallel and
                   column-parallel matmuls to dh_i (no ``backward_partial``)

so Megatron's backward Compute [norm:i+1, epi:i, tp:i] is one engine call instead of three.
Where, in the instructions the executor runs, nothing but Computes lies between tp:i and norm:i
(a region at tp=1 without sp: its "bwd" all-reduce is a no-op the executor drops), the chain
goes on across Computes::

    h-link at i    body:i's TP core reads h_i itself, not a detached leaf, and epi:i reads
                   x_i itself (epi:i-1's output) for its residual: tp:i hands its roots on to
                   this sub-batch's next Compute [norm:i, epi:i-1, ..], which adds none, and
                   the engine call is made by the first tp that cannot hand on (a collective
                   follows it, or the embedding's); a whole Megatron step at tp=1 is then one
                   call from the loss, as the plain model's. With no all-reduce between, the
                   row-parallel bias joins p_i's matmul (outside autocast): the plain model's
                   graph, but one view per linked norm (its uses of x_i sum before the
                   residual's, as a recompute twin's do: bit for bit). Under a block
                   recompute a block's MLP hands on to its attention's Compute; under the
                   communication-free recompute (no p-link) tp:i hands on (y_i, dy_i) after
                   its row-parallel backward, and norm:i adds the residual part of dx_i (epi:i
                   read the saved x_i): one engine call per region, not two
``program_links`` reads a program once (the executor keeps the result per program) and says
where each link may be made: an x-link where every backward Compute with norm:i has epi:i-1
next; a p-link where every backward Compute with epi:i has tp:i next, under a schedule whose
recompute (if any) re-runs the row-parallel matmul (a block recompute links p_i in its
recompute: the forward of a segment keeps no graph), without sequence parallelism, deferred
weight gradients or ZeRO (whose pieces need p_i's own buffer or a weight gradient outside
autograd); the communication-free recompute skips that matmul, so its tp:i stays on its own.
The executor still checks each link as it makes it (a glue whose output is its input, a
reduction that did not land in place) and runs the pieces one by one where it could not.
"""

from __future__ import annotations

from dataclasses import dataclass

from oases.schedule.instructions import Compute, Instr


@dataclass(frozen=True)
class Links:
    """Regions i with an x-link (norm:i on epi:i-1's output), a p-link (epi:i on p_i) and an
    h-link (tp:i's roots handed on to norm:i's Compute)."""

    x: frozenset[int]
    p: frozenset[int]
    h: frozenset[int] = frozenset()


def _always_next(program: list[Instr], first: str, then: str, offset: int) -> set[int]:
    """Regions i where every backward Compute holding (first, i) has (then, i - offset) next."""
    ok: dict[int, bool] = {}
    for ins in program:
        if not isinstance(ins, Compute) or ins.phase != "backward":
            continue
        for n, (kind, i) in enumerate(ins.pieces):
            if kind == first:
                nxt = ins.pieces[n + 1] if n + 1 < len(ins.pieces) else None
                ok[i] = ok.get(i, True) and nxt == (then, i - offset)
    return {i for i, good in ok.items() if good}


def program_links(program: list[Instr], recompute: str, sp: str | None, zero: bool) -> Links:
    """Where ``program``'s pieces may be linked (see the module docstring)."""
    if sp is not None:
        return Links(frozenset(), frozenset())
    x = _always_next(program, "norm", "epi", 1)
    deferring = any(
        kind == "dw" for ins in program if isinstance(ins, Compute) for kind, _ in ins.pieces
    )
    skips_row = recompute == "commfree"  # its recompute skips the row-parallel matmul
    p = set() if skips_row or zero or deferring else _always_next(program, "epi", "tp", 0)
    return Links(frozenset(x), frozenset(p))


def handed_on(
    steps: list[Instr],
    links: Links,
    recompute: str,
    head: int,
    leaf_inputs: frozenset = frozenset(),
) -> Links:
    """``links`` with its h-links: the regions i (every region's x- and p-link held, or the
    head's x-link) where, in ``steps`` (the instructions the executor runs), each backward
    Compute ending in tp:i is followed, before any other instruction than a Compute, by its
    sub-batch's next backward Compute [norm:i, epi:i-1, ..] (recompute Computes may lie
    between). Under the communication-free recompute (no p-links: its tp:i runs the row-parallel
    backward outside autograd) the roots handed on are (y_i, dy_i); not at ``leaf_inputs``: the
    regions whose norm reads a saved leaf, not epi:i-1's output with its graph (a block
    recompute's block inputs, a communication-free recompute's inputs after a reshard, and the
    head where its glue ran without a graph), and those whose tp:i leaves its weight gradients
    to a "dw" piece (the executor passes both). ``head``: the head's region index (the chain's
    last, whose tp:i starts from the loss; not a pipeline stage's last region)."""
    commfree = recompute == "commfree"
    ok: dict[int, bool] = {}
    waiting: dict[int, int] = {}  # sub-batch -> the region whose tp:i ended its last Compute
    for ins in steps:
        if not isinstance(ins, Compute):
            for i in waiting.values():
                ok[i] = False  # a collective (or p2p, or a release) between: no hand-on
            waiting = {}
            continue
        if ins.phase != "backward":
            continue
        i = waiting.pop(ins.sub, None)
        if i is not None:
            ok[i] = ok[i] and ins.pieces[:2] == (("norm", i), ("epi", i - 1))
        kind, i = ins.pieces[-1]
        if kind == "tp":
            waiting[ins.sub] = i
            ok.setdefault(i, True)
    for i in waiting.values():
        ok[i] = False  # the last backward Compute: the embedding's, nothing to hand on to
    h = {
        i
        for i, good in ok.items()
        if good
        and i in links.x
        and (i in links.p or i == head or commfree)
        and i not in leaf_inputs
    }
    return Links(links.x, links.p, frozenset(h))
