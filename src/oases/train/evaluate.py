"""Validation loss: the mean over the first validation batches, averaged over the head's DP
group (every rank holds the same number afterwards). A pipeline stage's model runs the batch
through every stage (``schedule.pipeline_forward``)."""

from __future__ import annotations

import torch
from torch import nn

from oases.data.dataset import ShardBatches
from oases.parallel import comm
from oases.parallel.context import Group, ParallelContext
from oases.precision import accum_dtype, upcast


def loss_group(model: nn.Module, ctx: ParallelContext) -> Group:
    """The head's DP group: one rank of every head TP group, so the mean of the ranks' losses
    over it is the global loss (the DP group of a uniform plan)."""
    return ctx.groups_for(model.parallel_plan.tp_of("head"))[1]


@torch.no_grad()
def evaluate(model: nn.Module, batches: ShardBatches, ctx: ParallelContext, n: int) -> float:
    """Mean loss over the first ``n`` validation batches (fewer if the split is small)."""
    was_training = model.training
    model.eval()
    n = max(1, min(n, batches.n_windows // batches.global_batch))
    total = torch.zeros((), dtype=accum_dtype(next(model.parameters()).dtype), device=ctx.device)
    forward = model
    if model.parallel_plan is not None and model.parallel_plan.pp > 1:
        from oases.schedule.pipeline_forward import stage_forward_loss

        def forward(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return stage_forward_loss(model, tokens, targets)

    for i in range(n):
        tokens, targets = batches.batch(i)
        total += upcast(forward(tokens.to(ctx.device), targets.to(ctx.device)))
    model.train(was_training)
    return float(comm.all_reduce_mean(total / n, loss_group(model, ctx)))
