"""What a training run does differently with pipeline stages (``parallel.pp`` > 1).

    check_pipeline_run   before any rank trains: ValueError (with the numbers) for what this
                         version does not run with a pipeline, on every rank alike
    pipeline_warnings    lines the run prints: a bubble when a step has few micro-batches,
                         the sample skipped
    counted_once         the parameters the gradient norm must not count twice (the last
                         stage's copy of a tied embedding)

The loop's own changes are a few lines (``train/loop.py``): the process groups of the plan's
``pp``, the gradient norm over every stage (``clip_grad_norm_``'s ``pp_group``), no sample.
Evaluation runs through the stages (``train/evaluate.py``, ``schedule/pipeline_forward.py``).
"""

from __future__ import annotations

from oases.config import Config
from oases.plan import ParallelPlan


def check_pipeline_run(cfg: Config, plan: ParallelPlan | None) -> None:
    """ValueError for what a pipeline run does not support yet (issue 28's next rounds)."""
    pp = plan.pp if plan is not None else cfg.parallel.pp
    if pp == 1:
        return
    stages = plan.zero_stages(cfg.parallel.zero) if plan is not None else (cfg.parallel.zero,)
    if max(stages) >= 3:
        raise ValueError(
            f"parallel.pp={pp} runs ZeRO stage 2 at most for now (got ZeRO "
            f"{max(stages)}): stage 3 gathers every region's weights around every "
            "pass, which the pipeline's interleaved micro-batches do not place "
            "yet; use parallel.zero=2"
        )
    if cfg.model.tie_embeddings and max(stages[0], stages[-1]) >= 2:
        raise ValueError(
            f"parallel.pp={pp} with model.tie_embeddings=true runs the embedding "
            f"and head at ZeRO stage 1 at most (got {max(stages[0], stages[-1])}): "
            "the tied weight's full gradient is summed between the first and last "
            "stage once a step, after its last micro-batch, while stage 2 "
            "reduce-scatters it after every micro-batch; use parallel.zero=1 (or a "
            "plan with stage 1 for embed and head)"
        )
    if plan is not None and plan.pp_chunks > 1:
        from oases.stages import check_interleaved_micro

        dp = plan.regions[0].dp
        check_interleaved_micro(
            pp, plan.pp_chunks, cfg.train.global_batch // (cfg.train.micro_batch * dp)
        )
    if cfg.model.init_from:
        raise ValueError(
            f"parallel.pp={pp} with model.init_from={cfg.model.init_from!r}: "
            "loading Hugging Face weights into pipeline stages is not built yet"
        )


def pipeline_warnings(cfg: Config, plan: ParallelPlan, n_micro: int) -> list[str]:
    """Lines for the run's start: the bubble of few micro-batches, the skipped sample."""
    if plan.pp == 1:
        return []
    out = []
    if n_micro < plan.pp:
        out.append(
            f"parallel.pp={plan.pp} with {n_micro} micro-batch(es) a step: every stage "
            f"idles at least {(plan.pp - 1) / (n_micro + plan.pp - 1):.0%} of it "
            "(the pipeline's bubble); more micro-batches (a smaller train.micro_batch or "
            "a larger train.global_batch) fill it"
        )
    if cfg.train.sample_tokens:
        out.append(
            f"train.sample_tokens={cfg.train.sample_tokens}: no sample at the end of a "
            f"pipeline run (parallel.pp={plan.pp}): sampling across stages is not "
            "built yet"
        )
    return out


def counted_once(model: object) -> frozenset[int]:
    """Ids of the parameters the gradient norm leaves out (``clip_grad_norm_``'s
    ``uncounted``): the last stage's copy of a tied embedding."""
    from oases.parallel.stage_model import tied_copy

    tied = tied_copy(model)  # type: ignore[arg-type]
    return frozenset() if tied is None else frozenset({id(tied)})
