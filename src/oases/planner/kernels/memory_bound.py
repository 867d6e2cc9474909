"""Memory-bound kernels: the bytes each eager op of the model moves, at STREAM bandwidth.

The model runs eagerly (``oases/model.py``, ``parallel/layers.py``): every op is its own
kernel and reads and writes its whole tensor. ``OPS`` lists, per element of the tensor an op
runs over, the bytes its forward and backward kernels move and how many kernels they are, as
a function of ``e``, the bytes of the compute dtype (fp32 math inside: norms, rotary and the
loss upcast to fp32; ``c`` below is 1 when that costs a cast kernel, i.e. e < 4)::

    op           over            forward bytes                      backward bytes
    rmsnorm      [T, H]          cast in, pow, mean, mul, cast out,  4e + 44 (+ casts)
                                 x weight: 20 + 2e (+ 8 + 2e if c)
    layernorm    [T, H]          one kernel: 8 (+ casts)             16 (+ casts)
    rotary       [T, (A+K)/t D]  neg, cat, 2 upcasts, 2 muls, add,   mul, mul, casts, neg,
                                 cast: 3e + 28 (+ 10 + 3e if c)      grad sum: 19 + 3e (+ ...)
    repeat_kv    [T, A/t D] x 2  GQA's repeat_interleave of k, v     its sum: 2e each
    copy         [T, A/t D]      attention output made contiguous    2e
    swiglu       [T, F/t]        silu(gate) * up: 5e                 13e (mul, silu, cat)
    gelu         [T, F/t]        2e                                  3e
    bias         [T, H]          2e                                  e (the bias gradient sum)
    residual     [T, H]          3e                                  3e (the two gradients' sum)
    dropout      [T, H]          2e + 1 (one-byte mask)              2e + 1
    ce           [T, V/t]        upcast, max, sub, exp, sum, div:    clone, scale, cast:
                                 32 (+ 4 + e if c)                   16 (+ 4 + e if c)
    cast_weight  parameters      autocast's cast of each weight: 6   dW cast + accumulate: 18
    adamw        parameters      torch's foreach AdamW: weight decay 8, lerp 12, mul+addcmul
                                 20, sqrt 8, div 8, add eps 8, addcdiv 16 = 80 bytes, 8 kernels
    grad_norm    parameters      the clipping norm (read, 4) and the scale (8): 12, 3 kernels

Each kernel is priced ``bytes / (memory bandwidth x STREAM efficiency)``; the launch of each is
``planner.kernels.launch``'s. Shape legend: T tokens, H hidden, A, K heads and kv heads, D head
dim, F ffn, V vocabulary, t TP degree, e bytes of the compute dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

FP32 = 4


@dataclass(frozen=True)
class MemoryOp:
    """An eager op's bytes per element and kernels, forward and backward, by ``e``."""

    cls: str  # the kernel class it is reported under
    fwd_bytes: Callable[[float], float]
    fwd_kernels: Callable[[float], int]
    bwd_bytes: Callable[[float], float]
    bwd_kernels: Callable[[float], int]


def _c(e: float) -> int:
    """1 where the fp32 math of an op costs a cast kernel each way (a 16-bit compute dtype)."""
    return 1 if e < FP32 else 0


OPS: dict[str, MemoryOp] = {
    "rmsnorm": MemoryOp(
        "norm",
        lambda e: 20 + 2 * e + _c(e) * (8 + 2 * e),
        lambda e: 6 + 2 * _c(e),
        lambda e: 4 * e + 44 + _c(e) * (8 + 2 * e),
        lambda e: 12 + 2 * _c(e),
    ),
    "layernorm": MemoryOp(
        "norm",
        lambda e: 8 + _c(e) * (8 + 2 * e),
        lambda e: 1 + 2 * _c(e),
        lambda e: 16 + _c(e) * (8 + 2 * e),
        lambda e: 2 + 2 * _c(e),
    ),
    "rotary": MemoryOp(
        "rotary",
        lambda e: 3 * e + 28 + _c(e) * (10 + 3 * e),
        lambda e: 5 + 3 * _c(e),
        lambda e: 19 + 3 * e + _c(e) * (10 + 3 * e),
        lambda e: 5 + 3 * _c(e),
    ),
    "repeat_kv": MemoryOp(
        "elementwise", lambda e: 2 * e, lambda e: 1, lambda e: 2 * e, lambda e: 1
    ),
    "copy": MemoryOp("elementwise", lambda e: 2 * e, lambda e: 1, lambda e: 2 * e, lambda e: 1),
    "swiglu": MemoryOp("activation", lambda e: 5 * e, lambda e: 2, lambda e: 13 * e, lambda e: 4),
    "gelu": MemoryOp("activation", lambda e: 2 * e, lambda e: 1, lambda e: 3 * e, lambda e: 1),
    "bias": MemoryOp("elementwise", lambda e: 2 * e, lambda e: 1, lambda e: e, lambda e: 1),
    "residual": MemoryOp("elementwise", lambda e: 3 * e, lambda e: 1, lambda e: 3 * e, lambda e: 1),
    "dropout": MemoryOp(
        "elementwise", lambda e: 2 * e + 1, lambda e: 1, lambda e: 2 * e + 1, lambda e: 1
    ),
    "ce": MemoryOp(
        "cross-entropy",
        lambda e: 32 + _c(e) * (4 + e),
        lambda e: 12 + _c(e),
        lambda e: 16 + _c(e) * (4 + e),
        lambda e: 4 + _c(e),
    ),
    "cast_weight": MemoryOp(
        "cast", lambda e: 6 * _c(e), lambda e: _c(e), lambda e: 6 * _c(e) + 12, lambda e: 1 + _c(e)
    ),
    "adamw": MemoryOp("optimizer", lambda e: 80, lambda e: 8, lambda e: 0, lambda e: 0),
    "grad_norm": MemoryOp("grad-norm", lambda e: 12, lambda e: 3, lambda e: 0, lambda e: 0),
}


def op_bytes(op: str, elements: float, e: float, backward: bool) -> tuple[float, int]:
    """(bytes, kernels) of ``op`` over ``elements`` elements (0 kernels over none)."""
    spec = OPS[op]
    if elements <= 0:
        return 0.0, 0
    if backward:
        return elements * spec.bwd_bytes(e), spec.bwd_kernels(e)
    return elements * spec.fwd_bytes(e), spec.fwd_kernels(e)


def stream_s(nbytes: float, bytes_per_s: float) -> float:
    """Seconds of ``nbytes`` moved at a STREAM-like bandwidth."""
    return nbytes / bytes_per_s if nbytes > 0 else 0.0
