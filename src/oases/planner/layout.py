"""Where a plan puts things, as the simulator prices them: rank 0's groups, the data-parallel
gradient buckets and their bytes, ZeRO's layout, every region's parameter state, sequence
parallelism's glue.

    group_ranks("tp", t, 0, W)       rank 0's TP group at degree t: (0, 1, .., t-1)
    group_ranks("dp", t, 0, W)       its DP group:                  (0, t, 2t, .., W-t)
    group_ranks("merge", a, b, W)    its merge group of degrees a < b: (0, a, .., b-a)
    dp_buckets(...)                  {backward task: [(dp degree, parameters)]}
    dp_bucket_bytes(buckets)         {backward task: bytes of its flat gradient copy}
    zero_layout(cfg, stages)         the program's view of the plan's ZeRO stages
    model_state(cfg, plan, W)        parameters, DP degree and ZeRO stage of every region

Pure functions of the model, the plan and the world size W (no costs, no program).
"""

from __future__ import annotations

import functools

from oases.config import ModelConfig
from oases.plan import ParallelPlan
from oases.planner.costs import region_kind, region_param_count
from oases.planner.peak_memory import ModelState
from oases.schedule.program import ZeroLayout


def glue_param_count(cfg: ModelConfig) -> int:
    """Parameters of the glue and norms (each norm, the biases added after the row-parallel
    matmuls): what sequence parallelism's "sg" sums over the TP group. Not GPT-2's positions:
    every rank computes their whole gradient from the gathered embedding gradient."""
    norm = 2 * cfg.dim if cfg.arch == "gpt2" else cfg.dim
    n = (2 * cfg.n_layers + 1) * norm
    if cfg.arch == "gpt2":
        n += 2 * cfg.n_layers * cfg.dim
    return n


@functools.lru_cache(maxsize=1024)
def group_ranks(kind: str, a: int, b: int, world_size: int) -> tuple[int, ...]:
    """Rank 0's group: TP at degree a, DP at degree a, or the merge group of degrees a < b."""
    if kind == "tp":
        return tuple(range(a))
    if kind == "dp":
        return tuple(range(0, world_size, a))
    return tuple(j * a for j in range(b // a))


def dp_buckets(
    cfg: ModelConfig,
    kinds: list[str],
    degrees: list[int],
    world_size: int,
    stages: tuple[int, ...] | None = None,
) -> dict[int, list[tuple[int, int]]]:
    """{backward task: [(dp degree, parameters)]}, as ``schedule.regions.dp_buckets`` groups
    them: task i finalizes region i's own parameters and region i+1's norm (a tied head's
    weight is the embedding's, final at task 0). Regions sharded by ZeRO (``stages`` >= 1)
    reduce-scatter their own parameters instead ("rs"). Empty when no region is
    data-parallel."""
    if all(t == world_size for t in degrees):
        return {}
    stages = stages or (0,) * len(kinds)
    norm = 2 * cfg.dim if cfg.arch == "gpt2" else cfg.dim
    buckets: dict[int, list[tuple[int, int]]] = {}
    counts = _param_counts(cfg, kinds, degrees)
    for i, (kind, t) in enumerate(zip(kinds, degrees)):
        own = counts[i] - (norm if kind != "embed" else 0)
        parts = {world_size // t: 0 if stages[i] else own}  # one all-reduce per DP group
        if i + 1 < len(kinds) and not stages[i + 1]:
            dp = world_size // degrees[i + 1]
            parts[dp] = parts.get(dp, 0) + norm
        if any(parts.values()):
            buckets[i] = [(dp, numel) for dp, numel in parts.items() if numel]
    return buckets


def _param_counts(cfg: ModelConfig, kinds: list[str], degrees: list[int]) -> list[int]:
    """Every region's own parameter count (``region_param_count``), each distinct (kind,
    degree) counted once: a model's blocks are a few distinct."""
    counts: dict[tuple[str, int], int] = {}
    for key in zip(kinds, degrees):
        if key not in counts:
            counts[key] = region_param_count(cfg, *key)
    return [counts[key] for key in zip(kinds, degrees)]


def dp_bucket_bytes(
    buckets: dict[int, list[tuple[int, int]]], element_bytes: float = 4
) -> dict[int, float]:
    """{backward task: bytes of its flat gradient copy} (``comm.gradient_mean_async``
    concatenates a bucket's gradients over each DP group into one buffer, in the dtype it
    reduces in, ``element_bytes`` an element, that lives from the bucket's Start to its Wait);
    a DP group of one rank copies nothing."""
    return {
        t: float(sum(numel for dp, numel in parts if dp > 1) * element_bytes)
        for t, parts in buckets.items()
    }


def zero_layout(
    cfg: ModelConfig,
    stages: tuple[int, ...],
    reshard_after_forward: bool = True,
    *,
    gather_updated: bool = True,
    ends_step: bool = True,
) -> ZeroLayout | None:
    """The program's view of a plan's ZeRO stages (as ``executor._zero_layout`` derives it
    from a sharded model): region i's TP pieces read region i's parameters, and a tied head
    also the embedding's, when the embedding is sharded. None when nothing is sharded.
    ``gather_updated``, ``ends_step``: ``ZeroLayout``'s knobs for one micro-batch of many."""
    if not any(stages):
        return None
    return ZeroLayout(
        tuple(stages),
        region_uses(cfg, len(stages), tied=bool(stages[0])),
        reshard_after_forward,
        gather_updated,
        ends_step,
    )


def region_uses(cfg: ModelConfig, n: int, tied: bool = True) -> tuple[tuple[int, ...], ...]:
    """Per region i of n, the regions whose parameters its TP pieces read and make gradients
    for: its own, and for a head tied to the embedding (``tied``) also region 0's."""
    uses = [(i,) for i in range(n)]
    if tied and cfg.tie_embeddings:
        uses[-1] = (0, n - 1)
    return tuple(uses)


def plan_sp(plan: ParallelPlan) -> str | None:
    """The sequence parallelism a plan is simulated with (``ParallelPlan.sp``): none where
    every region has degree 1 (megatron-sp at tp=1 runs megatron's program: nothing to
    slice)."""
    return plan.sp() if max(r.tp for r in plan.regions) > 1 else None


def model_state(cfg: ModelConfig, plan: ParallelPlan, world_size: int) -> ModelState:
    """Every region's own parameter count, DP degree and ZeRO stage under ``plan``."""
    kinds = [region_kind(r.name) for r in plan.regions]
    return ModelState(
        tuple(_param_counts(cfg, kinds, [r.tp for r in plan.regions])),
        tuple(world_size // r.tp for r in plan.regions),
        plan.zero_stages(),
    )
