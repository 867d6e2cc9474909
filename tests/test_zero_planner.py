"""ZeRO in the planner's simulator (``planner.simulate``, ``planner.peak_memory``): the model
state it counts is the executor's, its collectives are priced where the program puts them, and
the search chooses a stage and a micro-batch.

The program itself (reduce-scatters, weight gathers, releases) is the executor's: see
``test_planner.test_simulator_and_executor_consume_the_same_programs``.
"""

from __future__ import annotations

import dataclasses

import pytest

from oases.config import ModelConfig
from oases.plan import ParallelPlan
from oases.planner.clusters import get_cluster
from oases.planner.hardware import HardwareCosts
from oases.planner.simulate import BatchShape, model_state, simulate_plan
from test_zero import _cfg, _rank_state_bytes

GPT = ModelConfig(arch="gpt2", n_layers=8, dim=1024, n_heads=16, vocab_size=50304,
                  seq_len=1024, tie_embeddings=True)


def _zero(plan: ParallelPlan, stage: int) -> ParallelPlan:
    return dataclasses.replace(plan, regions=[dataclasses.replace(r, zero=stage)
                                              for r in plan.regions])


def test_simulated_model_state_is_the_executors_own_accounting(spawn_ranks):
    """Per stage, the bytes of weights, gradients and Adam moments a rank holds after a step,
    counted from the tensors (``optim.model_state_bytes``) and by the simulator
    (``model_state``): equal, for a model whose norms (34 elements) do not divide evenly."""
    r0, _ = spawn_ranks(_rank_state_bytes, 2)
    cfg = _cfg()
    for stage, (got, _padded) in r0.items():
        plan = _zero(ParallelPlan.uniform(cfg, 2, 1, schedule="oases", n_sub=2), stage)
        assert model_state(cfg, plan, 2).bytes_by_kind() == got, stage


def _simulated(stage: int, n_micro: int = 2, raf: bool = True):  # noqa: ANN202
    costs = HardwareCosts(get_cluster("paper-3090-pcie-32"), GPT)
    plan = _zero(ParallelPlan.uniform(GPT, 32, 4, schedule="oases", n_sub=2), stage)
    return simulate_plan(GPT, plan, costs, 32, BatchShape(16 * n_micro, 16),
                         reshard_after_forward=raf)


def test_each_stage_holds_less_and_pays_where_its_collectives_are():
    """tp=4 x dp=8 on the paper's PCIe cluster, 2 micro-batches: each stage holds less than
    the one before; 1 and 2 all-gather the updated shards after the optimizer, 3 gathers the
    weights in the passes instead; the optimizer updates 1/dp of the parameters."""
    res = {z: _simulated(z) for z in (0, 1, 2, 3)}
    peaks = [res[z].peak_mem_bytes for z in (0, 1, 2, 3)]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4, peaks
    for z in (1, 2):
        assert res[z].breakdown["post_step_gather_s"] > 0
        assert any(e.phase == "ag" for e in res[z].timeline.events)
    for z in (0, 3):
        assert res[z].breakdown["post_step_gather_s"] == 0
    assert any(e.phase == "ag" and e.sub == 1 for e in res[3].timeline.events)  # per pass
    assert any(e.phase == "rs" for e in res[2].timeline.events)
    costs = HardwareCosts(get_cluster("paper-3090-pcie-32"), GPT)
    plan = _zero(ParallelPlan.uniform(GPT, 32, 4, schedule="oases", n_sub=2), 1)
    state = model_state(GPT, plan, 32)
    assert res[1].breakdown["optimizer_s"] == costs.optimizer_s(
        sum(state.updated(i) for i in range(len(plan.regions))))
    assert res[1].breakdown["optimizer_s"] < res[0].breakdown["optimizer_s"]
    # the Adam moments: 8 bytes per parameter, a shard of them from stage 1 on
    assert res[1].breakdown["optimizer_state_bytes"] == pytest.approx(
        res[0].breakdown["optimizer_state_bytes"] / 8, rel=1e-3)
    # stage 3 keeps 1/dp of the weights between passes
    assert res[3].breakdown["params_bytes"] == pytest.approx(
        res[0].breakdown["params_bytes"] / 8, rel=1e-3)
    # every part of the step is accounted for
    for r in res.values():
        assert sum(r.step_parts().values()) == pytest.approx(r.step_s, rel=1e-9)


def test_keeping_gathered_weights_from_forward_to_backward_costs_memory_not_gathers():
    """Stage 3 with ``reshard_after_forward`` false gathers each region once per micro-batch
    instead of twice, and holds more at its peak."""
    freed, kept = _simulated(3, raf=True), _simulated(3, raf=False)
    n_ag = [sum(e.phase == "ag" for e in r.timeline.events) for r in (freed, kept)]
    assert n_ag[1] < n_ag[0]
    assert kept.peak_mem_bytes > freed.peak_mem_bytes
