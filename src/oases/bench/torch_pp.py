"""Benchmark peer "torch-pp": the single-device model cut into pipeline stages by PyTorch's own
``torch.distributed.pipelining`` (``PipelineStage`` and its schedules), trained with plain
autograd inside each stage.

This is what a user would pick instead of ``parallel.pp``: the same blocks on the same stages
(``oases.stages.default_stage_starts``), the same micro-batches, the loss on the last stage::

    stage 0       tokens -> embed (+ positions) -> blocks [0, b1)              -> send x
    stage s       recv x -> blocks [b_s, b_{s+1})                                -> send x
    stage S-1     recv x -> blocks [b_{S-1}, L) -> norm -> head -> cross-entropy

Orders (``ORDERS``) and torch's schedule for each, with the stages a rank holds (P ranks,
v model chunks a rank under the interleaved orders, Megatron-LM's loop: rank r holds stages
r, r + P, ..., as ``parallel.pp_chunks`` lays ours out)::

    gpipe         ScheduleGPipe                    one stage a rank
    1f1b          Schedule1F1B                     one stage a rank
    interleaved   ScheduleInterleaved1F1B          v stages a rank
    zb            ScheduleInterleavedZeroBubble    v stages a rank (ZB1P: input gradients
                                                   first, weight gradients fill the bubbles)

Only a pipeline over the whole world (tp = dp = 1) is built: the peer of ``NAME@pp=P`` at
``pp`` = the world size. Its gradients are scaled by 1/M (``scale_grads``), ours by the
micro-batch count as well: the same step, the gradients of the single-device model's loss
(``tests/test_torch_pp.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from oases.model import Transformer
from oases.parallel.context import ParallelContext
from oases.precision import upcast
from oases.stages import default_stage_starts

ORDERS = ("gpipe", "1f1b", "interleaved", "zb")
MULTI = ("interleaved", "zb")  # several stages a rank
SCHEDULE_OF = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zb": "ScheduleInterleavedZeroBubble",
}


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
    """The single-device model's loss (``model.CrossEntropy``: low precision upcast)."""
    return F.cross_entropy(upcast(logits.flatten(0, 1)), targets.flatten())


def torch_pp_step(
    model: Transformer,
    ctx: ParallelContext,
    order: str,
    n_micro: int,
    tokens: Tensor,
    targets: Tensor,
    chunks: int = 1,
) -> Callable[[], None]:
    """One training step's closure (forward, backward, no optimizer) of ``model`` cut into
    ``ctx.world_size * chunks`` stages under torch's ``order`` schedule with ``n_micro``
    micro-batches of the global batch ``tokens``/``targets``."""
    from torch.distributed import pipelining as tpp

    pp, r = ctx.world_size, ctx.rank
    v = chunks if order in MULTI else 1
    if ctx.tp != 1 or order not in ORDERS or (order in MULTI) != (chunks >= 2):
        raise ValueError(
            f"torch-pp runs a pipeline over the whole world (tp=1) under "
            f"{'/'.join(ORDERS)}, with v >= 2 chunks exactly under {'/'.join(MULTI)}; got "
            f"tp={ctx.tp}, order {order!r}, v={chunks}"
        )
    n_stages, n_layers = pp * v, model.cfg.n_layers
    if n_layers < n_stages:
        raise ValueError(f"torch-pp: {n_layers} blocks do not fill {n_stages} stages")
    bounds = [0, *[(b - 1) // 2 for b in default_stage_starts(n_layers, n_stages)], n_layers]
    mine = [r + k * pp for k in range(v)]  # the stages this rank holds
    parts = [_StagePart(model, bounds[s], bounds[s + 1], s == 0, s == n_stages - 1) for s in mine]
    stages = [tpp.PipelineStage(p, s, n_stages, ctx.device) for p, s in zip(parts, mine)]
    kind = getattr(tpp, SCHEDULE_OF[order])
    schedule = kind(stages if order in MULTI else stages[0], n_micro, loss_fn=_loss)
    first, last = 0 in mine, n_stages - 1 in mine

    def step() -> None:
        for part in parts:
            part.zero_grad(set_to_none=True)
        inputs = (tokens,) if first else ()
        if last:
            schedule.step(*inputs, target=targets, losses=[])
        else:
            schedule.step(*inputs)

    return step
