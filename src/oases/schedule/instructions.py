"""The instruction set of schedule programs, and how timelines and profiles name instructions.

A program is a flat list of instructions for one rank (``program.build_program``), run by the
executor on tensors and by the planner's simulator on costs. Pieces of the chain (see
``regions.py``) in each phase, named in ``Compute.pieces``:

    forward / recompute   ("epi", i)   glue after region i's all-reduce   (x_i, r_i) -> x_{i+1}
                          ("body", i)  norm + TP matmuls of region i       x_i -> p_i
                          ("norm", i)  sequence parallelism: body:i's norm, on a slice
                          ("core", i)  sequence parallelism: body:i's TP matmuls, gathered
    backward              ("norm", i)  backward of region i's norm (needs the reduced dh_i)
                          ("epi", i)   backward of the glue -> dr_i, residual part of dx_i
                          ("tp", i)    backward of region i's TP matmuls -> partial dh_i
                          ("dw", i)    sequence parallelism: the weight gradients ("tp", i)
                                       left, run under later collectives (``dw_tasks``)

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
                of the shards the previous step's optimizer updated; see ``dp_insert``

Pipeline stages (``pipeline_program``; b is the first region of the later stage)::

    "sf", b     send x_b (made by epi:b-1 on stage s) to the next stage
    "rf", b     receive it there, where body:b reads it
    "sb", b     send dx_b (made by norm:b on stage s+1) back to the previous stage
    "rb", b     receive it there, where epi:b-1's backward reads it
    "tie", 0    sum the tied embedding's gradient over the first and last stage

Sequence parallelism (``sp``, Megatron-LM's ``--sequence-parallel``; see ``sp_tasks``): the
glue and norms run on this rank's S/t slice of the sequence, "fwd" and "bwd" become
reduce-scatters along the sequence (same bytes as half an all-reduce each), and two gathers
along the sequence join them (the other half)::

    "gf", i     all-gather of h_i (norm:i's output slice) before region i's TP matmuls
    "gb", i     all-gather of dr_i (epi:i's input-gradient slice) before tp:i's backward
    "gr", i     "gf" again in a communication-free recompute that keeps only slices
                (``sp="shards"``; ``sp="gathered"`` keeps the gathered h_i and gathers nothing)
    "gh", i     "gf" again in the backward of a schedule without recompute, before tp:i: the
                forward kept norm:i's slice, not the gathered h_i (``regather``)
    "sg", 0     the sum over the TP group of the gradients of the parameters the glue and norms
                use (each rank's come from its slice of the sequence): one all-reduce at the
                end of the step (after ZeRO's reduce-scatters: it sums their shards' parts
                of those parameters), as Megatron-LM's all-reduce of its layernorm gradients
"""

from __future__ import annotations

from dataclasses import dataclass

Piece = tuple[str, int]  # ("epi" | "body" | "norm" | "core" | "tp" | "dw", region index)
CollKey = tuple[str, int, int]  # (kind, region or task index, sub-batch)


@dataclass(frozen=True, slots=True)
class Compute:
    phase: str  # "forward" | "recompute" | "backward"
    pieces: tuple[Piece, ...]
    sub: int


@dataclass(frozen=True, slots=True)
class Start:
    kind: str  # "fwd" | "bwd" | "rsf" | "rsb" | "dp" | "rs" | "ag" | "gf" | "gb" | "gr" | "gh" ..
    index: int
    sub: int = 0


@dataclass(frozen=True, slots=True)
class Wait:
    kind: str
    index: int
    sub: int = 0


@dataclass(frozen=True, slots=True)
class Release:
    """Free region ``index``'s gathered weights (ZeRO stage 3) after their last use in a pass."""

    index: int


Instr = Compute | Start | Wait | Release


def deferred_regions(program: list[Instr]) -> frozenset[int]:
    """The regions whose weight gradients ``program`` defers (has a "dw" piece for)."""
    return frozenset(
        {i for ins in program if type(ins) is Compute for kind, i in ins.pieces if kind == "dw"}
    )


def label(ins: Compute) -> str:
    """A compute instruction's name in timelines and profiles, e.g. ``"epi:2 body:3"``."""
    return " ".join(f"{kind}:{index}" for kind, index in ins.pieces)


def comm_name(kind: str, index: int) -> str:
    """A collective's name in timelines, e.g. ``"fwd AR 3"``, ``"rsf 3"`` (a reshard), ``"rs 3"``
    (a ZeRO gradient reduce-scatter), ``"ag 3"`` (a ZeRO weight gather) or ``"gf 3"`` (a
    sequence-parallel gather; its "fwd"/"bwd" reduce-scatters are named like the all-reduces)."""
    return (
        f"{kind} {index}"
        if kind in ("rsf", "rsb", "rs", "ag", "gf", "gb", "gr", "gh", "sf", "rf", "sb", "rb", "tie")
        else f"{kind} AR {index}"
    )
