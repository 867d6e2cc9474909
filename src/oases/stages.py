"""Pipeline stages: which contiguous range of the chain's regions each stage holds, and the
names of the pipeline schedules. Pure (no torch), so the config, the plan, the schedules, the
runtime and (next) the simulator share one answer.

The chain has R = 2L + 2 regions (``schedule/regions.py``): 0 the embedding, 2l+1 and 2l+2 block
l's attention and MLP, R-1 the head. A pipeline of P stages cuts it between blocks: stage s holds
regions ``[starts[s-1], starts[s])`` (``starts[-1]`` = 0 and ``starts[P-1]`` = R), so the first
stage holds the embedding, the last the head and the loss, and every boundary is a block's
attention region (a block is never split: the block recompute re-runs it from its input)::

    L = 4, P = 2, starts (5,):   stage 0 [0, 5)  embed, blocks 0-1
                                 stage 1 [5, 10) blocks 2-3, head

``default_stage_starts`` balances by block count (the first ``L % P`` stages take one block
more: the last stage also runs the head); the simulator's cost balancing comes later. At a
boundary b the forward sends x_b from stage s to s+1 and the backward sends dx_b back
(``schedule/pipeline_program.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "1f1b-pair", "zb-h1")  # ``schedule/pipeline_order.py``
PLANNED_SCHEDULES = ("interleaved",)  # named by issue 28, not built yet


def check_pipeline_schedule(name: str) -> None:
    """ValueError unless ``name`` is a pipeline schedule this version runs."""
    if name in PLANNED_SCHEDULES:
        raise ValueError(
            f"parallel.pp_schedule={name!r} is not built yet (issue 28); "
            f"valid: {', '.join(PIPELINE_SCHEDULES)}"
        )
    if name not in PIPELINE_SCHEDULES:
        raise ValueError(f"parallel.pp_schedule={name!r}; valid: {', '.join(PIPELINE_SCHEDULES)}")


def block_start(layer: int) -> int:
    """The region index of block ``layer``'s attention, where a stage may begin."""
    return 2 * layer + 1


def default_stage_starts(n_layers: int, pp: int) -> tuple[int, ...]:
    """The first region of stages 1 .. pp-1, balanced by block count (ValueError for fewer
    blocks than stages)."""
    if pp < 1:
        raise ValueError(f"parallel.pp={pp} must be at least 1")
    if n_layers < pp:
        raise ValueError(
            f"model.n_layers={n_layers} blocks do not fill parallel.pp={pp} "
            "pipeline stages (every stage holds at least one block)"
        )
    per, extra = divmod(n_layers, pp)
    starts, layer = [], 0
    for s in range(pp - 1):
        layer += per + (1 if s < extra else 0)
        starts.append(block_start(layer))
    return tuple(starts)


def check_stage_starts(starts: tuple[int, ...], n_layers: int, pp: int) -> None:
    """ValueError (with the numbers) unless ``starts`` cuts the chain of ``n_layers`` blocks
    into ``pp`` stages at block boundaries, each holding at least one block."""
    if len(starts) != pp - 1:
        raise ValueError(
            f"stage_starts={list(starts)} must give the first region of each of "
            f"the {pp - 1} stages after the first (pp={pp})"
        )
    prev = 0
    for s, b in enumerate(starts, 1):
        if b % 2 != 1 or not 3 <= b <= 2 * n_layers - 1:
            raise ValueError(
                f"stage_starts={list(starts)}: stage {s} starts at region {b}, "
                f"which is not the attention region (2l+1) of one of blocks "
                f"1..{n_layers - 1}"
            )
        if b <= prev:
            raise ValueError(
                f"stage_starts={list(starts)} must increase (stage {s} starts "
                f"at region {b}, not after region {prev})"
            )
        prev = b


@dataclass(frozen=True)
class StageLayout:
    """The stages of a chain of ``n_regions`` regions: ``starts`` (the first region of each
    stage after the first). One stage (``pp == 1``) holds everything."""

    n_regions: int
    starts: tuple[int, ...] = ()

    @property
    def pp(self) -> int:
        return len(self.starts) + 1

    def bounds(self, stage: int) -> tuple[int, int]:
        """[lo, hi): the regions of ``stage``."""
        if not 0 <= stage < self.pp:
            raise ValueError(f"stage {stage} of a {self.pp}-stage pipeline")
        edges = (0, *self.starts, self.n_regions)
        return edges[stage], edges[stage + 1]

    def stage_of(self, region: int) -> int:
        return sum(1 for b in self.starts if b <= region)

    @property
    def boundaries(self) -> frozenset[int]:
        """The regions b whose input x_b crosses from one stage to the next."""
        return frozenset(self.starts)

    def holds(self, stage: int, region: int) -> bool:
        lo, hi = self.bounds(stage)
        return lo <= region < hi
