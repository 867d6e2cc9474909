"""Activations between regions of different TP degrees, along the batch (dim 0), over the
merge group of the two degrees (``ParallelContext.merge_group``): an all-gather when the degree
grows, a local slice when it shrinks. ``reshard_batch`` is the autograd pair (the model's
forward and backward), ``reshard_batch_async`` a schedule's reshard instruction (no autograd).
Sequence-parallel activations move with ``seq.reshard_seq_async`` instead.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from oases.parallel.comm.autograd import gather_from_tp, scatter_to_tp
from oases.parallel.comm.core import Handle, _Keep, _local_chunk
from oases.parallel.comm.record import _issue
from oases.parallel.context import Group


def reshard_batch(x: Tensor, from_tp: int, to_tp: int, group: Group) -> Tensor:
    """Move activations [b, ...] between TP degrees along the batch (dim 0), over the merge
    group of the two degrees (``ParallelContext.merge_group``).

    Growing the degree (a < b): the merging groups' batches are all-gathered, in rank order;
    backward keeps this rank's chunk (the gradient is replicated over the larger TP group).
    Shrinking it: this rank keeps its chunk; backward all-gathers the gradient.
    """
    if from_tp == to_tp:
        return x
    if to_tp > from_tp:
        return gather_from_tp(x, group, dim=0)
    return scatter_to_tp(x, group, dim=0)


def reshard_batch_async(
    x: Tensor, from_tp: int, to_tp: int, group: Group, *, direction: str = "forward", tag: str = ""
) -> Handle:
    """Start moving ``x`` [b, ...] from degree ``from_tp``'s batch layout to ``to_tp``'s, over
    their merge group (no autograd); ``.wait()`` returns [b * to_tp / from_tp, ...].

    Growing the degree: an async all-gather along the batch, in rank order. Shrinking it: this
    rank's chunk, at once (the handle is complete). The two directions of one reshard point
    are each other's conjugates, so the backward reshard of a gradient is this same call with
    the degrees swapped (``direction="backward"`` only labels the record), exactly as
    ``reshard_batch``'s autograd pair does it.
    """
    if from_tp == to_tp:
        return Handle(x, None)
    if to_tp < from_tp:
        return Handle(_local_chunk(x, group, 0), None)
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * group.size, *x.shape[1:]))  # [g * b, ...]
    _issue("all_gather", group, x, direction, tag, True)
    # into one tensor (no list of views: NCCL gathers straight into ``out``; gloo supports it
    # too, torch 2.13); the input is kept to the wait (the caller may hold it no longer)
    work = dist.all_gather_single(out, x, group=group.pg, async_op=True)
    return _Keep(out, work, x)
