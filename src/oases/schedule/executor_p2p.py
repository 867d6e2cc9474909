"""The executor's pipeline instructions: point-to-point between stages and the tied embedding.

A mixin of ``executor.Executor`` (which owns the per-step state and dispatches every
``Start``/``Wait`` through ``executor_collectives``). Per kind (``instructions``), b the first
region of the later stage, j the sub-batch::

    sf, b   send x[b, j] (epi:b-1's output) to the next stage         (pair "fwd", next)
    rf, b   receive x_b [rows_b, S or S/t_b, H] into x[b, j] for body:b  (pair "fwd", prev)
    sb, b   send gx[b, j] (norm:b's dx_b) to the previous stage       (pair "bwd", prev)
    rb, b   receive dx_b into gx[b, j] for epi:b-1's backward          (pair "bwd", next)
    tie, 0  sum the tied embedding weight's gradient over the first and last stage (in place)

Where b wraps around (the interleaved schedule's boundary from the last stage's chunk to the
first stage's next one: ``StageLayout.wraps``), the pair is the "wrap-" one of that side.

A receive's buffer is sized from the sub-batch (``tokens[j]``: every stage gets the batch) at
region b's degree (rows_b = rows_0 * t_b / t_0; under sequence parallelism the sequence is
S / t_b), in the activations' dtype (the autocast dtype inside autocast, else the weights'):
the sender casts to it (a no-op when the model keeps its activations there, as it does).

Shape legend: rows sub-batch rows at the region's degree, S sequence, H hidden.
"""

from __future__ import annotations

import torch
from torch import Tensor

from oases.parallel import comm
from oases.parallel.stage_model import holds
from oases.schedule.instructions import Start, Wait

# kind -> (direction, the pair's side, what the instruction moves)
P2P = {
    "sf": ("fwd", "next"),
    "rf": ("fwd", "prev"),
    "sb": ("bwd", "prev"),
    "rb": ("bwd", "next"),
}


def activation_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype activations cross a stage boundary in: the autocast dtype inside autocast
    (``precision.to_activation``), else the weights'."""
    kind = model.parallel_ctx.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return next(model.parameters()).dtype


class PointToPointInstructions:
    """ "sf", "rf", "sb", "rb" and "tie" of ``Executor`` (see the module docstring)."""

    def _start_pipeline(self, ins: Start, tag: str) -> tuple[comm.Handle, bool]:
        """Start one point-to-point or "tie" instruction: (handle, moves data)."""
        i, j = ins.index, ins.sub
        if ins.kind == "tie":
            weight = self._tied_weight()
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            group = self.ctx.embed_group
            return comm.all_reduce_async(weight.grad, group, direction="backward", tag=tag), True
        direction, side = P2P[ins.kind]
        if self.layout.wraps(i):  # from the last stage's chunk to the first's next one
            pair = self.ctx.p2p_groups[direction, f"wrap-{side}"]
        else:
            pair = self.ctx.p2p_groups[direction, side]
        peer = pair.ranks[1] if side == "next" else pair.ranks[0]
        passes = "forward" if direction == "fwd" else "backward"
        number = comm.p2p_tag(i, j, passes)
        dtype = self._activation_dtype()
        if ins.kind == "sf":
            x = self.x.pop((i, j)).to(dtype)
            return comm.send_async(x, pair, peer, tag=number, direction=passes, label=tag), True
        if ins.kind == "sb":
            dx = self.gx.pop((i, j)).to(dtype)
            return comm.send_async(dx, pair, peer, tag=number, direction=passes, label=tag), True
        return comm.recv_async(
            self._boundary_shape(i, j), dtype, pair, peer, tag=number, direction=passes, label=tag
        ), True

    def _wait_pipeline(self, ins: Wait, result: Tensor) -> None:
        """Put a received tensor where the next piece reads it."""
        if ins.kind == "rf":  # body:b reads x_b
            self.x[ins.index, ins.sub] = result
        elif ins.kind == "rb":  # epi:b-1's backward reads dx_b
            self.gx[ins.index, ins.sub] = result

    def _boundary_shape(self, b: int, j: int) -> tuple[int, int, int]:
        """x_b's (and dx_b's) shape for sub-batch j: [rows_b, S or S / t_b, H]."""
        rows, seq = self.tokens[j].shape
        t0, tb = self.chain[0].tp, self.chain[b].tp
        if self.sp is not None:
            seq //= tb
        return rows * tb // t0, seq, self.model.cfg.dim

    def _activation_dtype(self) -> torch.dtype:
        return activation_dtype(self.model)

    def _tied_weight(self) -> torch.nn.Parameter:
        """This stage's copy of the tied embedding weight (the embedding's on the first stage,
        the head's on the last)."""
        if holds(self.model, 0):
            return self.model.embed.weight
        return self.model.head.weight
