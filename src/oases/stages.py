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

Model chunks (``chunks`` = v > 1, the "interleaved" schedule): the chain is cut into P v
*virtual stages* (``starts`` has P v - 1 entries), and stage s holds the virtual stages s, s + P,
s + 2P, ...: v contiguous ranges (``chunk_bounds``). The last virtual stage of one round hands
its output to stage 0's next chunk (the pipeline wraps around)::

    L = 4, P = 2, v = 2, starts (3, 5, 7):   stage 0 [0, 3) + [5, 7)   embed, blocks 0 and 2
                                             stage 1 [3, 5) + [7, 10)  blocks 1 and 3, head
"""

from __future__ import annotations

from dataclasses import dataclass

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "1f1b-pair", "zb-h1", "interleaved")
# (``schedule/pipeline_order.py``)
PLANNED_SCHEDULES: tuple[str, ...] = ()  # named by issue 28, not built yet


def check_pipeline_schedule(name: str) -> None:
    """ValueError unless ``name`` is a pipeline schedule this version runs."""
    if name in PLANNED_SCHEDULES:
        raise ValueError(
            f"parallel.pp_schedule={name!r} is not built yet (issue 28); "
            f"valid: {', '.join(PIPELINE_SCHEDULES)}"
        )
    if name not in PIPELINE_SCHEDULES:
        raise ValueError(f"parallel.pp_schedule={name!r}; valid: {', '.join(PIPELINE_SCHEDULES)}")


def check_chunks(pp_schedule: str, chunks: int, n_layers: int, pp: int) -> None:
    """ValueError (with the numbers) unless ``chunks`` model chunks per stage fit: more than one
    only with the "interleaved" schedule (which needs more than one), and every one of the
    ``pp * chunks`` virtual stages holds at least one block."""
    if chunks < 1:
        raise ValueError(f"parallel.pp_chunks={chunks} must be at least 1")
    if pp_schedule == "interleaved" and chunks < 2:
        raise ValueError(
            f'parallel.pp_schedule="interleaved" needs parallel.pp_chunks >= 2 model chunks '
            f"per stage (got {chunks})"
        )
    if pp_schedule != "interleaved" and chunks > 1:
        raise ValueError(
            f"parallel.pp_chunks={chunks} model chunks per stage run only with "
            f'parallel.pp_schedule="interleaved" (got {pp_schedule!r})'
        )
    if n_layers < pp and chunks == 1:
        raise ValueError(
            f"model.n_layers={n_layers} blocks do not fill parallel.pp={pp} "
            "pipeline stages (every stage holds at least one block)"
        )
    if n_layers < pp * chunks:
        raise ValueError(
            f"model.n_layers={n_layers} blocks do not divide into parallel.pp={pp} x "
            f"parallel.pp_chunks={chunks} = {pp * chunks} model chunks (each holds a block)"
        )


def check_interleaved_micro(pp: int, chunks: int, n_micro: int) -> None:
    """ValueError unless ``n_micro`` micro-batches a step suit the interleaved schedule: a
    multiple of ``pp`` (its forwards go round the stages in groups of ``pp``)."""
    if chunks > 1 and n_micro % pp:
        raise ValueError(
            f'parallel.pp_schedule="interleaved" runs a multiple of parallel.pp={pp} '
            f"micro-batches a step (got {n_micro})"
        )


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
    virtual stage after the first), ``chunks`` virtual stages per stage (module docstring).
    One stage (``pp == 1``) holds everything."""

    n_regions: int
    starts: tuple[int, ...] = ()
    chunks: int = 1

    def __post_init__(self) -> None:
        if (len(self.starts) + 1) % self.chunks:
            raise ValueError(
                f"{len(self.starts) + 1} virtual stages do not make {self.chunks} chunks a stage"
            )

    @property
    def pp(self) -> int:
        return (len(self.starts) + 1) // self.chunks

    def virtual_bounds(self, virtual: int) -> tuple[int, int]:
        """[lo, hi): the regions of virtual stage ``virtual`` (stage ``virtual % pp``)."""
        edges = (0, *self.starts, self.n_regions)
        return edges[virtual], edges[virtual + 1]

    def chunk_bounds(self, stage: int) -> list[tuple[int, int]]:
        """[lo, hi) of each of the chunks of ``stage``, in chain order."""
        if not 0 <= stage < self.pp:
            raise ValueError(f"stage {stage} of a {self.pp}-stage pipeline")
        return [self.virtual_bounds(stage + c * self.pp) for c in range(self.chunks)]

    def bounds(self, stage: int) -> tuple[int, int]:
        """[lo, hi): the regions of ``stage`` (one chunk a stage; else ``chunk_bounds``)."""
        if self.chunks > 1:
            raise ValueError(f"a stage of {self.chunks} chunks holds no single range")
        return self.chunk_bounds(stage)[0]

    def virtual_of(self, region: int) -> int:
        return sum(1 for b in self.starts if b <= region)

    def stage_of(self, region: int) -> int:
        return self.virtual_of(region) % self.pp

    def wraps(self, boundary: int) -> bool:
        """Does x_b cross from the last stage back to the first (the next round of chunks)?"""
        return self.chunks > 1 and self.stage_of(boundary) == 0

    @property
    def boundaries(self) -> frozenset[int]:
        """The regions b whose input x_b crosses from one stage to the next."""
        return frozenset(self.starts)

    def holds(self, stage: int, region: int) -> bool:
        return any(lo <= region < hi for lo, hi in self.chunk_bounds(stage))
