"""Launch and host overhead of a piece, by how many kernels it runs.

A piece's kernels run back to back on the GPU while the CPU dispatches them ahead of it
(PyTorch eager: Python, autograd, the dispatcher, the launch); the executor adds its own work
per instruction (detaching the inputs, one ``autograd.backward`` call)::

    device = sum of the kernels' own times + kernels x kernel_gap_s
    host   = (kernels + EXECUTOR_OPS) x host_op_s
    piece  = max(device, host)

so a piece of large kernels pays only the gaps, and a piece of many tiny kernels is as slow
as the CPU that feeds it. ``launch_s`` is what the launches add to the kernels' own times
(the "launch" class of a breakdown). The gap and the per-op CPU time are the GPU's kernel
table's ``kernel_gap_s`` and ``host_op_s`` (``planner.kernels.sources``).
"""

from __future__ import annotations

EXECUTOR_OPS = 2  # the executor's own work per Compute instruction, in eager ops' time


def piece_s(kernels_s: float, n_kernels: int, kernel_gap_s: float, host_op_s: float) -> float:
    """Seconds of a piece whose ``n_kernels`` kernels take ``kernels_s`` on their own."""
    if n_kernels <= 0:
        return kernels_s
    device = kernels_s + n_kernels * kernel_gap_s
    host = (n_kernels + EXECUTOR_OPS) * host_op_s
    return max(device, host)


def launch_s(kernels_s: float, n_kernels: int, kernel_gap_s: float, host_op_s: float) -> float:
    """What launching adds to the kernels' own ``kernels_s``."""
    return piece_s(kernels_s, n_kernels, kernel_gap_s, host_op_s) - kernels_s
