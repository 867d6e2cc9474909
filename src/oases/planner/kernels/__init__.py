"""The GPU cost model built from kernels: every piece of a region is the kernels it launches,
each priced from a named public microbenchmark or specification.

Modules, one concern each::

    sources.py        the public figures (GEMM sweeps, FlashAttention benchmarks, STREAM-like
                      bandwidth, launch costs, NCCL's SMs) and the presets' kernel tables
    gemm.py           a matmul by shape: tiles and waves over the SMs, split-K, memory floor
    attention.py      fused attention by head dim, sequence, mask and direction
    memory_bound.py   the bytes and kernels of every eager memory-bound op
    launch.py         launch and host overhead of a piece by its kernel count
    pieces.py         the kernels of each piece of each region
    prices.py         one GPU's prices of kernels and pieces, by class; interference

``planner.hardware.HardwareCosts`` consumes them; ``planner.kernel_profile`` reads a measured
kernel table (``oases profile --kernels``).
"""

from oases.planner.kernels.pieces import Kernel, PieceKernels
from oases.planner.kernels.prices import CLASSES, FLOP_CLASSES, KernelPrices

__all__ = ["CLASSES", "FLOP_CLASSES", "Kernel", "KernelPrices", "PieceKernels"]
