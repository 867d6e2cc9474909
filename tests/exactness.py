"""The tolerances of the exactness tests, in one place, with the reason each one holds.

A test that proves a parallel path equal to the single-device model (or one schedule equal to
another) compares two computations of the same numbers that differ only in the order of their
sums: TP splits a matmul's inner dimension into partial sums added by an all-reduce, DP sums
gradients over ranks, sub-batches and micro-batches sum the token gradients in pieces. Rounding
then depends on that order and on the CPU kernels torch picks (AVX2 and AVX512 block their sums
differently), so the tolerance must cover every order, not the one this machine happens to use.

float64 (``EXACT64``, every parity test). A sum of n terms rounded in float64 is off by at most
about n * eps64 * sum|terms| (eps64 = 2.2e-16; Higham, Accuracy and Stability, 3.1). The tests'
models are tiny (hidden 32-64, ffn <= 256, vocabulary <= 257, <= 128 tokens a batch): no
reduction has more than ~1e3 terms, terms are O(1) or smaller, and a forward + backward chains a
few dozen reductions, so two orders differ by < ~1e-12, relative or absolute, while any real bug
(a missing all-reduce, a wrong shard, a mis-scaled micro-batch) moves results by >= ~1e-3. 1e-10
leaves a margin of ~100 on one side and ~1e7 on the other, on every CPU. AdamW steps keep it:
an update is lr * m / (sqrt(v) + 1e-8), so a gradient difference d moves a parameter by at most
lr * d / 1e-8 = 1e-2 * ~1e-17 / 1e-8 ~ 1e-11 a step (gradients here are < 0.1 and their float64
noise < ~1e-17).

Bitwise (``BITWISE``): a recompute schedule runs the same kernels on the same inputs in the same
order as its twin, so it must agree to the bit in any dtype.

fp32 (one case per path, ``fp32_tol``): the same argument with eps32 = 1.2e-7 and the worst-case
(not statistical) constant, so it holds for every kernel set. Each reduction of at most ``width``
terms adds at most width * eps32 relative error; to first order the errors of the ``depth``
chained reductions on the path to a quantity add up; the two computations compared may each be
off by half of that. So

    |fp32 a - fp32 b| <= depth * width * eps32 * scale,

with scale the largest magnitude of the quantity (per tensor), width the longest reduction
(max of hidden, ffn, vocabulary, sequence, tokens in the batch) and depth from ``fp32_depth``.
Only the loss, logits and gradients after one backward from equal weights are compared in fp32:
fp32 parameters after AdamW steps are not (AdamW's first updates are about lr * sign(grad), so a
gradient element near zero whose rounding differs flips its step by 2 * lr: no rounding bound
holds there; that is what failed on AVX512 machines).

Measured over every ``pytest -m exact`` comparison under ATEN_CPU_CAPABILITY=default, avx2 and
avx512 (an Intel AVX512 machine): float64 parameters after AdamW steps differ by at most 9.5e-13
(1% of EXACT64), losses, logits and gradients by at most 2.7e-14; fp32 differences stay below
0.12% of their derived bound.
"""

from __future__ import annotations

import torch

EXACT64 = {"atol": 1e-10, "rtol": 1e-10}
BITWISE = {"atol": 0.0, "rtol": 0.0}
EPS32 = torch.finfo(torch.float32).eps  # 1.19e-7


def fp32_depth(n_layers: int, backward: bool) -> int:
    """Chained reductions from the tokens to the loss (and back to a weight gradient).

    Per pre-LN block: 2 norms (mean and variance each: 4), qkv, attention scores, softmax,
    attention values, projection, fc1, fc2 (7): 11. The head: norm (2), vocabulary matmul,
    log-sum-exp, mean over tokens: 5. The backward mirrors the forward and adds the weight
    gradient's sum over tokens."""
    forward = 11 * n_layers + 5
    return 2 * forward + 1 if backward else forward


def fp32_width(cfg, n_tokens: int) -> int:  # noqa: ANN001 (a ModelConfig)
    """The longest single reduction: hidden, ffn, vocabulary, sequence or the batch's tokens."""
    return max(cfg.dim, cfg.ffn_dim, cfg.vocab_size, cfg.seq_len, n_tokens)


def fp32_bound(ref: torch.Tensor, depth: int, width: int) -> dict:
    """``assert_close`` arguments: atol = depth * width * eps32 * max|ref| (module doc)."""
    scale = float(ref.detach().abs().max()) if ref.numel() else 0.0
    return {"atol": depth * width * EPS32 * scale, "rtol": 0.0}


def fp32_tol(ref: torch.Tensor, cfg, n_tokens: int, backward: bool) -> dict:  # noqa: ANN001
    """``fp32_bound`` for a quantity of a model ``cfg`` on ``n_tokens`` tokens whose reference
    value is ``ref``: the loss or logits (``backward`` False) or a gradient (True)."""
    return fp32_bound(ref, fp32_depth(cfg.n_layers, backward), fp32_width(cfg, n_tokens))


def to64(model: torch.nn.Module) -> torch.nn.Module:
    """The model in float64 (parameters and buffers, in place); returns it."""
    return model.to(torch.float64)
