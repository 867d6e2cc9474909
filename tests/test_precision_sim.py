"""The planner per dtype (issue 15): bytes priced by tensor kind and dtype, bf16 presets, a
profile's precision, MFU and tokens/s per GPU in ``oases simulate``."""

from __future__ import annotations

import dataclasses
import json

import pytest

from oases.config import ModelConfig
from oases.plan import ParallelPlan
from oases.planner import load_costs
from oases.planner.batch import BatchShape, BatchSpec
from oases.planner.clusters import CLUSTERS
from oases.planner.costs import analytic_saved_bytes, matmul_params, model_flops
from oases.planner.hardware import HardwareCosts
from oases.planner.models import MODELS
from oases.planner.precision import (
    FP32,
    PlanPrecision,
    precision_of,
    resolve_plan_precision,
)
from oases.planner.presets import MAMF_A100_SXM, MAMF_H100_SXM
from oases.planner.profile import Profile
from oases.planner.report import format_report
from oases.planner.search import with_zero
from oases.planner.sim_inputs import parse_entries
from oases.planner.simulate import simulate_plan
from oases.planner.whatif import simulate_cluster

# a small GPT without dropout, so every activation byte is in the compute dtype
SMALL = ModelConfig(
    arch="gpt2", n_layers=4, dim=1024, n_heads=16, vocab_size=50257, seq_len=1024, dropout=0.0
)
PAPER = "paper-3090-pcie-32"


class Recorder:
    """A preset's costs, recording the bytes of every collective the simulator prices by the
    group's ranks: contiguous from 0 = a TP group, strided = a DP group."""

    def __init__(self, costs: HardwareCosts) -> None:
        self.costs, self.calls = costs, []

    def __getattr__(self, name: str) -> object:
        return getattr(self.costs, name)

    def collective_ranks_s(self, op: str, ranks, nbytes: int) -> float:
        ranks = tuple(ranks)
        tp = ranks == tuple(range(len(ranks)))
        self.calls.append((op, "tp" if tp else "dp", len(ranks), nbytes))
        return self.costs.collective_ranks_s(op, ranks, nbytes)

    def bytes_of(self, op: str, group: str) -> set[int]:
        return {n for o, g, _, n in self.calls if (o, g) == (op, group)}


def _run(
    dtype: str, grad_reduce: str = "fp32", zero: int = 0, tp: int = 4, cfg: ModelConfig = SMALL
) -> tuple[Recorder, object]:
    costs = Recorder(HardwareCosts(CLUSTERS[PAPER], cfg, dtype, grad_reduce))
    plan = with_zero(ParallelPlan.uniform(cfg, 32, tp, schedule="megatron"), zero)
    return costs, simulate_plan(cfg, plan, costs, 32, BatchShape(32, 32))


# ----------------------------------------------------------------------- bytes by tensor kind


def test_bf16_halves_the_tp_all_reduce_bytes_and_their_byte_term():
    fp32, _ = _run("fp32")
    bf16, _ = _run("bf16")
    (a,), (b,) = fp32.bytes_of("all_reduce", "tp"), bf16.bytes_of("all_reduce", "tp")
    assert a == 32 * 4 // 32 * SMALL.seq_len * SMALL.dim * 4  # [b, S, H] fp32, b = 4 rows
    assert b * 2 == a
    # the time's byte term (time minus the zero-byte latency) halves with the bytes, for the
    # same link: the collective model is linear in bytes at large messages
    c = HardwareCosts(CLUSTERS[PAPER], SMALL, "fp32")
    ranks = range(4)
    lat = c.collective_ranks_s("all_reduce", ranks, 1)
    term = c.collective_ranks_s("all_reduce", ranks, a) - lat
    assert c.collective_ranks_s("all_reduce", ranks, b) - lat == pytest.approx(term / 2, rel=0.02)


def test_bf16_halves_reshard_bytes():
    def gathered(dtype: str) -> set[int]:
        costs = Recorder(HardwareCosts(CLUSTERS[PAPER], SMALL, dtype))
        plan = ParallelPlan.uniform(SMALL, 32, 2, schedule="megatron")
        plan = dataclasses.replace(
            plan,
            regions=[
                dataclasses.replace(r, tp=4, dp=8) if i >= 3 else r
                for i, r in enumerate(plan.regions)
            ],
        )
        simulate_plan(SMALL, plan, costs, 32, BatchShape(32, 32))
        return {n for o, g, k, n in costs.calls if o == "all_gather"}

    a, b = gathered("fp32"), gathered("bf16")
    assert a and {n // 2 for n in a} == b


def test_bf16_halves_the_activation_memory_and_keeps_the_model_state():
    _, fp32 = _run("fp32")
    _, bf16 = _run("bf16")
    act32, act16 = (
        fp32.breakdown["activations_peak_bytes"],
        bf16.breakdown["activations_peak_bytes"],
    )
    assert act32 > 0 and act16 * 2 == act32
    for kind in ("params_bytes", "optimizer_state_bytes", "grads_bytes"):
        assert bf16.breakdown[kind] == fp32.breakdown[kind] > 0  # fp32 master, AdamW, grads
    n = fp32.breakdown["params_bytes"] / 4
    assert fp32.breakdown["optimizer_state_bytes"] == 8 * n  # two fp32 moments a parameter
    # every block's saved activations halve (4 S B H elements x 2 bytes under bf16 ...)
    for kind in ("attn", "mlp"):
        for mode in ("none", "block", "commfree"):
            full = analytic_saved_bytes(SMALL, kind, mode, 4, 2)
            assert analytic_saved_bytes(SMALL, kind, mode, 4, 2, PlanPrecision("bf16")) * 2 == full
    # ... and a dropout mask stays one byte an element
    drop = dataclasses.replace(SMALL, dropout=0.1)
    h = analytic_saved_bytes(drop, "mlp", "none", 4, 1, PlanPrecision("bf16"))
    assert h - analytic_saved_bytes(SMALL, "mlp", "none", 4, 1, PlanPrecision("bf16")) == (
        SMALL.seq_len * SMALL.dim
    )


def test_dp_gradient_reduction_stays_fp32_by_default_and_halves_with_bf16():
    fp32, _ = _run("fp32")
    bf16, _ = _run("bf16")
    low, _ = _run("bf16", "bf16")
    a = fp32.bytes_of("all_reduce", "dp")
    assert a and bf16.bytes_of("all_reduce", "dp") == a
    assert low.bytes_of("all_reduce", "dp") == {n // 2 for n in a}


def test_zero_scatters_in_grad_reduce_and_gathers_fp32_master_weights():
    fp32, _ = _run("fp32", zero=3)
    bf16, _ = _run("bf16", zero=3)
    low, res = _run("bf16", "bf16", zero=3)
    scatter = fp32.bytes_of("reduce_scatter", "dp")
    gather = {n for o, g, _, n in fp32.calls if o == "all_gather" and g == "dp"}
    assert scatter and gather
    assert bf16.bytes_of("reduce_scatter", "dp") == scatter
    assert low.bytes_of("reduce_scatter", "dp") == {n // 2 for n in scatter}
    # the runtime gathers fp32 master weights (parallel.shard) and autocast casts them
    for rec in (bf16, low):
        assert {n for o, g, _, n in rec.calls if o == "all_gather" and g == "dp"} == gather
    assert res.peak_mem_bytes > 0


def test_tf32_keeps_fp32_bytes_and_the_presets_carry_bf16_efficiencies():
    tf32 = HardwareCosts(CLUSTERS["a100-ib-64"], SMALL, "tf32")
    assert tf32.precision == FP32 and tf32.elem_bytes == 4
    a100 = HardwareCosts(CLUSTERS["a100-ib-64"], SMALL, "bf16")
    assert a100.matmul_flops_per_s == pytest.approx(271.2e12)  # MAMF: 271.2 of 312
    assert a100.matmul_efficiency == MAMF_A100_SXM
    h100 = HardwareCosts(CLUSTERS["h100-ib-64"], SMALL, "bf16")
    assert h100.matmul_efficiency == MAMF_H100_SXM
    assert h100.precision == PlanPrecision("bf16", "fp32", "fp32")
    assert precision_of(object()) == FP32
    for name, cluster in CLUSTERS.items():
        gpu = cluster.server.gpu
        assert "bf16" in gpu.peak_flops and "bf16" in gpu.dtype_efficiency, name
        assert "MAMF" in gpu.source or "Maximum Achievable" in gpu.source, name


# -------------------------------------------------------------------------------- profiles


def _profile(precision: PlanPrecision = FP32) -> Profile:
    return Profile(
        dataclasses.asdict(SMALL),
        {"device": "cpu", "backend": "gloo"},
        [{"region": "attn", "phase": "forward", "piece": "body", "tp": 1, "rows": 1, "s": 0.01}],
        [],
        precision=precision,
    )


def test_a_profile_records_its_precision_and_round_trips(tmp_path):
    path = tmp_path / "p.json"
    _profile(PlanPrecision("bf16", "bf16")).save(path)
    raw = json.loads(path.read_text())
    assert raw["precision"] == {"compute": "bf16", "grad_reduce": "bf16", "master": "fp32"}
    back = Profile.load(path)
    assert back.precision == PlanPrecision("bf16", "bf16", "fp32")
    assert precision_of(back) == back.precision
    assert back.retimed([], []).precision == back.precision


def test_an_old_profile_without_the_record_loads_as_fp32(tmp_path):
    raw = _profile().to_dict()
    del raw["precision"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(raw))
    assert Profile.load(path).precision == FP32


def test_a_profile_of_another_precision_is_refused_not_reused(tmp_path):
    path = tmp_path / "p.json"
    _profile().save(path)
    assert load_costs(str(path), SMALL, "auto").precision == FP32  # auto: its own
    assert load_costs(str(path), SMALL, "fp32").precision == FP32
    with pytest.raises(ValueError, match="measured in fp32 compute.*--train.precision=bf16"):
        load_costs(str(path), SMALL, "bf16")
    _profile(PlanPrecision("bf16")).save(path)
    assert load_costs(str(path), SMALL, "bf16").precision.compute == "bf16"
    with pytest.raises(ValueError, match="grad_reduce_dtype=bf16"):
        load_costs(str(path), SMALL, "bf16", "bf16")


def test_plan_precision_resolves_as_the_run_would():
    assert resolve_plan_precision("auto", gpu=True) == PlanPrecision("bf16")
    assert resolve_plan_precision("auto", gpu=False) == FP32
    assert resolve_plan_precision("bf16", "bf16") == PlanPrecision("bf16", "bf16")
    assert resolve_plan_precision("fp64", gpu=False) == PlanPrecision("fp64", "fp64", "fp64")
    assert (
        PlanPrecision.from_record(
            {"compute": "fp64", "grad_reduce": "fp64", "master": "fp64"}
        ).master_bytes
        == 8
    )
    with pytest.raises(ValueError, match="train.precision"):
        resolve_plan_precision("int8")
    hw = load_costs("hw:a100-ib-64", SMALL, "auto")
    assert hw.precision == PlanPrecision("bf16") and hw.dtype == "bf16"
    assert load_costs("hw:a100-ib-64", SMALL).precision == FP32  # no run precision: fp32


# ------------------------------------------------------------------------ MFU and tokens/s


def test_mfu_in_the_table_is_the_formula_checked_by_hand():
    cfg = MODELS["paper-h1024-l24"]
    rep = simulate_cluster(
        cfg,
        CLUSTERS[PAPER],
        parse_entries("megatron@tp=4,oases@tp=8", "auto"),
        BatchSpec(64, None, 32),
        1e12,
        dtype="bf16",
        model_name="paper",
    )
    H, L, S, V = 1024, 24, 1024, 50257
    n = L * 12 * H * H + V * H  # qkv 3H^2 + proj H^2 + fc1 4H^2 + fc2 4H^2 a layer; the head
    assert matmul_params(cfg) == n
    text = format_report(rep)
    for row in rep.rows:
        tokens = 64 * S
        flops = 6 * n * tokens + 12 * L * H * S * tokens
        assert model_flops(cfg, tokens) == flops
        by_hand = flops / (row.result.step_s * 32 * 71e12)
        assert row.mfu == pytest.approx(by_hand, rel=1e-12)
        assert 0 < row.mfu < 1
        assert row.tokens_per_s_per_gpu == pytest.approx(tokens / row.result.step_s / 32)
        line = next(
            x
            for x in text.splitlines()
            if x.strip().startswith(row.schedule) and f"tp={row.plan.degrees()[0]}" in x
        )
        assert f"{by_hand:.1%}" in line.split()
        assert f"{row.tokens_per_s_per_gpu:,.0f}" in line.split()
    assert "MFU = model FLOPs per step (6 N tokens + 12 L H S tokens" in text


def test_simulate_bf16_works_for_every_preset(tmp_path, capsys):
    from oases.cli import main

    model = tmp_path / "m.toml"
    model.write_text(
        "[model]\narch = 'llama'\nn_layers = 2\ndim = 1024\nn_heads = 16\n"
        "n_kv_heads = 16\nffn_dim = 2816\nseq_len = 1024\nvocab_size = 32000\n"
    )
    for name in CLUSTERS:
        out = tmp_path / name
        code = main(
            [
                "simulate",
                "--model",
                str(model),
                "--cluster",
                name,
                "--dtype",
                "bf16",
                "--schedules",
                "oases@auto",
                "--out",
                str(out),
            ]
        )
        assert code == 0, name
        data = json.loads((out / "simulate.json").read_text())
        assert data["dtype"] == "bf16" and data["precision"]["compute"] == "bf16", name
        row = data["rows"][0]
        assert 0 < row["mfu"] < 1 and row["tokens_per_s_per_gpu"] > 0, name
        assert data["peak_flops_per_gpu"] == CLUSTERS[name].server.gpu.peak_flops["bf16"]
    code = main(
        [
            "simulate",
            "--model",
            str(model),
            "--cluster",
            "a100-nvlink",
            "--dtype",
            "bf16",
            "--grad-reduce-dtype",
            "bf16",
            "--attention",
            "fused",
            "--out",
            str(tmp_path / "gr"),
        ]
    )
    assert code == 0
    data = json.loads((tmp_path / "gr" / "simulate.json").read_text())
    assert data["precision"] == {"compute": "bf16", "grad_reduce": "bf16", "master": "fp32"}
    assert data["attention"] == "fused" and "fused attention" in data["costs"]
    capsys.readouterr()


def test_plan_in_bf16_prices_the_run_precision(tmp_path, capsys):
    from oases.cli import main

    run = tmp_path / "run.toml"
    run.write_text(
        "[model]\narch = 'llama'\nn_layers = 2\ndim = 1024\nn_heads = 16\n"
        "n_kv_heads = 16\nffn_dim = 2816\nseq_len = 1024\nvocab_size = 32000\n"
        "[train]\nglobal_batch = 64\nmicro_batch = 1\nprecision = 'bf16'\n"
    )
    for name in ("paper-3090-pcie-32", "a100-ib-64", "h100-ib-64"):
        world = CLUSTERS[name].world_size
        code = main(
            [
                "plan",
                str(run),
                "--world-size",
                str(world),
                "--hardware",
                name,
                "--out",
                str(tmp_path / f"{name}.json"),
            ]
        )
        out = capsys.readouterr().out
        assert code == 0, name
        assert "bf16 matmuls" in out and "bf16 compute, fp32 grad reduce" in out, name


def test_a_cluster_file_may_give_a_dtype_efficiency(tmp_path):
    from oases.planner.clusters import load_cluster, save_cluster

    path = tmp_path / "lab.toml"
    gpu = (
        "name = 'g'\npeak_flops = {fp32 = 20e12, bf16 = 300e12}\nmemory_bytes = 40e9\n"
        "memory_bandwidth_bytes_per_s = 1.5e12\nmatmul_efficiency = 0.8\n"
        "elementwise_efficiency = 0.8\n"
    )
    path.write_text(
        "name = 'lab'\nservers = 1\n[server]\ngpus_per_server = 4\n"
        "link = 'pcie4-x16'\n[server.gpu]\n" + gpu + "dtype_efficiency = {bf16 = 0.7}\n"
    )
    lab = load_cluster(path)
    assert HardwareCosts(lab, SMALL, "bf16").matmul_flops_per_s == pytest.approx(0.7 * 300e12)
    assert HardwareCosts(lab, SMALL, "fp32").matmul_flops_per_s == pytest.approx(0.8 * 20e12)
    save_cluster(lab, tmp_path / "lab.json")
    assert load_cluster(tmp_path / "lab.json") == lab
    path.write_text(path.read_text().replace("{bf16 = 0.7}", "{fp16 = 0.7}"))
    with pytest.raises(ValueError, match="dtype_efficiency has 'fp16'"):
        load_cluster(path)
    path.write_text(path.read_text().replace("dtype_efficiency = {fp16 = 0.7}\n", ""))
    assert load_cluster(path).server.gpu.matmul_efficiency_at("bf16") == 0.8  # the default
