"""The pipeline search (``planner.pipeline_search``): stage boundaries balanced against a brute
force; the depths that fit the servers; a pipeline plan found where it must win (a slow link
between servers, a model whose gradient reduction dominates) and not where it must lose (one
server, a fast link); the numbers a candidate carries are its full walk's; the plan file round
trip; ``oases plan --pp``; and a pipeline plan file run by ``oases train`` on 2 ranks, float64
equal to the single-device model."""

from __future__ import annotations

import itertools
import random

import pytest

from oases.config import Config, ModelConfig
from oases.plan import ParallelPlan
from oases.planner import search_plans
from oases.planner.budget import costs_budget
from oases.planner.hardware import HardwareCosts
from oases.planner.pipeline_boundaries import balanced_stage_starts, stage_shares
from oases.planner.pipeline_screen import pipeline_depths
from oases.planner.pipeline_search import choose, search_config_pipelines
from oases.planner.sim_inputs import load_any_cluster
from oases.planner.simulate import simulate_plan
from oases.stages import block_start

DP_HEAVY = ModelConfig(arch="gpt2", dim=2048, n_heads=16, n_layers=8, vocab_size=512, seq_len=256)
SLOW_TWO_SERVERS = """name = "slow2"
servers = 2
inter_link = "10gbe"
[server]
gpus_per_server = 1
gpu = "rtx3090"
link = "pcie4-x16-geforce"
"""


def _config(model: ModelConfig, global_batch: int, micro_batch: int, tp: int) -> Config:
    cfg = Config()
    cfg.model = model
    cfg.train.global_batch, cfg.train.micro_batch, cfg.parallel.tp = global_batch, micro_batch, tp
    return cfg


def _brute_force(region_s: list[float], pp: int) -> float:
    n_layers = (len(region_s) - 2) // 2
    best = float("inf")
    for cuts in itertools.combinations(range(1, n_layers), pp - 1):
        starts = tuple(block_start(c) for c in cuts)
        edges = (0, *starts, len(region_s))
        best = min(best, max(sum(region_s[a:b]) for a, b in zip(edges, edges[1:])))
    return best


@pytest.mark.parametrize("seed", range(20))
def test_balanced_stage_starts_match_the_brute_force(seed):
    rng = random.Random(seed)
    n_layers, pp = rng.randint(2, 9), rng.randint(2, 4)
    if pp > n_layers:
        pp = n_layers
    region_s = [rng.uniform(0.1, 3.0) for _ in range(2 * n_layers + 2)]
    starts = balanced_stage_starts(region_s, pp)
    total = sum(region_s)
    got = max(stage_shares(region_s, starts)) * total
    assert got == pytest.approx(_brute_force(region_s, pp), rel=1e-12)
    ParallelPlan.uniform(
        ModelConfig(n_layers=n_layers, dim=32, n_heads=4), pp, 1, pp=pp, stage_starts=list(starts)
    ).check(ModelConfig(n_layers=n_layers, dim=32, n_heads=4), pp)


def test_pipeline_depths_fit_the_servers():
    assert pipeline_depths(32, 40, 4) == [2, 4, 8, 16, 32]  # stages of 16, 8, 4, 2, 1 GPUs
    assert pipeline_depths(24, 40, 4) == [2, 3, 6, 12, 24]  # not 4 (stages of 6 GPUs)
    assert pipeline_depths(32, 6, 4) == [2, 4]  # at most one block a stage
    assert pipeline_depths(32, 40, 4, (4, 3)) == [4]
    assert pipeline_depths(8, 8, None) == [2, 4, 8]


def _both(cfg: Config, costs: HardwareCosts, world: int):  # noqa: ANN202
    budget = costs_budget(0.0, costs).bytes
    flat = search_plans(
        cfg, world, costs, budget, ("megatron", "oases"), zeros=(0, 1), sps=(),
        search_micro_batch=False,
    )  # fmt: skip
    piped = search_config_pipelines(cfg, world, costs, budget, search_micro_batch=False, sps=())
    return flat.best, piped


def test_a_pipeline_wins_on_a_slow_link_where_the_reduction_dominates():
    """Two 4-GPU servers joined by 1 Gb/s, a model of 0.4 G parameters and 32 sequences a
    step: every plan without a pipeline reduces the gradient over the slow port, a pipeline
    of one stage per server sends only activations over it."""
    cfg = _config(DP_HEAVY, 32, 1, 1)
    costs = HardwareCosts(load_any_cluster("paper-3090-pcie-32", 1.0), DP_HEAVY, "bf16", "fp32")
    flat, piped = _both(cfg, costs, 8)
    assert piped.best is not None and piped.best.fits
    assert piped.best.result.step_s < 0.2 * flat.result.step_s
    chosen = choose(flat, piped)
    assert chosen is piped.best and chosen.plan.pp == 2
    assert "pp=2" in chosen.label()
    # the numbers a candidate carries are its own full walk's
    again = simulate_plan(DP_HEAVY, chosen.plan, costs, 8, chosen.batch, timeline=False)
    assert again.step_s == chosen.result.step_s
    assert again.peak_mem_bytes == chosen.result.peak_mem_bytes
    assert chosen.plan.notes["micro_rows"] == chosen.batch.micro_rows
    assert chosen.plan.precision == {"compute": "bf16", "grad_reduce": "fp32", "master": "fp32"}


def test_no_pipeline_where_it_must_lose():
    """One server of 8 A100s on NVLink, a small model, 8 sequences a step: the reduction is
    cheap and a pipeline's bubble is not, so the plan without a pipeline is chosen."""
    model = ModelConfig(arch="gpt2", dim=256, n_heads=4, n_layers=8, vocab_size=512, seq_len=1024)
    cfg = _config(model, 8, 1, 1)
    costs = HardwareCosts(load_any_cluster("a100-ib-64"), model, "bf16", "fp32")
    flat, piped = _both(cfg, costs, 8)
    assert piped.best is not None
    assert piped.best.result.step_s > flat.result.step_s
    assert choose(flat, piped) is flat


def test_the_plan_file_round_trip_keeps_the_pipeline(tmp_path):
    cfg = _config(DP_HEAVY, 32, 1, 1)
    costs = HardwareCosts(load_any_cluster("paper-3090-pcie-32", 1.0), DP_HEAVY, "bf16", "fp32")
    _, piped = _both(cfg, costs, 8)
    plan = piped.best.plan
    plan.stage_starts = [7]  # not the default boundaries: the file must keep them
    plan.save(tmp_path / "plan.json")
    back = ParallelPlan.load(tmp_path / "plan.json")
    assert back == plan
    assert (back.pp, back.pp_schedule, back.stage_starts) == (2, plan.pp_schedule, [7])
    back.check(DP_HEAVY, 8)
    a = simulate_plan(DP_HEAVY, plan, costs, 8, piped.best.batch, timeline=False)
    b = simulate_plan(DP_HEAVY, back, costs, 8, piped.best.batch, timeline=False)
    assert a.step_s == b.step_s


@pytest.mark.slow
def test_oases_plan_pp_auto_writes_the_pipeline(tmp_path):
    import json
    import subprocess
    import sys

    from test_train_cli import TINY

    cluster = tmp_path / "slow2.toml"
    cluster.write_text(SLOW_TWO_SERVERS)
    out = tmp_path / "plan.json"
    proc = subprocess.run(
        [sys.executable, "-m", "oases", "plan", str(TINY), "--world-size", "2", "--hardware",
         str(cluster), "--pp", "auto", "--out", str(out), "--model.dim=512",
         "--model.n_layers=4", "--model.vocab_size=256"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pipelines:" in proc.stdout and "best without a pipeline" in proc.stdout
    raw = json.loads(out.read_text())
    assert raw["pp"] == 2 and raw["pp_schedule"] and raw["stage_starts"]


@pytest.mark.slow
def test_oases_plan_searches_the_interleaved_order(tmp_path):
    """``--pp-schedules 1f1b,interleaved``: the interleaved order is walked, with two model
    chunks a stage (four virtual stages of one block each), and on this tiny model its
    pipeline beats 1F1B's (the plan without a pipeline wins overall)."""
    import subprocess
    import sys

    from test_train_cli import TINY

    cluster = tmp_path / "slow2.toml"
    cluster.write_text(SLOW_TWO_SERVERS)
    out = tmp_path / "plan.json"
    proc = subprocess.run(
        [sys.executable, "-m", "oases", "plan", str(TINY), "--world-size", "2", "--hardware",
         str(cluster), "--pp", "2", "--pp-schedules", "1f1b,interleaved", "--out", str(out),
         "--model.n_layers=4", "--train.global_batch=4", "--train.micro_batch=2"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pp=2 1f1b (stages at 5)" in proc.stdout
    walked = [line for line in proc.stdout.splitlines() if "bound by" in line and "pp=2" in line]
    assert "pp=2 interleaved (stages at 3,5,7)" in walked[0]
    assert out.exists()


DEEP = ModelConfig(arch="gpt2", dim=2048, n_heads=16, n_layers=16, vocab_size=512, seq_len=256)


def test_the_interleaved_order_wins_where_the_bubble_dominates():
    """Four stages and four micro-batches (one sequence each) on 100 GbE: 1F1B idles each
    stage for 3 of its 7 passes' time; two model chunks a stage halve that bubble, and the
    search finds it, with 8 virtual stages balanced on the chain's costs."""
    cfg = _config(DEEP, 4, 1, 1)
    costs = HardwareCosts(load_any_cluster("paper-3090-pcie-32", 100.0), DEEP, "bf16", "fp32")
    budget = costs_budget(0.0, costs).bytes
    found = search_config_pipelines(
        cfg, 4, costs, budget, search_micro_batch=False, sps=(), pp_options=(4,),
        pp_schedules=("1f1b", "interleaved"),
    )  # fmt: skip
    best = found.best
    assert best is not None and best.fits
    assert (best.plan.pp, best.plan.pp_schedule, best.plan.pp_chunks) == (4, "interleaved", 2)
    assert len(best.plan.stage_starts) == 4 * 2 - 1
    best.plan.check(DEEP, 4)
    one_f = [c for c in found.candidates if c.plan.pp_schedule == "1f1b" and c.fits]
    assert one_f and best.result.step_s < 0.9 * min(c.result.step_s for c in one_f)
    again = simulate_plan(DEEP, best.plan, costs, 4, best.batch, timeline=False)
    assert again.step_s == best.result.step_s
    assert "pp=4 interleaved" in best.label()


SLOW_TWO_BY_TWO = SLOW_TWO_SERVERS.replace("gpus_per_server = 1", "gpus_per_server = 2")
# a model whose embedding and head are large beside its blocks: the search mixes degrees
MIXED_TINY = [
    "--model.dim=64",
    "--model.vocab_size=8192",
    "--model.seq_len=64",
    "--train.global_batch=16",
    "--train.micro_batch=4",
]


def _train_searched_plan_file(  # noqa: ANN202
    tmp_path, cluster: str, world: int, overrides: list[str], orders: tuple[str, ...] = ()
):
    """The pipeline search's best plan (pp=2) for configs/tiny.toml with ``overrides`` on
    ``cluster`` written to a file and run by ``oases train --parallel.plan=FILE`` on ``world``
    ranks in float64: every step's loss and gradient norm equal a one-rank run's of the
    single-device model. ``orders``: the pipeline orders searched (default: all). Returns the
    plan."""
    import io
    import json

    import torch

    from exactness import EXACT64
    from oases.config import load_config
    from oases.planner.clusters import load_cluster
    from oases.train.loop import train
    from test_train_cli import TINY, _run_cli

    (tmp_path / "cluster.toml").write_text(cluster)
    cfg = load_config(TINY, overrides)
    costs = HardwareCosts(load_cluster(tmp_path / "cluster.toml"), cfg.model, "fp32", "fp32")
    kw = {"pp_schedules": orders} if orders else {}
    found = search_config_pipelines(cfg, world, costs, 1e12, pp_options=(2,), **kw)
    assert found.best is not None and found.best.plan.pp == 2
    plan_path = tmp_path / "plan.json"
    found.best.plan.save(plan_path)
    run_dir = tmp_path / "run"
    args = [
        str(TINY),
        "--nproc-per-node",
        str(world),
        f"--train.run_dir={run_dir}",
        "--train.precision=fp64",
        "--train.sample_tokens=0",
        f"--parallel.plan={plan_path}",
        *overrides,
    ]
    proc, _ = _run_cli(args, 300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pp=2" in proc.stdout
    ref = train(
        load_config(
            TINY,
            [
                f"--train.run_dir={tmp_path / 'one'}",
                "--parallel.tp=1",
                "--train.precision=fp64",
                "--train.sample_tokens=0",
                "--checkpoint.resume=never",
                *overrides,
            ],
        ),
        log=io.StringIO(),
    )
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in lines if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 7))
    torch.testing.assert_close([r["loss"] for r in rows], ref["losses"], **EXACT64)
    torch.testing.assert_close([r["grad_norm"] for r in rows], ref["grad_norms"], **EXACT64)
    return found.best.plan


@pytest.mark.slow
@pytest.mark.exact
def test_train_runs_a_searched_pipeline_plan_file_exactly(tmp_path):
    """A pipeline plan the search chose (2 ranks, one GPU per server over 10 GbE) run by
    ``oases train --parallel.plan=FILE`` on 2 ranks in float64, equal to one rank."""
    _train_searched_plan_file(tmp_path, SLOW_TWO_SERVERS, 2, [])


@pytest.mark.slow
@pytest.mark.exact
def test_train_runs_a_searched_mixed_pipeline_plan_file_exactly(tmp_path):
    """Per-region TP inside stages, end to end: on two 2-GPU servers over 10 GbE the search
    chooses pp=2 with mixed degrees inside each stage of 2 ranks (a stage of 2 needs 4 ranks:
    at pp=2 on 2 ranks every stage has one rank, tp=1); the plan file carries the degrees and
    ``oases train --parallel.plan=FILE`` runs it on 4 ranks in float64, equal to one rank."""
    plan = _train_searched_plan_file(tmp_path, SLOW_TWO_BY_TWO, 4, MIXED_TINY)
    assert not plan.is_uniform() and plan.pp == 2
    assert ParallelPlan.load(tmp_path / "plan.json").degrees() == plan.degrees()


@pytest.mark.slow
@pytest.mark.exact
def test_train_runs_a_searched_interleaved_plan_file_exactly(tmp_path):
    """The interleaved order as the search gives it (two model chunks a stage, four virtual
    stages' boundaries from the chain's costs) run by ``oases train --parallel.plan=FILE`` on
    2 ranks in float64, equal to one rank."""
    plan = _train_searched_plan_file(
        tmp_path, SLOW_TWO_SERVERS, 2, ["--model.n_layers=4"], orders=("interleaved",)
    )
    assert (plan.pp_schedule, plan.pp_chunks, len(plan.stage_starts)) == ("interleaved", 2, 3)


@pytest.mark.parametrize("seed", range(10))
def test_boundaries_only_where_the_degrees_agree(seed):
    """A mixed layout's stages start only at blocks whose neighbours have one degree
    (``stage_cuts``); the DP under those cuts matches a brute force over them."""
    from oases.plan import RegionPlan
    from oases.planner.pipeline_mixed import stage_cuts

    rng = random.Random(seed)
    n_layers, pp = rng.randint(3, 8), rng.randint(2, 3)
    model = ModelConfig(n_layers=n_layers, dim=32, n_heads=4)
    tps = [1 if i % 4 < 2 else 2 for i in range(2 * n_layers + 2)]  # 1, 1, 2, 2, 1, 1, ...
    for i in rng.sample(range(1, len(tps) - 1), 2):  # and a few more changes
        tps[i] = 3 - tps[i]
    plan = ParallelPlan.uniform(model, 4, 1)
    plan.regions = [RegionPlan(r.name, t, 4 // t) for r, t in zip(plan.regions, tps)]
    cuts = stage_cuts(plan)
    region_s = [rng.uniform(0.1, 3.0) for _ in range(2 * n_layers + 2)]
    options = list(itertools.combinations(sorted(cuts), pp - 1))
    if not options:
        with pytest.raises(ValueError, match="give no"):
            balanced_stage_starts(region_s, pp, cuts)
        return
    starts = balanced_stage_starts(region_s, pp, cuts)
    assert {(s - 1) // 2 for s in starts} <= cuts
    best = min(
        max(sum(region_s[a:b]) for a, b in zip(e, e[1:]))
        for e in ((0, *(block_start(c) for c in o), len(region_s)) for o in options)
    )
    assert max(stage_shares(region_s, starts)) * sum(region_s) == pytest.approx(best, rel=1e-12)
    for b in starts:
        assert plan.regions[b - 1].tp == plan.regions[b].tp


MIXED_WINS = ModelConfig(
    arch="llama", dim=1024, n_heads=16, n_layers=8, vocab_size=50304, seq_len=512
)


def test_a_mixed_stage_layout_where_it_is_faster():
    """Issue 28 item 7, per-region TP inside stages: 16 GPUs (4 servers) on 10 GbE, a model
    whose vocabulary is large beside its blocks: the search with mixed stage layouts finds a
    pipeline plan with more than one degree, faster (as walked) than its best with one degree
    per plan; its boundaries sit where both sides have one degree, and its numbers are its
    own full walk's."""
    cfg = _config(MIXED_WINS, 64, 4, 1)
    costs = HardwareCosts(load_any_cluster("paper-3090-pcie-32", 10.0), MIXED_WINS, "bf16", "fp32")
    budget = costs_budget(0.0, costs).bytes
    kw = dict(search_micro_batch=False, sps=())
    one = search_config_pipelines(cfg, 16, costs, budget, mixed=False, **kw)
    mixed = search_config_pipelines(cfg, 16, costs, budget, **kw)
    assert one.mixed == 0 and one.best.plan.is_uniform()
    best = mixed.best
    assert mixed.mixed > 0 and best is not None and best.fits and not best.plan.is_uniform()
    assert best.result.step_s < one.best.result.step_s
    assert "mixed tp" in best.label()
    for b in best.plan.stage_layout().starts:
        assert best.plan.regions[b - 1].tp == best.plan.regions[b].tp
    best.plan.check(MIXED_WINS, 16)
    again = simulate_plan(MIXED_WINS, best.plan, costs, 16, best.batch, timeline=False)
    assert again.step_s == best.result.step_s


def _scalar_stage_starts(region_s, pp, cuts=None):
    """The dynamic programme as scalar loops (the vectorised one's reference: the same
    boundaries, ties to the earliest cut, bit for bit)."""
    n_layers = (len(region_s) - 2) // 2
    allowed = set(range(1, n_layers)) if cuts is None else set(cuts)
    prefix = [0.0]
    for layer in range(n_layers):
        prefix.append(prefix[-1] + region_s[2 * layer + 1] + region_s[2 * layer + 2])
    inf = float("inf")
    best = [[inf] * (n_layers + 1) for _ in range(pp + 1)]
    cut = [[0] * (n_layers + 1) for _ in range(pp + 1)]
    best[0][0] = 0.0
    for s in range(1, pp + 1):
        for b in range(s, n_layers + 1):
            for a in range(s - 1, b):
                if a and a not in allowed:
                    continue
                extra = (region_s[0] if a == 0 else 0.0) + (region_s[-1] if b == n_layers else 0.0)
                value = max(best[s - 1][a], prefix[b] - prefix[a] + extra)
                if value < best[s][b]:
                    best[s][b], cut[s][b] = value, a
    if best[pp][n_layers] == inf:
        return None
    starts, b = [], n_layers
    for s in range(pp, 1, -1):
        b = cut[s][b]
        starts.append(block_start(b))
    return tuple(reversed(starts))


@pytest.mark.parametrize("seed", range(40))
def test_balanced_stage_starts_equal_the_scalar_programme(seed):
    """Every boundary as the scalar loops give it, with ties (integer costs) and cuts."""
    rng = random.Random(seed)
    n_layers = rng.randint(2, 40)
    pp = rng.randint(2, min(n_layers, 12))
    ties = seed % 2 == 0
    region_s = [
        float(rng.randint(1, 3)) if ties else rng.uniform(0.1, 3.0) for _ in range(2 * n_layers + 2)
    ]
    cuts = None if seed % 3 else set(rng.sample(range(1, n_layers), max(1, n_layers // 2)))
    want = _scalar_stage_starts(region_s, pp, cuts)
    if want is None:
        with pytest.raises(ValueError, match="give no"):
            balanced_stage_starts(region_s, pp, cuts)
        return
    assert balanced_stage_starts(region_s, pp, cuts) == want


def test_a_stage_search_runs_on_one_process(monkeypatch):
    """``mixed_layouts`` searches a stage on one process where searches may use two
    (``search_prefetch.PROCESSES``), and leaves that setting as it found it."""
    import oases.planner.search as search
    from oases.planner import search_prefetch
    from oases.planner.batch import BatchShape
    from oases.planner.pipeline_mixed import mixed_layouts

    processes = []
    solve = search.solve_plan

    def counted(*args, **kw):  # noqa: ANN202
        processes.append(search_prefetch.PROCESSES)
        return solve(*args, **kw)

    monkeypatch.setattr(search, "solve_plan", counted)
    monkeypatch.setattr(search_prefetch, "PROCESSES", 2)
    costs = HardwareCosts(load_any_cluster("paper-3090-pcie-32", 10.0), MIXED_WINS, "bf16", "fp32")
    kw = dict(schedules=("megatron",), degrees=[1, 2, 4, 8], n_subs=(1,), zeros=(0,), sps=("",))
    found = mixed_layouts(
        MIXED_WINS, costs, 8, BatchShape(64, 32), costs_budget(0.0, costs).bytes, 2,
        max_inflight=1, **kw,
    )  # fmt: skip
    assert processes == [1] and search_prefetch.PROCESSES == 2
    assert found and all(not plan.is_uniform() for plan in found)
