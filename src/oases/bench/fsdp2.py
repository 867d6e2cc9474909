"""Benchmark peer "fsdp2": the single-device model under PyTorch's own FSDP2 (ZeRO-3 style DP).

What a user would pick instead of tensor parallelism when the model fits one device's compute but
not its memory: ``torch.distributed.fsdp.fully_shard`` on a 1-D ``DeviceMesh`` over every rank
(pure data parallelism, tp=1) applied to the unchanged ``oases.model.Transformer``, trained with
plain autograd. Units, in this order (``shard_fsdp2``)::

    blocks.i      one unit per block: its parameters are one flat all-gather / reduce-scatter
    root          embed, pos_embed, norm, head: the rest, in the root unit

Every parameter becomes a ``Shard(0)`` DTensor over the world (uneven last shard allowed), so a
rank holds 1/world of the parameters, of their gradients and (an optimizer built afterwards, e.g.
``oases.train.optim.build_optimizer``) of the AdamW state. A unit's forward all-gathers its
parameters and frees them after (the root keeps its own until the backward); the backward
all-gathers again and reduce-scatters the gradients, averaged over the ranks, into ``.grad``
(``Shard(0)`` DTensors). A tied ``head.weight`` *is* ``embed.weight``: both users live in the
root unit, so it stays one parameter, gathered once, its two gradient contributions summed
before the reduce-scatter.

Each rank feeds its own share of the global batch (``FSDP2Schedule.step``: micro-batches with
gradient accumulation, one reduce-scatter per micro-batch as FSDP2 does by default);
``fsdp2_optimizer_step`` is the rest of a training step (LR schedule, clipping by the global
norm with the two halves of torch's ``clip_grad_norm_``, which reduce DTensor gradient norms
over the mesh, then the optimizer).

A CPU/gloo run is a valid benchmark: FSDP2's collectives (``all_gather_into_tensor``,
``reduce_scatter_tensor``) are plain process-group calls that gloo implements, and on a CPU
mesh its streams and events are ``torch.cpu``'s no-ops, so a step does the same computation and
moves the same bytes as on GPUs, in program order (on GPUs a side stream lets the next unit's
all-gather overlap compute; on CPU each collective blocks). Its collectives go through torch,
not ``oases.parallel.comm``: Oases' collective hooks do not record them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from oases.config import TrainConfig
from oases.model import Transformer
from oases.parallel.context import ParallelContext
from oases.precision import Precision
from oases.train.optim import lr_at

__all__ = ["FSDP2Schedule", "build_world_mesh", "fsdp2_optimizer_step", "shard_fsdp2"]


def build_world_mesh(ctx: ParallelContext) -> DeviceMesh:
    """A 1-D ``DeviceMesh`` ("dp") over every rank; collective: call on every rank."""
    return init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("dp",))


def shard_fsdp2(
    model: Transformer, mesh: DeviceMesh, precision: Precision | None = None
) -> Transformer:
    """``fully_shard`` every block of ``model``, then the root, over ``mesh``, in place.

    ``model`` is the full single-device model, identical on every rank (same seed) and already
    on the mesh's device. Returns it (its class becomes an ``FSDPModule`` subclass). A tied
    embedding/head weight stays one parameter (checked). With a ``precision`` that computes in
    another dtype than its master weights (bf16), FSDP2's own mixed precision, as torchtitan
    sets it: the shards stay fp32, the weights are gathered and used in bf16
    (``MixedPrecisionPolicy.param_dtype``), the gradients reduced in the precision's
    ``grad_reduce_dtype`` (fp32 by default).
    """
    if mesh.ndim != 1:
        raise ValueError(f"fsdp2 shards over a 1-D mesh, got {mesh}")
    tied = model.cfg.tie_embeddings
    policy = MixedPrecisionPolicy()
    if precision is not None and precision.compute_dtype != precision.param_dtype:
        policy = MixedPrecisionPolicy(
            param_dtype=precision.compute_dtype, reduce_dtype=precision.grad_reduce_dtype
        )
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if tied and model.head.weight is not model.embed.weight:
        raise RuntimeError("fully_shard untied the embedding and head weights")
    return model


class FSDP2Schedule:
    """Plain autograd step for a ``shard_fsdp2`` model (Schedule API).

    ``step(model, tokens, targets)``: this rank's rows, forward and ``backward()`` over
    micro-batches of ``micro_batch`` rows (each loss scaled by 1/n_micro; one micro-batch of all
    rows when None); FSDP2's hooks reduce-scatter the averaged gradients during each backward.
    Returns this rank's mean loss, detached.
    """

    name = "fsdp2"

    def __init__(self, micro_batch: int | None = None) -> None:
        if micro_batch is not None and micro_batch < 1:
            raise ValueError(f"train.micro_batch={micro_batch} must be at least 1")
        self.micro_batch = micro_batch

    def __repr__(self) -> str:
        return f"FSDP2Schedule(micro_batch={self.micro_batch})"

    def step(self, model: nn.Module, tokens: Tensor, targets: Tensor) -> Tensor:
        """Forward + backward of tokens/targets [rows, S]; returns the mean loss (detached)."""
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
        return torch.stack(losses).mean()


def fsdp2_optimizer_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, step: int, t: TrainConfig
) -> float:
    """The rest of training step ``step`` (0-based), as ``oases.train.loop`` does it: the LR of
    ``lr_at(step, t)``, clipping by the global gradient norm to ``t.grad_clip`` (``<= 0``: only
    measure), ``optimizer.step()``, ``zero_grad``. Returns the norm before clipping.

    torch's ``get_total_norm`` on ``Shard(0)`` DTensor gradients all-reduces the partial norms
    over the mesh, so every rank gets the full model's norm and applies the same coefficient.
    """
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, t)
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if t.grad_clip > 0:
        torch.nn.utils.clip_grads_with_norm_(params, t.grad_clip, norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
