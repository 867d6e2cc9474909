"""Named model shapes for planning and simulation: the paper's seven GPT models.

The Oases paper (Li et al., IEEE TPDS 2025) evaluates seven GPT models on 32 RTX 3090s, given
by hidden size H and layers L. Everything else is stated once here, the same for all seven:

    heads H / 64 (head dim 64), sequence 1024, GPT-2 blocks (pre-LN, GELU MLP of 4H, learned
    positions, biases), GPT-2's vocabulary of 50257 tokens with the embedding tied to the head,
    dropout 0.1, fp32 weights and activations (the paper's setting), Adam (two fp32 moments
    per parameter)

(the dtypes are a simulation's precision, ``planner.precision``: ``oases simulate --dtype
bf16`` prices the same models in bf16 activations with fp32 master weights). The authors'
prototype ran a bare stack of blocks; these presets add GPT-2's embedding and head, which a
real training run has.

    load_model("paper-h2048-l24")        a preset by name
    load_model("configs/bench.toml")     the [model] table of a run file
"""

from __future__ import annotations

from pathlib import Path

from oases.config import ModelConfig, format_params

# (H, L) of the paper's table, in its order
PAPER_SHAPES = ((1024, 24), (2048, 24), (3072, 24), (4096, 16), (6144, 16), (8192, 8), (12288, 4))
GPT2_VOCAB = 50257
PAPER_SEQ_LEN = 1024
PAPER_HEAD_DIM = 64


def paper_model(dim: int, n_layers: int) -> ModelConfig:
    """One of the paper's GPT models (any H divisible by 64 and any L, in fact)."""
    if dim % PAPER_HEAD_DIM:
        raise ValueError(f"hidden size {dim} is not a multiple of the head dim {PAPER_HEAD_DIM}")
    return ModelConfig(
        arch="gpt2",
        n_layers=n_layers,
        dim=dim,
        n_heads=dim // PAPER_HEAD_DIM,
        vocab_size=GPT2_VOCAB,
        seq_len=PAPER_SEQ_LEN,
        dropout=0.1,
        tie_embeddings=True,
    )


MODELS: dict[str, ModelConfig] = {f"paper-h{h}-l{n}": paper_model(h, n) for h, n in PAPER_SHAPES}


def load_model(source: str) -> ModelConfig:
    """A preset name, or a TOML run file whose ``[model]`` table is used (ValueError naming
    the presets otherwise)."""
    if source in MODELS:
        return MODELS[source]
    if Path(source).suffix == ".toml":
        from oases.config import load_config

        return load_config(source, []).model
    raise ValueError(
        f"unknown model {source!r}: give a preset ({', '.join(MODELS)}) or a TOML "
        "run file with a [model] table"
    )


def describe_model(cfg: ModelConfig) -> str:
    """One line: shape and parameter count."""
    from oases.plan import region_names
    from oases.planner.costs import region_kind, region_param_count

    n_params = sum(region_param_count(cfg, region_kind(n), 1) for n in region_names(cfg))
    return (
        f"{cfg.arch} H={cfg.dim} L={cfg.n_layers} heads={cfg.n_heads} S={cfg.seq_len} "
        f"V={cfg.vocab_size}{' tied' if cfg.tie_embeddings else ''}: "
        f"{format_params(n_params)} parameters"
    )
