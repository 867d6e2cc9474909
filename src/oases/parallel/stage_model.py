"""The model of one pipeline stage: ``keep_stage`` frees the modules of every other stage.

Every rank builds the full single-device model from the same seed (as without a pipeline),
``parallelize`` shards it and then keeps only this stage's modules (``plan.stage_layout()``,
``ctx.pp_rank``); region indices and parameter names stay those of the whole model::

    stage 0 of 2 (L = 4):   embed, pos_embed, blocks.0-1              (blocks.2-3: empty)
    stage 1 of 2:           blocks.2-3, norm, head                    (blocks.0-1: empty)
                            (+ embed, holding the head's copy of a tied weight)

Dropped blocks become ``DroppedBlock`` placeholders (no parameters), so ``blocks.{l}`` keeps
its index; the embedding, positions, final norm and head of other stages become None. The
optimizer, the DP buckets and ZeRO then see only this stage's parameters.

Tied embeddings (GPT-2): the last stage keeps the embedding module as a shell whose weight is
the head's, so its copy of the shared weight keeps the name ``embed.weight`` (no weight decay,
the embedding's degree, the single-device model's checkpoint key) while the first stage has its
own: the two copies start equal and get the same summed gradient every step ("tie",
``schedule/pipeline_program.py``), so they stay equal (``tied_copy`` names the last stage's,
which the gradient norm counts once). A plain model's ``forward`` does not run on a stage
model: the schedules run it (``schedule/pipeline_eval.py`` evaluates it).
"""

from __future__ import annotations

from torch import nn

from oases.model import Transformer


class DroppedBlock(nn.Module):
    """The place of a block another pipeline stage holds."""

    def forward(self, *args: object) -> None:
        raise RuntimeError("this block belongs to another pipeline stage")


def holds(model: Transformer, region: int) -> bool:
    """Does this rank's stage hold chain region ``region`` (always, without a pipeline)?"""
    plan, ctx = model.parallel_plan, model.parallel_ctx
    if plan is None or plan.pp == 1:
        return True
    return plan.stage_layout().holds(ctx.pp_rank, region)


def is_stage_model(model: Transformer) -> bool:
    """Is ``model`` one pipeline stage of a larger model?"""
    plan = getattr(model, "parallel_plan", None)
    return plan is not None and plan.pp > 1


def keep_stage(model: Transformer) -> Transformer:
    """Free the modules of the other pipeline stages (module docstring); a no-op at pp=1."""
    if not is_stage_model(model):
        return model
    n_regions = 2 * len(model.blocks) + 2
    tied = model.cfg.tie_embeddings
    first, last = holds(model, 0), holds(model, n_regions - 1)
    for layer in range(len(model.blocks)):
        if not holds(model, 2 * layer + 1):
            model.blocks[layer] = DroppedBlock()
    if not first:
        model.pos_embed = None
        if not (tied and last):  # the last stage's shell of a tied weight (module docstring)
            model.embed = None
    if not last:
        model.norm = None
        model.head = None
    return model


def tied_copy(model: Transformer) -> nn.Parameter | None:
    """The last stage's copy of a tied embedding weight (counted once in the gradient norm:
    the first stage's is the other), or None."""
    if not (is_stage_model(model) and model.cfg.tie_embeddings):
        return None
    if holds(model, 0) or not holds(model, 2 * len(model.blocks) + 1):
        return None
    return model.head.weight
