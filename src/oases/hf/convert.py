"""Hugging Face <-> Oases: config fields and parameter names, in both directions (no I/O).

Every Oases parameter is a concatenation along dim 0 of one or more Hugging Face tensors
(``Piece``), each possibly transposed (GPT-2's ``Conv1D`` stores weights as [in, out])::

    GPT-2   blocks.i.attn.qkv.weight [3H, H] = transformer.h.i.attn.c_attn.weight^T  ([q|k|v])
    LLaMA   blocks.i.attn.qkv.weight [(A+2K)D, H] = cat(q_proj, k_proj, v_proj)
    LLaMA   blocks.i.mlp.fc1.weight  [2F, H] = cat(gate_proj, up_proj)

Loading reads the pieces (or slices of them), saving splits a full tensor back into them. LLaMA's
q/k rows are already in the rotate-half layout that ``oases.model.apply_rope`` uses, so they are
copied as they are (no permutation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from oases.config import ModelConfig

SUPPORTED = ("gpt2", "llama", "mistral")
# Canonical prefixes of the *ForCausalLM classes; a bare base model's files lack them.
PREFIX = {"gpt2": "transformer.", "llama": "model."}


@dataclass(frozen=True)
class Piece:
    """``rows`` rows (along Oases dim 0) of an Oases parameter come from HF tensor ``name``,
    transposed when ``transposed`` (its stored shape is then [in, rows])."""

    name: str
    rows: int
    transposed: bool = False


def _unsupported(path: str, what: str) -> ValueError:
    return ValueError(f"{path}: unsupported Hugging Face model: {what}")


def _rope_theta(hf: dict[str, Any], path: str) -> float:
    """rope_theta from a transformers 4.x (rope_theta, rope_scaling) or 5.x (rope_parameters)
    config; any scaled rope is unsupported."""
    params = hf.get("rope_parameters") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise _unsupported(path, f"rope_parameters.rope_type={kind!r} (only 'default')")
    if hf.get("rope_scaling"):
        raise _unsupported(path, f"rope_scaling={hf['rope_scaling']!r}")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def config_from_hf(
    hf: dict[str, Any], path: str = "config.json", max_seq_len: int | None = None
) -> ModelConfig:
    """ModelConfig of a GPT-2 or LLaMA/Mistral ``config.json``; ValueError naming the field that
    Oases does not support. ``max_seq_len`` caps seq_len (n_positions/max_position_embeddings)."""
    kind = hf.get("model_type")
    if kind not in SUPPORTED:
        raise _unsupported(path, f"model_type={kind!r} (supported: {', '.join(SUPPORTED)})")
    cap = max_seq_len or math.inf
    if kind == "gpt2":
        act = hf.get("activation_function", "gelu_new")
        checks = {
            "activation_function": (act in ("gelu_new", "gelu_pytorch_tanh"), act),
            "scale_attn_weights": (hf.get("scale_attn_weights", True), False),
            "scale_attn_by_inverse_layer_idx": (
                not hf.get("scale_attn_by_inverse_layer_idx", False),
                True,
            ),
            "add_cross_attention": (not hf.get("add_cross_attention", False), True),
        }
        for key, (ok, value) in checks.items():
            if not ok:
                raise _unsupported(path, f"{key}={value!r}")
        dim = hf["n_embd"]
        return ModelConfig(
            arch="gpt2",
            n_layers=hf["n_layer"],
            dim=dim,
            n_heads=hf["n_head"],
            ffn_dim=hf.get("n_inner") or 4 * dim,
            vocab_size=hf["vocab_size"],
            seq_len=int(min(hf["n_positions"], cap)),
            tie_embeddings=hf.get("tie_word_embeddings", True),
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        )
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    checks = {
        "hidden_act": (hf.get("hidden_act", "silu") == "silu", hf.get("hidden_act")),
        "attention_bias": (not hf.get("attention_bias", False), True),
        "mlp_bias": (not hf.get("mlp_bias", False), True),
        "head_dim": (hf.get("head_dim") in (None, dim // heads), hf.get("head_dim")),
    }
    for key, (ok, value) in checks.items():
        if not ok:
            raise _unsupported(path, f"{key}={value!r}")
    theta = _rope_theta(hf, path)
    seq_len = int(min(hf["max_position_embeddings"], cap))
    window = hf.get("sliding_window")
    if hf.get("use_sliding_window", True) and window is not None and window < seq_len:
        raise _unsupported(
            path,
            f"sliding_window={window} < seq_len={seq_len} (pass a "
            f"max_seq_len <= {window} to load it with full attention)",
        )
    return ModelConfig(
        arch="llama",
        n_layers=hf["num_hidden_layers"],
        dim=dim,
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        ffn_dim=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        seq_len=seq_len,
        tie_embeddings=hf.get("tie_word_embeddings", False),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
    )


# ``oases export --dtype`` -> the name config.json gives the weights' dtype
HF_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def config_to_hf(cfg: ModelConfig, doc_sep_id: int = 0, dtype: str = "fp32") -> dict[str, Any]:
    """The ``config.json`` transformers reads back as the same model (weights in ``dtype``,
    a key of ``HF_DTYPES``).

    ``doc_sep_id``: the token between documents in training (byte 0 for the byte tokenizer,
    ``Tokenizer.doc_sep_id`` otherwise), the begin and end of every text the model saw: it is
    written as ``bos_token_id`` and ``eos_token_id``, inside the vocabulary (transformers'
    defaults, GPT-2's 50256 or LLaMA's 1 and 2, would name other tokens or none)."""
    if not 0 <= doc_sep_id < cfg.vocab_size:
        raise ValueError(f"doc_sep_id={doc_sep_id} is outside the vocabulary of {cfg.vocab_size}")
    special = {"bos_token_id": doc_sep_id, "eos_token_id": doc_sep_id}
    if cfg.arch == "gpt2":
        return special | {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": cfg.vocab_size,
            "n_positions": cfg.seq_len,
            "n_embd": cfg.dim,
            "n_layer": cfg.n_layers,
            "n_head": cfg.n_heads,
            "n_inner": cfg.ffn_dim,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": cfg.norm_eps,
            "resid_pdrop": cfg.dropout,
            "embd_pdrop": cfg.dropout,
            "attn_pdrop": 0.0,
            "tie_word_embeddings": cfg.tie_embeddings,
            "dtype": HF_DTYPES[dtype],
        }
    return special | {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        "dtype": HF_DTYPES[dtype],
    }


def hf_pieces(cfg: ModelConfig) -> dict[str, list[Piece]]:
    """Oases parameter name -> its HF pieces (canonical *ForCausalLM names), in dim-0 order.
    A tied head has no entry (its weight is ``embed.weight``)."""
    H, F, V = cfg.dim, cfg.ffn_dim, cfg.vocab_size
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    out: dict[str, list[Piece]] = {}
    if cfg.arch == "gpt2":
        t = PREFIX["gpt2"]
        out["embed.weight"] = [Piece(t + "wte.weight", V)]
        out["pos_embed.weight"] = [Piece(t + "wpe.weight", cfg.seq_len)]
        ours_theirs = (
            ("attn_norm", "ln_1", H, False),
            ("attn.qkv", "attn.c_attn", 3 * H, True),
            ("attn.proj", "attn.c_proj", H, True),
            ("mlp_norm", "ln_2", H, False),
            ("mlp.fc1", "mlp.c_fc", F, True),
            ("mlp.fc2", "mlp.c_proj", H, True),
        )
        for i in range(cfg.n_layers):
            for ours, theirs, rows, transposed in ours_theirs:
                src = f"{t}h.{i}.{theirs}"
                out[f"blocks.{i}.{ours}.weight"] = [Piece(src + ".weight", rows, transposed)]
                out[f"blocks.{i}.{ours}.bias"] = [Piece(src + ".bias", rows)]
        out["norm.weight"] = [Piece(t + "ln_f.weight", H)]
        out["norm.bias"] = [Piece(t + "ln_f.bias", H)]
    else:
        m = PREFIX["llama"]
        out["embed.weight"] = [Piece(m + "embed_tokens.weight", V)]
        for i in range(cfg.n_layers):
            b, L = f"blocks.{i}.", f"{m}layers.{i}."
            out[b + "attn_norm.weight"] = [Piece(L + "input_layernorm.weight", H)]
            out[b + "attn.qkv.weight"] = [
                Piece(L + "self_attn.q_proj.weight", q),
                Piece(L + "self_attn.k_proj.weight", kv),
                Piece(L + "self_attn.v_proj.weight", kv),
            ]
            out[b + "attn.proj.weight"] = [Piece(L + "self_attn.o_proj.weight", H)]
            out[b + "mlp_norm.weight"] = [Piece(L + "post_attention_layernorm.weight", H)]
            out[b + "mlp.fc1.weight"] = [
                Piece(L + "mlp.gate_proj.weight", F),
                Piece(L + "mlp.up_proj.weight", F),
            ]
            out[b + "mlp.fc2.weight"] = [Piece(L + "mlp.down_proj.weight", H)]
        out["norm.weight"] = [Piece(m + "norm.weight", H)]
    if not cfg.tie_embeddings:
        out["head.weight"] = [Piece("lm_head.weight", V)]
    return out
