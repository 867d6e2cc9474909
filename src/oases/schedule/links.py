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
    """Regions i with an x-link (norm:i on epi:i-1's output) and with a p-link (epi:i on p_i)."""

    x: frozenset[int]
    p: frozenset[int]


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
