"""Cut a parallelized ``Transformer`` into its chain of regions.

Under Megatron-style TMP the model alternates *TP regions* (sharded matmuls from a replicated
input to a partial sum) and replicated *glue*. Region i of the chain has two pieces:

    body:i   x_i [B,S,H] -> norm -> h_i -> TP matmuls -> y_i -> row-parallel partial p_i [B,S,H]
    epi:i    (x_i, r_i = all-reduce(p_i)) -> x_{i+1} = x_i + dropout(r_i + bias)

so the chain is ``body:0 epi:0 | body:1 epi:1 | ... | body:R-1`` with one forward all-reduce
after every body (of p_i) and one backward all-reduce of the partial gradient of h_i, each over
the region's own TP group (a plan may give every region its own degree; the batch is resharded
between regions of different degrees, so a region at degree t holds t / t_0 times the rows of
the embedding's layout)::

    region 0          embed       body: vocab-parallel lookup; epi: + positions, dropout
    region 2l+1       blocks.l    attention (attn_norm, qkv, attention, proj)
    region 2l+2       blocks.l    MLP (mlp_norm, fc1, act, fc2)
    region R-1 = 2L+1 head        norm, column-parallel head, vocab-parallel cross-entropy (no epi)

Under a pipeline (``plan.pp`` > 1) a rank holds only its stage's regions
(``parallel/stage_model.py``); the chain keeps every region's index, name and degree, the
others as stubs without modules or parameters.

Shape legend: b sub-batch rows, S sequence, H hidden, I row-parallel input features (local).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor, nn

from oases.model import Transformer
from oases.parallel.context import Group
from oases.parallel.layers import RowParallelLinear
from oases.precision import to_activation


@dataclass
class Region:
    """One TP region of the chain and the glue that follows its collective."""

    index: int
    kind: str  # "embed" | "attn" | "mlp" | "head"
    name: str  # e.g. "blocks.3.mlp"
    norm: nn.Module | None  # None for the embedding region
    core: Callable[[Tensor], Tensor] | None  # h -> y (attn/mlp) ; None for embed/head
    row: RowParallelLinear | None  # the row-parallel output layer (attn/mlp)
    epilogue: Callable[[Tensor | None, Tensor], Tensor] | None  # (x, r) -> x'; None for head
    tp: int  # the region's TP degree (``ParallelPlan.tp_of(name)``)
    tp_group: Group  # its fwd/bwd all-reduces
    dp_group: Group  # its gradients' data-parallel mean
    norm_params: list[nn.Parameter] = field(default_factory=list)
    tp_params: list[nn.Parameter] = field(default_factory=list)
    epi_params: list[nn.Parameter] = field(default_factory=list)
    dropout: float = 0.0
    module: nn.Module | None = None  # the attention or MLP whose core this region runs


def _params(*modules: nn.Module | None) -> list[nn.Parameter]:
    return [p for m in modules if m is not None for p in m.parameters()]


def build_chain(model: Transformer) -> list[Region]:
    """The regions of a parallelized model, in forward order."""
    if model.parallel_ctx is None:
        raise ValueError("build_chain needs a parallelized model: call oases.parallelize first")
    cfg, ctx, plan = model.cfg, model.parallel_ctx, model.parallel_plan

    def degree(name: str) -> tuple[int, Group, Group]:
        tp = plan.tp_of(name)
        return (tp, *ctx.groups_for(tp))

    layout = plan.stage_layout()
    if layout.pp > 1:
        if ctx.pp != layout.pp:
            raise ValueError(f"plan pp={layout.pp} but the process groups have pp={ctx.pp}")

        def held(index: int) -> bool:
            return layout.holds(ctx.pp_rank, index)
    else:

        def held(index: int) -> bool:
            return True

    def stub(index: int, kind: str, name: str) -> Region:
        """A region of another pipeline stage: its place in the chain, nothing to run."""
        return Region(index, kind, name, None, None, None, None, *degree(name))

    def embed_epilogue(
        x: Tensor | None, r: Tensor, start: int = 0, pos_grad: bool = True
    ) -> Tensor:
        S = r.shape[1]  # positions start .. start + S (a slice of the sequence under sp)
        if model.pos_embed is not None:  # in r's dtype, as the single-device model adds it
            w = model.pos_embed.weight  # (sp: its gradient comes from the gathered dr_0)
            r = r + to_activation((w if pos_grad else w.detach())[start : start + S])
        return model.drop(r)

    chain = [
        Region(
            0,
            "embed",
            "embed",
            None,
            None,
            None,
            embed_epilogue,
            *degree("embed"),
            tp_params=_params(model.embed),
            epi_params=_params(model.pos_embed),
            dropout=cfg.dropout,
        )
        if held(0)
        else stub(0, "embed", "embed")
    ]
    for layer, block in enumerate(model.blocks):
        if not held(len(chain)):
            chain += [
                stub(len(chain), "attn", f"blocks.{layer}.attn"),
                stub(len(chain) + 1, "mlp", f"blocks.{layer}.mlp"),
            ]
            continue
        for kind, norm, sub in (
            ("attn", block.attn_norm, block.attn),
            ("mlp", block.mlp_norm, block.mlp),
        ):
            row = sub.proj if kind == "attn" else sub.fc2

            def epilogue(
                x: Tensor | None,
                r: Tensor,
                row: RowParallelLinear = row,
                drop: nn.Module = block.drop,
                biased: bool = False,  # r holds the bias already (its matmul added it)
            ) -> Tensor:
                return x + drop(r if biased else row.add_bias(r))

            tp = [p for p in sub.parameters() if p is not row.bias]
            name = f"blocks.{layer}.{kind}"
            chain.append(
                Region(
                    len(chain),
                    kind,
                    name,
                    norm,
                    sub.core,
                    row,
                    epilogue,
                    *degree(name),
                    norm_params=_params(norm),
                    tp_params=tp,
                    epi_params=[row.bias] if row.bias is not None else [],
                    dropout=cfg.dropout,
                    module=sub,
                )
            )
    if not held(len(chain)):
        return [*chain, stub(len(chain), "head", "head")]
    chain.append(
        Region(
            len(chain),
            "head",
            "head",
            model.norm,
            None,
            None,
            None,
            *degree("head"),
            norm_params=_params(model.norm),
            tp_params=_params(model.head),
        )
    )
    return chain


def dp_buckets(
    chain: list[Region], skip: frozenset[int] = frozenset()
) -> dict[int, list[nn.Parameter]]:
    """Parameters grouped by the backward task after which their gradients are final.

    Backward task i runs ``norm:i+1``, ``epi:i`` and ``tp:i``; a parameter used by several tasks
    (a tied embedding) is final after the lowest one. Returns {task index: params}, without the
    parameters whose ids are in ``skip`` (those ZeRO shards: they reduce-scatter instead).
    """
    last: dict[int, tuple[int, nn.Parameter]] = {}
    for region in chain:
        i = region.index
        for task, params in (
            (i, region.tp_params),
            (i, region.epi_params),
            (i - 1, region.norm_params),
        ):
            for p in params:
                if id(p) in skip:
                    continue
                if id(p) not in last or task < last[id(p)][0]:
                    last[id(p)] = (task, p)
    buckets: dict[int, list[nn.Parameter]] = {}
    for task, p in last.values():
        buckets.setdefault(task, []).append(p)
    return buckets


def dp_bucket_groups(
    chain: list[Region], skip: frozenset[int] = frozenset()
) -> dict[int, list[tuple[Group, list[nn.Parameter]]]]:
    """Each bucket of ``dp_buckets`` split by the data-parallel group its parameters are
    reduced over: that of the region owning them (backward task i holds norm:i+1's parameters
    and region i's, which differ where the degree changes). One entry per (task, group), in
    chain order; a tied weight belongs to the embedding (the head shares its degree)."""
    owner: dict[int, Region] = {}
    for region in reversed(chain):
        for p in (*region.norm_params, *region.tp_params, *region.epi_params):
            owner[id(p)] = region
    out: dict[int, list[tuple[Group, list[nn.Parameter]]]] = {}
    for task, params in dp_buckets(chain, skip).items():
        by_degree: dict[int, tuple[Group, list[nn.Parameter]]] = {}
        for p in params:
            region = owner[id(p)]
            by_degree.setdefault(region.tp, (region.dp_group, []))[1].append(p)
        out[task] = list(by_degree.values())
    return out
