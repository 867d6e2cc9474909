"""The optimizer side of a training step: AdamW with its parameter groups, the LR schedule, and
gradient clipping by the global norm of a model sharded over one or several TP degrees."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from oases.config import TrainConfig
from oases.parallel import comm
from oases.parallel.apply import shard_spec
from oases.parallel.context import Group
from oases.precision import accum_dtype


def lr_at(step: int, t: TrainConfig) -> float:
    """Learning rate of 0-based ``step``: linear warmup to ``lr``, cosine decay to ``min_lr``."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + math.cos(math.pi * min(1.0, progress)))


def build_optimizer(model: nn.Module, t: TrainConfig) -> torch.optim.AdamW:
    """AdamW; biases, norms and embeddings (by name) get no weight decay."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():  # a tied weight appears once, as embed.weight
        if not p.requires_grad:
            continue
        skip = name.endswith("bias") or "norm" in name or "embed" in name
        (no_decay if skip else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": t.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr_at(0, t), betas=(0.9, 0.95), eps=1e-8)


def clip_grad_norm_(params: Iterable[nn.Parameter], max_norm: float, tp_group: Group,
                    tp_groups: dict[int, Group] | None = None) -> float:
    """Clip ``.grad`` in place by the global norm of the full (unsharded) model's gradient.

    Sharded parameters contribute their local sum of squares, summed over their TP group by one
    all-reduce per group (``tp_groups``: id(parameter) -> its TP group where that is not
    ``tp_group``, as under a mixed-degree plan); replicated parameters hold the same gradient on
    every rank of their TP group and are counted once. Gradients must already be averaged over
    DP. ``max_norm <= 0`` only measures. Returns the norm before clipping.
    """
    params = [p for p in {id(p): p for p in params}.values() if p.grad is not None]
    if not params:
        return 0.0
    # sums of squares in at least fp32 (float64 gradients: float64)
    zero = params[0].grad.new_zeros((), dtype=accum_dtype(params[0].grad.dtype))
    groups = tp_groups or {}
    sharded = {tp_group.ranks: (tp_group, zero.clone())}  # ranks -> (group, sum of squares)
    for p in params:
        if shard_spec(p) is not None:
            group = groups.get(id(p), tp_group)
            _, acc = sharded.get(group.ranks, (group, zero))
            sharded[group.ranks] = (group, acc + p.grad.to(zero.dtype).pow(2).sum())
    replicated = sum((p.grad.to(zero.dtype).pow(2).sum() for p in params
                      if shard_spec(p) is None), zero)
    total = replicated
    for _, (group, acc) in sorted(sharded.items(), key=lambda kv: len(kv[0])):  # same order on
        # every rank: one TP group per degree
        total = total + comm.all_reduce_(acc.reshape(1), group, direction="backward",
                                         tag="grad-norm")[0]
    norm = float(total.sqrt())
    if max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for p in params:
            p.grad.mul_(coef)
    return norm
