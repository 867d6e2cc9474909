"""Megatron's conjugate autograd pairs between the replicated glue and a TP region, named by
what they do in the *forward* pass:

=================  ============================  ==============================
function           forward                       backward (its conjugate)
=================  ============================  ==============================
copy_to_tp   (f)   identity                      all-reduce of the input grad
reduce_from_tp (g) all-reduce of partial sums    identity
gather_from_tp     all-gather along ``dim``      keep the local chunk
scatter_to_tp      keep the local chunk          all-gather along ``dim``
=================  ============================  ==============================

A group of size 1 makes all of them the identity and issues nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from oases.parallel.comm.core import _local_chunk, all_reduce_
from oases.parallel.comm.record import _issue
from oases.parallel.context import Group


def _all_gather(x: Tensor, group: Group, dim: int, direction: str) -> Tensor:
    """Every rank's ``x`` concatenated along ``dim``, in rank order: gathered into one tensor
    (``all_gather_single``, NCCL's all-gather into a flat buffer, on gloo too), so that along
    dim 0 the result is the buffer itself; along another dim one copy moves the chunks."""
    x = x.contiguous()
    _issue("all_gather", group, x, direction, "", False)
    dim = dim % x.dim()
    out = x.new_empty((group.size * x.shape[0], *x.shape[1:]))  # [g * b, ...]
    dist.all_gather_single(out, x, group=group.pg)
    if dim == 0:
        return out
    return torch.cat(out.chunk(group.size), dim=dim)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:  # noqa: ANN001
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # noqa: ANN001
        return all_reduce_(grad.contiguous().clone(), ctx.group, direction="backward"), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:  # noqa: ANN001
        return all_reduce_(x.contiguous().clone(), group, direction="forward")

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # noqa: ANN001
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group, dim: int) -> Tensor:  # noqa: ANN001
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim, "forward")

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # noqa: ANN001
        return _local_chunk(grad, ctx.group, ctx.dim), None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group, dim: int) -> Tensor:  # noqa: ANN001
        ctx.group, ctx.dim = group, dim
        return _local_chunk(x, group, dim)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # noqa: ANN001
        return _all_gather(grad, ctx.group, ctx.dim, "backward"), None, None


def copy_to_tp(x: Tensor, group: Group) -> Tensor:
    """f: identity forward; backward all-reduces the input gradient over the TP group."""
    return x if group.size == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: Tensor, group: Group) -> Tensor:
    """g: forward all-reduces the partial sums over the TP group; backward is the identity."""
    return x if group.size == 1 else _ReduceFromTP.apply(x, group)


def gather_from_tp(x: Tensor, group: Group, dim: int = -1) -> Tensor:
    """Forward all-gathers the TP shards along ``dim``; backward keeps this rank's chunk."""
    return x if group.size == 1 else _GatherFromTP.apply(x, group, dim)


def scatter_to_tp(x: Tensor, group: Group, dim: int = -1) -> Tensor:
    """Forward keeps this rank's chunk along ``dim``; backward all-gathers the gradient."""
    return x if group.size == 1 else _ScatterToTP.apply(x, group, dim)
