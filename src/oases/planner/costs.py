"""What the simulator needs to know about a machine and a model, in one place.

``Costs`` is the interface both cost sources offer: a profile measured on this machine
(``planner.profile.Profile``) and named hardware (``planner.hardware.HardwareCosts``)::

    compute_s(region, phase, piece, tp, rows)     one sub-batch's piece of one region, seconds
    collective_s(op, group_size, nbytes)          all_reduce | all_gather | reduce_scatter
    optimizer_s(n_params)                         one AdamW step over n_params local parameters
    saved_bytes(region, mode, tp, rows) | None    activations a region keeps forward -> backward

Pieces (see ``schedule.program``): forward/recompute "body", "body-commfree" (the recompute of a
body without its last row-parallel matmul), "epi"; backward "norm", "epi", "tp". Regions are the
kinds "embed", "attn", "mlp", "head"; ``rows`` are sequences of ``seq_len`` tokens.

The model-side numbers here are exact counts from the shapes: parameters per region and degree
(sharded and replicated), and analytic activation sizes for when no profile measured them.
Shape legend: b rows, S sequence, H hidden, F ffn, V vocabulary (padded to a multiple of t),
A heads, K kv heads, D head dim, t TP degree.
"""

from __future__ import annotations

from typing import Protocol

from oases.config import ModelConfig

BYTES = 4  # fp32 everywhere (parameters, gradients, Adam moments, activations)
OPTIMIZER_STATES = 2  # AdamW: exp_avg and exp_avg_sq per parameter


class Costs(Protocol):
    def compute_s(self, region: str, phase: str, piece: str, tp: int, rows: int) -> float: ...

    def collective_s(self, op: str, group_size: int, nbytes: int) -> float: ...


def sp_mode(mode: str, sp: str | None) -> str:
    """The saved-activation mode of recompute ``mode`` under sequence parallelism ``sp``
    (None: off): "commfree" -> "sp-commfree-gathered" or "sp-commfree-shards", else "sp-"
    + mode."""
    if sp is None:
        return mode
    return f"sp-commfree-{sp}" if mode == "commfree" else f"sp-{mode}"


def region_kind(name: str) -> str:
    """``blocks.3.mlp`` -> ``mlp``; ``embed`` and ``head`` are their own kinds."""
    return name.rsplit(".", 1)[-1]


def padded_vocab(cfg: ModelConfig, tp: int) -> int:
    return -(-cfg.vocab_size // tp) * tp


def region_params(cfg: ModelConfig, kind: str, tp: int) -> tuple[int, int]:
    """(local sharded, replicated) parameter counts of one region at degree ``tp``.

    A tied head owns nothing (its weight is the embedding's); the final norm is the head's."""
    H, F, D = cfg.dim, cfg.ffn_dim, cfg.head_dim
    gpt2 = cfg.arch == "gpt2"
    norm = 2 * H if gpt2 else H
    if kind == "embed":
        return padded_vocab(cfg, tp) * H // tp, cfg.seq_len * H if gpt2 else 0
    if kind == "head":
        head = 0 if cfg.tie_embeddings else padded_vocab(cfg, tp) * H // tp
        return head, norm
    if kind == "attn":
        qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * D
        sharded = (H * qkv + H * H + (qkv if gpt2 else 0)) // tp
        return sharded, norm + (H if gpt2 else 0)  # the proj bias is replicated
    if kind == "mlp":
        fc1 = 2 * F if cfg.arch == "llama" else F
        sharded = (H * fc1 + F * H + (fc1 if gpt2 else 0)) // tp
        return sharded, norm + (H if gpt2 else 0)  # the fc2 bias is replicated
    raise ValueError(f"unknown region kind {kind!r}")


def region_param_count(cfg: ModelConfig, kind: str, tp: int) -> int:
    return sum(region_params(cfg, kind, tp))


def analytic_saved_bytes(cfg: ModelConfig, kind: str, mode: str, tp: int, rows: int) -> float:
    """Activations region ``kind`` keeps from forward to backward for one sub-batch of ``rows``
    under recompute ``mode`` ("none" | "block" | "commfree"; under sequence parallelism
    ``sp_mode(mode, keep)``: "sp-none" | "sp-block" | "sp-commfree-gathered" |
    "sp-commfree-shards"), from the shapes (an estimate of what autograd saves; a measured
    profile replaces it). Region i owns the glue before it (epi:i-1), as the executor counts.

    Sequence parallelism keeps the norm's input, the dropout mask and the post-collective
    (x, r) on a 1/t slice; the TP matmuls still keep their gathered input h [b, S, H]."""
    H, S, F = cfg.dim, cfg.seq_len, cfg.ffn_dim
    tok = rows * S
    mask = 0.25 if cfg.dropout > 0 else 0.0  # a bool dropout mask per element, in fp32 units
    if kind == "embed":
        return 0.0
    if mode.startswith("sp-"):
        return _sp_saved_bytes(cfg, kind, mode, tp, tok, mask)
    if kind == "head":  # never recomputed: norm in/out, logits and the CE's softmax
        return tok * BYTES * (2 * H + 2 * padded_vocab(cfg, tp) / tp + mask * H)
    if mode == "commfree":
        return tok * BYTES * 2 * H  # the post-collective (x, r) of the glue before it
    if mode == "block":
        return tok * BYTES * H if kind == "attn" else 0.0  # the block input
    if kind == "attn":
        qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim / tp
        rope = qkv * 2 / 3 if cfg.arch == "llama" else 0.0
        return tok * BYTES * (3 * H + mask * H + qkv + rope + 2 * H / tp)
    fc1 = F * (3 if cfg.arch == "llama" else 2) / tp  # fc1 out (+ gate act), act out
    return tok * BYTES * (3 * H + mask * H + fc1)


def _sp_saved_bytes(cfg: ModelConfig, kind: str, mode: str, tp: int, tok: int,
                    mask: float) -> float:
    """``analytic_saved_bytes`` under sequence parallelism (see there)."""
    H, F = cfg.dim, cfg.ffn_dim
    if kind == "head":  # norm in on a slice, its gathered output, logits and the CE's softmax
        return tok * BYTES * (H / tp + H + 2 * padded_vocab(cfg, tp) / tp + mask * H / tp)
    if mode == "sp-commfree-shards":
        return tok * BYTES * 2 * H / tp  # the (x, r) slices of the glue before it
    if mode == "sp-commfree-gathered":
        return tok * BYTES * (2 * H / tp + H)  # ... and the gathered input h
    if mode == "sp-block":
        return tok * BYTES * H / tp if kind == "attn" else 0.0  # the block input's slice
    glue = 2 * H / tp + H + mask * H / tp  # norm in, residual slices; gathered h; mask
    if kind == "attn":
        qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim / tp
        rope = qkv * 2 / 3 if cfg.arch == "llama" else 0.0
        return tok * BYTES * (glue + qkv + rope + 2 * H / tp)
    fc1 = F * (3 if cfg.arch == "llama" else 2) / tp
    return tok * BYTES * (glue + fc1)
