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
from oases.planner.batch import BatchShape
from oases.planner.clusters import get_cluster
from oases.planner.hardware import HardwareCosts
from oases.planner.layout import model_state
from oases.planner.simulate import simulate_plan
from test_zero import _cfg, _rank_state_bytes

GPT = ModelConfig(
    arch="gpt2",
    n_layers=8,
    dim=1024,
    n_heads=16,
    vocab_size=50304,
    seq_len=1024,
    tie_embeddings=True,
)


def _zero(plan: ParallelPlan, stage: int) -> ParallelPlan:
    return dataclasses.replace(
        plan, regions=[dataclasses.replace(r, zero=stage) for r in plan.regions]
    )


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
    return simulate_plan(
        GPT, plan, costs, 32, BatchShape(16 * n_micro, 16), reshard_after_forward=raf
    )


def test_each_stage_holds_less_and_pays_where_its_collectives_are():
    """tp=4 x dp=8 on the paper's PCIe cluster, 2 micro-batches: each stage holds less than
    the one before; 1 and 2 all-gather the updated shards once, at the step's head, under the
    first micro-batch's forward; 3 gathers the weights in every pass instead; the optimizer
    updates 1/dp of the parameters."""
    res = {z: _simulated(z) for z in (0, 1, 2, 3)}
    peaks = [res[z].peak_mem_bytes for z in (0, 1, 2, 3)]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4, peaks
    n_regions = 2 * GPT.n_layers + 2
    for z in (1, 2):
        gathers = [e for e in res[z].timeline.events if e.phase == "ag"]
        assert len(gathers) == n_regions and {e.sub for e in gathers} == {0}, z
        forward = [
            e
            for e in res[z].timeline.events
            if e.lane == "compute" and e.phase == "forward" and e.sub < 2
        ]
        assert gathers[-1].start_s < forward[-1].end_s  # under the forward, not after it
    assert not any(e.phase == "ag" for e in res[0].timeline.events)
    assert any(e.phase == "ag" and e.sub == 1 for e in res[3].timeline.events)  # per pass
    assert any(e.phase == "rs" for e in res[2].timeline.events)
    costs = HardwareCosts(get_cluster("paper-3090-pcie-32"), GPT)
    plan = _zero(ParallelPlan.uniform(GPT, 32, 4, schedule="oases", n_sub=2), 1)
    state = model_state(GPT, plan, 32)
    assert res[1].breakdown["optimizer_s"] == costs.optimizer_s(
        sum(state.updated(i) for i in range(len(plan.regions)))
    )
    assert res[1].breakdown["optimizer_s"] < res[0].breakdown["optimizer_s"]
    # the Adam moments: 8 bytes per parameter, a shard of them from stage 1 on
    assert res[1].breakdown["optimizer_state_bytes"] == pytest.approx(
        res[0].breakdown["optimizer_state_bytes"] / 8, rel=1e-3
    )
    # stage 3 keeps 1/dp of the weights between passes
    assert res[3].breakdown["params_bytes"] == pytest.approx(
        res[0].breakdown["params_bytes"] / 8, rel=1e-3
    )
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


# ------------------------------------------------------------------------------ the search
def test_the_planner_shards_when_memory_binds_and_not_when_it_does_not():
    """Under no budget the planner shards no further than stage 1, and only where stage 1 is
    faster than the best unsharded plan (it moves stage 0's bytes, half of them under the next
    forward); under a budget below every unsharded plan's peak, it picks a sharded plan that
    fits it, one stage for every region (sequence parallelism, the other lever, left out)."""
    from oases.config import Config
    from oases.planner import batch_shape, plan_model
    from oases.planner.search import solve_plan

    cfg = Config()
    cfg.model = GPT
    cfg.train.global_batch, cfg.train.micro_batch, cfg.parallel.tp = 64, 2, 1
    costs = HardwareCosts(get_cluster("paper-3090-pcie-32"), GPT)
    free, _ = plan_model(
        cfg, 32, costs, float("inf"), schedules=("oases",), search_micro_batch=False, sps=()
    )
    unsharded, _ = plan_model(
        cfg,
        32,
        costs,
        float("inf"),
        schedules=("oases",),
        zeros=(0,),
        search_micro_batch=False,
        sps=(),
    )
    assert max(free.plan.zero_stages()) <= 1
    assert free.result.step_s <= unsharded.result.step_s
    if max(free.plan.zero_stages()) == 1:
        assert free.result.step_s < unsharded.result.step_s
    batch = batch_shape(cfg, 32)
    least = {
        z: min(
            c.result.peak_mem_bytes
            for c in solve_plan(
                GPT, costs, 32, batch, float("inf"), schedules=("oases",), zeros=(z,)
            )[1]
        )
        for z in (0, 3)
    }
    assert least[3] < least[0]
    budget = (least[0] + least[3]) / 2
    best, _ = plan_model(
        cfg, 32, costs, budget, schedules=("oases",), search_micro_batch=False, sps=()
    )
    assert best.result.peak_mem_bytes <= budget and max(best.plan.zero_stages()) >= 1
    assert len(set(best.plan.zero_stages())) == 1
    with pytest.raises(ValueError, match="no plan fits"):  # unsharded, nothing fits it
        plan_model(
            cfg,
            32,
            costs,
            budget,
            schedules=("oases",),
            zeros=(0,),
            search_micro_batch=False,
            sps=(),
        )


def test_a_smaller_micro_batch_is_searched_when_the_given_one_does_not_fit():
    """The global batch stays; the micro-batch is cut until a plan fits, as a user would with
    ``train.micro_batch``, and the plan's notes carry it into training."""
    from oases.config import Config
    from oases.planner import plan_model

    cfg = Config()
    cfg.model = GPT
    cfg.train.global_batch, cfg.train.micro_batch, cfg.parallel.tp = 256, 8, 1
    costs = HardwareCosts(get_cluster("paper-3090-pcie-32"), GPT)
    _, cands = plan_model(
        cfg, 32, costs, float("inf"), schedules=("megatron",), zeros=(0,), search_micro_batch=False
    )
    least = min(c.result.peak_mem_bytes for c in cands)
    best, _ = plan_model(cfg, 32, costs, least * 0.8, schedules=("megatron",), zeros=(0,))
    assert best.batch.micro_rows < 8 * 32 and best.result.peak_mem_bytes <= least * 0.8
    assert best.plan.notes["global_batch"] == 256
    assert best.plan.notes["micro_rows"] == best.batch.micro_rows
    assert "n_micro=" in best.label()


# ------------------------------------------------------------------------- oases simulate
def test_simulate_plan_specs_take_a_zero_stage():
    from oases.planner.sim_inputs import PlanSpec, parse_entries, parse_plan

    assert parse_plan("tp=4,zero=3") == PlanSpec(False, 4, False, 3)
    assert parse_plan("auto,zero=1") == PlanSpec(True, zero=1)
    assert str(parse_plan("tp=2+,zero=2")) == "tp=2+,zero=2"
    assert parse_entries("megatron@tp=4,oases@tp=4,zero=1,oases@auto", "auto") == [
        ("megatron", PlanSpec(False, 4)),
        ("oases", PlanSpec(False, 4, False, 1)),
        ("oases", PlanSpec(True)),
    ]
    with pytest.raises(ValueError, match="zero=Z"):
        parse_plan("tp=4,zero=5")


def test_oases_simulate_prices_a_sharded_row(tmp_path, capsys):
    from oases.cli import main

    code = main(
        [
            "simulate",
            "--model",
            "paper-h1024-l24",
            "--cluster",
            "paper-3090-pcie-32",
            "--schedules",
            "oases@tp=4,oases@tp=4,zero=3",
            "--global-batch",
            "128",
            "--micro-batch",
            "4",
            "--out",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    rows = [line for line in out.splitlines() if line.strip().startswith("oases")]
    assert len(rows) == 2 and "tp=4,zero=3" in rows[1]
    import json

    got = json.loads((tmp_path / "simulate.json").read_text())["rows"]
    assert got[1]["peak_mem_bytes"] < got[0]["peak_mem_bytes"]


# ------------------------------------------------------------------------ bench --memory
def test_bench_memory_counts_the_model_state_the_simulator_counts(tmp_path, capsys):
    """``oases bench --memory`` on 2 gloo ranks (tp=1 x dp=2): per entry, the model state the
    ranks hold, from the tensors, equals the simulator's count exactly; the table and its JSON
    are written."""
    import json

    from distributed import REPO_ROOT
    from oases.cli import main

    code = main(
        [
            "bench",
            str(REPO_ROOT / "configs" / "tiny.toml"),
            "--parallel.tp=1",
            "--nproc-per-node",
            "2",
            "--memory",
            "--schedules",
            "oases,oases@zero=3",
            "--steps",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    got = json.loads((tmp_path / "memory.json").read_text())["entries"]
    for entry in ("oases", "oases@zero=3"):
        rank0 = got[entry]["ranks"][0]
        state = {k: rank0[k] for k in ("weights", "gradients", "optimizer")}
        assert state == got[entry]["predicted"]["model_state"], entry
        assert rank0["peak_over_base_mb"] > 0
        # the counted step: saved bytes per block as planner.activation_terms counts them
        assert rank0["saved_per_block"][-1] == got[entry]["analytic_saved_per_block"], entry
        assert rank0["peak_live"] > 0
    assert "sim peak" in (tmp_path / "memory.md").read_text()
    assert "meas/anal" in (tmp_path / "memory.md").read_text()


def test_max_tp_bounds_the_degrees_searched():
    from oases.config import Config
    from oases.planner import plan_model

    cfg = Config()
    cfg.model = GPT
    cfg.train.global_batch, cfg.train.micro_batch, cfg.parallel.tp = 64, 2, 1
    costs = HardwareCosts(get_cluster("paper-3090-pcie-32"), GPT)
    best, cands = plan_model(cfg, 32, costs, float("inf"), schedules=("megatron",), max_tp=2)
    assert {t for c in cands for t in c.plan.degrees()} <= {1, 2}
    with pytest.raises(ValueError, match="--max-tp=0: no candidate degree"):
        plan_model(cfg, 32, costs, float("inf"), max_tp=0)
