"""``parallelize(model, ctx)``: turn a single-device ``Transformer`` into its TP twin, in place.

Sharding by module name (every weight is cut from the full one, so a model built from a seed and
then parallelized equals the single-device model built from the same seed)::

    embed                 -> VocabParallelEmbedding    rows (vocabulary, padded to a multiple of tp)
    blocks.i.attn.qkv     -> ColumnParallelLinear      rows per part [Q | K | V]: heads, kv-heads
    blocks.i.attn.proj    -> RowParallelLinear         columns (heads)
    blocks.i.mlp.fc1      -> ColumnParallelLinear      rows ([gate | up] per part for llama)
    blocks.i.mlp.fc2      -> RowParallelLinear         columns (ffn)
    head                  -> ColumnParallelLinear      rows (vocabulary; embed's shard if tied)
    loss_fn               -> VocabParallelCrossEntropy
    gather_logits         -> GatherLogits
    norms, pos_embed      replicated

Degree checks run before anything changes and before any collective, on every rank alike.
"""

from __future__ import annotations

from oases.model import Transformer
from oases.parallel.context import ParallelContext
from oases.parallel.layers import (
    ColumnParallelLinear,
    GatherLogits,
    RowParallelLinear,
    ShardSpec,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    shard_spec,
    shard_tensor,
)

__all__ = ["check_model_degrees", "parallelize", "shard_spec", "shard_tensor", "ShardSpec"]


def check_model_degrees(model: Transformer, tp: int) -> None:
    """Raise ValueError (with the numbers) if the model's heads or ffn do not split over tp."""
    cfg = model.cfg
    for key, value in (("n_heads", cfg.n_heads), ("n_kv_heads", cfg.n_kv_heads),
                       ("ffn_dim", cfg.ffn_dim)):
        if value % tp:
            raise ValueError(f"model.{key}={value} is not divisible by parallel.tp={tp}")


def parallelize(model: Transformer, ctx: ParallelContext) -> Transformer:
    """Shard ``model`` over ``ctx.tp_group`` in place and return it (``model.parallel_ctx = ctx``).

    The model must be a full single-device model, identical on every rank of the TP group (build
    it from the same seed everywhere); each rank keeps only its shards.
    """
    if getattr(model, "parallel_ctx", None) is not None:
        raise ValueError("model is already parallelized")
    tp, group = ctx.tp, ctx.tp_group
    check_model_degrees(model, tp)
    cfg = model.cfg
    tied = model.head.weight is model.embed.weight

    model.embed = VocabParallelEmbedding(model.embed, group)
    for block in model.blocks:
        attn = block.attn
        q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        attn.qkv = ColumnParallelLinear(attn.qkv, group, (q, kv, kv))
        attn.proj = RowParallelLinear(attn.proj, group)
        attn.n_heads, attn.n_kv_heads = cfg.n_heads // tp, cfg.n_kv_heads // tp
        mlp = block.mlp
        parts = (cfg.ffn_dim, cfg.ffn_dim) if mlp.gated else (cfg.ffn_dim,)
        mlp.fc1 = ColumnParallelLinear(mlp.fc1, group, parts)
        mlp.fc2 = RowParallelLinear(mlp.fc2, group)
    head = ColumnParallelLinear(model.head, group, pad=True)
    if tied:
        head.weight = model.embed.weight
    model.head = head
    model.loss_fn = VocabParallelCrossEntropy(group, cfg.vocab_size)
    model.gather_logits = GatherLogits(group, cfg.vocab_size)
    model.parallel_ctx = ctx
    if any(p.is_meta for p in model.parameters()):
        return model  # built on "meta" (oases.hf.load_hf): the caller materializes it
    return model.to(ctx.device)
