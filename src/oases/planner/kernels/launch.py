"""Launch and host overhead of a piece, by how many kernels it runs.

A piece's kernels run back to back on the GPU while the CPU dispatches them ahead of it
(PyTorch eager: Python, autograd, the dispatcher, the launch); the executor adds its own work
per piece (detaching the inputs, its share of an ``autograd.backward`` call)::

    device = sum of the kernels' own times + kernels x kernel_gap_s
    host   = (kernels + executor_ops) x host_op_s
    piece  = max(device, host)

so a piece of large kernels pays only the gaps, and a piece of many tiny kernels is as slow
as the CPU that feeds it. ``launch_s`` is what the launches add to the kernels' own times
(the "launch" class of a breakdown). The gap and the per-op CPU time are the GPU's kernel
table's ``kernel_gap_s`` and ``host_op_s`` (``planner.kernels.sources``); ``executor_ops`` is
the table's term of that name, measured by ``oases bench --overhead`` (a schedule's step less
a plain forward + backward of the same model, per piece, in this host's eager-op times),
``EXECUTOR_OPS`` where a table has none.
"""

from __future__ import annotations

# the executor's own host work per piece, in eager ops' time, where a kernel table has no
# "executor_ops": the assumed 2 of before (``oases bench --overhead`` measures it on a host;
# benchmarks/2026-12-04-overhead)
EXECUTOR_OPS = 2.0


def piece_s(
    kernels_s: float,
    n_kernels: int,
    kernel_gap_s: float,
    host_op_s: float,
    executor_ops: float = EXECUTOR_OPS,
) -> float:
    """Seconds of a piece whose ``n_kernels`` kernels take ``kernels_s`` on their own."""
    if n_kernels <= 0:
        return kernels_s
    device = kernels_s + n_kernels * kernel_gap_s
    host = (n_kernels + executor_ops) * host_op_s
    return max(device, host)


def launch_s(
    kernels_s: float,
    n_kernels: int,
    kernel_gap_s: float,
    host_op_s: float,
    executor_ops: float = EXECUTOR_OPS,
) -> float:
    """What launching adds to the kernels' own ``kernels_s``."""
    return piece_s(kernels_s, n_kernels, kernel_gap_s, host_op_s, executor_ops) - kernels_s
