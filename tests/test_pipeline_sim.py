"""The simulator's pipeline (``planner.pipeline_walk``): the stages' own programs walked together
with their point-to-point edges. One stage is today's ``simulate_plan`` exactly; two stages of
GPipe on hand-made costs reproduce the step derived by hand; the first stage of 1F1B holds P
micro-batches' activations where GPipe's holds M; a slower link between servers raises the
step and its bubble; ``oases simulate`` takes ``tp=T,pp=P`` specs and prints the bubble.
Single process, no ranks."""

from __future__ import annotations

import dataclasses
import json

import pytest

from oases.config import ModelConfig
from oases.plan import ParallelPlan
from oases.planner.batch import BatchShape
from oases.planner.candidate import with_zero
from oases.planner.event_walk import StepCosts
from oases.planner.hardware import HardwareCosts
from oases.planner.pipeline_walk import p2p_s, simulate_pipeline, walk_stages
from oases.planner.sim_inputs import load_any_cluster, parse_entries, parse_plan
from oases.planner.simulate import simulate_plan
from oases.schedule.instructions import Compute, Start, Wait

CFG = ModelConfig(arch="gpt2", dim=256, n_heads=4, n_layers=4, vocab_size=512, seq_len=128)


class _Hand:
    """Costs to derive a step by hand: each attention or MLP region's forward body takes ``f``,
    its backward "tp" piece ``b``, every other piece and every collective nothing, a send
    ``link`` seconds."""

    def __init__(self, f: float, b: float, link: float) -> None:
        self.f, self.b, self.link = f, b, link

    def compute_s(self, region: str, phase: str, piece: str, tp: int, rows: int) -> float:
        if region in ("attn", "mlp") and (phase, piece) == ("forward", "body"):
            return self.f
        if region in ("attn", "mlp") and (phase, piece) == ("backward", "tp"):
            return self.b
        return 0.0

    def collective_s(self, op: str, group_size: int, nbytes: int) -> float:
        return 0.0

    def p2p_s(self, src: int, dst: int, nbytes: float) -> float:
        return self.link


def _hw(world_servers: str = "paper-3090-pcie-32", gbps: float | None = None) -> HardwareCosts:
    return HardwareCosts(load_any_cluster(world_servers, gbps), CFG, "bf16", "bf16")


@pytest.mark.parametrize("name", ["megatron", "oases", "megatron-recompute", "overlap"])
@pytest.mark.parametrize("zero", [0, 1])
@pytest.mark.parametrize("n_micro", [1, 3])
def test_one_stage_is_simulate_plan_exactly(name, zero, n_micro):
    costs = _hw()
    plan = with_zero(ParallelPlan.uniform(CFG, 8, 2, schedule=name, n_sub=2), zero)
    batch = BatchShape(8 * n_micro, 8)
    want = simulate_plan(CFG, plan, costs, 8, batch, timeline=False, scaled=False)
    got = simulate_pipeline(CFG, plan, costs, 8, batch, timeline=False)
    assert got.step_s == want.step_s
    assert got.peak_mem_bytes == want.peak_mem_bytes
    assert got.step_parts()["bubble"] == 0.0


@pytest.mark.parametrize("n_micro", [1, 2, 5])
@pytest.mark.parametrize("link", [0.0, 0.25])
def test_two_stage_gpipe_step_is_the_hand_derived_one(n_micro, link):
    """Two stages of two blocks each (an attention and an MLP region apiece), tp=1, GPipe:
    a forward pass of a stage takes F = 4f, a backward B = 4b. Stage 1 starts micro-batch m
    when it arrives, at (m + 1) F + l, so its forwards end at (M + 1) F + l; its backwards
    follow one by one, each sent back (+ l) to stage 0, whose backwards then run back to
    back::

        step = (M + 1)(F + B) + 2 l          stage 0's bubble: F + B + 2 l   (l <= F)
    """
    f, b = 1.0, 1.5
    cfg = dataclasses.replace(CFG, tie_embeddings=False)
    plan = ParallelPlan.uniform(cfg, 2, 1, schedule="megatron", n_sub=1, pp=2, pp_schedule="gpipe")
    res = simulate_pipeline(cfg, plan, _Hand(f, b, link), 2, BatchShape(n_micro, 1))
    F, B = 4 * f, 4 * b
    assert res.step_s == pytest.approx((n_micro + 1) * (F + B) + 2 * link, rel=1e-12)
    assert res.breakdown["bound_stage"] == 0
    assert res.step_parts()["bubble"] == pytest.approx(F + B + 2 * link, rel=1e-12)
    assert res.step_parts()["compute"] == pytest.approx(n_micro * (F + B), rel=1e-12)
    assert sum(res.step_parts().values()) == pytest.approx(res.step_s, rel=1e-12)
    # the timeline: both stages' computes, and the sends on the receivers' comm lanes
    ranks = {e.rank for e in res.timeline.events}
    assert ranks == {0, 1}
    if link:
        moved = [e for e in res.timeline.events if e.phase in ("rf", "rb")]
        assert len(moved) == 2 * n_micro
        assert all(e.end_s - e.start_s == pytest.approx(link) for e in moved)


def test_two_stage_1f1b_without_link_cost_has_gpipes_step():
    """With free links the two-stage 1F1B step is (M + 1)(F + B) as well: the same bubble,
    fewer activations."""
    cfg = dataclasses.replace(CFG, tie_embeddings=False)
    plan = ParallelPlan.uniform(cfg, 2, 1, schedule="megatron", n_sub=1, pp=2)
    res = simulate_pipeline(cfg, plan, _Hand(1.0, 2.0, 0.0), 2, BatchShape(4, 1))
    assert res.step_s == pytest.approx(5 * (4.0 + 8.0), rel=1e-12)


@pytest.mark.parametrize("pp", [2, 4])
def test_first_stage_of_1f1b_holds_p_micro_batches_gpipe_m(pp):
    n_micro = 6
    acts = {}
    for sched, m in (("gpipe", n_micro), ("1f1b", n_micro), ("1f1b", 1)):
        plan = ParallelPlan.uniform(
            CFG, pp, 1, schedule="megatron", n_sub=1, pp=pp, pp_schedule=sched
        )
        res = simulate_pipeline(CFG, plan, _hw(), pp, BatchShape(m, 1), timeline=False)
        acts[sched, m] = res.breakdown["stage0_activations_bytes"]
    one = acts["1f1b", 1]
    assert one > 0
    assert acts["gpipe", n_micro] == pytest.approx(n_micro * one, rel=1e-12)
    assert acts["1f1b", n_micro] == pytest.approx(pp * one, rel=1e-12)


def test_stage_memory_holds_its_own_regions_and_a_tied_copy_on_the_last():
    plan = ParallelPlan.uniform(CFG, 8, 2, schedule="oases", n_sub=2)
    whole = simulate_plan(CFG, plan, _hw(), 8, BatchShape(8, 8), timeline=False)
    staged_plan = ParallelPlan.uniform(CFG, 8, 2, schedule="oases", n_sub=2, pp=2)
    staged = simulate_pipeline(CFG, staged_plan, _hw(), 8, BatchShape(4, 4), timeline=False)
    assert staged.breakdown["params_bytes"] < whole.breakdown["params_bytes"]
    tied = staged.breakdown["stage1_params_bytes"]
    untied_cfg = dataclasses.replace(CFG, tie_embeddings=False)
    untied = simulate_pipeline(untied_cfg, staged_plan, _hw(), 8, BatchShape(4, 4), timeline=False)
    # untied, the head owns its own weight: the same bytes as the tied copy
    assert untied.breakdown["stage1_params_bytes"] == tied
    assert staged.breakdown["stage0_params_bytes"] == untied.breakdown["stage0_params_bytes"]


def test_a_slower_link_between_servers_raises_the_step_and_its_bubble():
    cfg = dataclasses.replace(CFG, dim=1024, n_heads=8, seq_len=1024, n_layers=8)
    plan = ParallelPlan.uniform(cfg, 32, 4, schedule="oases", n_sub=1, pp=8)
    batch = BatchShape(16, 1)
    fast, slow = (
        simulate_pipeline(
            cfg,
            plan,
            HardwareCosts(load_any_cluster("paper-3090-pcie-32", g), cfg, "bf16", "bf16"),
            32,
            batch,
            timeline=False,
        )
        for g in (100.0, 1.0)
    )
    assert slow.step_s > fast.step_s
    assert slow.step_parts()["bubble"] > fast.step_parts()["bubble"]
    # a boundary inside a server is priced on its link, one across servers on the network's
    costs = HardwareCosts(load_any_cluster("paper-3090-pcie-32", 1.0), cfg, "bf16", "bf16")
    assert p2p_s(costs, 0, 4, 2**24) > 5 * p2p_s(costs, 0, 2, 2**24)


def test_stages_that_wait_on_each_other_are_refused():
    step = StepCosts(
        piece_s=lambda *a: 1.0, collective_s=lambda k, i: 1.0, stream_of=lambda k, i: k
    )
    a = [Start("rb", 1, 0), Wait("rb", 1, 0), Start("sf", 1, 0), Wait("sf", 1, 0)]
    b = [Start("rf", 1, 0), Wait("rf", 1, 0), Start("sb", 1, 0), Wait("sb", 1, 0)]
    with pytest.raises(ValueError, match="wait on each other"):
        walk_stages([a, b], [step, step])
    a = [Compute("forward", (("body", 0),), 0), Start("sf", 1, 0), Wait("sf", 1, 0)]
    b = [Start("rf", 1, 0), Wait("rf", 1, 0), Compute("forward", (("body", 1),), 0)]
    first, second = walk_stages([a, b], [step, step])
    assert (first.step_s, second.step_s) == (2.0, 3.0)  # compute 1, link 1, compute 1
    assert second.exposed_s["pp"] == 2.0


def test_plan_specs_with_stages_parse():
    spec = parse_plan("tp=2,pp=4,zero=1,sp=shards,pps=1f1b-pair")
    assert (spec.tp, spec.pp, spec.pps, spec.zero, spec.sp) == (2, 4, "1f1b-pair", 1, "shards")
    assert parse_plan(str(spec)) == spec
    entries = parse_entries("oases@tp=2,pp=2,pps=gpipe,megatron@tp=2,pp=2,zero=1", "auto")
    assert [(n, s.pp, s.pps, s.zero) for n, s in entries] == [
        ("oases", 2, "gpipe", None),
        ("megatron", 2, None, 1),
    ]
    auto = parse_plan("auto,pp=4,pps=zb-h1,zero=1")
    assert (auto.auto, auto.pp, auto.pps, auto.zero) == (True, 4, "zb-h1", 1)
    assert parse_plan(str(auto)) == auto
    for bad in (
        "auto,pps=gpipe",
        "tp=2,pps=gpipe",
        "tp=2,pp=2,pps=zb",
        "tp=2,pp=0",
        "tp=2,pp=2,pp=4",
    ):
        with pytest.raises(ValueError):
            parse_plan(bad)


def test_simulate_prints_pipeline_rows_with_their_bubble(capsys, tmp_path):
    from oases.cli import main

    code = main(
        [
            "simulate",
            "--model",
            "paper-h1024-l24",
            "--cluster",
            "paper-3090-pcie-32",
            "--inter-gbps",
            "10",
            "--dtype",
            "bf16",
            "--schedules",
            "oases@tp=4,oases@tp=4,pp=4,oases@tp=4,pp=4,pps=gpipe,zero=1",
            "--global-batch",
            "32",
            "--micro-batch",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "bubble" in out and "tp=4,pp=4" in out and "tp=4,pp=4,pps=gpipe,zero=1" in out
    rows = json.loads((tmp_path / "simulate.json").read_text())["rows"]
    assert [r["step_parts_s"]["bubble"] > 0 for r in rows] == [False, True, True]


def test_simulate_auto_with_pp_runs_the_pipeline_search(capsys, tmp_path):
    """``oases simulate`` with ``oases@auto,pp=4``: the pipeline search at 4 stages, for the
    oases schedule inside them; the row prints the plan it chose (order, stages, degrees);
    zero=3 is refused with one line; ``pps=interleaved`` searches that order alone."""
    from oases.cli import main

    args = ["simulate", "--model", "paper-h1024-l24", "--cluster", "paper-3090-pcie-32",
            "--inter-gbps", "10", "--dtype", "bf16", "--global-batch", "32", "--micro-batch",
            "2", "--out", str(tmp_path), "--schedules"]  # fmt: skip
    assert main([*args, "oases@tp=4,oases@auto,pp=4"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("oases@auto degrees by region"))
    assert ", pp=4 " in line and "stages at regions" in line, out
    rows = json.loads((tmp_path / "simulate.json").read_text())["rows"]
    assert rows[1]["step_parts_s"]["bubble"] > 0
    assert main([*args, "oases@auto,pp=4,zero=3"]) != 0
    assert "ZeRO 2 at most" in capsys.readouterr().err
    assert main([*args, "oases@auto,pp=4,pps=interleaved"]) == 0  # searched: 2 chunks a stage
    line = next(
        x
        for x in capsys.readouterr().out.splitlines()
        if x.startswith("oases@auto degrees by region")
    )
    assert ", pp=4 " in line and "interleaved" in line, line


class _HandSplit(_Hand):
    """``_Hand`` where zb-h1's split backward prices its input gradient ("sp-dx") and weight
    gradients ("sp-dw") at half the backward each: the same work as the whole backward."""

    def compute_s(self, region: str, phase: str, piece: str, tp: int, rows: int) -> float:
        if region in ("attn", "mlp") and phase == "backward" and piece in ("sp-dx", "sp-dw"):
            return self.b / 2
        return super().compute_s(region, phase, piece, tp, rows)


@pytest.mark.parametrize("pp,n_layers", [(2, 4), (4, 8)])
def test_zb_h1_prices_its_weight_gradients_and_shortens_the_step(pp, n_layers):
    """zb-h1's programs carry "dw" pieces without sequence parallelism: the simulator prices
    a deferring region's backward "tp" as its input gradient and "dw" as its weight
    gradients, so the compute is 1F1B's, and the step is shorter (the W's fill 1F1B's
    waits)."""
    cfg = dataclasses.replace(CFG, tie_embeddings=False, n_layers=n_layers)
    res = {}
    for order in ("1f1b", "zb-h1"):
        plan = ParallelPlan.uniform(
            cfg, pp, 1, schedule="megatron", n_sub=1, pp=pp, pp_schedule=order
        )
        res[order] = simulate_pipeline(
            cfg, plan, _HandSplit(1.0, 2.0, 0.1), pp, BatchShape(8, 1), timeline=False
        )
    assert res["zb-h1"].step_parts()["compute"] == pytest.approx(
        res["1f1b"].step_parts()["compute"], rel=1e-12
    )
    assert res["zb-h1"].step_s < 0.97 * res["1f1b"].step_s, (
        res["zb-h1"].step_s,
        res["1f1b"].step_s,
    )
    assert res["zb-h1"].step_parts()["bubble"] < res["1f1b"].step_parts()["bubble"]
