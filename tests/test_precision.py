"""train.precision (oases.precision): the name -> dtypes/autocast table, the config check, and
models that compute in their own dtype: a float64 model stays float64 end to end (norms, rotary,
both cross-entropies, the gradient norm), an fp32 one computes as before."""

from __future__ import annotations

import copy

import pytest
import torch

from oases.config import ModelConfig, load_config
from oases.config.sections import PRECISION_NAMES
from oases.model import build_model
from oases.precision import PRECISIONS, accum_dtype, resolve_precision, upcast
from oases.train.optim import clip_grad_norm_


def test_names_map_to_dtypes_and_autocast():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    auto_cpu, auto_cuda = resolve_precision("auto", cpu), resolve_precision("auto", cuda)
    assert (auto_cpu.param_dtype, auto_cpu.autocast_dtype) == (torch.float32, None)
    assert (auto_cuda.param_dtype, auto_cuda.autocast_dtype) == (torch.float32, torch.bfloat16)
    for device in (cpu, cuda):
        assert resolve_precision("fp32", device).autocast_dtype is None
        p64 = resolve_precision("fp64", device)
        assert (p64.param_dtype, p64.autocast_dtype) == (torch.float64, None)
    with auto_cpu.autocast():  # no autocast on CPU: fp32 stays fp32
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    for device in (cpu, cuda):  # bf16: autocast wherever it runs, fp32 master weights
        bf16 = resolve_precision("bf16", device)
        assert (bf16.param_dtype, bf16.autocast_dtype) == (torch.float32, torch.bfloat16)
        assert bf16.compute_dtype == torch.bfloat16
        assert bf16.grad_reduce_dtype == torch.float32  # DP reduction in fp32 by default
        assert resolve_precision("bf16", device, "bf16").grad_reduce_dtype == torch.bfloat16
    assert resolve_precision("fp64", cpu).grad_reduce_dtype == torch.float64  # the master dtype
    assert resolve_precision("bf16", cpu).describe() == {
        "compute": "bf16",
        "grad_reduce": "fp32",
        "master": "fp32",
    }
    with resolve_precision("bf16", cpu).autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with pytest.raises(
        ValueError, match="train.precision='fp16' must be one of auto, fp32, bf16, fp64"
    ):
        resolve_precision("fp16", cpu)
    with pytest.raises(ValueError, match="parallel.grad_reduce_dtype='fp16' must be one of"):
        resolve_precision("bf16", cpu, "fp16")
    assert set(PRECISIONS) == {"auto", "fp32", "bf16", "fp64"}
    assert tuple(PRECISIONS) == PRECISION_NAMES  # the config checks names without torch


def test_config_checks_the_name():
    assert load_config(None, []).train.precision == "auto"
    assert load_config(None, ["--train.precision=fp64"]).train.precision == "fp64"
    assert load_config(None, ["--train.precision=bf16"]).train.precision == "bf16"
    assert load_config(None, []).parallel.grad_reduce_dtype == "fp32"
    with pytest.raises(ValueError, match="parallel.grad_reduce_dtype='fp16' must be fp32 or bf16"):
        load_config(None, ["--parallel.grad_reduce_dtype=fp16"])
    with pytest.raises(ValueError, match=r"train.precision='double' must be one of auto, fp32"):
        load_config(None, ["--train.precision=double"])


def test_upcast_is_at_least_fp32():
    assert accum_dtype(torch.bfloat16) == accum_dtype(torch.float16) == torch.float32
    assert accum_dtype(torch.float32) == torch.float32
    assert accum_dtype(torch.float64) == torch.float64
    x = torch.ones(3)
    assert upcast(x) is x  # no copy when already there (fp32 computes exactly as before)
    assert upcast(x.to(torch.bfloat16)).dtype == torch.float32


@pytest.mark.parametrize("arch", ("gpt2", "llama"))
def test_a_float64_model_computes_in_float64(arch):
    from oases.parallel.context import init_distributed

    cfg = ModelConfig(arch=arch, n_layers=1, dim=32, n_heads=4, vocab_size=50, seq_len=8)
    torch.manual_seed(0)
    model32 = build_model(cfg)
    model64 = copy.deepcopy(model32).to(torch.float64)
    tokens = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    seen = set()
    hooks = [
        m.register_forward_hook(
            lambda _m, _i, out: seen.add(out.dtype) if out.is_floating_point() else None
        )
        for m in model64.modules()
        if m is not model64
    ]  # every module's output
    loss64 = model64(tokens, tokens)
    for h in hooks:
        h.remove()
    assert seen == {torch.float64} and loss64.dtype == torch.float64  # no fp32 step anywhere
    loss64.backward()
    assert {p.grad.dtype for p in model64.parameters()} == {torch.float64}
    norm = clip_grad_norm_(model64.parameters(), 0.0, init_distributed(tp=1).tp_group)
    ref = torch.nn.utils.clip_grad_norm_(model64.parameters(), float("inf"))
    assert norm == pytest.approx(float(ref), rel=1e-12)
    # the fp32 model computes in fp32 and agrees to fp32 rounding, not to float64's
    with torch.no_grad():
        loss32 = model32(tokens, tokens)
    assert loss32.dtype == torch.float32
    assert 0 < abs(loss32.item() - loss64.item()) < 1e-5


@pytest.mark.parametrize("arch", ("gpt2", "llama"))
def test_bf16_keeps_activations_in_bf16_and_master_state_in_fp32(arch):
    """Under bf16 autocast every module's activation output is bf16 (the residual stream, the
    norms, the partial sums), the loss and the gradients of the fp32 weights fp32; outside
    autocast ``to_activation`` changes nothing (fp32 computes exactly as before)."""
    from oases.precision import to_activation

    cfg = ModelConfig(arch=arch, n_layers=1, dim=32, n_heads=4, vocab_size=50, seq_len=8)
    torch.manual_seed(0)
    model = build_model(cfg)
    tokens = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    seen = {}

    def note(name: str):
        def hook(_m, _i, out) -> None:  # returns None: the output stays the module's
            if torch.is_tensor(out) and out.is_floating_point():
                seen.setdefault(name, out.dtype)

        return hook

    hooks = [
        m.register_forward_hook(note(n))
        for n, m in model.named_modules()
        if n not in ("", "embed", "loss_fn")
    ]
    with resolve_precision("bf16", torch.device("cpu")).autocast():
        loss = model(tokens, tokens)
        assert to_activation(torch.ones(2)).dtype == torch.bfloat16
        assert to_activation(torch.ones(2, dtype=torch.long)).dtype == torch.long
    for h in hooks:
        h.remove()
    assert set(seen.values()) == {torch.bfloat16}, seen  # the loss: loss_fn's output, below
    assert loss.dtype == torch.float32
    loss.backward()
    assert {p.grad.dtype for p in model.parameters()} == {torch.float32}
    x = torch.ones(3)
    assert to_activation(x) is x
