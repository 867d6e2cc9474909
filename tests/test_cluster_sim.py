"""Clusters on paper: the paper's model presets, the Merak baseline program (built, simulated and
run by the executor), topology-aware collective prices, the simulator's one-micro-batch
shortcut (equal to simulating the whole program), the planning time at 1024 GPUs, and
``oases simulate``."""

from __future__ import annotations

import dataclasses
import itertools
import json
import time

import pytest

from distributed import REPO_ROOT, run_ranks
from oases.config import ModelConfig
from oases.plan import ParallelPlan, RegionPlan, region_names
from oases.planner.batch import BatchShape
from oases.planner.clusters import get_cluster
from oases.planner.costs import region_param_count
from oases.planner.hardware import HardwareCosts
from oases.planner.models import MODELS, PAPER_SHAPES, load_model
from oases.planner.simulate import plan_program, simulate_plan
from oases.schedule import SCHEDULES
from oases.schedule.instructions import Compute, Start, Wait
from oases.schedule.program import build_program
from oases.schedule.specs import BASELINES, SPECS

TINY = ModelConfig(
    arch="gpt2", n_layers=2, dim=32, n_heads=4, vocab_size=101, seq_len=16, tie_embeddings=True
)


# ------------------------------------------------------------------------------------ presets


def test_paper_presets_match_the_table():
    assert len(MODELS) == 7
    for (h, n_layers), (name, cfg) in zip(PAPER_SHAPES, MODELS.items()):
        assert name == f"paper-h{h}-l{n_layers}"
        assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.head_dim) == (h, n_layers, h // 64, 64)
        assert (cfg.seq_len, cfg.vocab_size, cfg.arch, cfg.ffn_dim) == (1024, 50257, "gpt2", 4 * h)
        assert load_model(name) is cfg
    assert [(c.dim, c.n_layers) for c in MODELS.values()] == [
        (1024, 24),
        (2048, 24),
        (3072, 24),
        (4096, 16),
        (6144, 16),
        (8192, 8),
        (12288, 4),
    ]
    assert load_model(str(REPO_ROOT / "configs" / "tiny.toml")).n_layers >= 1
    with pytest.raises(ValueError, match="paper-h1024-l24"):
        load_model("gpt-5")


# ------------------------------------------------------------------------------------- merak


def _merak(n_layers: int, n_sub: int, n_micro: int = 1, inflight: int = 1) -> list:
    r = 2 * n_layers + 2
    return build_program(
        "merak", r, n_sub, n_micro=n_micro, max_inflight=inflight, dp_tasks=(0, 1, r - 2, r - 1)
    )


def _block_pass(ins: Compute, produces: bool) -> tuple[int, str]:
    step = "backward" if ins.phase == "recompute" and not produces else ins.phase
    return (ins.pieces[-1][1] + 1) // 2, step


@pytest.mark.parametrize(
    "n_layers,n_sub,n_micro,inflight", list(itertools.product((1, 3), (1, 2, 3), (1, 2), (1, 2)))
)
def test_merak_overlaps_inside_a_block_and_a_pass_only(n_layers, n_sub, n_micro, inflight):
    """Every Start is waited once; no TP collective is open when a compute of another block or
    pass runs; and merak does overlap-recompute's very work (same computes and collectives),
    only with more waits."""
    program = _merak(n_layers, n_sub, n_micro, inflight)
    open_: dict[tuple, tuple[int, str]] = {}
    last: Compute | None = None
    for pos, ins in enumerate(program):
        if isinstance(ins, Start):
            key = (ins.kind, ins.index, ins.sub)
            assert key not in open_
            open_[key] = _block_pass(last, True) if ins.kind != "dp" else (-1, "dp")
        elif isinstance(ins, Wait):
            open_.pop((ins.kind, ins.index, ins.sub))
        else:
            nxt = next((i for i in program[pos + 1 :] if not isinstance(i, Wait)), None)
            here = _block_pass(ins, isinstance(nxt, Start) and nxt.kind != "dp")
            for key, where in open_.items():
                if key[0] != "dp":
                    assert where == here, f"{key} from {where} still open at {ins} ({here})"
            last = ins
    assert not open_
    twin = build_program(
        "overlap-recompute",
        2 * n_layers + 2,
        n_sub,
        n_micro=n_micro,
        max_inflight=inflight,
        dp_tasks=(0, 1, 2 * n_layers, 2 * n_layers + 1),
    )
    for kind in (Compute, Start):
        assert sorted(map(repr, (i for i in program if isinstance(i, kind)))) == sorted(
            map(repr, (i for i in twin if isinstance(i, kind)))
        )
    if n_sub > 1:  # and it does overlap: a Start is followed by a compute before its Wait
        assert any(
            isinstance(a, Start) and isinstance(b, Compute) for a, b in zip(program, program[1:])
        )


def test_merak_is_a_baseline_not_an_ablation_schedule():
    assert "merak" in SPECS and BASELINES == ("merak", "megatron-sp") and "merak" not in SCHEDULES
    assert SPECS["merak"].overlapped and SPECS["merak"].recompute == "block"


def test_merak_simulates_between_megatron_and_cross_block_overlap():
    """On the paper's PCIe servers a block's all-reduce outlasts its compute: merak hides
    collectives inside blocks, so it beats megatron-recompute, but exposes one per block and
    pass that overlap-recompute hides behind the next block."""
    from oases.planner.models import paper_model

    cfg = paper_model(2048, 4)
    costs = HardwareCosts(get_cluster("paper-3090-pcie-32"), cfg)
    step = {
        name: simulate_plan(
            cfg,
            ParallelPlan.uniform(cfg, 32, 4, schedule=name, n_sub=2),
            costs,
            32,
            BatchShape(64, 32),
            timeline=False,
        ).step_s
        for name in ("megatron-recompute", "merak", "overlap-recompute", "oases")
    }
    assert step["oases"] < step["overlap-recompute"] < step["merak"] < step["megatron-recompute"]


def _rank_merak_equals_megatron(rank: int, world_size: int) -> dict:
    """tp=2, dropout 0: merak's loss and gradients equal megatron's (float64, 1e-10:
    tests/exactness.py); the program the executor runs is the one the simulator prices."""
    import copy

    import torch

    from exactness import EXACT64, to64
    from oases.model import build_model
    from oases.parallel.apply import parallelize
    from oases.parallel.context import init_distributed
    from oases.schedule import build_schedule

    ctx = init_distributed(tp=world_size)
    torch.manual_seed(0)
    ref = to64(build_model(TINY))
    gen = torch.Generator().manual_seed(1)
    tokens, targets = (
        torch.randint(0, TINY.vocab_size, (4, TINY.seq_len), generator=gen) for _ in range(2)
    )
    out = {}
    for name in ("megatron", "merak"):
        model = parallelize(copy.deepcopy(ref), ctx)
        model.zero_grad(set_to_none=True)
        sched = build_schedule(name, n_sub=2, micro_batch=2)
        loss = sched.step(model, tokens, targets)
        out[name] = (loss, {n: p.grad.clone() for n, p in model.named_parameters()})
        plan = ParallelPlan.uniform(TINY, world_size, world_size, schedule=name, n_sub=2)
        out[name + " same program"] = sched.program(model, 4) == plan_program(
            TINY, plan, world_size, BatchShape(4, 2)
        )
    torch.testing.assert_close(out["merak"][0], out["megatron"][0], **EXACT64)
    for n, g in out["megatron"][1].items():
        torch.testing.assert_close(out["merak"][1][n], g, **EXACT64, msg=n)
    return {k: v for k, v in out.items() if k.endswith("same program")}


@pytest.mark.exact
def test_executor_runs_merak_and_equals_megatron(tmp_path):
    for per_rank in run_ranks(_rank_merak_equals_megatron, 2, tmp_path):
        assert per_rank == {"megatron same program": True, "merak same program": True}


# ------------------------------------------------------------------ the simulator's shortcut

SMALL = ModelConfig(
    arch="gpt2", n_layers=3, dim=512, n_heads=8, vocab_size=1000, seq_len=128, tie_embeddings=True
)


def _plan(degrees: list[int], schedule: str, world: int = 32) -> ParallelPlan:
    return ParallelPlan(
        [RegionPlan(n, t, world // t) for n, t in zip(region_names(SMALL), degrees)],
        n_sub=2,
        schedule=schedule,
    )


@pytest.mark.parametrize("schedule", [*SCHEDULES, "merak"])
@pytest.mark.parametrize(
    "degrees", [[4] * 8, [2] * 8, [4, 4, 8, 8, 2, 2, 4, 4], [8, 8, 4, 4, 4, 2, 2, 8]]
)
@pytest.mark.parametrize("n_micro", [1, 2, 3])
def test_one_micro_batch_scaled_equals_the_whole_program(schedule, degrees, n_micro):
    """Micro-batches are identical and each ends with its collectives done: simulating one
    (and the last, with the DP all-reduces) and adding up gives the whole program's step,
    busy times, peak memory and timeline."""
    costs = HardwareCosts(get_cluster("paper-3090-pcie-32"), SMALL)
    batch = BatchShape(32 * n_micro, 32)
    fast = simulate_plan(SMALL, _plan(degrees, schedule), costs, 32, batch)
    slow = simulate_plan(SMALL, _plan(degrees, schedule), costs, 32, batch, scaled=False)
    assert fast.step_s == pytest.approx(slow.step_s, rel=1e-12)
    assert fast.peak_mem_bytes == pytest.approx(slow.peak_mem_bytes, rel=1e-12)
    assert fast.breakdown == pytest.approx(slow.breakdown, rel=1e-12)
    key = lambda e: (e.lane, e.start_s, e.name, e.sub)  # noqa: E731
    a, b = sorted(fast.timeline.events, key=key), sorted(slow.timeline.events, key=key)
    assert [(e.lane, e.name, e.phase, e.sub) for e in a] == [
        (e.lane, e.name, e.phase, e.sub) for e in b
    ]
    assert [e.end_s for e in a] == pytest.approx([e.end_s for e in b], rel=1e-12, abs=1e-15)
    bare = simulate_plan(SMALL, _plan(degrees, schedule), costs, 32, batch, timeline=False)
    assert bare.step_s == fast.step_s and not bare.timeline.events


def test_chain_solvers_agree_with_brute_force(monkeypatch):
    """The dynamic program (memory ignored), the Pareto dynamic program and the MILP (memory
    binding) against brute force; solve_chain falls back to the MILP when fronts grow."""
    import numpy as np

    from oases.planner import chain as search
    from oases.planner.chain import (
        _solve_chain_milp,
        solve_chain,
        solve_chain_brute,
        solve_chain_dp,
        solve_chain_pareto,
    )

    rng = np.random.default_rng(7)
    for case in range(80):
        n, k = int(rng.integers(1, 7)), int(rng.integers(2, 4))
        node_s, node_bytes = rng.uniform(0, 1, (n, k)), rng.uniform(1, 3, (n, k))
        edge_s = rng.uniform(0, 0.3, (max(n - 1, 0), k, k)) * (1 - np.eye(k))
        node_s[rng.integers(n), rng.integers(k)] = np.inf
        free = solve_chain_brute(node_s, node_bytes, edge_s, np.inf)
        assert solve_chain_dp(node_s, edge_s) == free.choice
        budget = float(node_bytes.min(axis=1).sum() * rng.uniform(1.0, 1.3))
        try:
            want = solve_chain_brute(node_s, node_bytes, edge_s, budget)
        except ValueError:
            continue
        got = _solve_chain_milp(node_s, node_bytes, edge_s, ~np.isfinite(node_s), budget, 30.0)
        assert got.time_s == pytest.approx(want.time_s, abs=1e-9)
        monkeypatch.setattr(search, "PARETO_LIMIT", 100_000)
        pareto = search.evaluate(
            solve_chain_pareto(node_s, node_bytes, edge_s, budget), node_s, node_bytes, edge_s
        )
        assert pareto.time_s == pytest.approx(want.time_s, abs=1e-12)
        assert pareto.memory_bytes <= budget
        monkeypatch.setattr(search, "PARETO_LIMIT", 0 if case % 2 else 100_000)
        assert solve_chain(node_s, node_bytes, edge_s, budget).time_s == pytest.approx(
            want.time_s, abs=1e-9
        )


# ------------------------------------------------------------------ collectives by topology


def test_tp_and_dp_groups_are_priced_for_the_8x4_topology():
    """paper-3090-pcie-32: a TP group of 4 is NCCL's ring over one server's host-staged PCIe
    (every GPU's link both ways); of 8, a ring over two servers bound by the server's port; a
    DP group (strided: one rank per server at tp=4) crosses all 8 servers while the server's
    other 3 GPUs do the same in their DP groups, so 4 share each port. Each is NCCL's Simple
    ring at these sizes: latency (base + per-step hardware latencies, network steps 14 us,
    x1.4 across servers) + bytes x steps / ranks / bus bandwidth."""
    cluster = get_cluster("paper-3090-pcie-32")
    costs = HardwareCosts(cluster, MODELS["paper-h2048-l24"])
    n = 32 * 2**20
    staged = cluster.server.link.duplex_bytes_per_s
    port = cluster.inter_link.effective_bytes_per_s

    def ring(p: int, nodes: int, nbytes: float, bus: float, steps: int = 2) -> float:
        total, crossing = steps * (p - 1), (steps * (nodes - 1))
        lat = 8.4 + (total - crossing) * 5.7 + crossing * 14.0
        return lat * (1.4 if nodes > 1 else 1.0) * 1e-6 + total / p * nbytes / bus

    assert costs.collective_ranks_s("all_reduce", range(4), n) == pytest.approx(
        ring(4, 1, n, staged)
    )
    assert costs.collective_ranks_s("all_reduce", range(8), n) == pytest.approx(
        ring(8, 2, n, min(staged, port))
    )
    dp = range(0, 32, 4)
    assert costs.collective_ranks_s("all_reduce", dp, n) == pytest.approx(ring(8, 8, n, port / 4))
    assert costs.collective_ranks_s("all_reduce", range(0, 32, 2), n) == pytest.approx(
        ring(16, 8, n, port / 2)
    )
    # the simulator prices a plan's groups by rank 0's: TP contiguous, DP strided
    cfg = dataclasses.replace(MODELS["paper-h2048-l24"], n_layers=1)
    res = simulate_plan(
        cfg,
        ParallelPlan.uniform(cfg, 32, 4, schedule="megatron", n_sub=1),
        costs,
        32,
        BatchShape(32, 32),
    )
    tp_events = [e for e in res.timeline.events if e.phase == "fwd" and e.name == "fwd AR 1"]
    assert tp_events[0].end_s - tp_events[0].start_s == pytest.approx(
        ring(4, 1, 4 * 1024 * 2048 * 4, staged)
    )
    dp_s = sum(e.end_s - e.start_s for e in res.timeline.events if e.phase == "dp")
    grads = sum(
        costs.collective_ranks_s("all_reduce", dp, region_param_count(cfg, k, 4) * 4)
        for k in ("embed", "attn", "mlp", "head")
    )
    assert dp_s == pytest.approx(grads, rel=0.02)  # (buckets group the norms differently)


# ------------------------------------------------------------------------ planning at scale


def test_planning_1024_gpus_96_layers():
    """128 H100 servers x 8, a 96-layer GPT (H=2048, S=2048): the planner's auto plan for
    oases under a 45 GiB budget (memory binds, so the Pareto solver runs), then the chosen
    plan simulated with its timeline. Its time is printed, never asserted (speed lives in
    benchmarks/*-paper-simulation)."""
    from oases.planner.sim_inputs import parse_entries
    from oases.planner.whatif import simulate_cluster

    cfg = ModelConfig(
        arch="gpt2",
        n_layers=96,
        dim=2048,
        n_heads=16,
        vocab_size=50257,
        seq_len=2048,
        tie_embeddings=True,
    )
    cluster = dataclasses.replace(get_cluster("h100-ib-64"), servers=128, name="h100-ib-1024")
    start = time.perf_counter()
    rep = simulate_cluster(
        cfg,
        cluster,
        parse_entries("oases@auto", "auto"),
        BatchShape(4096, 1024),
        45 * 2**30,
        dtype="tf32",
    )
    elapsed = time.perf_counter() - start
    print(f"1024 GPUs x 96 layers: planned and simulated in {elapsed:.2f} s")
    (row,) = rep.rows
    assert row.fits and len(row.plan.regions) == 2 * 96 + 2
    assert max(row.plan.degrees()) <= 8  # TP stays inside a server


# ---------------------------------------------------------------------------- the command


def _main(capsys, *args: str) -> tuple[int, str, str]:
    from oases.cli import main

    try:
        code = main(list(args))
    except SystemExit as exc:  # --help
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_simulate_help_explains_presets_and_cluster_files(capsys, tmp_path):
    code, out, _ = _main(capsys, "simulate", "--help")
    assert code == 0
    for needle in (
        "cluster preset",
        "paper-3090-pcie-32",
        "paper-h1024-l24",
        "TOML",
        "gpus_per_server",
        "inter_link",
        "nics_per_server",
        "tp=N+",
    ):
        assert needle in out, needle
    # the example in the help is a cluster file that loads
    from oases.planner.clusters import load_cluster

    lines = out[out.index('  name = "lab"') :].splitlines()
    toml = "\n".join(line.split("  #")[0].strip() for line in lines[:8])
    (tmp_path / "lab.toml").write_text(toml)
    lab = load_cluster(tmp_path / "lab.toml")
    assert (lab.servers, lab.server.gpus_per_server, lab.world_size) == (4, 8, 32)


def test_simulate_writes_json_and_png(capsys, tmp_path):
    (tmp_path / "two.toml").write_text(
        'name = "two"\nservers = 2\ninter_link = "25gbe"\n'
        '[server]\ngpus_per_server = 2\ngpu = "rtx3090"\n'
        'link = "pcie3-x16-geforce"\n'
    )
    code, out, err = _main(
        capsys,
        "simulate",
        "--model",
        "paper-h1024-l24",
        "--cluster",
        str(tmp_path / "two.toml"),
        "--schedules",
        "megatron-recompute@tp=2,merak@tp=2,oases",
        "--global-batch",
        "8",
        "--micro-batch",
        "4",
        "--out",
        str(tmp_path / "out"),
    )
    assert code == 0, err
    assert "vs megatron-recompute" in out and "oases@auto degrees by region" in out
    data = json.loads((tmp_path / "out" / "simulate.json").read_text())
    assert [r["schedule"] for r in data["rows"]] == ["megatron-recompute", "merak", "oases"]
    assert data["rows"][0]["speedup"] == 1.0 and data["cluster"]["servers"] == 2
    for row in data["rows"]:
        assert (
            row["step_s"] > 0
            and row["tokens_per_s"] == pytest.approx(8 * 1024 / row["step_s"])
            and row["peak_mem_bytes"] > 0
        )
    assert (tmp_path / "out" / "timeline-oases.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, _, err = _main(
        capsys,
        "simulate",
        "--model",
        "paper-h1024-l24",
        "--cluster",
        "nowhere-64",
        "--out",
        str(tmp_path / "bad"),
    )
    assert code == 2 and err.startswith("error: unknown cluster preset 'nowhere-64'")
