"""The interleaved schedule (``parallel.pp_chunks`` model chunks per stage) on real ranks:
float64 parity with the single-device model, as ``test_pipeline.py``'s (gpt2 with tied
embeddings and llama, megatron and oases inner schedules, 4 micro-batches, 3 AdamW steps with
clipping), at pp=2 and pp=2 x tp=2 with 2 chunks a stage; the point-to-point of one step."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import oases
from exactness import EXACT64, to64
from oases.plan import ParallelPlan
from oases.planner.batch import BatchShape
from oases.planner.pipeline_walk import simulate_pipeline
from oases.schedule.instructions import Compute
from oases.schedule.pipeline_order import in_flight, pipeline_order
from oases.schedule.pipeline_program import build_stage_program
from oases.stages import StageLayout, default_stage_starts
from test_pipeline import N_MICRO, TIMEOUT_S, _batches, _cfg, _check, _reference, _spawn, _train
from test_pipeline_program import _unit_cost, _walk
from test_pipeline_sim import CFG as SIM_CFG
from test_pipeline_sim import _Hand

CASES = [(arch, name) for arch in ("gpt2", "llama") for name in ("megatron", "oases")]


def _rank_parity(rank: int, world: int, pp: int, tp: int, chunks: int, cases: list) -> dict:
    ctx = oases.init_distributed(tp=tp, pp=pp, timeout_s=TIMEOUT_S)
    dp = world // (pp * tp)
    n_sub = 2
    batches = _batches(N_MICRO * n_sub * dp)
    out, refs = {}, {}
    for arch, name in cases:
        cfg = _cfg(arch)
        if arch not in refs:
            torch.manual_seed(0)
            base = to64(oases.build_model(cfg))
            refs[arch] = (base, *_reference(base, batches))
        base, want_losses, want_params = refs[arch]
        where = f"{arch} pp={pp} tp={tp} v={chunks} {name} rank {rank}"
        plan = ParallelPlan.uniform(
            cfg, world, tp, pp=pp, pp_schedule="interleaved", pp_chunks=chunks
        )
        plan.check(cfg, world)
        model = oases.parallelize(copy.deepcopy(base), ctx, plan)
        losses = _train(model, ctx, name, batches, n_sub)
        _check(model, ctx, losses, want_losses, want_params, where)
        out[where] = [float(x) for x in losses]
    return out


@pytest.mark.exact
def test_interleaved_pp2_equals_the_single_device_model(tmp_path):
    _spawn(tmp_path, _rank_parity, 2, 2, 1, 2, CASES)


@pytest.mark.exact
def test_interleaved_pp2_tp2_equals_the_single_device_model(tmp_path):
    _spawn(tmp_path, _rank_parity, 4, 2, 2, 2, CASES)


# --------------------------------------------------------------------- orders and programs


@pytest.mark.parametrize(
    "pp,chunks,n_micro", [(2, 2, 2), (2, 2, 4), (2, 3, 6), (4, 2, 8), (4, 2, 4)]
)
def test_interleaved_order(pp, chunks, n_micro):
    """Every chunk's forward and backward of every micro-batch once; a micro-batch's chunks in
    chain order forward and reversed backward; Megatron-LM's warm-up (every forward first at
    M = P); P micro-batches through a chunk before the next chunk; the first stage holds the
    most in flight."""
    for s in range(pp):
        units = pipeline_order("interleaved", pp, s, n_micro, chunks)
        assert all(len(u) == 1 for u in units)
        flat = [u[0] for u in units]
        want = [(k, m, c) for k in "FB" for m in range(n_micro) for c in range(chunks)]
        assert sorted(flat) == sorted(want)
        for m in range(n_micro):
            fwd = [c for k, mm, c in flat if k == "F" and mm == m]
            bwd = [c for k, mm, c in flat if k == "B" and mm == m]
            assert fwd == list(range(chunks)) and bwd == list(range(chunks))[::-1]
        first_b = next(i for i, p in enumerate(flat) if p[0] == "B")
        warm = 2 * (pp - s - 1) + (chunks - 1) * pp
        total = n_micro * chunks
        assert first_b == (total if n_micro == pp else min(warm, total) + (warm < total))
        forwards = [p for p in flat if p[0] == "F"]
        assert [p[2] for p in forwards[:pp]] == [0] * pp
        assert [p[1] for p in forwards[:pp]] == list(range(pp))
        held = max(
            sum(1 if p[0] == "F" else -1 for p in flat[: i + 1]) for i in range(len(flat))
        )  # chunk passes whose activations are held at once
        assert held == (total if n_micro == pp else min(warm + 1, total))
    paired = pipeline_order("1f1b", pp, 0, n_micro)
    assert in_flight(pipeline_order("interleaved", pp, 0, n_micro, chunks)) >= in_flight(paired)


def test_interleaved_needs_chunks_and_a_multiple_of_pp_micro_batches():
    with pytest.raises(ValueError, match="runs a multiple of parallel.pp=2 micro-batches .*got 3"):
        pipeline_order("interleaved", 2, 0, 3, 2)
    with pytest.raises(ValueError, match="needs parallel.pp_chunks >= 2"):
        pipeline_order("interleaved", 2, 0, 4)
    with pytest.raises(ValueError, match='only with parallel.pp_schedule="interleaved"'):
        pipeline_order("1f1b", 2, 0, 4, 2)
    layout = StageLayout(10, default_stage_starts(4, 4), 2)
    assert layout.pp == 2 and layout.chunk_bounds(0) == [(0, 3), (5, 7)]
    assert [layout.stage_of(i) for i in range(10)] == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
    assert [b for b in layout.starts if layout.wraps(b)] == [5]
    assert layout.holds(0, 6) and not layout.holds(0, 4)


@pytest.mark.parametrize("pp,chunks,n_layers,n_micro", [(2, 2, 4, 4), (2, 4, 8, 4), (4, 2, 8, 8)])
def test_interleaved_walk_has_a_smaller_bubble_than_1f1b(pp, chunks, n_layers, n_micro):
    """On unit costs (``test_pipeline_program._walk``: the programs run together, no
    deadlock) the step less each stage's own compute, the order's bubble, is smaller than
    1F1B's (the chunks' boundaries split a few tasks: more computes, the same work)."""
    bubbles = {}
    for order, v in (("1f1b", 1), ("interleaved", chunks)):
        layout = StageLayout(2 * n_layers + 2, default_stage_starts(n_layers, pp * v), v)
        progs = [
            build_stage_program("megatron", 1, layout, s, n_micro=n_micro, pp_schedule=order)
            for s in range(pp)
        ]
        busy = max(sum(_unit_cost(i) for i in p if isinstance(i, Compute)) for p in progs)
        bubbles[order] = _walk(progs) - busy
    assert bubbles["interleaved"] < 0.75 * bubbles["1f1b"], bubbles


@pytest.mark.parametrize("pp,chunks,n_micro", [(2, 2, 4), (2, 4, 4), (2, 2, 8), (4, 2, 8)])
def test_interleaved_simulated_step_is_the_hand_derived_one(pp, chunks, n_micro):
    """The simulator on free links, 8 blocks, a stage's forward F and backward B: 1F1B's step
    is (M + P - 1)(F + B), the interleaved one's M(F + B) + (P - 1)(F + B) / v (each warm-up
    and cool-down step a chunk, 1/v of a stage); the first stage holds 2(P - 1) + (v - 1)P + 1
    chunk passes' activations, each 1/v of a micro-batch's (1F1B: P micro-batches')."""
    cfg = dataclasses.replace(SIM_CFG, tie_embeddings=False, n_layers=8)
    res = {}
    for order, v in (("1f1b", 1), ("interleaved", chunks)):
        plan = ParallelPlan.uniform(
            cfg, pp, 1, schedule="megatron", n_sub=1, pp=pp, pp_schedule=order, pp_chunks=v
        )
        res[order] = simulate_pipeline(
            cfg, plan, _Hand(1.0, 2.0, 0.0), pp, BatchShape(n_micro, 1), timeline=False
        )
    fb = 16 / pp * 3.0  # 16 block regions, f = 1 and b = 2 each
    assert res["1f1b"].step_s == pytest.approx((n_micro + pp - 1) * fb, rel=1e-12)
    want = n_micro * fb + (pp - 1) * fb / chunks
    assert res["interleaved"].step_s == pytest.approx(want, rel=1e-12)
    acts = {k: r.breakdown["stage0_activations_bytes"] for k, r in res.items()}
    held = (2 * (pp - 1) + (chunks - 1) * pp + 1) / chunks
    assert acts["interleaved"] == pytest.approx(acts["1f1b"] * held / pp, rel=1e-9)


# ------------------------------------------------------------------------ oases train, CLI


@pytest.mark.slow
@pytest.mark.exact
def test_cli_interleaved_pp2_resumes_at_pp1(tmp_path):
    """``oases train`` at pp=2 with 2 chunks a stage (2 ranks, float64, 4 micro-batches a
    step): a stage saves its chunks under the single-device model's names, so its step-3
    checkpoint resumes at pp=1 (one rank) and steps 4-6 (losses, gradient norms, the
    validation loss through the chunks) equal the uninterrupted run's."""
    import json
    import shutil

    from test_train_cli import TINY, _run_cli

    common = [
        str(TINY),
        "--train.precision=fp64",
        "--model.n_layers=4",
        "--schedule.name=oases",
        "--schedule.n_sub=1",
        "--train.micro_batch=1",
        "--train.sample_tokens=0",
        "--parallel.tp=1",
    ]
    run_dir = tmp_path / "pp2"
    chunked = ["--parallel.pp=2", "--parallel.pp_schedule=interleaved", "--parallel.pp_chunks=2"]
    proc, _ = _run_cli(
        [*common, "--nproc-per-node", "2", *chunked, f"--train.run_dir={run_dir}"], 240
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pp=2 (interleaved)" in proc.stdout, proc.stdout

    def rows(path):
        lines = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]
        return (
            [(r["step"], r["loss"], r["grad_norm"]) for r in lines if "loss" in r],
            [r["val_loss"] for r in lines if "val_loss" in r],
        )

    want, want_val = rows(run_dir)
    again = tmp_path / "pp1"
    shutil.copytree(run_dir, again)
    shutil.rmtree(again / "checkpoints" / "step_000006")
    proc, _ = _run_cli([*common, "--nproc-per-node", "1", f"--train.run_dir={again}"], 240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resumed from" in proc.stdout and "at step 3" in proc.stdout, proc.stdout
    got, got_val = rows(again)
    assert [r[0] for r in got] == list(range(1, 7))
    torch.testing.assert_close([r[1:] for r in got[3:]], [r[1:] for r in want[3:]], **EXACT64)
    torch.testing.assert_close(got_val[-1], want_val[-1], **EXACT64)


def test_config_checks_and_warns_about_chunks():
    """Before any rank starts: a step of micro-batches that is no multiple of pp is one line;
    pp_chunks without a pipeline is a warning."""
    from oases.config import load_config
    from oases.train.setup import check_config, resolve_setup
    from test_train_cli import TINY

    args = ["--parallel.tp=1", "--model.n_layers=4", "--parallel.pp=2", "--train.micro_batch=2"]
    chunked = ["--parallel.pp_schedule=interleaved", "--parallel.pp_chunks=2"]
    with pytest.raises(ValueError, match="a multiple of parallel.pp=2 micro-batches .*got 3"):
        check_config(load_config(TINY, [*args, *chunked, "--train.global_batch=6"]), 2)
    assert check_config(load_config(TINY, [*args, *chunked]), 2).pp_chunks == 2
    with pytest.raises(ValueError, match='only with parallel.pp_schedule="interleaved"'):
        check_config(load_config(TINY, [*args, "--parallel.pp_chunks=2"]), 2)
    setup = resolve_setup(load_config(TINY, ["--parallel.pp_chunks=2"]), 2)
    assert any("pp_chunks=2 has no effect at parallel.pp=1" in w for w in setup.warnings)
