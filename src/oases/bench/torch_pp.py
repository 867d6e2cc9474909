"""Benchmark peer "torch-pp": the single-device model cut into pipeline stages by PyTorch's own
``torch.distributed.pipelining`` (``PipelineStage`` and its ``ScheduleGPipe`` /
``Schedule1F1B``), trained with plain autograd inside each stage.

This is what a user would pick instead of ``parallel.pp``: the same blocks on the same stages
(``oases.stages.default_stage_starts``), the same micro-batches, the loss on the last stage::

    stage 0       tokens -> embed (+ positions) -> blocks [0, b1)              -> send x
    stage s       recv x -> blocks [b_s, b_{s+1})                                -> send x
    stage P-1     recv x -> blocks [b_{P-1}, L) -> norm -> head -> cross-entropy

Only a pipeline over the whole world (tp = dp = 1) is built: the peer of ``NAME@pp=P`` at
``pp`` = the world size. Its gradients are scaled by 1/M (``scale_grads``), ours by the
micro-batch count as well: the same step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from oases.model import Transformer
from oases.parallel.context import ParallelContext
from oases.stages import default_stage_starts

ORDERS = ("gpipe", "1f1b")


class _StagePart(nn.Module):
    """The modules of one stage of ``model`` (module docstring), sharing its parameters."""

    def __init__(self, model: Transformer, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.embed = model.embed if first else None
        self.pos_embed = model.pos_embed if first else None
        self.drop = model.drop
        self.blocks = nn.ModuleList(model.blocks[lo:hi])
        self.norm = model.norm if last else None
        self.head = model.head if last else None

    def forward(self, x: Tensor) -> Tensor:
        if self.first:
            h = self.embed(x)
            if self.pos_embed is not None:
                h = h + self.pos_embed.weight[: x.shape[1]]
            x = self.drop(h)
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = self.head(self.norm(x))
        return x


def _loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def torch_pp_step(
    model: Transformer,
    ctx: ParallelContext,
    order: str,
    n_micro: int,
    tokens: Tensor,
    targets: Tensor,
) -> Callable[[], None]:
    """One training step's closure (forward, backward, no optimizer) of ``model`` cut into
    ``ctx.world_size`` stages under torch's ``order`` schedule with ``n_micro`` micro-batches
    of the global batch ``tokens``/``targets``."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    pp, s = ctx.world_size, ctx.rank
    if ctx.tp != 1 or order not in ORDERS:
        raise ValueError(
            f"torch-pp runs a pipeline over the whole world (tp=1) under "
            f"{'/'.join(ORDERS)}; got tp={ctx.tp}, order {order!r}"
        )
    n_layers = model.cfg.n_layers
    bounds = [0, *[(b - 1) // 2 for b in default_stage_starts(n_layers, pp)], n_layers]
    part = _StagePart(model, bounds[s], bounds[s + 1], s == 0, s == pp - 1)
    stage = PipelineStage(part, s, pp, ctx.device)
    schedule = (Schedule1F1B if order == "1f1b" else ScheduleGPipe)(stage, n_micro, loss_fn=_loss)

    def step() -> None:
        part.zero_grad(set_to_none=True)
        if s == 0:
            schedule.step(tokens)
        elif s == pp - 1:
            schedule.step(target=targets, losses=[])
        else:
            schedule.step()

    return step
