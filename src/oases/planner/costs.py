"""What the simulator needs to know about a machine and a model, in one place.

``Costs`` is the interface both cost sources offer: a profile measured on this machine
(``planner.profile.Profile``) and named hardware (``planner.hardware.HardwareCosts``)::

    compute_s(region, phase, piece, tp, rows)     one sub-batch's piece of one region, seconds
    collective_s(op, group_size, nbytes)          all_reduce | all_gather | reduce_scatter
    optimizer_s(n_params)                         one AdamW step over n_params local parameters
    saved_bytes(region, mode, tp, rows) | None    activations a region keeps forward -> backward

Pieces (see ``schedule.program``): forward/recompute "body", "body-commfree" (the recompute of a
body without its last row-parallel matmul), "epi"; backward "norm", "epi", "tp"; sequence
parallelism's "sp-" pieces (``sp_piece``). Regions are the
kinds "embed", "attn", "mlp", "head"; ``rows`` are sequences of ``seq_len`` tokens.

The model-side numbers here are exact counts from the shapes: parameters per region and degree
(sharded and replicated), and analytic activation sizes for when no profile measured them.
Shape legend: b rows, S sequence, H hidden, F ffn, V vocabulary (padded to a multiple of t),
A heads, K kv heads, D head dim, t TP degree.
"""

from __future__ import annotations

import functools
from typing import Protocol

from oases.config import ModelConfig
from oases.planner.activation_terms import region_terms
from oases.planner.precision import FP32, PlanPrecision


class Costs(Protocol):
    def compute_s(self, region: str, phase: str, piece: str, tp: int, rows: int) -> float: ...

    def collective_s(self, op: str, group_size: int, nbytes: int) -> float: ...


def sp_mode(mode: str, sp: str | None) -> str:
    """The saved-activation mode of recompute ``mode`` under sequence parallelism ``sp``
    (None: off): "none" and "commfree" -> "sp-none-gathered", "sp-none-shards",
    "sp-commfree-gathered", "sp-commfree-shards"; "block" -> "sp-block" (the same in both)."""
    if sp is None:
        return mode
    return f"sp-{mode}-{sp}" if mode in ("none", "commfree") else f"sp-{mode}"


def sp_piece(piece: str, phase: str, index: int, commfree: bool, deferred: bool = False) -> str:
    """The costs' name of a sequence-parallel program's piece ("norm", "epi", "core", "tp",
    "dw" of region ``index``): "sp-norm", "sp-epi", "sp-core" ("sp-core-commfree" in a
    communication-free recompute); where the region defers its weight gradients
    (``deferred``, ``schedule.program.defers_weight_grad``) the backward "tp" is "sp-dx" (the
    input gradient alone) and "dw" is "sp-dw"; elsewhere the backward "tp" and the
    embedding's lookup ("core" of region 0) are named as without it ("tp", "body"). The
    profile records and the simulator prices pieces by these names."""
    if piece == "dw":
        return "sp-dw"
    if piece == "tp":
        return "sp-dx" if deferred else piece
    if piece == "core" and index == 0:
        return "body"
    if piece == "core" and phase == "recompute" and commfree:
        return "sp-core-commfree"
    return "sp-" + piece


@functools.lru_cache(maxsize=4096)
def region_kind(name: str) -> str:
    """``blocks.3.mlp`` -> ``mlp``; ``embed`` and ``head`` are their own kinds (remembered: a
    search asks for every region's, of every plan)."""
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


def analytic_saved_bytes(
    cfg: ModelConfig, kind: str, mode: str, tp: int, rows: int, precision: PlanPrecision = FP32
) -> float:
    """Activations region ``kind`` keeps from forward to backward for one sub-batch of ``rows``
    under recompute ``mode`` ("none" | "block" | "commfree"; under sequence parallelism
    ``sp_mode(mode, keep)``: "sp-none-gathered" | "sp-none-shards" | "sp-block" |
    "sp-commfree-gathered" | "sp-commfree-shards"), from the shapes (an estimate of what
    autograd saves; a measured profile replaces it), in the compute dtype's bytes
    (``precision.activation_bytes``: 2 under bf16) plus a one-byte dropout mask per element.
    Region i owns the glue before it (epi:i-1), as the executor counts.

    Without recompute a block region's tensors are ``activation_terms.region_terms``'. Sequence
    parallelism keeps the norm's input and output, the dropout mask and the post-collective
    (x, r) on a 1/t slice; the TP matmuls' gathered input h [b, S, H] is kept ("gathered") or
    gathered again in the backward ("shards")."""
    H, S = cfg.dim, cfg.seq_len
    tok = rows * S
    e = precision.activation_bytes
    mask = 1.0 if cfg.dropout > 0 else 0.0  # a bool dropout mask per element, bytes
    if kind == "embed":
        return 0.0
    if mode.startswith("sp-"):
        return _sp_saved_bytes(cfg, kind, mode, tp, tok, mask, e)
    if kind == "head":  # never recomputed: norm in/out, logits and the CE's softmax
        return tok * (e * (2 * H + 2 * padded_vocab(cfg, tp) / tp) + mask * H)
    if mode == "commfree":
        return tok * e * 2 * H  # the post-collective (x, r) of the glue before it
    if mode == "block":
        return tok * e * H if kind == "attn" else 0.0  # the block input
    return _block_region_bytes(cfg, kind, tp, rows, e, mask, False)


def _block_region_bytes(
    cfg: ModelConfig, kind: str, tp: int, rows: int, e: float, mask: float, sp: bool
) -> float:
    """A block region's tensors without recompute, term by term as
    ``activation_terms.region_terms`` counts them (what the executor keeps; the per-module
    rotary tables, a few S x D, left out: they are not per sub-batch)."""
    terms = region_terms(cfg, kind, rows, tp, sp, 1, mask_bytes=0)  # elements, mask apart
    terms.pop("rope tables", None)
    mask_terms = region_terms(cfg, kind, rows, tp, sp, 1, mask_bytes=1)["mask"] * mask
    return e * sum(terms.values()) + mask_terms


def matmul_params(cfg: ModelConfig) -> int:
    """The parameters a matmul multiplies by, N of ``model_flops``: every block's weights and
    the output head's V x H (tied or not); not the embedding lookup, the position table, the
    norms or the biases."""
    H, F = cfg.dim, cfg.ffn_dim
    qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    fc1 = 2 * F if cfg.arch == "llama" else F
    return cfg.n_layers * (H * qkv + cfg.n_heads * cfg.head_dim * H + H * fc1 + F * H) + (
        cfg.vocab_size * H
    )


def model_flops(cfg: ModelConfig, tokens: float) -> float:
    """Model FLOPs of a training step over ``tokens`` tokens (forward and backward, without
    recompute), the PaLM / Megatron-LM formula MFU divides by::

        6 * N * tokens + 12 * L * H * S * tokens

    N: ``matmul_params`` (the blocks' matmul weights and the output head's), L layers, H
    hidden, S sequence; the second term is attention's QK^T and AV (2 x 2 x S x H flops a token
    and layer forward, x 3 with the backward), over the full S x S."""
    return 6 * matmul_params(cfg) * tokens + 12 * cfg.n_layers * cfg.dim * cfg.seq_len * tokens


def _sp_saved_bytes(
    cfg: ModelConfig, kind: str, mode: str, tp: int, tok: int, mask: float, e: float
) -> float:
    """``analytic_saved_bytes`` under sequence parallelism (see there): ``e`` bytes an
    activation element, ``mask`` bytes a dropout mask element."""
    H = cfg.dim
    if kind == "head":  # norm in on a slice, its gathered output, logits and the CE's softmax
        return tok * (e * (H / tp + H + 2 * padded_vocab(cfg, tp) / tp) + mask * H / tp)
    if mode == "sp-commfree-shards":
        return tok * e * 2 * H / tp  # the (x, r) slices of the glue before it
    if mode == "sp-commfree-gathered":
        return tok * e * (2 * H / tp + H)  # ... and the gathered input h
    if mode == "sp-block":
        return tok * e * H / tp if kind == "attn" else 0.0  # the block input's slice
    # the norm's input and output on slices; the gathered input h of the TP matmuls kept
    # ("sp-none-gathered") or gathered again in the backward ("sp-none-shards",
    # ``schedule.regather``: Korthikanti's sbh(34/t))
    kept_h = tok * e * H if mode == "sp-none-gathered" else 0.0
    return _block_region_bytes(cfg, kind, tp, tok // cfg.seq_len, e, mask, True) + kept_h
