"""The kernels of every piece: what one sub-batch's piece of a region launches on a GPU.

A piece (``planner.costs``: forward/recompute "body", "body-commfree", "epi"; backward
"norm", "epi", "tp"; sequence parallelism's "sp-*") is the eager ops of ``oases/model.py``
and ``parallel/layers.py`` on its tokens, in order. A region's forward body::

    attn   norm -> cast W, qkv GEMM -> rotary (LLaMA) -> repeat k, v (GQA) -> attention ->
           copy out -> cast W, proj GEMM               (body-commfree: without the proj)
    mlp    norm -> cast W, fc1 GEMM -> swiglu | gelu -> cast W, fc2 GEMM   (commfree: no fc2)
    head   norm -> cast W, logits GEMM -> vocab-parallel cross-entropy
    embed  the vocab-parallel lookup (mask foreign ids, gather rows, zero them)
    epi    bias (GPT-2) -> dropout -> residual add           (embed: positions, dropout)

Attention is one fused kernel ("fused": SDPA's flash kernel; ``planner.kernels.attention``)
or the paper prototype's materialized path: QK^T as a batched GEMM [S, D] x [D, S] per head,
the scores masked, softmaxed and dropped out in memory-bound passes over [b, A/t, S, S], and
AV as a GEMM [S, S] x [S, D]. The backward "tp" piece runs each GEMM's input gradient
(dX = dY W: M=T, N=in, K=out) and weight gradient (dW = dY^T X: M=out, N=in, K=T), the
elementwise ops' backward, and attention's (fused: one kernel at 2.5x the forward's flops;
materialized: dP, dV, dQ, dK GEMMs and the softmax backward's passes). "sp-dw" is the weight
gradients alone, "sp-dx" the rest. Shape legend: b rows, S sequence, T = b S tokens, H
hidden, A, K heads and kv heads, D head dim, F ffn, V vocabulary (padded to a multiple of t),
t TP degree, e bytes of the compute dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from oases.config import ModelConfig
from oases.planner.kernels.memory_bound import op_bytes

SCORE_FWD_PASSES = 6  # QK^T writes, mask (2), softmax (2), AV reads; + dropout
SCORE_BWD_PASSES = 8  # dP written, softmax backward (3), mask backward (2), two GEMM reads
SCORE_FWD_KERNELS, SCORE_BWD_KERNELS = 3, 3  # mask, softmax (+ dropout): each a kernel


@dataclass(frozen=True)
class Kernel:
    """One kernel (or ``count`` back-to-back ones) of a piece: a GEMM of ``gemm`` = (M, N,
    K, batch), a fused attention pass of ``attn`` = (b, heads, S, D, causal, backward), or
    a memory-bound op moving ``nbytes``; ``cls`` names its class in a breakdown."""

    cls: str
    label: str
    flops: float = 0.0
    nbytes: float = 0.0
    count: int = 1
    gemm: tuple[int, int, int, int] | None = None
    attn: tuple[int, float, int, int, bool, bool] | None = None
    weight_grad: bool = False  # a weight gradient (sequence parallelism's "sp-dw")


def gemm(label: str, m: int, n: int, k: int, batch: int = 1, weight_grad: bool = False) -> Kernel:
    return Kernel(
        "gemm", label, 2.0 * m * n * k * batch, gemm=(m, n, k, batch), weight_grad=weight_grad
    )


def memory(
    op: str, label: str, elements: float, e: float, backward: bool, weight_grad: bool = False
) -> list[Kernel]:
    from oases.planner.kernels.memory_bound import OPS

    nbytes, count = op_bytes(op, elements, e, backward)
    if count == 0:
        return []
    return [Kernel(OPS[op].cls, label, nbytes=nbytes, count=count, weight_grad=weight_grad)]


class PieceKernels:
    """The kernels of ``model``'s pieces with ``e``-byte activations and ``attention``
    ("fused" | "materialized")."""

    def __init__(self, model: ModelConfig, e: float, attention: str) -> None:
        self.m, self.e, self.attention = model, e, attention
        self.norm = "layernorm" if model.arch == "gpt2" else "rmsnorm"

    # -- shapes ---------------------------------------------------------------------------
    def _linears(self, region: str, tp: int) -> list[tuple[str, int, int]]:
        """(name, in, out) of the region's local linears in forward order."""
        m = self.m
        if region == "attn":
            return [
                ("qkv", m.dim, (m.n_heads + 2 * m.n_kv_heads) * m.head_dim // tp),
                ("proj", m.n_heads * m.head_dim // tp, m.dim),
            ]
        if region == "mlp":
            fc1 = (2 if m.arch == "llama" else 1) * m.ffn_dim // tp
            return [("fc1", m.dim, fc1), ("fc2", m.ffn_dim // tp, m.dim)]
        if region == "head":
            return [("logits", m.dim, math.ceil(m.vocab_size / tp))]
        return []

    # -- forward --------------------------------------------------------------------------
    def forward(self, region: str, piece: str, tp: int, rows: int) -> list[Kernel]:
        """Kernels of a forward (or recompute) "body", "body-commfree" or "epi"."""
        m, e = self.m, self.e
        T, H = rows * m.seq_len, m.dim
        if piece == "epi":
            return self.epi(region, T, backward=False)
        if region == "embed":
            return [Kernel("embedding", "lookup", nbytes=4 * T * H * e, count=4)]
        ks = memory(self.norm, "norm", T * H, e, False)
        linears = self._linears(region, tp)
        if piece == "body-commfree" and region in ("attn", "mlp"):
            linears = linears[:-1]
        for i, (name, n_in, n_out) in enumerate(linears):
            ks += memory("cast_weight", f"cast {name}", n_in * n_out, e, False)
            ks.append(gemm(name, T, n_out, n_in))
            if i == 0:
                ks += self._after_first(region, T, tp, rows, backward=False)
        return ks

    def _after_first(
        self, region: str, tokens: int, tp: int, rows: int, backward: bool
    ) -> list[Kernel]:
        """The ops between a region's first GEMM and its second (or, head, after it)."""
        m, e, T = self.m, self.e, tokens
        if region == "mlp":
            act = "swiglu" if m.arch == "llama" else "gelu"
            return memory(act, act, T * m.ffn_dim / tp, e, backward)
        if region == "head":
            return memory("ce", "cross-entropy", T * math.ceil(m.vocab_size / tp), e, backward)
        heads, kv = m.n_heads / tp, m.n_kv_heads / tp
        ks: list[Kernel] = []
        if m.arch == "llama":
            ks += memory("rotary", "rotary", T * (heads + kv) * m.head_dim, e, backward)
        if kv != heads:
            ks += memory("repeat_kv", "repeat k, v", 2 * T * heads * m.head_dim, e, backward)
        ks += self._attention(rows, heads, backward)
        ks += memory("copy", "attention out copy", T * heads * m.head_dim, e, backward)
        return ks

    def _attention(self, rows: int, heads: float, backward: bool) -> list[Kernel]:
        m, e = self.m, self.e
        S, D = m.seq_len, m.head_dim
        if self.attention == "fused":
            from oases.planner.kernels.attention import attention_flops

            flops = attention_flops(rows, heads, S, D, True, backward)
            return [
                Kernel(
                    "attention",
                    "flash attention" + (" backward" if backward else ""),
                    flops,
                    attn=(rows, heads, S, D, True, backward),
                )
            ]
        batch = max(1, round(rows * heads))
        drop = 2 + 1 / e if m.dropout > 0 else 0.0
        passes = (SCORE_BWD_PASSES if backward else SCORE_FWD_PASSES) + drop
        scores = Kernel(
            "attention",
            "scores (mask, softmax, dropout)",
            nbytes=rows * heads * S * S * e * passes,
            count=(SCORE_BWD_KERNELS if backward else SCORE_FWD_KERNELS) + (m.dropout > 0),
        )
        if not backward:
            return [gemm("QK^T", S, S, D, batch), scores, gemm("AV", S, D, S, batch)]
        return [
            gemm("dP = dO V^T", S, S, D, batch),
            gemm("dV = P^T dO", S, D, S, batch),
            scores,
            gemm("dQ = dS K", S, D, S, batch),
            gemm("dK = dS^T Q", S, D, S, batch),
        ]

    def epi(self, region: str, tokens: float, backward: bool) -> list[Kernel]:
        """Kernels of the glue after a region (forward, or its backward) over ``tokens``."""
        m, e, T = self.m, self.e, tokens
        H, gpt2 = m.dim, m.arch == "gpt2"
        if region == "head":
            return []
        ks: list[Kernel] = []
        if gpt2:  # the row-parallel bias (embed: the learned positions)
            ks += memory(
                "residual" if region == "embed" and not backward else "bias",
                "positions" if region == "embed" else "bias",
                T * H,
                e,
                backward,
            )
        if m.dropout > 0:
            ks += memory("dropout", "dropout", T * H, e, backward)
        if region != "embed" and not backward:
            ks += memory("residual", "residual add", T * H, e, False)
        return ks

    # -- backward -------------------------------------------------------------------------
    def backward(self, region: str, piece: str, tp: int, rows: int) -> list[Kernel]:
        """Kernels of a backward "norm", "epi" or "tp" (weight gradients flagged)."""
        m, e = self.m, self.e
        T, H = rows * m.seq_len, m.dim
        if piece == "norm":
            if region == "embed":
                return []
            return memory(self.norm, "norm backward", T * H, e, True) + memory(
                "residual", "residual gradient sum", T * H, e, True
            )
        if piece == "epi":
            return self.epi(region, T, backward=True)
        if region == "embed":  # zero the [V/t, H] gradient, scatter-add the rows into it
            vt = math.ceil(m.vocab_size / tp)
            return [
                Kernel("embedding", "lookup backward", nbytes=2 * T * H * e + vt * H * e, count=3)
            ]
        ks: list[Kernel] = []
        linears = self._linears(region, tp)
        for i, (name, n_in, n_out) in reversed(list(enumerate(linears))):
            ks.append(gemm(f"{name} dX", T, n_in, n_out))
            ks.append(gemm(f"{name} dW", n_out, n_in, T, weight_grad=True))
            ks += memory(
                "cast_weight",
                f"{name} dW cast, accumulate",
                n_in * n_out,
                e,
                True,
                weight_grad=True,
            )
            if i == 0 and region != "head":
                continue
            if i == 1 or region == "head":
                ks += self._after_first(region, T, tp, rows, backward=True)
        return ks
