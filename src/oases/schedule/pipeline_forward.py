"""A stage model's forward without gradients: the loss of a batch through every pipeline stage
(evaluation; a stage model has no plain ``forward``: ``parallel/stage_model.py``).

Each stage runs its regions on the whole batch, one after the other, with blocking collectives
(no program, no overlap: evaluation is not timed)::

    stage 0      x_1 = epi:0(all-reduce(embed.partial(tokens)))  ... x_b   -send->
    stage s      <-recv- x_lo   x_{i+1} = epi:i(x_i, all-reduce(row.partial(core(norm(x_i)))))
                 (a reshard where the degree changes)                 ... x_hi  -send->
    last stage   <-recv- ...   loss = loss_fn(head.local(norm(x_head)), targets)

(a stage of several model chunks runs them in chain order, each receiving and sending as one
stage) and the loss goes from the last stage to every stage (a sum over the ``pp`` group), so every
rank returns it. Sequence parallelism does not change the numbers, so evaluation runs without
it, as ``Transformer.forward`` does.

Shape legend: B batch rows (the embedding's layout; rows_i at region i's degree), S sequence,
H hidden.
"""

from __future__ import annotations

import torch
from torch import Tensor

from oases.model import Transformer
from oases.parallel import comm
from oases.precision import accum_dtype
from oases.schedule.executor_p2p import activation_dtype
from oases.schedule.regions import build_chain


@torch.no_grad()
def stage_forward_loss(model: Transformer, tokens: Tensor, targets: Tensor) -> Tensor:
    """The mean loss of this rank's rows (the head's layout), on every stage (docstring)."""
    ctx, plan = model.parallel_ctx, model.parallel_plan
    chain = build_chain(model)
    layout = plan.stage_layout()
    loss: Tensor | None = None
    for lo, hi in layout.chunk_bounds(ctx.pp_rank):  # (model chunks: one after the other)
        got = _chunk_forward(model, chain, lo, hi, tokens, targets)
        loss = got if got is not None else loss
    dtype = accum_dtype(next(model.parameters()).dtype)
    out = (
        loss.to(dtype) if loss is not None else torch.zeros((), dtype=dtype, device=ctx.device)
    ).reshape(1)
    return comm.all_reduce_(out, ctx.pp_group, tag="pp-loss")[0]


def _chunk_forward(
    model: Transformer, chain: list, lo: int, hi: int, tokens: Tensor, targets: Tensor
) -> Tensor | None:
    """Regions [lo, hi) of this stage: x_lo received, x_hi sent on; the loss on the last."""
    ctx, layout = model.parallel_ctx, model.parallel_plan.stage_layout()
    n = len(chain)
    x: Tensor | None = None
    if lo > 0:  # x_lo [rows_lo, S, H] from the previous stage
        rows = tokens.shape[0] * chain[lo].tp // chain[0].tp
        pair = ctx.p2p_groups["fwd", "wrap-prev" if layout.wraps(lo) else "prev"]
        dtype = activation_dtype(model)
        x = comm.recv_async(
            (rows, tokens.shape[1], model.cfg.dim),
            dtype,
            pair,
            pair.ranks[0],
            tag=comm.p2p_tag(lo, 0, "forward"),
            label="eval",
        ).wait()
    loss: Tensor | None = None
    for i in range(lo, hi):
        region = chain[i]
        if i > lo and region.tp != chain[i - 1].tp:  # [B_{i-1}, S, H] -> [B_i, S, H]
            group = ctx.merge_group(chain[i - 1].tp, region.tp)
            x = comm.reshard_batch_async(x, chain[i - 1].tp, region.tp, group).wait()
        if region.kind == "embed":
            p = model.embed.partial(tokens)  # [B, S, H] partial sums
            x = region.epilogue(None, comm.all_reduce_(p, region.tp_group, tag="eval"))
        elif region.kind == "head":
            y = model.target_reshard(targets)
            loss = model.loss_fn(model.head.local(region.norm(x)), y)
        else:
            p = region.row.partial(region.core(region.norm(x)))  # [rows_i, S, H] partial sums
            x = region.epilogue(x, comm.all_reduce_(p, region.tp_group, tag="eval"))
    if hi < n:
        pair = ctx.p2p_groups["fwd", "wrap-next" if layout.wraps(hi) else "next"]
        comm.send_async(
            x.to(activation_dtype(model)),
            pair,
            pair.ranks[1],
            tag=comm.p2p_tag(hi, 0, "forward"),
            label="eval",
        ).wait()
    return loss
