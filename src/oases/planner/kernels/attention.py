"""Fused (flash-style) attention's seconds from the published kernel benchmarks.

A GPU's kernel table holds the efficiency of the fused kernel (``attn_*`` keys,
``planner.kernels.sources``) by direction (forward, backward), mask (full, causal), head dim
D and sequence S, as fractions of the dense 16-bit peak in the FlashAttention papers' flop
count::

    forward flops  = 4 x b x A x S^2 x D   (x 1/2 causal)      backward = 2.5 x forward

Between the benchmarked sequences the efficiency is interpolated in log2(S) (held at the ends);
a head dim without a series takes the nearest one's. The benchmarks run batch x S = 16k tokens
over 2048 / D heads, enough thread blocks (one per 128 queries of a head) to fill every SM; a
sub-batch of fewer heads (a high TP degree) fills fewer, so the efficiency is scaled by the
wave quantization of its own blocks (``wave_fill``) against a full one.
Shape legend: b sequences, A query heads on this rank, S sequence, D head dim.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

BLOCK_Q = 128  # queries per thread block (FlashAttention-2's forward tile)


def attention_flops(b: int, heads: float, s: int, d: int, causal: bool, backward: bool) -> float:
    """The FlashAttention papers' flop count of one pass (see the module docstring)."""
    flops = 4 * b * heads * s * s * d * (0.5 if causal else 1.0)
    return flops * (2.5 if backward else 1.0)


def _series(
    table: Mapping[str, float], direction: str, mask: str, d: int
) -> tuple[list[int], list[float]] | None:
    """(sequences, efficiencies) of the series nearest head dim ``d``, or None."""
    points = _parsed(tuple(sorted(table.items()))).get((direction, mask), {})
    if not points:
        return None
    near = min(points, key=lambda x: (abs(math.log2(x / d)), x))
    seqs = sorted(points[near])
    return seqs, [points[near][s] for s in seqs]


@functools.cache
def _parsed(
    items: tuple[tuple[str, float], ...],
) -> dict[tuple[str, str], dict[int, dict[int, float]]]:
    """{(direction, mask): {head dim: {sequence: efficiency}}} of a table's ``attn_*`` keys."""
    out: dict[tuple[str, str], dict[int, dict[int, float]]] = {}
    for key, value in items:
        if key.startswith("attn_"):
            _, direction, mask, rest = key.split("_", 3)
            dim, seq = rest.removeprefix("d").split("_s")
            out.setdefault((direction, mask), {}).setdefault(int(dim), {})[int(seq)] = value
    return out


def fused_efficiency(
    table: Mapping[str, float], d: int, s: int, causal: bool, backward: bool
) -> float:
    """The fused kernel's efficiency at head dim ``d`` and sequence ``s`` (0 when the table
    has no attention series)."""
    found = _series(table, "bwd" if backward else "fwd", "causal" if causal else "full", d)
    if found is None:
        return 0.0
    seqs, values = found
    x = math.log2(max(seqs[0], min(seqs[-1], s)))
    xs = [math.log2(v) for v in seqs]
    for i in range(len(xs) - 1):
        if xs[i] <= x <= xs[i + 1]:
            t = (x - xs[i]) / (xs[i + 1] - xs[i])
            return values[i] + t * (values[i + 1] - values[i])
    return values[-1]


def wave_fill(blocks: float, sms: int) -> float:
    """Useful fraction of the waves ``blocks`` thread blocks take on ``sms`` SMs."""
    if blocks <= 0:
        return 0.0
    return blocks / (math.ceil(blocks / sms) * sms)


def fused_attention_s(
    table: Mapping[str, float],
    *,
    b: int,
    heads: float,
    s: int,
    d: int,
    causal: bool,
    backward: bool,
    peak_flops: float,
    sms: int,
) -> float:
    """Seconds of one fused attention pass over ``b`` sequences of ``heads`` local heads;
    ValueError when the table has no attention series."""
    eff = fused_efficiency(table, d, s, causal, backward)
    if eff <= 0:
        raise ValueError(
            "the GPU's kernel table has no fused-attention series (attn_* keys); "
            "price attention as materialized, or add them"
        )
    blocks = b * heads * math.ceil(s / BLOCK_Q)
    bench_blocks = 16384 / s * (2048 / d) * math.ceil(s / BLOCK_Q)  # the papers' setting
    eff *= min(1.0, wave_fill(blocks, sms) / wave_fill(bench_blocks, sms))
    return attention_flops(b, heads, s, d, causal, backward) / (peak_flops * eff)
