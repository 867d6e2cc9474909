"""Data-parallel gradient reduction: a flat all-reduce of several gradients at once, and
``GradientMean``, its handle, which divides and copies the result back into every ``.grad``.

    h = gradient_mean_async(params, dp_group)      # one flat buffer [sum of numels]
    ...                                            # backward of the next region runs
    h.wait()                                       # every p.grad is the mean over dp_group
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from oases.parallel.comm.core import Handle
from oases.parallel.comm.record import _issue
from oases.parallel.context import Group


class GradientMean(Handle):
    """In-flight average of several parameters' gradients over a (data-parallel) group, as one
    flat all-reduce; ``wait()`` divides by ``divisor`` and copies back into every ``.grad``."""

    def __init__(
        self, grads: list[Tensor], flat: Tensor, work: dist.Work | None, divisor: float
    ) -> None:
        super().__init__(flat, work)
        self.grads, self.divisor = grads, divisor

    def wait(self) -> Tensor:
        flat = super().wait()
        if self.grads:
            if self.divisor != 1.0:
                flat.div_(self.divisor)
            offset = 0
            for g in self.grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            self.grads = []
        return flat


def gradient_mean_async(
    params: Iterable[torch.nn.Parameter],
    group: Group,
    *,
    divisor: float | None = None,
    tag: str = "dp-grads",
    dtype: torch.dtype | None = None,
) -> GradientMean:
    """Start averaging the gradients of ``params`` (those that require grad) over ``group``.
    A parameter without a gradient contributes zeros, so every rank sends the same layout.
    ``dtype``: reduce in this dtype (e.g. bf16: half the bytes; the mean is copied back into
    the gradients' own dtype); None: in the gradients' dtype."""
    params = [p for p in params if p.requires_grad]
    divisor = float(group.size if divisor is None else divisor)
    if group.size == 1 or not params:  # nothing to exchange; still scale (mixed-degree plans)
        if divisor != 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.div_(divisor)
        return GradientMean([], torch.empty(0), None, 1.0)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return flat_all_reduce_async(
        [p.grad for p in params], group, divisor=divisor, tag=tag, dtype=dtype
    )


def flat_all_reduce_async(
    tensors: list[Tensor],
    group: Group,
    *,
    divisor: float = 1.0,
    tag: str = "",
    dtype: torch.dtype | None = None,
) -> GradientMean:
    """Start one flat sum all-reduce of several tensors over ``group`` (in ``dtype``; None:
    theirs); ``wait()`` divides by ``divisor`` and copies the result back into each tensor
    (a gradient, or a view of a ZeRO gradient shard)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    if dtype is not None and dtype != flat.dtype:
        flat = flat.to(dtype)
    _issue("all_reduce", group, flat, "backward", tag, True)
    work = dist.all_reduce(flat, group=group.pg, async_op=True)
    return GradientMean(tensors, flat, work, divisor)
