"""The planner end to end on costs: profiles, whole-plan simulation, plan search, the CLI."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from distributed import REPO_ROOT, run_ranks
from oases.config import ModelConfig, load_config
from oases.plan import ParallelPlan, RegionPlan, region_names
from oases.planner import batch_shape, format_candidates, plan_model
from oases.planner.batch import BatchShape
from oases.planner.costs import region_param_count, region_params
from oases.planner.profile import Profile, fit_latency_bandwidth
from oases.planner.search import solve_plan
from oases.planner.simulate import plan_program, simulate_plan
from oases.schedule.instructions import Start

CFG = ModelConfig(arch="gpt2", n_layers=4, dim=64, n_heads=4, vocab_size=128, seq_len=32)
PIECES = [
    ("forward", "body"),
    ("forward", "epi"),
    ("recompute", "body"),
    ("recompute", "body-commfree"),
    ("recompute", "epi"),
    ("backward", "norm"),
    ("backward", "epi"),
    ("backward", "tp"),
]


def synthetic_profile(
    cfg=CFG,
    degrees=(1, 2),
    rows=(1, 2, 4),
    latency_s=1e-3,
    bandwidth=50e6,
    baseline=100e6,
    groups=None,
) -> Profile:
    """Matmul pieces cost 1 ms per row at tp=1 and scale as 1/tp; glue 0.1 ms per row."""
    compute = []
    for region in ("embed", "attn", "mlp", "head"):
        for phase, piece in PIECES:
            for t in degrees:
                for r in rows:
                    matmul = piece in ("body", "body-commfree", "tp")
                    s = (1e-3 * r / t) * (2 if piece == "tp" else 1) if matmul else 1e-4 * r
                    if piece == "body-commfree":
                        s *= 0.6
                    compute.append(
                        {
                            "region": region,
                            "phase": phase,
                            "piece": piece,
                            "tp": t,
                            "rows": r,
                            "s": s,
                        }
                    )
    collectives = [
        {"op": op, "group_size": g, "nbytes": n, "s": latency_s + n / bandwidth}
        for op in ("all_reduce", "all_gather")
        for g in (groups or degrees)
        if g > 1
        for n in (2**14, 2**18, 2**22)
    ]
    model = {
        k: getattr(cfg, k)
        for k in (
            "arch",
            "dim",
            "n_heads",
            "n_kv_heads",
            "ffn_dim",
            "vocab_size",
            "seq_len",
            "tie_embeddings",
        )
    }
    return Profile(
        model,
        {"cpu": "synthetic"},
        compute,
        collectives,
        [],
        [{"n_params": 1e5, "s": 1e-3}, {"n_params": 1e6, "s": 1e-2}],
        baseline,
    )


def test_fit_recovers_latency_and_bandwidth():
    pts = [(n, 2e-4 + n / 1e8) for n in (1e4, 1e5, 1e6, 1e7)]
    latency, bandwidth = fit_latency_bandwidth(pts)
    assert latency == pytest.approx(2e-4, rel=1e-6)
    assert bandwidth == pytest.approx(1e8, rel=1e-6)


def test_profile_round_trip_and_interpolation(tmp_path):
    prof = synthetic_profile()
    prof.save(tmp_path / "p.json")
    back = Profile.load(tmp_path / "p.json")
    assert back.compute_s("mlp", "forward", "body", 2, 4) == pytest.approx(2e-3)
    assert back.compute_s("mlp", "forward", "body", 2, 3) == pytest.approx(1.5e-3)  # between
    assert back.compute_s("mlp", "forward", "body", 2, 8) == pytest.approx(4e-3)  # beyond
    assert back.collective_s("all_reduce", 2, 2**20) == pytest.approx(1e-3 + 2**20 / 50e6)
    assert back.collective_s("all_reduce", 1, 2**20) == 0.0
    assert back.optimizer_s(5e5) == pytest.approx(5e-3)
    with pytest.raises(ValueError, match="profiled degrees"):
        back.compute_s("mlp", "forward", "body", 4, 1)
    with pytest.raises(ValueError, match="no all_reduce over 4 ranks"):
        back.collective_s("all_reduce", 4, 100)


def test_profile_errors_name_the_problem(tmp_path):
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(ValueError, match="not an oases profile"):
        Profile.load(tmp_path / "x.json")
    with pytest.raises(ValueError, match="cannot read profile"):
        Profile.load(tmp_path / "missing.json")
    raw = synthetic_profile().to_dict() | {"version": 99}
    (tmp_path / "v.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="version 99"):
        Profile.load(tmp_path / "v.json")
    other = ModelConfig(arch="gpt2", n_layers=4, dim=128, n_heads=4, vocab_size=128, seq_len=32)
    with pytest.raises(ValueError, match="dim: profile 64, model 128"):
        synthetic_profile().check_model(other)
    synthetic_profile().check_model(ModelConfig(**{**CFG.__dict__, "n_layers": 9}))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("tied", [False, True])
def test_region_parameter_counts_match_the_model(arch, tied):
    import oases

    cfg = ModelConfig(
        arch=arch,
        n_layers=2,
        dim=32,
        n_heads=4,
        n_kv_heads=2 if arch == "llama" else 4,
        vocab_size=101,
        seq_len=16,
        tie_embeddings=tied,
    )
    total = sum(region_param_count(cfg, name.rsplit(".", 1)[-1], 1) for name in region_names(cfg))
    assert total == oases.count_params(oases.build_model(cfg))
    sharded, replicated = region_params(cfg, "mlp", 2)
    assert sharded * 2 + replicated == region_param_count(cfg, "mlp", 1)


def _plan(degrees, schedule="oases", n_sub=2, world=2):
    return ParallelPlan(
        [RegionPlan(n, t, world // t) for n, t in zip(region_names(CFG), degrees)],
        n_sub=n_sub,
        schedule=schedule,
    )


def test_synchronous_uniform_plan_adds_up():
    """megatron at tp=2 on 2 ranks: no overlap, no DP; step = compute + collectives + optimizer."""
    prof = synthetic_profile()
    res = simulate_plan(CFG, _plan([2] * 10, "megatron", 1), prof, 2, BatchShape(8, 4))
    b = res.breakdown
    assert res.step_s == pytest.approx(b["compute_s"] + b["comm_s"] + b["optimizer_s"])
    assert b["comm_s"] > 0 and b["optimizer_s"] > 0


def test_mixed_plan_prices_reshards_where_the_degree_changes():
    prof = synthetic_profile()
    degrees = [1, 1, 1, 2, 2, 2, 2, 1, 1, 1]
    res = simulate_plan(CFG, _plan(degrees), prof, 2, BatchShape(8, 4))
    reshards = {(e.phase, e.name) for e in res.timeline.events if e.phase in ("rsf", "rsb")}
    # growing at region 3 moves data forward, shrinking at region 7 moves gradients back
    assert reshards == {("rsf", "rsf 3"), ("rsb", "rsb 7")}
    program = plan_program(CFG, _plan(degrees), 2, BatchShape(8, 4))
    starts = {
        (s.kind, s.index) for s in program if isinstance(s, Start) and s.kind in ("rsf", "rsb")
    }
    assert starts == {("rsf", 3), ("rsb", 3), ("rsf", 7), ("rsb", 7)}


def _rank_programs(rank, world_size, cases):
    import oases
    from oases.parallel.shard import shard_model
    from oases.schedule import build_schedule

    out = []
    for degrees, schedule, global_batch, micro_rows, *zero in cases:
        plan = _plan(degrees, schedule)
        if zero:  # every region at this ZeRO stage (stage 3: weights gathered per pass)
            plan = dataclasses.replace(
                plan, regions=[dataclasses.replace(r, zero=zero[0]) for r in plan.regions]
            )
        ctx = oases.init_distributed(tp=degrees[0], degrees=plan.degrees())
        model = oases.parallelize(oases.build_model(CFG), ctx, plan)
        if zero:
            shard_model(model, plan.zero_stages())
        t_e = degrees[0]
        sched = build_schedule(schedule, n_sub=2, micro_batch=micro_rows * t_e // world_size)
        executed = sched.program(model, global_batch * t_e // world_size)
        simulated = plan_program(CFG, plan, world_size, BatchShape(global_batch, micro_rows))
        out.append(executed == simulated)
    return out


def test_simulator_and_executor_consume_the_same_programs(tmp_path):
    cases = [
        ([1] * 10, "oases", 8, 4),
        ([2] * 10, "megatron", 8, 8),
        ([1, 1, 1, 2, 2, 2, 2, 1, 1, 1], "oases", 8, 4),
        ([2, 1, 1, 2, 2, 1, 2, 1, 1, 2], "overlap-recompute", 16, 8),
        ([1, 2, 2, 2, 1, 1, 2, 2, 1, 1], "commfree-recompute", 8, 8),
        # ZeRO: reduce-scatters, weight gathers and releases in the same places
        ([1] * 10, "oases", 16, 4, 1),
        ([1] * 10, "megatron", 8, 4, 2),
        ([1] * 10, "oases", 16, 4, 3),
        ([1] * 10, "megatron-recompute", 8, 8, 3),
        ([1, 1, 1, 2, 2, 2, 2, 1, 1, 1], "oases", 8, 4, 3),
    ]
    for per_rank in run_ranks(_rank_programs, 2, tmp_path, cases):
        assert per_rank == [True] * len(cases)


def test_memory_falls_with_degree_and_recompute():
    prof = synthetic_profile(baseline=0.0)
    batch = BatchShape(8, 8)
    mem = {
        (s, t): simulate_plan(
            CFG, _plan([t] * 10, s, 1 if s == "megatron" else 2), prof, 2, batch
        ).breakdown
        for s in ("megatron", "oases")
        for t in (1, 2)
    }
    assert mem["megatron", 2]["params_bytes"] < mem["megatron", 1]["params_bytes"]
    assert mem["oases", 1]["activations_peak_bytes"] < mem["megatron", 1]["activations_peak_bytes"]


def test_plan_search_is_never_worse_than_uniform_and_meets_the_budget():
    prof = synthetic_profile()
    batch = BatchShape(8, 4)
    best, cands = solve_plan(CFG, prof, 2, batch, float("inf"))
    fitting_uniform = [c for c in cands if c.kind == "uniform"]
    assert best.result.step_s <= min(c.result.step_s for c in fitting_uniform) + 1e-12
    assert best.plan.predicted_step_s == best.result.step_s
    # a budget between the leanest and the fattest uniform plan: the answer fits it
    peaks = sorted(c.result.peak_mem_bytes for c in fitting_uniform)
    budget = (peaks[0] + peaks[-1]) / 2
    tight, cands = solve_plan(CFG, prof, 2, batch, budget)
    assert tight.result.peak_mem_bytes <= budget
    assert (
        tight.result.step_s
        <= min(c.result.step_s for c in cands if c.kind == "uniform" and c.fits) + 1e-12
    )
    text = format_candidates(tight, cands, budget)
    assert "chosen" in text and ("over budget" in text or "slower" in text)
    with pytest.raises(ValueError, match=r"smallest feasible budget is \d+\.\d+ GiB"):
        solve_plan(CFG, prof, 2, batch, peaks[0] * 0.5)


def test_memory_pressure_moves_layers_to_the_higher_degree():
    """tp=1 is faster (no TP collectives) but holds twice the weights: under a budget between
    the two uniform plans the planner mixes degrees (or recomputes), and stays in budget."""
    prof = synthetic_profile(bandwidth=5e9, baseline=0.0)
    batch = BatchShape(8, 4)
    free, cands = solve_plan(CFG, prof, 2, batch, float("inf"), schedules=("megatron",))
    assert free.plan.degrees() == (1,)
    uni = {c.plan.degrees()[0]: c.result.peak_mem_bytes for c in cands if c.kind == "uniform"}
    budget = uni[2] + 0.4 * (uni[1] - uni[2])
    tight, _ = solve_plan(CFG, prof, 2, batch, budget, schedules=("megatron",))
    assert tight.result.peak_mem_bytes <= budget
    assert 2 in tight.plan.degrees()


def test_plan_for_96_layers():
    cfg = ModelConfig(arch="gpt2", n_layers=96, dim=64, n_heads=8, vocab_size=128, seq_len=32)
    prof = synthetic_profile(cfg, degrees=(1, 2, 4, 8), rows=(1, 2, 4, 8))
    best, _ = solve_plan(
        cfg, prof, 8, BatchShape(16, 16), float("inf"), schedules=("oases",), n_subs=(2,)
    )
    assert len(best.plan.regions) == 2 * 96 + 2


def test_batch_shape_from_the_config():
    cfg = load_config(REPO_ROOT / "configs" / "bench.toml", [])
    shape = batch_shape(cfg, 2)
    assert (shape.global_batch, shape.micro_rows) == (4, 4)
    with pytest.raises(ValueError, match="not a multiple"):
        batch_shape(
            load_config(REPO_ROOT / "configs" / "bench.toml", ["--train.global_batch=6"]), 2
        )


def test_plan_model_uses_only_profiled_degrees():
    cfg = load_config(
        REPO_ROOT / "configs" / "bench.toml",
        [
            "--model.dim=64",
            "--model.n_heads=4",
            "--model.seq_len=32",
            "--model.vocab_size=128",
            "--train.global_batch=8",
        ],
    )
    prof = synthetic_profile(cfg.model, degrees=(1, 2), groups=(2, 4))
    best, cands = plan_model(cfg, 4, prof, float("inf"))  # 4 ranks, but tp=4 is not profiled
    assert all(max(c.plan.degrees()) <= 2 for c in cands)
    assert {c.plan.degrees()[0] for c in cands if c.kind == "uniform"} == {1, 2}
    # the DP all-reduce of tp=1 runs over 4 ranks: a profile without it says so
    with pytest.raises(ValueError, match="no all_reduce over 4 ranks"):
        plan_model(cfg, 4, synthetic_profile(cfg.model, degrees=(1, 2)), float("inf"))
    with pytest.raises(ValueError, match="unknown schedule"):
        plan_model(cfg, 4, prof, float("inf"), schedules=("oases", "nope"))
    with pytest.raises(ValueError, match="none of which fits"):
        plan_model(cfg, 4, synthetic_profile(cfg.model, degrees=(8,)), float("inf"))
    with pytest.raises(ValueError, match="does not divide the world size"):
        batch_shape(load_config(REPO_ROOT / "configs" / "bench.toml", []), 3)


def _cli(*args, cwd=REPO_ROOT):
    return subprocess.run(
        [sys.executable, "-m", "oases", *args], capture_output=True, text=True, cwd=cwd, timeout=300
    )


def test_cli_plan_writes_the_plan_and_explains(tmp_path):
    cfg = load_config(REPO_ROOT / "configs" / "tiny.toml", [])
    synthetic_profile(cfg.model).save(tmp_path / "p.json")
    out = tmp_path / "plan.json"
    proc = _cli(
        "plan",
        "configs/tiny.toml",
        "--world-size",
        "2",
        "--profile",
        str(tmp_path / "p.json"),
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    assert "chosen:" in proc.stdout and "uniform tp=2" in proc.stdout
    raw = json.loads(out.read_text())
    assert {"regions", "n_sub", "schedule", "predicted_step_s", "predicted_peak_mem_bytes"} <= set(
        raw
    )
    assert raw["regions"][0] == {
        "name": "embed",
        "tp": raw["regions"][0]["tp"],
        "dp": 2 // raw["regions"][0]["tp"],
    }
    ParallelPlan.load(out).check(cfg.model, 2)
    proc = _cli(
        "plan",
        "configs/tiny.toml",
        "--world-size",
        "2",
        "--profile",
        str(tmp_path / "p.json"),
        "--memory-gb",
        "0.001",
        "--out",
        str(out),
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: no plan fits in 0.001 GiB")
    assert "smallest feasible budget" in proc.stderr and len(proc.stderr.splitlines()) == 1
    proc = _cli(
        "plan",
        "configs/tiny.toml",
        "--world-size",
        "2",
        "--profile",
        str(tmp_path / "missing.json"),
    )
    assert proc.returncode == 2 and "cannot read profile" in proc.stderr


def test_cli_profile_measures_every_piece_on_two_ranks(tmp_path):
    out = tmp_path / "profile.json"
    proc = _cli(
        "profile", "configs/tiny.toml", "--out", str(out), "--repeats", "1", "--model.n_layers=1"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    prof = Profile.load(out)
    assert prof.degrees() == [1, 2]
    assert prof.machine["world_size"] == 2 and prof.machine["cores"] >= 1
    # CPU ranks record no device memory of their own: the default budget is none, and says so
    assert prof.machine["device_memory_bytes"] is None
    assert prof.config["file"] == "configs/tiny.toml" and prof.config["tp"] == 2
    assert prof.config["overrides"] == ["--model.n_layers=1"]
    # it records the precision it measured in: train.precision=auto is fp32 on CPU ranks
    assert json.loads(out.read_text())["precision"] == {
        "compute": "fp32",
        "grad_reduce": "fp32",
        "master": "fp32",
    }
    for region in ("attn", "mlp"):
        for phase, piece in PIECES:
            for t in (1, 2):
                assert prof.compute_s(region, phase, piece, t, 1) > 0
    assert prof.collective_fit("all_reduce", 2) is not None
    assert prof.collective_fit("all_gather", 2) is not None
    assert prof.collective_fit("reduce_scatter", 2) is not None
    assert prof.saved_bytes("attn", "none", 1, 1) > prof.saved_bytes("attn", "commfree", 1, 1)
    assert prof.baseline_bytes > 0 and prof.optimizer_s(10**6) > 0
    assert np.isfinite(prof.collective_s("all_reduce", 2, 2**20))
    # one optimizer step per degree's model, timed between the profile's steps
    assert (
        sorted(e["n_params"] for e in prof.optimizer)
        == sorted({e["n_params"] for e in prof.optimizer})
        and len(prof.optimizer) == 2
    )
    # contention both ways, for every kind of collective (CPU ranks: >= 1 by construction)
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        assert prof.contention(op) >= 1.0 and op in prof.contention_factors
        assert prof.comm_contention(op) >= 1.0 and op in prof.comm_contention_factors


def test_train_runs_the_planned_plan(tmp_path):
    """parallel.plan=auto plans with parallel.profile; the plan's schedule and micro-batch are
    the run's; a saved plan file runs without --nproc-per-node (its world size)."""
    cfg = load_config(REPO_ROOT / "configs" / "tiny.toml", [])
    synthetic_profile(cfg.model).save(tmp_path / "p.json")
    common = [
        "--train.steps=2",
        "--train.eval_every=0",
        "--train.sample_tokens=0",
        "--checkpoint.every=0",
        "--checkpoint.resume=never",
    ]
    proc = _cli(
        "train",
        "configs/tiny.toml",
        "--parallel.plan=auto",
        f"--parallel.profile={tmp_path / 'p.json'}",
        f"--train.run_dir={tmp_path / 'a'}",
        *common,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "plan (auto): " in proc.stdout
    saved = (tmp_path / "a" / "config.toml").read_text()
    assert 'plan = "auto"' in saved
    best, _ = plan_model(cfg, 2, synthetic_profile(cfg.model), float("inf"))
    assert f'name = "{best.plan.schedule}"' in saved
    best.plan.save(tmp_path / "plan.json")
    proc = _cli(
        "train",
        "configs/tiny.toml",
        f"--parallel.plan={tmp_path / 'plan.json'}",
        f"--train.run_dir={tmp_path / 'b'}",
        *common,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _cli("train", "configs/tiny.toml", "--parallel.plan=auto", *common)
    assert proc.returncode == 2 and "needs parallel.profile" in proc.stderr


def test_cli_plan_verify_measures_the_chosen_plan(tmp_path):
    cfg = load_config(REPO_ROOT / "configs" / "tiny.toml", [])
    synthetic_profile(cfg.model).save(tmp_path / "p.json")
    proc = _cli(
        "plan",
        "configs/tiny.toml",
        "--world-size",
        "2",
        "--profile",
        str(tmp_path / "p.json"),
        "--out",
        str(tmp_path / "plan.json"),
        "--verify",
        str(tmp_path / "v"),
        "--candidates",
        "chosen",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--rounds",
        "1",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "v" / "verify.json").read_text())
    (row,) = report["candidates"]
    assert row["measured_step_s"] > 0 and row["measured_peak_mem_bytes"] > 0
    assert report["summary"]["chosen"] == row["plan"]
    assert "Prediction against measurement" in (tmp_path / "v" / "report.md").read_text()
    # the launch re-timed the plan's pieces: they alone price the plan (no piece of the
    # synthetic profile is left in the prediction from them)
    assert row["predicted_now_step_s"] > 0 and row["drift"] > -1
    assert row["now_error"] == pytest.approx(
        row["predicted_now_step_s"] / row["measured_step_s"] - 1
    )
    plan = ParallelPlan.load(tmp_path / "plan.json")
    only_now = dataclasses.replace(
        synthetic_profile(cfg.model),
        compute=row["retimed_pieces"],
        optimizer=row["retimed_optimizer"],
    )
    batch = BatchShape(cfg.train.global_batch, int(plan.notes["micro_rows"]))
    res = simulate_plan(cfg.model, plan, only_now, 2, batch, timeline=False)
    assert res.step_s == pytest.approx(row["predicted_now_step_s"])
    assert "re-timed in each launch" in (tmp_path / "v" / "report.md").read_text()


def test_retimed_profile_replaces_the_pieces_it_was_given():
    """``Profile.retimed``: the given pieces take the place of the same piece and rows, the
    given optimizer times the place of all; every other piece, the collectives and the memory
    stay."""
    base = synthetic_profile()
    slower = [dict(e, s=2 * e["s"]) for e in base.compute if e["tp"] == 1]
    now = base.retimed(slower, [{"n_params": 1e6, "s": 5e-2}])
    assert len(now.compute) == len(base.compute)
    for phase, piece in PIECES:
        assert now.compute_s("mlp", phase, piece, 1, 2) == pytest.approx(
            2 * base.compute_s("mlp", phase, piece, 1, 2)
        )
        assert now.compute_s("mlp", phase, piece, 2, 2) == base.compute_s("mlp", phase, piece, 2, 2)
    assert now.optimizer_s(10**6) == pytest.approx(5e-2)
    assert now.optimizer_s(10**5) == pytest.approx(5e-3)  # one point: in proportion
    assert base.retimed(slower, []).optimizer_s(10**5) == base.optimizer_s(10**5)
    assert now.collective_s("all_reduce", 2, 2**20) == base.collective_s("all_reduce", 2, 2**20)
    plan = ParallelPlan.uniform(CFG, 2, 1, schedule="oases", n_sub=2)
    batch = BatchShape(8, 8)
    fast = simulate_plan(CFG, plan, base, 2, batch, timeline=False)
    slow = simulate_plan(CFG, plan, now, 2, batch, timeline=False)
    assert slow.breakdown["compute_s"] == pytest.approx(2 * fast.breakdown["compute_s"])


def test_the_planner_needs_no_process_groups():
    """DESIGN: planner/ runs without torch.distributed (what needs ranks is in oases.bench)."""
    import ast

    for path in sorted((REPO_ROOT / "src" / "oases" / "planner").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                assert not name.startswith(
                    (
                        "torch.distributed",
                        "oases.parallel",
                        "oases.schedule.executor",
                        "oases.train",
                    )
                ), f"{path.name} imports {name}"


def test_full_plan_search_for_1024_gpus_and_96_layers():
    """Every schedule, sub-batch count and degree, 128 servers x 8 H100; its time is printed,
    never asserted (benchmarks/*-paper-simulation reports planning times)."""
    import time

    from oases.planner.clusters import cluster_from_dict
    from oases.planner.hardware import HardwareCosts

    cluster = cluster_from_dict(
        {
            "name": "h100-1024",
            "servers": 128,
            "nics_per_server": 8,
            "inter_link": "ib-ndr",
            "server": {"gpus_per_server": 8, "gpu": "h100", "link": "nvswitch-h100"},
        }
    )
    cfg = ModelConfig(
        arch="gpt2", n_layers=96, dim=12288, n_heads=96, vocab_size=50257, seq_len=2048
    )
    costs = HardwareCosts(cluster, cfg)
    start = time.perf_counter()
    best, cands = solve_plan(cfg, costs, 1024, BatchShape(1024, 128), 140 * 2**30)
    print(f"1024 GPUs x 96 layers, every schedule: {time.perf_counter() - start:.2f} s")
    assert best.fits and len(best.plan.regions) == 2 * 96 + 2
    assert len({c.plan.schedule for c in cands}) >= 6


def test_planning_a_run_twice_gives_the_same_plan_and_batch(tmp_path):
    """The launcher checks the config, then every rank checks the same (updated) config again:
    an auto plan must come out the same, on the same world micro-batch."""
    from oases.train.setup import check_config

    base = load_config(REPO_ROOT / "configs" / "tiny.toml", [])
    synthetic_profile(base.model).save(tmp_path / "p.json")
    for tp in (1, 2):
        cfg = load_config(
            REPO_ROOT / "configs" / "tiny.toml",
            [
                "--parallel.plan=auto",
                f"--parallel.profile={tmp_path / 'p.json'}",
                f"--parallel.tp={tp}",
                f"--train.micro_batch={2 * tp}",
            ],
        )
        first = check_config(cfg, 2)
        seen = (cfg.train.micro_batch, cfg.parallel.tp, cfg.schedule.name, cfg.schedule.n_sub)
        again = check_config(cfg, 2)
        assert again.regions == first.regions and again.schedule == first.schedule
        assert (
            cfg.train.micro_batch,
            cfg.parallel.tp,
            cfg.schedule.name,
            cfg.schedule.n_sub,
        ) == seen
        assert cfg.train.micro_batch * 2 // cfg.parallel.tp == 4  # the world's micro-batch
