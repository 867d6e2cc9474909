"""What a step keeps, counted in tensors: saved bytes per block and the peak of live tensor bytes.

Two measures of one training step (forward and backward) of a schedule, on a CPU as on a GPU:

    saved bytes per block   the executor's ``track_memory``: every storage autograd saves in a
                            forward piece (``saved_tensors_hooks``' pack, keyed by
                            ``untyped_storage().data_ptr()``: one storage counted once, a
                            parameter never), plus the tensors the pieces keep themselves
                            (a norm's output slice, y_i, a recompute's inputs), per region;
                            a block is its attention and MLP regions
    peak live tensor bytes  the most bytes of tensors alive at once during the step, above
                            what was alive when it started: on a GPU CUDA's allocator peak;
                            on a CPU the allocation and free events the profiler records
                            from torch's CPU allocator (``profile_memory``), summed in order
                            (the process's resident set would also hold the allocator's
                            free lists, gloo's buffers and code pages)

The analytic side is ``planner.activation_terms`` (per tensor; Korthikanti et al.).
``measure_step`` runs both on one step; ``bench.memory_runner`` reports them beside the
resident peak (``oases bench --memory``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor


def saved_per_block(saved_bytes: dict[int, int], n_layers: int) -> list[int]:
    """Block l's bytes (regions 2l + 1 and 2l + 2) from an executor's ``saved_bytes``."""
    return [saved_bytes.get(2 * b + 1, 0) + saved_bytes.get(2 * b + 2, 0) for b in range(n_layers)]


@contextlib.contextmanager
def peak_live_bytes(device: torch.device) -> Iterator[dict[str, int]]:
    """Inside the block, measure the peak of live tensor bytes above those alive at its
    start; the dict it yields holds ``"peak"`` after the block."""
    out = {"peak": 0}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield out
        torch.cuda.synchronize(device)
        out["peak"] = torch.cuda.max_memory_allocated(device) - start
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield out
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):  # + an allocation, - a free
        live += e.nbytes()
        peak = max(peak, live)
    out["peak"] = peak


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
