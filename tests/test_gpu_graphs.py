"""CUDA graphs of a step (``schedule.cuda_graphs``; skipped without a GPU, run by
``benchmarks/gpu/run.sh``).

Every schedule's graphed step against its eager step over three optimizer steps on different
batches (the inputs copied into the graph, the gradients bound back after each replay), in
fp32 and under bf16 autocast; dropout inside a graph (fresh masks each replay); the cases a
capture cannot take (a recompute under dropout, a step that records a timeline) run eagerly,
say why, and give the eager step's answer; no host sync in a replay.

Tolerances: a replay launches the kernels the capture recorded, on the same inputs, so fp32
agrees with the eager step to rounding (1e-5; cuBLAS may pick another algorithm on the capture's
side stream, which only reorders a sum); bf16 as tests/test_gpu.py (loss 2%, gradients 5% of
their norm).
"""

import copy
import warnings

import pytest
import torch

import oases
from oases.schedule import SCHEDULES, record_timeline
from oases.schedule.graphed import GraphedStep

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
FP32 = {"atol": 1e-5, "rtol": 1e-5}


def _setup(dropout: float = 0.0):
    ctx = oases.init_distributed(tp=1)
    cfg = oases.ModelConfig(
        arch="llama",
        dim=64,
        n_heads=4,
        n_kv_heads=2,
        n_layers=2,
        vocab_size=101,
        seq_len=32,
        dropout=dropout,
    )
    torch.manual_seed(0)
    ref = oases.build_model(cfg).cuda()
    g = torch.Generator().manual_seed(1)
    batches = [
        tuple(torch.randint(0, 101, (4, 32), generator=g).cuda() for _ in range(2))
        for _ in range(3)
    ]
    return ctx, ref, batches


def _grads_close(model, ref, tol: dict, where: str) -> None:
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, **tol, msg=f"{where}: {n}")


@pytest.mark.parametrize("name", SCHEDULES)
def test_graphed_step_equals_the_eager_step_over_optimizer_steps(name):
    ctx, ref, batches = _setup()
    eager, graph = (oases.parallelize(copy.deepcopy(ref), ctx) for _ in range(2))
    sched = oases.build_schedule(name, n_sub=2)
    said = []
    graphed = GraphedStep(oases.build_schedule(name, n_sub=2), say=said.append)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, graph)]
    for step, (tokens, targets) in enumerate(batches):
        want = sched.step(eager, tokens, targets)
        got = graphed.step(graph, tokens, targets)
        torch.testing.assert_close(got, want, **FP32)
        _grads_close(graph, eager, FP32, f"{name} step {step}")
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert said == [] and graphed.captured(graph) == 1
    for (n, p), (_, q) in zip(graph.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p, q, **FP32, msg=n)


def test_graphed_step_under_bf16_autocast():
    ctx, ref, batches = _setup()
    eager, graph = (oases.parallelize(copy.deepcopy(ref), ctx) for _ in range(2))
    sched, graphed = oases.build_schedule("oases"), GraphedStep(oases.build_schedule("oases"))
    for tokens, targets in batches[:2]:
        eager.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            want = sched.step(eager, tokens, targets)
            got = graphed.step(graph, tokens, targets)
        torch.testing.assert_close(got, want, atol=0.0, rtol=2e-2)
        for (n, p), (_, q) in zip(graph.named_parameters(), eager.named_parameters()):
            err = float((p.grad - q.grad).norm())
            assert err <= 5e-2 * float(q.grad.norm()) + 1e-6, f"{n}: {err}"
    assert graphed.captured(graph) == 1 and not graphed.reasons


def test_dropout_inside_a_graph_draws_fresh_masks():
    ctx, ref, batches = _setup(dropout=0.1)
    model = oases.parallelize(ref, ctx)
    graphed = GraphedStep(oases.build_schedule("overlap", n_sub=2))
    tokens, targets = batches[0]
    losses = [float(graphed.step(model, tokens, targets)) for _ in range(3)]
    assert graphed.captured(model) == 1 and not graphed.reasons
    assert all(torch.isfinite(torch.tensor(losses))) and len(set(losses)) == 3


def test_what_a_capture_cannot_take_runs_eagerly_and_says_why():
    ctx, ref, batches = _setup(dropout=0.1)
    tokens, targets = batches[0]
    eager, graph = (oases.parallelize(copy.deepcopy(ref), ctx) for _ in range(2))
    said = []
    graphed = GraphedStep(oases.build_schedule("megatron-recompute"), say=said.append)
    torch.manual_seed(5)
    want = oases.build_schedule("megatron-recompute").step(eager, tokens, targets)
    torch.manual_seed(5)
    got = graphed.step(graph, tokens, targets)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    _grads_close(graph, eager, {"rtol": 0, "atol": 0}, "megatron-recompute")
    assert len(said) == 1 and "RNG state" in said[0] and graphed.captured(graph) == 0

    model = oases.parallelize(copy.deepcopy(ref), ctx)
    timed = GraphedStep(oases.build_schedule("overlap"), say=said.append)
    with record_timeline() as tl:
        timed.step(model, tokens, targets)
    assert tl.events and timed.captured(model) == 0 and "timeline" in said[-1]
    timed.step(model, tokens, targets)  # the next step, without a timeline, is captured
    assert timed.captured(model) == 1


def test_no_host_sync_in_a_replay():
    ctx, ref, batches = _setup()
    model = oases.parallelize(ref, ctx)
    graphed = GraphedStep(oases.build_schedule("oases", n_sub=2))
    tokens, targets = batches[0]
    graphed.step(model, tokens, targets)  # warm-up and capture
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            graphed.step(model, *batches[1])
        finally:
            torch.cuda.set_sync_debug_mode("default")
