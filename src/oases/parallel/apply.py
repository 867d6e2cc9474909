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

With pipeline stages (``ctx.pp`` > 1) each rank then keeps only its stage's modules
(``stage_model.keep_stage``).

Degree checks run before anything changes and before any collective, on every rank alike.
"""

from __future__ import annotations

from torch import Tensor, nn

from oases.model import Transformer
from oases.parallel import comm
from oases.parallel.context import Group, ParallelContext
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
from oases.parallel.stage_model import keep_stage
from oases.plan import ParallelPlan

__all__ = ["check_model_degrees", "parallelize", "shard_spec", "shard_tensor", "ShardSpec"]


def check_model_degrees(model: Transformer, tp: int) -> None:
    """Raise ValueError (with the numbers) if the model's heads or ffn do not split over tp."""
    cfg = model.cfg
    for key, value in (
        ("n_heads", cfg.n_heads),
        ("n_kv_heads", cfg.n_kv_heads),
        ("ffn_dim", cfg.ffn_dim),
    ):
        if value % tp:
            raise ValueError(f"model.{key}={value} is not divisible by parallel.tp={tp}")


class BatchReshard(nn.Module):
    """A reshard point of a mixed-degree plan: activations [b, ...] from TP degree ``from_tp``
    to ``to_tp`` along the batch (``comm.reshard_batch``)."""

    def __init__(self, from_tp: int, to_tp: int, group: Group) -> None:
        super().__init__()
        self.from_tp, self.to_tp, self.group = from_tp, to_tp, group

    def forward(self, x: Tensor) -> Tensor:
        return comm.reshard_batch(x, self.from_tp, self.to_tp, self.group)

    def extra_repr(self) -> str:
        return f"tp {self.from_tp} -> {self.to_tp}"


def _reshard(ctx: ParallelContext, from_tp: int, to_tp: int) -> nn.Module:
    if from_tp == to_tp:
        return nn.Identity()
    return BatchReshard(from_tp, to_tp, ctx.merge_group(from_tp, to_tp))


def parallelize(
    model: Transformer, ctx: ParallelContext, plan: ParallelPlan | None = None
) -> Transformer:
    """Shard ``model`` in place and return it (``model.parallel_ctx = ctx``,
    ``model.parallel_plan = plan``).

    Without a plan every region uses ``ctx.tp``. With a plan each region is sharded over the TP
    group of its own degree (``init_distributed(degrees=plan.degrees())`` builds them) and the
    activations are resharded along the batch where the degree changes; the input batch is in
    the embedding's layout, and the targets follow to the head's. The model must be a full
    single-device model, identical on every rank (build it from the same seed everywhere).
    """
    if getattr(model, "parallel_ctx", None) is not None:
        raise ValueError("model is already parallelized")
    cfg = model.cfg
    if plan is None:
        check_model_degrees(model, ctx.tp)
        plan = ParallelPlan.uniform(
            cfg, ctx.world_size, ctx.tp, **({"pp": ctx.pp} if ctx.pp > 1 else {})
        )
    plan.check(cfg, ctx.world_size)
    if plan.pp != ctx.pp:
        raise ValueError(
            f"plan pp={plan.pp} but the process groups have pp={ctx.pp} (init_distributed(pp=...))"
        )
    tied = model.head.weight is model.embed.weight

    def group(name: str) -> Group:
        return ctx.groups_for(plan.tp_of(name))[0]

    model.embed = VocabParallelEmbedding(model.embed, group("embed"))
    prev = "embed"
    for layer, block in enumerate(model.blocks):
        a, m = f"blocks.{layer}.attn", f"blocks.{layer}.mlp"
        ta, tm = plan.tp_of(a), plan.tp_of(m)
        attn = block.attn
        q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        attn.qkv = ColumnParallelLinear(attn.qkv, group(a), (q, kv, kv))
        attn.proj = RowParallelLinear(attn.proj, group(a))
        attn.n_heads, attn.n_kv_heads = cfg.n_heads // ta, cfg.n_kv_heads // ta
        mlp = block.mlp
        parts = (cfg.ffn_dim, cfg.ffn_dim) if mlp.gated else (cfg.ffn_dim,)
        mlp.fc1 = ColumnParallelLinear(mlp.fc1, group(m), parts)
        mlp.fc2 = RowParallelLinear(mlp.fc2, group(m))
        block.attn_reshard = _reshard(ctx, plan.tp_of(prev), ta)
        block.mlp_reshard = _reshard(ctx, ta, tm)
        prev = m
    head = ColumnParallelLinear(model.head, group("head"), pad=True)
    if tied:
        head.weight = model.embed.weight
    model.head = head
    model.loss_fn = VocabParallelCrossEntropy(group("head"), cfg.vocab_size)
    model.gather_logits = GatherLogits(group("head"), cfg.vocab_size)
    model.head_reshard = _reshard(ctx, plan.tp_of(prev), plan.tp_of("head"))
    model.target_reshard = _reshard(ctx, plan.tp_of("embed"), plan.tp_of("head"))
    model.parallel_ctx, model.parallel_plan = ctx, plan
    keep_stage(model)  # (pipeline stages: only this stage's modules)
    if any(p.is_meta for p in model.parameters()):
        return model  # built on "meta" (oases.hf.load_hf): the caller materializes it
    return model.to(ctx.device)


def region_parameters(model: Transformer) -> dict[str, list[nn.Parameter]]:
    """Each plan region's parameters (a tied weight once, under the embedding; a pipeline
    stage's model: those it holds, the other regions' lists empty)."""

    def params(*modules: nn.Module | None) -> list[nn.Parameter]:
        return [p for m in modules if m is not None for p in m.parameters()]

    out: dict[str, list[nn.Parameter]] = {"embed": params(model.embed, model.pos_embed)}
    for layer, block in enumerate(model.blocks):
        attn, mlp = (getattr(block, n, None) for n in ("attn", "mlp"))
        out[f"blocks.{layer}.attn"] = params(getattr(block, "attn_norm", None), attn)
        out[f"blocks.{layer}.mlp"] = params(getattr(block, "mlp_norm", None), mlp)
    seen = {id(p) for ps in out.values() for p in ps}
    out["head"] = [p for p in params(model.norm, model.head) if id(p) not in seen]
    return out


def parameter_degrees(model: Transformer) -> dict[int, int]:
    """id(parameter) -> the TP degree of its region ({} for a model that is not parallelized)."""
    plan = model.parallel_plan
    if plan is None:
        return {}
    return {id(p): plan.tp_of(name) for name, ps in region_parameters(model).items() for p in ps}


def reduce_gradients(model: Transformer) -> None:
    """Average gradients over data parallelism for any plan: each region's gradients are
    summed over its own DP group and divided by the head's DP degree (the number of distinct
    loss terms), which is the plain mean when the plan is uniform."""
    ctx, plan = model.parallel_ctx, model.parallel_plan
    dp_head = ctx.stage_size // plan.tp_of("head")
    handles = [
        comm.gradient_mean_async(params, ctx.groups_for(plan.tp_of(name))[1], divisor=dp_head)
        for name, params in region_parameters(model).items()
    ]
    for h in handles:
        h.wait()
