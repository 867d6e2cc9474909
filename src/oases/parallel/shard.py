"""Sharded data parallelism (ZeRO 1-3): one flat buffer per region, sharded over its DP group.

``shard_model(model, stages)`` gives every region i with ``stages[i] >= 1`` a ``ZeroUnit``: the
parameters the region owns (its norm, TP and glue weights; a tied weight belongs to the
embedding) become views of one flat buffer, padded to a multiple of the region's DP degree d,
and DP rank r owns the slice ``[r * n / d, (r + 1) * n / d)`` of it::

    flat  [ norm.w | qkv.w | qkv.b | proj.w | proj.b | pad ]     n = padded numel
           \\_____ rank 0 ____/\\_____ rank 1 _____/              (d = 2: a parameter may span
                                                                 two shards)

What each stage keeps on a rank between steps (16 bytes per parameter in fp32 AdamW):

    stage 1   full weights; Adam moments of its shard only; the gradient is full during the
              step's last micro-batch, then reduce-scattered (``start_grad_reduce``): the rank
              keeps its shard of the mean (``grad_shard``); the sharded optimizer step updates
              the shard in place (``mark_updated``: the rest of the flat buffer is now stale),
              and the next step's program all-gathers the updated shards back into it
              (``start_gather``) under its first forward computes, as Megatron-LM's distributed
              optimizer does with ``--overlap-param-gather``.
    stage 2   as 1, but every micro-batch's gradient is reduce-scattered as soon as its last
              backward is done and accumulated into ``grad_shard``: no full gradient outlives
              its micro-batch.
    stage 3   as 2, and the weights too: only the shard is kept (its own storage); the flat
              buffer's storage is allocated and all-gathered before a pass's first use
              (``start_gather``, prefetched by the program one compute ahead) and freed after
              its last (``release``). Views stay valid: freeing resizes the storage to 0.

The schedule programs place these collectives (``program.ZeroLayout``); the executor runs them
through this module, and ``parallel/comm/`` issues them. ``materialized`` gathers everything
for code that needs whole weights (evaluation, sampling, checkpoints): between steps, read a
sharded model's weights only inside it (stage 3 holds none; stages 1-2 hold stale values of the
other ranks' shards until the next step's gathers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from oases.parallel import comm
from oases.parallel.context import Group

STAGES = (0, 1, 2, 3)


@dataclass
class Segment:
    """The part of parameter ``param`` that lies in this rank's shard: elements
    ``[start, stop)`` of ``param.view(-1)``, at ``offset`` in the shard."""

    param: nn.Parameter
    start: int
    stop: int
    offset: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass
class ZeroUnit:
    """One region's parameters as a flat buffer sharded over its DP group."""

    index: int  # the region
    stage: int
    params: list[nn.Parameter]
    offsets: list[int]  # where each parameter starts in the flat buffer
    group: Group  # the region's DP group
    numel: int  # real elements (without padding)
    flat: Tensor  # [padded] the whole buffer; its storage is empty between uses at stage 3
    shard: Tensor  # [padded / d] this rank's slice (stage 3: its own storage)
    grad_shard: Tensor | None = None  # this rank's slice of the DP mean of the gradient
    gathered: bool = True  # ``flat`` holds every rank's current shard (stage 3: is allocated)
    segments: list[Segment] = field(default_factory=list)

    @property
    def shard_numel(self) -> int:
        return self.shard.numel()

    @property
    def lo(self) -> int:
        return self.group.rank * self.shard_numel

    def nbytes_full(self) -> int:
        return self.flat.numel() * self.flat.element_size()


class ZeroShards:
    """The ZeRO units of a parallelized model (``model.zero_shards``), and their collectives."""

    def __init__(
        self,
        units: dict[int, ZeroUnit],
        stages: tuple[int, ...],
        reshard_after_forward: bool = True,
    ) -> None:
        self.units = units
        self.stages = stages
        self.reshard_after_forward = reshard_after_forward
        self._sharded_ids = {id(p) for u in units.values() for p in u.params}

    def is_sharded(self, p: nn.Parameter) -> bool:
        return id(p) in self._sharded_ids

    # ------------------------------------------------------------------------- gradients
    def start_grad_reduce(
        self, index: int, tag: str, dtype: torch.dtype | None = None
    ) -> comm.Handle:
        """Flatten unit ``index``'s gradients (a missing one is zeros), free them, and start
        the reduce-scatter of the sum over the DP group (in ``dtype``, e.g. bf16 for half the
        bytes; None: the gradients' own); ``finish_grad_reduce`` takes the result."""
        u = self.units[index]
        parts = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in u.params
        ]
        pad = u.flat.numel() - u.numel
        if pad:
            parts.append(parts[0].new_zeros(pad))
        flat = torch.cat(parts)
        if dtype is not None and dtype != flat.dtype:
            flat = flat.to(dtype)
        for p in u.params:
            p.grad = None
        return comm.reduce_scatter_async(flat, u.group, direction="backward", tag=tag)

    def finish_grad_reduce(self, index: int, summed: Tensor, divisor: float) -> None:
        """Add this rank's shard of the reduced gradient, divided by ``divisor`` (the number of
        distinct loss terms), into ``grad_shard`` (in the weights' dtype, whatever the dtype
        the reduction moved)."""
        u = self.units[index]
        if summed.dtype != u.flat.dtype:
            summed = summed.to(u.flat.dtype)
        summed.div_(divisor)  # a buffer of its own (the collective's output or the flat copy)
        if u.grad_shard is None:
            u.grad_shard = summed
        else:
            u.grad_shard.add_(summed)

    def zero_grad(self) -> None:
        for u in self.units.values():
            u.grad_shard = None

    # --------------------------------------------------------------------------- weights
    def start_gather(self, index: int, tag: str) -> comm.Handle:
        """Start all-gathering unit ``index``'s shards into its flat buffer: at stage 3 into
        newly allocated storage, at stages 1-2 the shards ``mark_updated`` made current (the
        input a copy: the shard is a view of the buffer). Nothing to do if it is gathered."""
        u = self.units[index]
        if u.gathered:
            return comm.Handle(u.flat, None)
        shard = u.shard
        if u.stage == 3:
            u.flat.untyped_storage().resize_(u.nbytes_full())
        else:
            shard = u.shard.clone()
        u.gathered = True
        return comm.all_gather_into_async(u.flat, shard, u.group, direction="forward", tag=tag)

    def release(self, index: int) -> None:
        """Stage 3: free unit ``index``'s gathered weights (the views stay, empty)."""
        u = self.units[index]
        if u.stage == 3 and u.gathered:
            u.flat.untyped_storage().resize_(0)
            u.gathered = False

    def mark_updated(self) -> None:
        """Stages 1-2, after the optimizer updated the shards in place: the other ranks' parts
        of each flat buffer are stale until ``start_gather`` (the next step's program, or
        ``materialized``) gathers them."""
        for u in self.units.values():
            if u.stage < 3 and u.group.size > 1:
                u.gathered = False

    @contextlib.contextmanager
    def materialized(self, write_back: bool = False) -> Iterator[None]:
        """Every unit's full weights inside the block (stage 3 gathers, then frees them);
        ``write_back``: the block changed the weights (a checkpoint load), so each rank copies
        its slice back into its shard."""
        for h in [self.start_gather(i, f"ag-all:{i}") for i in self.units]:
            h.wait()
        try:
            yield
        finally:
            for u in self.units.values():
                if write_back and u.stage == 3:
                    u.shard.copy_(u.flat[u.lo : u.lo + u.shard_numel])
                self.release(u.index)


def _owned_params(chain: list) -> dict[int, list[nn.Parameter]]:
    """Region index -> the parameters it owns (the lowest region using one owns it: a tied
    weight belongs to the embedding), in chain order, requiring grad, each once."""
    owner: dict[int, int] = {}
    params: dict[int, nn.Parameter] = {}
    for region in reversed(chain):
        for p in (*region.norm_params, *region.tp_params, *region.epi_params):
            if p.requires_grad:
                owner[id(p)] = region.index
                params[id(p)] = p
    out: dict[int, list[nn.Parameter]] = {r.index: [] for r in chain}
    seen: set[int] = set()
    for region in chain:
        for p in (*region.norm_params, *region.tp_params, *region.epi_params):
            if id(p) in owner and owner[id(p)] == region.index and id(p) not in seen:
                seen.add(id(p))
                out[region.index].append(p)
    return out


def _segments(params: list[nn.Parameter], offsets: list[int], lo: int, hi: int) -> list[Segment]:
    out = []
    for p, off in zip(params, offsets):
        start, stop = max(lo, off), min(hi, off + p.numel())
        if start < stop:
            out.append(Segment(p, start - off, stop - off, start - lo))
    return out


def _build_unit(index: int, stage: int, params: list[nn.Parameter], group: Group) -> ZeroUnit:
    offsets, numel = [], 0
    for p in params:
        offsets.append(numel)
        numel += p.numel()
    d = group.size
    padded = -(-numel // d) * d
    ref = params[0]
    flat = torch.zeros(padded, dtype=ref.dtype, device=ref.device)
    with torch.no_grad():
        for p, off in zip(params, offsets):
            flat[off : off + p.numel()].copy_(p.detach().reshape(-1))
            p.data = flat[off : off + p.numel()].view_as(p)
    lo, hi = group.rank * (padded // d), (group.rank + 1) * (padded // d)
    shard = flat[lo:hi]
    unit = ZeroUnit(
        index,
        stage,
        params,
        offsets,
        group,
        numel,
        flat,
        shard,
        segments=_segments(params, offsets, lo, hi),
    )
    if stage == 3:
        unit.shard = shard.clone()
        flat.untyped_storage().resize_(0)
        unit.gathered = False
    return unit


def shard_model(
    model: nn.Module, stages: int | tuple[int, ...], reshard_after_forward: bool = True
) -> ZeroShards | None:
    """Shard the parameters of a parallelized ``model`` over data parallelism: ``stages`` is
    one ZeRO stage for every region or one per region (0: not sharded). Sets and returns
    ``model.zero_shards`` (None when every stage is 0). Call after the model is on its device
    and in its dtype, before building the optimizer. ``reshard_after_forward`` (stage 3):
    free a region's gathered weights between its forward and its backward (less memory, one
    more all-gather per region and micro-batch)."""
    from oases.schedule.regions import build_chain

    chain = build_chain(model)
    if isinstance(stages, int):
        stages = (stages,) * len(chain)
    stages = tuple(int(s) for s in stages)
    if len(stages) != len(chain) or any(s not in STAGES for s in stages):
        raise ValueError(
            f"zero stages {stages} must give one of {STAGES} for each of the {len(chain)} regions"
        )
    owned = _owned_params(chain)
    units = {
        r.index: _build_unit(r.index, stages[r.index], owned[r.index], r.dp_group)
        for r in chain
        if stages[r.index] and owned[r.index]
    }
    model.zero_shards = ZeroShards(units, stages, reshard_after_forward) if units else None
    return model.zero_shards


def zero_shards(model: nn.Module) -> ZeroShards | None:
    """The model's ``ZeroShards``, or None (no region sharded)."""
    return getattr(model, "zero_shards", None)


@contextlib.contextmanager
def materialized(model: nn.Module, write_back: bool = False) -> Iterator[None]:
    """The model's whole weights inside the block, whatever its ZeRO stages (a no-op without
    stage 3)."""
    shards = zero_shards(model)
    if shards is None:
        yield
        return
    with shards.materialized(write_back):
        yield
