"""``schedule.cuda_graphs`` on a machine without CUDA: the step falls back to the eager one,
bit for bit, says why once, and the training loop runs with the flag set. (The capture itself
runs in tests/test_gpu.py, which ``benchmarks/gpu/run.sh`` runs on a GPU.)"""

import copy
import io

import pytest
import torch

import oases
from exactness import EXACT64
from oases.config import load_config
from oases.schedule.graphed import GraphedStep, capture_reason
from test_train_loop import TINY, tiny_cfg, write_text


def _setup(dropout: float = 0.0):
    ctx = oases.init_distributed(tp=1)
    cfg = oases.ModelConfig(
        arch="gpt2", dim=32, n_heads=2, n_layers=2, vocab_size=64, seq_len=8, dropout=dropout
    )
    torch.manual_seed(0)
    ref = oases.build_model(cfg).double()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (4, 8), generator=g)
    targets = torch.randint(0, 64, (4, 8), generator=g)
    return ctx, ref, tokens, targets


@pytest.mark.parametrize("name", ["megatron", "oases"])
def test_on_cpu_the_graphed_step_is_the_eager_step_and_says_why_once(name):
    ctx, ref, tokens, targets = _setup()
    eager_model = oases.parallelize(copy.deepcopy(ref), ctx)
    graph_model = oases.parallelize(copy.deepcopy(ref), ctx)
    schedule = oases.build_schedule(name, n_sub=2)
    said = []
    graphed = GraphedStep(oases.build_schedule(name, n_sub=2), say=said.append)
    for _ in range(2):
        eager_model.zero_grad(set_to_none=True)
        graph_model.zero_grad(set_to_none=True)
        want = schedule.step(eager_model, tokens, targets)
        got = graphed.step(graph_model, tokens, targets)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        for (n, p), (_, q) in zip(graph_model.named_parameters(), eager_model.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=n)
    assert said == [
        "cuda graphs: this step runs eagerly: the model is on cpu: CUDA graphs need a CUDA device"
    ]
    assert graphed.captured(graph_model) == 0
    assert graphed.reasons == [capture_reason(schedule, eager_model)]


def test_the_graphed_step_matches_the_single_device_model_in_float64():
    ctx, ref, tokens, targets = _setup()
    model = oases.parallelize(copy.deepcopy(ref), ctx)
    loss = GraphedStep(oases.build_schedule("overlap", n_sub=2), say=lambda _: None).step(
        model, tokens, targets
    )
    expected = ref(tokens, targets)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), **EXACT64)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, **EXACT64, msg=n)


def test_graphed_step_checks_its_warmup():
    with pytest.raises(ValueError, match="warmup=0"):
        GraphedStep(oases.build_schedule("megatron"), warmup=0)


def test_config_key_and_training_loop_with_cuda_graphs_on_cpu(tmp_path):
    from oases.train.loop import train

    write_text(tmp_path / "text.txt")
    base = ["--parallel.tp=1", "--train.steps=3", "--train.log_every=1", "--train.seed=3"]
    runs = {}
    for flag in ("false", "true"):
        cfg = tiny_cfg(tmp_path, f"graphs-{flag}", *base, f"--schedule.cuda_graphs={flag}")
        assert cfg.schedule.cuda_graphs is (flag == "true")
        log = io.StringIO()
        runs[flag] = (train(cfg, log=log), log.getvalue())
    assert runs["true"][0]["losses"] == runs["false"][0]["losses"]
    assert "cuda graphs: this step runs eagerly: the model is on cpu" in runs["true"][1]
    assert "cuda graphs" not in runs["false"][1]
    assert load_config(TINY, []).schedule.cuda_graphs is False  # default off
