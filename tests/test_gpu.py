"""The CUDA path of one rank (skipped without a GPU): executor schedules and bf16 autocast."""

import copy

import pytest
import torch

import oases
from oases.schedule import SCHEDULES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _setup():
    ctx = oases.init_distributed(tp=1)  # a single process: no process group, CUDA device
    cfg = oases.ModelConfig(arch="llama", dim=64, n_heads=4, n_kv_heads=2, n_layers=2,
                            vocab_size=101, seq_len=32)
    torch.manual_seed(0)
    ref = oases.build_model(cfg).cuda()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 101, (4, 32), generator=g).cuda()
    targets = torch.randint(0, 101, (4, 32), generator=g).cuda()
    return ctx, ref, tokens, targets


def test_every_schedule_equals_the_single_device_model_on_cuda():
    ctx, ref, tokens, targets = _setup()
    expected = ref(tokens, targets)
    expected.backward()
    for name in SCHEDULES:
        model = oases.parallelize(copy.deepcopy(ref), ctx)
        model.zero_grad(set_to_none=True)
        loss = oases.build_schedule(name, n_sub=2).step(model, tokens, targets)
        torch.testing.assert_close(loss, expected.detach(), atol=1e-4, rtol=1e-4)
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=n)


def test_bf16_autocast_step_runs_and_keeps_fp32_master_weights():
    ctx, ref, tokens, targets = _setup()
    model = oases.parallelize(ref, ctx)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = oases.build_schedule("oases", n_sub=2).step(model, tokens, targets)
    assert torch.isfinite(loss)
    for p in model.parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
