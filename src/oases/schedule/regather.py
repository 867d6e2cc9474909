"""Megatron-LM's re-gather of a linear layer's input in the backward, under sequence parallelism.

Under sequence parallelism region i's TP matmuls read the gathered h_i [b, S, H] ("gf"); their
weight gradients need it again in the backward. Keeping it from the forward costs sbh per region
(the t-fold of what the sequence split saves); Megatron-LM keeps norm:i's slice [b, S/t, H]
instead and all-gathers it again in the backward (Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models", 2022, section 4.2.2). Here that gather is the
collective "gh", i (``instructions``), inserted into a list-scheduled program of a schedule
without recompute (a recompute builds its core's graph in the backward anyway) under
``sp="shards"`` (``parallel.sp_recompute``)::

    overlapped   [tp i+1] -bwd(i+1), gh(i)-> [norm i+1 + epi i] -gb(i)-> [dw i+1] [tp i]
                 (gh(i) flies with bwd(i+1), under [norm i+1 + epi i] and the other
                 sub-batches' tasks; waited right before [tp i], which needs it)
    synchronous  ... Start gh(i), Wait gh(i) [tp i]   (a synchronous program overlaps nothing)
    pipeline     as above inside each unit of a stage's program; the stage's last region's
                 gh starts at the unit's start (its bwd(i+1) is the next stage's)

for every block region i (0 < i < R-1; not the embedding, whose lookup reads no gathered input,
nor the head, whose backward starts the chain: its gather would be exposed whole). The
executor then builds core:i's forward graph with the gathered h_i's saved uses swapped for a
token (``saved_tensors_hooks``), frees the gathered input after the forward, and resolves the
token to the "gh" result in tp:i (``executor_forward``, ``executor_backward``).

It is a choice, not the default: ``sp="gathered"`` keeps the gathered h_i (no "gh"). The
gather adds a fifth collective per region to the backward (gf + fwd forward, gb + bwd + gh
backward: +25% of the backward's bytes); Megatron-LM hides it under the input-gradient matmul
on a fast link, but where the link is the bottleneck (the shaped-link benchmark: link time
2.4-2.7x compute) there is no compute left to hide it under and the step grows by its bytes
(benchmarks/2026-12-03-actmem, +15% / +21%). So "shards" trades link time for sbh(1 - 1/t)
per region, and the planner prices both modes (``planner.search``) and picks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from oases.schedule.instructions import Compute, Instr, Start, Wait

if TYPE_CHECKING:
    from torch import Tensor


def regathers(recompute: str, scope: str, sp: str | None) -> bool:
    """Does a sequence-parallel program of this kind re-gather h_i in the backward? Only under
    ``sp="shards"`` and without recompute (block recompute rebuilds the block's graph from its
    saved input slice and its own gathers; communication-free recompute rebuilds core:i from
    the gathered h_i it kept, ``sp="gathered"``, or gathers again in the recompute,
    ``"shards"``: "gr"), and not in a program whose collectives are waited per block (merak)."""
    return sp == "shards" and recompute == "none" and scope != "block"


def insert_regathers(
    body: list[Instr], n_regions: int, synchronous: bool, lo: int = 0, hi: int | None = None
) -> list[Instr]:
    """``body`` (one micro-batch's list-scheduled instructions, or a pipeline unit's) with "gh"
    for each block region's backward: started right after the Start of bwd(i+1) of its
    sub-batch (``synchronous``: right before [tp i]) and waited right before the compute
    with ("tp", i) of its sub-batch. A pipeline stage holds regions [lo, hi): its last
    region's bwd(hi) is the next stage's, so that gather starts at the body's start (it
    flies while the stage waits for the gradient from the next stage)."""
    last = n_regions - 1
    hi = n_regions if hi is None else hi
    head: list[Instr] = []
    out: list[Instr] = []
    for ins in body:
        if isinstance(ins, Compute) and ins.phase == "backward":
            for kind, i in ins.pieces:
                if kind == "tp" and 0 < i < last:
                    if synchronous:
                        out.append(Start("gh", i, ins.sub))
                    elif i == hi - 1:  # (bwd(hi) runs on the next stage)
                        head.append(Start("gh", i, ins.sub))
                    out.append(Wait("gh", i, ins.sub))
        out.append(ins)
        if (
            not synchronous
            and isinstance(ins, Start)
            and ins.kind == "bwd"
            and 1 < ins.index <= last
            and lo <= ins.index - 1
        ):
            out.append(Start("gh", ins.index - 1, ins.sub))
    return head + out


def regathered_regions(program: list[Instr]) -> frozenset[int]:
    """The regions whose gathered input ``program`` gathers again in the backward ("gh")."""
    return frozenset(ins.index for ins in program if isinstance(ins, Start) and ins.kind == "gh")


@dataclass(frozen=True)
class Regathered:
    """What a saved use of the gathered h_i is packed as: where it sat in h_i's storage.
    ``resolve`` gives the re-gathered h_i (same shape, same layout) in the backward."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # from the gathered tensor's own storage offset
    resolve: Callable[[], Tensor]

    def unpack(self) -> Tensor:
        full = self.resolve()
        return full.as_strided(self.shape, self.stride, full.storage_offset() + self.offset)


def swapping_pack(
    gathered: Tensor, resolve: Callable[[], Tensor], other: Callable[[Tensor], Tensor]
) -> tuple[Callable[[Tensor], object], Callable[[object], Tensor]]:
    """A ``saved_tensors_hooks`` pair that packs every saved tensor on ``gathered``'s storage
    (itself or a view of it) as a ``Regathered`` token, and the others through ``other``."""
    storage, base = gathered.untyped_storage().data_ptr(), gathered.storage_offset()

    def pack(t: Tensor) -> object:
        if t.untyped_storage().data_ptr() == storage:
            return Regathered(tuple(t.shape), t.stride(), t.storage_offset() - base, resolve)
        return other(t)

    def unpack(packed: object) -> Tensor:
        return packed.unpack() if isinstance(packed, Regathered) else packed

    return pack, unpack
