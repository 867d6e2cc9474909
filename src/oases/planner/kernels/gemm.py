"""A matmul's seconds from its shape: tiles, waves and the memory floor.

cuBLAS cuts the [M, N] output into tiles (``TILES``, the tile shapes of NVIDIA's matmul
performance guide), gives each tile a thread block, and runs as many blocks at once as the GPU
has SMs (a *wave*). A tile of tm x tn over K computes 2 tm tn K flops; larger tiles reuse each
loaded element more, so a tile reaches ``tile_efficiency`` of what the largest ones do (the
guide's data-reuse argument: the flops a tile does per element it loads, tm tn / (tm + tn),
against that of 128x128)::

    seconds(tm, tn, split) = waves x 2 tm tn (K / split + K0) / (peak / SMs x e_max x tile_eff)
                             + the split-K reduction (fp32 partial outputs, memory-bound)
    waves = ceil(ceil(M / tm) x ceil(N / tn) x batch x split / SMs)
    gemm_s = max(min over tiles and splits, bytes of A, B and C / STREAM bandwidth)

K0 = 64 is the software pipeline's fill and the epilogue, about two 32-deep k-stages. Split-K
(cuBLAS's answer to few output tiles and a long K) cuts K into 2, 4 or 8 pieces of at least
256. ``e_max``, the efficiency of full waves of the largest tiles over a long K, is the GPU's
measured matmul efficiency (``GPU.matmul_efficiency_at``): the MAMF table's figure is the best
over a search of shapes, which is what such waves reach. Where the efficiency was measured at
one shape instead (``gemm_anchor_*``: the RTX 3090's, from a layer of the Oases paper), e_max
is solved so that the model reproduces it at that shape (at most 1). The level comes from the
measurement, the shape dependence from the tiles and waves.
Shape legend: M rows of the output (tokens), N its columns, K the reduction, batch
independent matmuls of that shape (attention's heads).
"""

from __future__ import annotations

import functools
import math

TILES = ((256, 128), (128, 256), (128, 128), (128, 64), (64, 128), (64, 64))
K0 = 64
SPLITS = (1, 2, 4, 8)
MIN_SPLIT_K = 256
_REF_REUSE = 128 * 128 / (128 + 128)


def tile_efficiency(tm: int, tn: int) -> float:
    """How much of the largest tiles' rate a tm x tn tile reaches (data reuse, capped at 1)."""
    return min(1.0, tm * tn / (tm + tn) / _REF_REUSE)


def _compute_s(
    m: int, n: int, k: int, batch: int, sms: int, flops_per_sm_s: float, bytes_per_s: float
) -> float:
    """The fastest tile and split at efficiency 1 (``flops_per_sm_s``: one SM's peak)."""
    best = math.inf
    for tm, tn in TILES:
        tiles = math.ceil(m / tm) * math.ceil(n / tn) * batch
        rate = flops_per_sm_s * tile_efficiency(tm, tn)
        for split in SPLITS:
            if split > 1 and k / split < MIN_SPLIT_K:
                break
            waves = math.ceil(tiles * split / sms)
            s = waves * 2 * tm * tn * (math.ceil(k / split) + K0) / rate
            if split > 1:  # write, read and sum the fp32 partial outputs
                s += (split + 1) * m * n * batch * 4 / bytes_per_s
            best = min(best, s)
    return best


@functools.cache
def peak_efficiency(
    anchor: tuple[int, int, int], measured: float, sms: int, peak_flops: float, bytes_per_s: float
) -> float:
    """``e_max``: the efficiency of full waves of the largest tiles that makes the model give
    ``measured`` x peak at the ``anchor`` shape (at most 1)."""
    m, n, k = anchor
    ideal = 2 * m * n * k / peak_flops
    at_one = _compute_s(m, n, k, 1, sms, peak_flops / sms, bytes_per_s)
    return min(1.0, measured * at_one / ideal)


@functools.cache
def gemm_s(
    m: int,
    n: int,
    k: int,
    *,
    batch: int = 1,
    elem_bytes: float,
    sms: int,
    peak_flops: float,
    e_max: float,
    bytes_per_s: float,
) -> float:
    """Seconds of ``batch`` matmuls [M, K] x [K, N] (see the module docstring); 0 when empty."""
    if min(m, n, k, batch) <= 0:
        return 0.0
    compute = _compute_s(m, n, k, batch, sms, peak_flops / sms * e_max, bytes_per_s)
    memory = (m * k + k * n + m * n) * batch * elem_bytes / bytes_per_s
    return max(compute, memory)
