"""The paper's prototype planner under its constraints (planner/prototype.py): at most two
degrees, one switch point, the lower first, its model pricing every block's all-reduce over the
whole world; checked against a brute-force enumeration on a small model."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from oases.plan import region_names
from oases.planner.batch import BatchShape, BatchSplitError
from oases.planner.clusters import get_cluster
from oases.planner.costs import region_kind
from oases.planner.hardware import HardwareCosts
from oases.planner.models import MODELS
from oases.planner.prototype import _plan, node_seconds, prototype_plan
from oases.planner.simulate import simulate_plan

CLUSTER = get_cluster("paper-3090-pcie-32")
CFG = dataclasses.replace(MODELS["paper-h4096-l16"], n_layers=3)
BATCH = BatchShape(64, 32)


def test_node_seconds_price_the_world_all_reduce():
    costs = HardwareCosts(CLUSTER, CFG)
    for t in (2, 4, 8):
        rows = 32 * t // 32 // 2
        f = sum(costs.compute_s("mlp", "forward", p, t, rows) for p in ("body", "epi"))
        r = costs.compute_s("mlp", "recompute", "body-commfree", t, rows) + sum(
            costs.compute_s("mlp", "backward", p, t, rows) for p in ("norm", "epi", "tp")
        )
        a = costs.collective_ranks_s("all_reduce", range(32), rows * CFG.seq_len * CFG.dim * 4)
        assert node_seconds(costs, "mlp", t, rows) == pytest.approx(2 * max(f, a) + 2 * max(r, a))


@pytest.mark.parametrize("budget_gib", [3.0, 4.0, 5.0, 6.0, 9.0])  # 3: nothing fits
def test_prototype_pick_is_the_cheapest_fitting_plan_of_its_own_model(budget_gib):
    costs = HardwareCosts(CLUSTER, CFG)
    budget = budget_gib * 2**30
    try:
        choice = prototype_plan(CFG, costs, BATCH, budget)
    except ValueError:
        choice = None
    kinds = [region_kind(n) for n in region_names(CFG) if region_kind(n) in ("attn", "mlp")]
    best = None
    for low, high in itertools.combinations_with_replacement((1, 2, 4, 8, 16, 32), 2):
        for cut in [0] if low == high else range(1, len(kinds) + 1):
            plan = _plan(CFG, 32, low, high, cut)
            try:
                res = simulate_plan(CFG, plan, costs, 32, BATCH, timeline=False)
            except BatchSplitError:
                continue
            if res.peak_mem_bytes > budget:
                continue
            reshard = (
                0.0
                if low == high
                else 2
                * costs.collective_s(
                    "all_gather", high // low, 32 * high // 32 * CFG.seq_len * CFG.dim * 4
                )
            )
            cost = BATCH.n_micro() * (
                reshard
                + sum(
                    node_seconds(
                        costs,
                        k,
                        low if j < cut else high,
                        32 * (low if j < cut else high) // 32 // 2,
                    )
                    for j, k in enumerate(kinds)
                )
            )
            if best is None or cost < best[0] - 1e-12:
                best = (cost, low, high, cut)
    if best is None:
        assert choice is None
        return
    assert choice is not None and choice.model_s == pytest.approx(best[0])
    degrees = [r.tp for r in choice.plan.regions if region_kind(r.name) in ("attn", "mlp")]
    assert len(set(degrees)) <= 2 and degrees == sorted(degrees)  # two at most, low first
    assert choice.result.peak_mem_bytes <= budget
