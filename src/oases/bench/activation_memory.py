"""What a step keeps, counted in tensors: saved bytes per block and the peak of live tensor bytes.

Two measures of one training step (forward and backward) of a schedule, on a CPU as on a GPU:

    saved bytes per block   the executor's ``track_memory``: every storage autograd saves in a
                            forward piece (``saved_tensors_hooks``' pack, keyed by
                            ``untyped_storage().data_ptr()``: one storage counted once, a
                            parameter never), plus the tensors the pieces keep themselves
                            (a norm's output slice, y_i, a recompute's inputs), per region;
                            a block is its attention and MLP regions
    peak live tensor bytes  the most bytes of tensors alive at once during the step, above
                            what was alive when it started (``oases.memory.peak_live_bytes``:
                            on a GPU CUDA's allocator peak; on a CPU the allocation and free
                            events the profiler records from torch's CPU allocator, summed in
                            order; the training metrics' ``live_peak_mb`` is the same)

The analytic side is ``planner.activation_terms`` (per tensor; Korthikanti et al.).
``measure_step`` runs both on one step; ``bench.memory_runner`` reports them beside the
resident peak (``oases bench --memory``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from oases.memory import peak_live_bytes

__all__ = ["measure_step", "peak_live_bytes", "saved_per_block"]


def saved_per_block(saved_bytes: dict[int, int], n_layers: int) -> list[int]:
    """Block l's bytes (regions 2l + 1 and 2l + 2) from an executor's ``saved_bytes``."""
    return [saved_bytes.get(2 * b + 1, 0) + saved_bytes.get(2 * b + 2, 0) for b in range(n_layers)]


def measure_step(
    schedule: object, model: torch.nn.Module, tokens: Tensor, targets: Tensor, device: torch.device
) -> dict:
    """One step of ``schedule`` (an ``oases.schedule.Schedule``) with both measures on:
    {"saved_per_block": [bytes per block], "peak_live": bytes}. Gradients are left to the
    caller (zero them before the next step)."""
    ex = schedule.executor(model)
    ex.track_memory, ex.saved_bytes = True, {}
    try:
        with peak_live_bytes(device) as peak:
            schedule.step(model, tokens, targets)
    finally:
        ex.track_memory = False
    return {
        "saved_per_block": saved_per_block(ex.saved_bytes, len(model.blocks)),
        "peak_live": peak["peak"],
    }
