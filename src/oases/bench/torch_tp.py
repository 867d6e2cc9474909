"""Benchmark peer "torch-tp": the single-device model under PyTorch's own tensor parallelism.

This is what a user would pick instead of Oases: ``torch.distributed.tensor.parallel
.parallelize_module`` (DTensor) on the unchanged ``oases.model.Transformer``, trained with plain
autograd (one forward, one ``backward()``) and a flat data-parallel gradient all-reduce.

Sharding (a 1-D ``DeviceMesh`` over this rank's TP group, ``mesh["tp"]`` of a row-major
``(dp, tp)`` world mesh, which matches ``oases.parallel.context``'s contiguous TP groups)::

    blocks.i.attn.qkv   ColwiseParallel   rows, after permuting [Q | K | V] to [Q_r | K_r | V_r]_r
    blocks.i.attn.proj  RowwiseParallel   columns (heads); output all-reduced, Replicate
    blocks.i.mlp.fc1    ColwiseParallel   rows ([gate | up] permuted to [gate_r | up_r]_r, llama)
    blocks.i.mlp.fc2    RowwiseParallel   columns (ffn); output all-reduced, Replicate
    embed               RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    head                ColwiseParallel(output_layouts=Replicate()): full logits on every rank,
                        then the model's plain cross-entropy (torchtitan style, no loss parallel)
    norms, pos_embed    plain replicated tensors

All plans use ``use_local_output=True``, so everything between the sharded linears (attention,
activations, norms, residuals) sees plain local tensors; ``attn.n_heads`` / ``attn.n_kv_heads``
become the local head counts, as ``oases.parallel.apply.parallelize`` sets them.

``ColwiseParallel`` shards a weight's rows contiguously (``Shard(0)``), but the fused layouts are
``[Q | K | V]`` and ``[gate | up]``: a contiguous chunk would hand rank 0 all of Q and none of V.
So the full fused weights (and biases) are first permuted so that contiguous chunk ``r`` is rank
``r``'s ``[Q_r | K_r | V_r]`` (``[gate_r | up_r]``); ``fused_row_permutation`` gives that index,
``expected_local_shard`` the matching shard of a full single-device tensor (for tests).

Fallbacks, documented: if ``tie_embeddings`` is set, or the vocabulary does not divide by ``tp``,
``embed`` and ``head`` stay replicated plain modules (every rank computes the full embedding and
the full logits; a shared tied weight cannot be both ``Shard(0)`` of an embedding and of a
colwise head without extra plumbing, and DTensor's uneven vocabulary shards are not what a user
would benchmark). With ``tp == 1`` nothing is sharded and the model stays plain (pure DP).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from oases.model import Transformer
from oases.parallel import comm
from oases.parallel.apply import check_model_degrees
from oases.parallel.context import ParallelContext, build_tp_mesh
from oases.precision import accum_dtype

__all__ = [
    "TorchTPSchedule",
    "all_reduce_local_gradients",
    "split_dtensor_groups",
    "torch_tp_clip_grad_norm_",
    "build_tp_mesh",
    "expected_local_shard",
    "fused_parts",
    "fused_row_permutation",
    "parallelize_torch_tp",
    "sharded_embeddings",
    "torch_tp_grad_shard",
    "torch_tp_local",
]


# --------------------------------------------------------------------------------------------
# fused layouts


def fused_parts(model: Transformer, name: str) -> tuple[int, ...] | None:
    """Row sizes of the fused parts of parameter ``name`` (full model), or None if not fused.

    ``attn.qkv`` -> (A*D, K*D, K*D); llama ``mlp.fc1`` -> (F, F); anything else -> None.
    """
    cfg = model.cfg
    if ".attn.qkv." in f".{name}":
        q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        return (q, kv, kv)
    if ".mlp.fc1." in f".{name}" and cfg.arch == "llama":
        return (cfg.ffn_dim, cfg.ffn_dim)
    return None


def fused_row_permutation(parts: tuple[int, ...], tp: int) -> Tensor:
    """Index ``perm`` such that ``full[perm].chunk(tp)[r]`` is ``cat(part.chunk(tp)[r])``.

    For ``parts = (A*D, K*D, K*D)`` that is ``[Q_r | K_r | V_r]`` for rank r.
    """
    offsets = [0]
    for n in parts:
        if n % tp:
            raise ValueError(f"fused part of {n} rows does not split over tp={tp}")
        offsets.append(offsets[-1] + n)
    index = []
    for r in range(tp):
        for start, n in zip(offsets, parts):
            k = n // tp
            index.append(torch.arange(start + r * k, start + (r + 1) * k))
    return torch.cat(index)


def sharded_embeddings(model: Transformer, tp: int) -> bool:
    """Whether ``parallelize_torch_tp`` shards ``embed``/``head`` (else they stay replicated)."""
    return tp > 1 and not model.cfg.tie_embeddings and model.cfg.vocab_size % tp == 0


def expected_local_shard(
    full: Tensor, name: str, model: Transformer, tp: int, tp_rank: int
) -> Tensor:
    """The part of a full single-device tensor (parameter or grad ``name``) that rank
    ``tp_rank`` holds locally after ``parallelize_torch_tp`` (``model`` is the reference)."""
    if tp == 1:
        return full
    colwise = name.endswith(("attn.qkv.weight", "attn.qkv.bias", "mlp.fc1.weight", "mlp.fc1.bias"))
    rowwise = name.endswith(("attn.proj.weight", "mlp.fc2.weight"))
    if sharded_embeddings(model, tp):
        colwise = colwise or name == "head.weight"
        rowwise_embed = name == "embed.weight"
    else:
        rowwise_embed = False
    if colwise:
        parts = fused_parts(model, name)
        if parts is not None:
            full = full[fused_row_permutation(parts, tp).to(full.device)]
        return full.chunk(tp, dim=0)[tp_rank]
    if rowwise:
        return full.chunk(tp, dim=1)[tp_rank]
    if rowwise_embed:  # RowwiseParallel on an embedding shards the vocabulary rows
        return full.chunk(tp, dim=0)[tp_rank]
    return full  # replicated (norms, pos_embed, row-parallel biases, unsharded embed/head)


# --------------------------------------------------------------------------------------------
# parallelize


@torch.no_grad()
def _permute_rows_(linear: nn.Linear, parts: tuple[int, ...], tp: int) -> None:
    perm = fused_row_permutation(parts, tp).to(linear.weight.device)
    linear.weight.copy_(linear.weight[perm])
    if linear.bias is not None:
        linear.bias.copy_(linear.bias[perm])


def parallelize_torch_tp(
    model: Transformer, ctx: ParallelContext, mesh: DeviceMesh | None = None
) -> Transformer:
    """Shard ``model`` over ``ctx.tp_group`` with ``parallelize_module``, in place; return it.

    The model must be the full single-device model, identical on every rank (same seed). Sets
    ``model.parallel_ctx = ctx``. Collective over the world (builds the device mesh): call on
    every rank. Sharded parameters become ``DTensor``s on the TP mesh (``.to_local()`` is this
    rank's shard); replicated parameters stay plain tensors. See the module docstring for the
    plan and the replicated-embedding fallbacks (tied embeddings, vocabulary not divisible by tp).
    ``mesh``: a TP mesh from ``build_tp_mesh(ctx)`` to reuse (each build creates process groups);
    built here when None.
    """
    if getattr(model, "parallel_ctx", None) is not None:
        raise ValueError("model is already parallelized")
    tp = ctx.tp
    check_model_degrees(model, tp)
    model.to(ctx.device)
    if tp == 1:  # nothing to shard: plain model, DP only
        model.parallel_ctx = ctx
        return model
    cfg = model.cfg
    if mesh is None:
        mesh = build_tp_mesh(ctx)
    if mesh.ndim != 1 or tuple(mesh.mesh.tolist()) != tuple(ctx.tp_group.ranks):
        raise ValueError(f"mesh must be the 1-D TP mesh over {ctx.tp_group.ranks}, got {mesh}")
    for block in model.blocks:
        _permute_rows_(block.attn.qkv, fused_parts(model, "blocks.0.attn.qkv.weight"), tp)
        if block.mlp.gated:
            _permute_rows_(block.mlp.fc1, fused_parts(model, "blocks.0.mlp.fc1.weight"), tp)
        parallelize_module(
            block,
            mesh,
            {
                "attn.qkv": ColwiseParallel(use_local_output=True),
                "attn.proj": RowwiseParallel(use_local_output=True),
                "mlp.fc1": ColwiseParallel(use_local_output=True),
                "mlp.fc2": RowwiseParallel(use_local_output=True),
            },
        )
        block.attn.n_heads = cfg.n_heads // tp
        block.attn.n_kv_heads = cfg.n_kv_heads // tp
    if sharded_embeddings(model, tp):
        parallelize_module(
            model,
            mesh,
            {
                "embed": RowwiseParallel(
                    input_layouts=Replicate(), output_layouts=Replicate(), use_local_output=True
                ),
                "head": ColwiseParallel(output_layouts=Replicate(), use_local_output=True),
            },
        )
    model.parallel_ctx = ctx
    model.tp_mesh = mesh  # for inspection; not used by the schedule
    return model


# --------------------------------------------------------------------------------------------
# gradients and the schedule


def torch_tp_local(t: Tensor) -> Tensor:
    """This rank's local part of ``t``: ``t.to_local()`` for a DTensor, else ``t`` itself.

    ``to_local()`` outside autograd returns a view of the local storage, so in-place updates of
    the result update the DTensor.
    """
    return t.to_local() if isinstance(t, DTensor) else t


def torch_tp_grad_shard(p: Tensor) -> Tensor | None:
    """This rank's local gradient of parameter ``p`` (None if it has none).

    A DTensor gradient whose placements differ from its parameter's (the embedding's ``Replicate``
    grad of a ``Shard(0)`` weight, before ``TorchTPSchedule.step`` normalizes it) is first
    redistributed to the parameter's placements, so the result always matches ``p.to_local()``.
    """
    g = p.grad
    if g is None:
        return None
    if isinstance(g, DTensor):
        if isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
            g = g.redistribute(p.device_mesh, p.placements)
        return g.to_local()
    return g


def _normalize_grad_(p: Tensor) -> None:
    """Put ``p.grad`` in ``p``'s placements (see ``_normalize_grad_placements``)."""
    g = p.grad
    if (
        isinstance(p, DTensor)
        and isinstance(g, DTensor)
        and tuple(g.placements) != tuple(p.placements)
    ):
        p.grad = g.redistribute(p.device_mesh, p.placements)


def _normalize_grad_placements(model: nn.Module) -> None:
    """Make every DTensor grad carry its parameter's placements.

    Not a no-op: with torch 2.13 the gradient of the ``RowwiseParallel`` embedding (weight
    ``Shard(0)``) comes back as a ``Replicate`` DTensor holding the full [V, H] gradient;
    redistributing it to ``Shard(0)`` is a local slice (no communication) and makes ``.grad``
    match the parameter's local shape, which the flat DP all-reduce and grad clipping rely on.
    """
    for p in model.parameters():
        _normalize_grad_(p)


def all_reduce_local_gradients(model: nn.Module, ctx: ParallelContext) -> None:
    """Average every parameter's local gradient over the DP group with one flat all-reduce.

    ``oases.parallel.comm.gradient_mean_async`` concatenates ``p.grad`` directly, which mixes
    DTensor and plain tensors, so this is its local equivalent on ``.to_local()`` grads; the
    collective itself goes through ``comm.all_reduce_`` (recorded like Oases' own, tag
    "dp-grads"). A missing grad contributes zeros so every rank has the same flat layout.
    """
    group = ctx.dp_group
    if group.size == 1:
        return
    params = list({id(p): p for p in model.parameters()}.values())
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(torch_tp_local(p.grad))
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce_(flat, group, direction="backward", tag="dp-grads")
    flat.div_(group.size)
    offset = 0
    with torch.no_grad():
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


# --------------------------------------------------------------------------------------------
# optimizer and clipping: DTensor and plain parameters must not share a foreach call


def split_dtensor_groups(param_groups: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Split every optimizer param group into its DTensor and its plain-tensor parameters.

    A ``parallelize_torch_tp`` model mixes DTensor (sharded) and plain (replicated) parameters,
    and the foreach optimizer kernels -- torch's default on CUDA -- reject a list holding both
    ("aten._foreach_add_.List got mixed torch.Tensor and DTensor"). Optimizers run foreach per
    param group, so giving each kind its own group (same options) fixes it::

        opt = build_optimizer(model, t)   # oases.train.loop: decay / no-decay groups
        opt = type(opt)(split_dtensor_groups(opt.param_groups), **opt.defaults)

    Groups that would be empty are dropped. Accepts a plain list of parameters as one group.
    """
    groups = list(param_groups)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    out = []
    for group in groups:
        params = list(group["params"])
        for keep in (True, False):
            part = [p for p in params if isinstance(p, DTensor) is keep]
            if part:
                out.append({**group, "params": part})
    return out


@torch.no_grad()
def torch_tp_clip_grad_norm_(
    params: Iterable[Tensor], max_norm: float, ctx: ParallelContext
) -> float:
    """Clip ``.grad`` in place by the global norm of the full model's gradient; return the norm.

    The DTensor counterpart of ``oases.train.loop.clip_grad_norm_`` (torch's own
    ``clip_grad_norm_`` fails on the mixed DTensor / plain list): parameters sharded over the TP
    mesh contribute their local sum of squares, summed over the TP group by one all-reduce;
    replicated ones (plain tensors and ``Replicate`` DTensors) are counted once. Gradients must
    already be in their parameters' placements and averaged over DP (``TorchTPSchedule.step``).
    ``max_norm <= 0`` only measures.
    """
    params = [p for p in {id(p): p for p in params}.values() if p.grad is not None]
    if not params:
        return 0.0
    for p in params:
        _normalize_grad_(p)
    dtype = accum_dtype(torch_tp_local(params[0].grad).dtype)  # at least fp32
    sharded = torch.zeros(1, dtype=dtype, device=ctx.device)
    replicated = torch.zeros((), dtype=dtype, device=ctx.device)
    for p in params:
        sq = torch_tp_local(p.grad).to(dtype).pow(2).sum()
        is_sharded = isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)
        if is_sharded:
            sharded += sq
        else:
            replicated += sq
    comm.all_reduce_(sharded, ctx.tp_group, direction="backward", tag="grad-norm")
    norm = float((sharded[0] + replicated).sqrt())
    if max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for p in params:
            torch_tp_local(p.grad).mul_(coef)
    return norm


class TorchTPSchedule:
    """Plain autograd training step for a ``parallelize_torch_tp`` model (Schedule API).

    ``step(model, tokens, targets)``: forward and ``backward()`` over micro-batches of
    ``micro_batch`` rows (gradient accumulation, each loss scaled by 1/n_micro; one micro-batch
    of all rows when None), then the DP gradient average; returns the mean loss, detached.
    """

    name = "torch-tp"

    def __init__(self, micro_batch: int | None = None) -> None:
        if micro_batch is not None and micro_batch < 1:
            raise ValueError(f"train.micro_batch={micro_batch} must be at least 1")
        self.micro_batch = micro_batch

    def __repr__(self) -> str:
        return f"TorchTPSchedule(micro_batch={self.micro_batch})"

    def step(self, model: Transformer, tokens: Tensor, targets: Tensor) -> Tensor:
        """Forward + backward of tokens/targets [rows, S]; returns the mean loss (detached)."""
        ctx = model.parallel_ctx
        if ctx is None:
            raise ValueError("torch-tp steps a parallelized model: call parallelize_torch_tp")
        rows = tokens.shape[0]
        mb = self.micro_batch or rows
        if rows % mb:
            raise ValueError(
                f"local batch of {rows} rows must split into micro-batches of "
                f"train.micro_batch={mb} rows"
            )
        n_micro = rows // mb
        losses = []
        for t, y in zip(tokens.split(mb), targets.split(mb)):
            loss = model(t, y)
            (loss / n_micro if n_micro > 1 else loss).backward()
            losses.append(loss.detach())
        _normalize_grad_placements(model)
        all_reduce_local_gradients(model, ctx)
        return torch.stack(losses).mean()
