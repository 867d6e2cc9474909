"""Ranks agreeing before they train: a user error found on one rank stops every rank with the
same one line (no hang, no wall of tracebacks), and values every rank must share (the plan, the
step resumed from, the corpus) are compared over the world.
"""

from __future__ import annotations

import torch

from oases.parallel import comm
from oases.parallel.context import ParallelContext


class PeerError(ValueError):
    """A user error that another rank reports (one line in all); this rank stops quietly."""


def agree_on_value(ctx: ParallelContext, value: int, what: str) -> None:
    """Every rank must hold the same ``value`` (e.g. the step it resumes from); else every rank
    raises the same ValueError. Min and max over the world via the TP then the DP groups."""
    t = torch.tensor([float(value), -float(value)], device=ctx.device)
    comm.all_reduce_(t, ctx.tp_group, op="max", tag="agree")
    comm.all_reduce_(t, ctx.dp_group, op="max", tag="agree")
    hi, lo = t[0].item(), -t[1].item()
    if hi != lo:
        raise ValueError(f"ranks disagree on {what}: from {lo:g} to {hi:g}")


def agree_on_setup(ctx: ParallelContext, error: ValueError | None) -> None:
    """Collective check after each rank's local setup: if any rank failed, all raise.

    The lowest failing rank re-raises its own error (the one line the user sees); the others
    raise ``PeerError``. Two max all-reduces (over TP, then DP) cover the whole world.
    """
    code = torch.tensor([float(ctx.world_size - ctx.rank) if error else 0.0], device=ctx.device)
    comm.all_reduce_(code, ctx.tp_group, op="max", tag="setup-check")
    comm.all_reduce_(code, ctx.dp_group, op="max", tag="setup-check")
    if code.item() == 0:
        return
    first = ctx.world_size - int(code.item())
    if ctx.rank == first:
        assert error is not None
        raise error if first == 0 else ValueError(f"rank {first}: {error}")
    raise PeerError(f"setup failed on rank {first}")
