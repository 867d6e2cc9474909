"""What the Oases paper's prototype planner could choose, under its own constraints and model.

The authors' public prototype (the Oases paper, Li et al., IEEE TPDS 2025, its planner
section) searches a TP degree per attention and MLP block but keeps at most two degrees with
one switch point, the lower degree first; it prices each block from its profile, and that
profile times the block's all-reduce over the whole world, not over the TP group; its cost
model leaves out data-parallel gradient synchronization, the optimizer, the embedding and the
head. In the paper's overlap model one forward node costs two stages of max(compute of one
sub-batch, all-reduce of the other), one backward node two stages of max(recompute +
backward, all-reduce)::

    node(t) = 2 max(f(t), a) + 2 max(r(t), a)      a = world all-reduce of [b, S, H] (0 at t=1)
    plan    = blocks [0, c) at t1, [c, 2L) at t2 >= t1, the (tied) embedding and head at t2
    cost    = micro-batches x (sum of nodes + the reshard at c)

``prototype_plan`` returns the plan of least such cost among those that fit the memory budget
as this project's simulator accounts it (both planners then see the same budget), k = 2
sub-batches; ``planner.simulate`` prices it whole, beside this project's own choice.
"""

from __future__ import annotations

from dataclasses import dataclass

from oases.config import ModelConfig
from oases.plan import ParallelPlan, RegionPlan, region_names
from oases.planner.batch import BatchShape, BatchSplitError
from oases.planner.costs import region_kind
from oases.planner.hardware import HardwareCosts
from oases.planner.precision import precision_of
from oases.planner.search import candidate_degrees
from oases.planner.simulate import PlanResult, simulate_plan

N_SUB = 2  # the paper's sub-batches


@dataclass
class PrototypeChoice:
    """The prototype's plan, its own model's seconds for it, and the simulator's result."""

    plan: ParallelPlan
    model_s: float
    result: PlanResult
    low: int
    high: int
    cut: int  # block nodes (attention and MLP, in order) at the low degree
    tried: int  # plans simulated for memory before one fitted

    def label(self) -> str:
        if self.low == self.high or self.cut == 0:
            return f"tp={self.high} everywhere"
        return f"tp={self.low} for the first {self.cut} blocks' nodes, then tp={self.high}"


def node_seconds(costs: HardwareCosts, kind: str, t: int, rows: int) -> float:
    """One micro-batch of one block node (attention or MLP) at degree t, in the prototype's
    model: two overlapped forward stages and two backward ones, each against the all-reduce
    its profile timed over the whole world."""
    cfg, world = costs.model, costs.cluster.world_size
    e = precision_of(costs).activation_bytes
    f = sum(costs.compute_s(kind, "forward", p, t, rows) for p in ("body", "epi"))
    r = costs.compute_s(kind, "recompute", "body-commfree", t, rows) + sum(
        costs.compute_s(kind, "backward", p, t, rows) for p in ("norm", "epi", "tp")
    )
    a = (
        0.0
        if t == 1
        else costs.collective_ranks_s("all_reduce", range(world), rows * cfg.seq_len * cfg.dim * e)
    )
    return 2 * max(f, a) + 2 * max(r, a)


def _plan(cfg: ModelConfig, world: int, low: int, high: int, cut: int) -> ParallelPlan:
    names = region_names(cfg)
    blocks = [i for i, n in enumerate(names) if region_kind(n) in ("attn", "mlp")]
    low_set = set(blocks[:cut])  # the tied embedding and head keep the higher degree
    return ParallelPlan(
        [
            RegionPlan(n, low if i in low_set else high, world // (low if i in low_set else high))
            for i, n in enumerate(names)
        ],
        n_sub=N_SUB,
        schedule="oases",
    )


def prototype_plan(
    cfg: ModelConfig,
    costs: HardwareCosts,
    batch: BatchShape,
    budget_bytes: float,
    max_tries: int = 400,
) -> PrototypeChoice:
    """The prototype's pick: every (t1 <= t2, cut) ordered by its model's cost, the first that
    fits the budget (ValueError if none of the first ``max_tries`` does)."""
    world = costs.cluster.world_size
    e = precision_of(costs).activation_bytes
    degrees = candidate_degrees(cfg, world)
    kinds = [region_kind(n) for n in region_names(cfg) if region_kind(n) in ("attn", "mlp")]
    per_node: dict[tuple[str, int], float] = {}
    for t in degrees:
        local, left = divmod(batch.micro_rows * t, world)
        if left or local % N_SUB or local == 0:
            continue  # the micro-batch does not split into sub-batches at this degree
        for kind in ("attn", "mlp"):
            per_node[kind, t] = node_seconds(costs, kind, t, local // N_SUB)
    usable = sorted({t for _, t in per_node})
    options = []
    for i, low in enumerate(usable):
        for high in usable[i:]:
            act = batch.micro_rows * high // world * cfg.seq_len * cfg.dim * e
            reshard = 0.0 if low == high else 2 * costs.collective_s("all_gather", high // low, act)
            for cut in [0] if low == high else range(1, len(kinds) + 1):
                nodes = sum(per_node[k, low if j < cut else high] for j, k in enumerate(kinds))
                options.append((batch.n_micro() * (nodes + reshard), low, high, cut))
    options.sort()
    for tried, (model_s, low, high, cut) in enumerate(options[:max_tries], 1):
        plan = _plan(cfg, world, low, high, cut)
        try:
            res = simulate_plan(cfg, plan, costs, world, batch, timeline=False)
        except BatchSplitError:
            continue
        if res.peak_mem_bytes <= budget_bytes:
            return PrototypeChoice(plan, model_s, res, low, high, cut, tried)
    raise ValueError(
        f"none of the prototype's {min(len(options), max_tries)} cheapest plans "
        f"fits {budget_bytes / 2**30:.2f} GiB per GPU"
    )
