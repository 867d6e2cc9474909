"""What one transformer block keeps from its forward to its backward, tensor by tensor.

Two accounts, in bytes per block for one micro-batch of ``rows`` sequences (the sub-batches of
an overlapped schedule together: every term is linear in the rows):

``korthikanti_block_bytes``: Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models" (MLSys 2023), section 4: with 16-bit activations and 1-byte dropout masks a
GPT block keeps sbh(34 + 5as/h); with tensor parallelism sbh(10 + 24/t + 5as/(ht)) and with
sequence parallelism as well sbh/t (34 + 5as/h). Flash attention keeps no [a, s, s] scores, so
the 5as/h terms go: sbh(10 + 24/t) and sbh(34/t). Written per tensor in elements of ``elt``
bytes (replicated without sequence parallelism: the two layer-norm inputs, the QKV and fc1
inputs, two masks; split over t always: Q, K, V, the projection's input, the GeLU's input
and fc2's input, 12 sbh) it is sbh((4 elt + 2) + 12 elt / t), sbh(16 elt + 2) / t with it.

``block_terms``: the same walk for OUR blocks as the executor runs them (``model.py``; one
storage counted once, parameters never), per tensor::

    attention region (norm:i, core:i, and epi:i-1's dropout mask)
      x        norm input (the residual stream)               N H           / t under sp
      stats    LayerNorm: mean, rstd (2 N); RMSNorm: rsqrt (N)
               and the normalized x before the weight (N H)   / t under sp
      h        norm output = QKV input (sp: the slice)      N H / t under sp
               sp="gathered": + the gathered h_i, N H; "shards": not kept, gathered again
               in the backward (``schedule.regather``)
      qkv      the fused projection's output (Q, K, V are views of it), kept while a view
               of it is: GPT-2, or LLaMA without GQA (V)      N (A + 2K) D / t
      rope     LLaMA: the rotated Q (and K without GQA)       N (A + K) D / t
               and the module's cos and sin tables            2 S D
      gqa      K, V repeated to A heads (K < A)                2 N A D / t
      attn     flash attention's output (the projection's input y is a view of it) and
               logsumexp                                      N A D / t + N A / t
      mask     dropout (dropout > 0): a bool mask on a GPU, the scaled noise in the
               activation dtype on a CPU                      N H bytes or elements / t (sp)
    MLP region
      x, stats, h, mask  as above
      GPT-2    fc1's output (GeLU's input) and GeLU's output (fc2's input)   2 N F / t
      LLaMA    fc1's output [gate | up], silu(gate), silu(gate) * up        4 N F / t

where N = rows * S tokens, A and K the query and key/value heads, D the head dimension, F the
MLP width. Against the paper's GPT-2 terms ours differ only in the norms' statistics and the
logsumexp (a few N), and on a CPU in the masks (``elt`` bytes an element, not 1); LLaMA's
SwiGLU, RMSNorm and rotary keep more. Checked tensor by tensor against the executor's
``track_memory`` (benchmarks/2026-12-03-actmem).

Schedules with recompute keep less (``schedule_block_bytes``): block recompute the block's
input (N H, / t under sp); the communication-free recompute each region's post-collective
(x, r), 2 N H per region (/ t under sp), plus the gathered h_i (N H) with ``sp="gathered"``.
"""

from __future__ import annotations

from oases.config import ModelConfig


def korthikanti_block_bytes(tokens: int, dim: int, tp: int, sp: bool, elt: int = 2) -> int:
    """The paper's flash-attention count of one GPT block (MLP width 4 h): sbh(10 + 24/t)
    without sequence parallelism, sbh(34/t) with it, at ``elt`` = 2; per tensor as the module
    docstring writes it for another element size."""
    sbh = tokens * dim
    replicated = sbh * (4 * elt + 2)  # LN inputs 2, QKV and fc1 inputs 2 (elements); 2 masks
    split = sbh * 12 * elt  # Q, K, V, projection input 1 each; GeLU and fc2 inputs 4 each
    return (replicated + split) // tp if sp else replicated + split // tp


def region_terms(
    cfg: ModelConfig,
    kind: str,
    rows: int,
    tp: int,
    sp: bool,
    elt: int,
    mask_bytes: int | None = None,
) -> dict[str, int]:
    """Bytes each tensor of one block region ("attn" or "mlp", with the dropout mask of the
    glue before it, as the executor counts) keeps from the forward to the backward without
    recompute (module docstring), for ``rows`` sequences of ``cfg.seq_len`` at TP degree
    ``tp``; ``sp``: under sequence parallelism. ``mask_bytes``: a dropout mask's bytes an
    element (None: ``elt``, a CPU's dropout, which keeps its scaled noise; 1 on a GPU)."""
    if kind not in ("attn", "mlp"):
        raise ValueError(f"region kind {kind!r} must be attn or mlp")
    n = rows * cfg.seq_len
    h_dim, a, k, d, f = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    rep = tp if sp else 1  # what sequence parallelism splits
    llama = cfg.arch == "llama"
    mask = (elt if mask_bytes is None else mask_bytes) if cfg.dropout > 0 else 0
    terms = {
        "x (norm input)": n * h_dim * elt // rep,
        "norm stats": ((n + n * h_dim) * elt if llama else 2 * n * elt) // rep,
        "h (norm output)": n * h_dim * elt // rep,
        "mask": n * h_dim * mask // rep,
    }
    if kind == "mlp":
        terms["mlp"] = (4 if llama else 2) * n * f * elt // tp
        return terms
    # the fused QKV output is kept while a view of it is: Q without rotary, V without GQA
    if not llama or k == a:
        terms["qkv"] = n * (a + 2 * k) * d * elt // tp
    if llama:
        terms["rope (q, k)"] = n * (a + (k if k == a else 0)) * d * elt // tp
        terms["rope tables"] = 2 * cfg.seq_len * d * elt  # the module's cos, sin
    if k < a:
        terms["gqa (k, v repeated)"] = 2 * n * a * d * elt // tp
    # flash attention's output (the projection's input y is a view of it) and logsumexp
    terms["attn out + lse"] = (n * a * d + n * a) * elt // tp
    return terms


def block_terms(
    cfg: ModelConfig, rows: int, tp: int, sp: bool, elt: int, mask_bytes: int | None = None
) -> dict[str, int]:
    """``region_terms`` of a block's attention and MLP regions, added term by term."""
    out: dict[str, int] = {}
    for kind in ("attn", "mlp"):
        for name, value in region_terms(cfg, kind, rows, tp, sp, elt, mask_bytes).items():
            out[name] = out.get(name, 0) + value
    return out


def schedule_block_bytes(
    cfg: ModelConfig, recompute: str, rows: int, tp: int, sp: str | None, elt: int
) -> int:
    """Bytes one block keeps from the forward to the backward under a schedule's recompute
    ("none", "block", "commfree") and sequence-parallel mode (None, "gathered", "shards")."""
    n_h = rows * cfg.seq_len * cfg.dim * elt
    rep = tp if sp else 1
    if recompute == "none":  # + the gathered h of both regions unless gathered again
        kept_h = 2 * n_h if sp == "gathered" and tp > 1 else 0
        return sum(block_terms(cfg, rows, tp, sp is not None, elt).values()) + kept_h
    if recompute == "block":
        return n_h // rep
    if recompute == "commfree":  # two regions a block
        return 2 * (2 * n_h // rep + (n_h if sp == "gathered" else 0))
    raise ValueError(f"recompute={recompute!r} must be none, block or commfree")
