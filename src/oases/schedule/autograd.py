"""The Megatron-style baselines as plain autograd steps.

``megatron``            one pass, synchronous collectives, every activation kept.
``megatron-recompute``  full per-block activation recomputation (``torch.utils.checkpoint``):
                        the recompute re-runs each block's forward, repeating its two
                        forward all-reduces inside the backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from oases.parallel import comm

SCHEDULES = ("megatron", "megatron-recompute")


@dataclass
class AutogradSchedule:
    """Forward and backward by autograd; DP gradient averaging after the last micro-batch."""

    name: str
    recompute: bool
    n_sub: int = 1
    micro_batch: int | None = None  # rows per micro-batch; None: the whole local batch at once

    def step(self, model: nn.Module, tokens: Tensor, targets: Tensor) -> Tensor:
        ctx = model.parallel_ctx
        if ctx is None:
            raise ValueError("step() needs a parallelized model: call oases.parallelize first")
        rows = tokens.shape[0]
        mb = self.micro_batch or rows
        if rows % mb:
            raise ValueError(f"local batch of {rows} rows does not split into micro-batches of {mb}")
        n_micro = rows // mb
        model.recompute = self.recompute
        total = 0.0
        for i in range(n_micro):
            rows_i = slice(i * mb, (i + 1) * mb)
            loss = model(tokens[rows_i], targets[rows_i])
            (loss / n_micro).backward()
            total += loss.detach()
        comm.all_reduce_gradients(
            (p for p in model.parameters() if p.requires_grad), ctx.dp_group
        )
        return total / n_micro


def build_schedule(name: str, n_sub: int = 2, micro_batch: int | None = None) -> AutogradSchedule:
    """The schedule called ``name``; raises ValueError listing the valid names."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; valid: {', '.join(SCHEDULES)}")
    if n_sub < 1:
        raise ValueError(f"schedule.n_sub={n_sub} must be at least 1")
    return AutogradSchedule(name, recompute=name == "megatron-recompute", n_sub=1,
                            micro_batch=micro_batch)
