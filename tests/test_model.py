"""Single-device model: shapes, loss, causality, GQA, parameter count, recompute, dropout."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from exactness import EXACT64, to64
from oases.config import ModelConfig
from oases.model import build_model, count_params

B, S = 4, 16
ARCHS = ["gpt2", "llama"]


def small_cfg(arch: str, **overrides: object) -> ModelConfig:
    kwargs: dict[str, object] = dict(
        arch=arch, n_layers=2, dim=32, n_heads=4, vocab_size=101, seq_len=S, dropout=0.0
    )
    kwargs.update(overrides)
    return ModelConfig(**kwargs)  # type: ignore[arg-type]


def make_model(cfg: ModelConfig, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(cfg)


def random_tokens(vocab: int, seed: int, batch: int = B, seq: int = S) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_shape_and_loss_is_cross_entropy(arch):
    cfg = small_cfg(arch)
    model = make_model(cfg)
    tokens, targets = random_tokens(cfg.vocab_size, 1), random_tokens(cfg.vocab_size, 2)
    logits = model(tokens)
    assert logits.shape == (B, S, cfg.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    loss = model(tokens, targets)
    assert loss.shape == ()
    expected = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1))
    torch.testing.assert_close(loss, expected)


@pytest.mark.parametrize("arch", ARCHS)
def test_causal(arch):
    cfg = small_cfg(arch)
    model = make_model(cfg)
    tokens = random_tokens(cfg.vocab_size, 3)
    base = model(tokens)
    for t in (0, 5, S - 1):
        changed = tokens.clone()
        changed[:, t] = (changed[:, t] + 1) % cfg.vocab_size
        out = model(changed)
        torch.testing.assert_close(out[:, :t], base[:, :t])
        assert not torch.allclose(out[:, t], base[:, t]), f"position {t} ignores its own token"


@pytest.mark.parametrize("arch", ARCHS)
def test_grouped_query_attention_runs(arch):
    cfg = small_cfg(arch, n_heads=4, n_kv_heads=2)
    model = make_model(cfg)
    qkv = model.blocks[0].attn.qkv.weight
    assert qkv.shape == ((4 + 2 * 2) * cfg.head_dim, cfg.dim)  # rows [Q | K | V]
    tokens, targets = random_tokens(cfg.vocab_size, 4), random_tokens(cfg.vocab_size, 5)
    assert model(tokens).shape == (B, S, cfg.vocab_size)
    loss = model(tokens, targets)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("kv", [None, 2])
def test_count_params(arch, tie, kv):
    cfg = small_cfg(arch, tie_embeddings=tie, n_kv_heads=kv)
    model = make_model(cfg)
    listed = [p for _, p in model.named_parameters(remove_duplicate=False)]
    unique = {id(p): p for p in listed}
    expected = sum(p.numel() for p in unique.values())
    assert count_params(model) == expected
    assert cfg.num_params() == expected
    if tie:
        assert model.head.weight is model.embed.weight
        # the tied tensor is listed once
        assert len(unique) == len(listed) - 1
    else:
        assert model.head.weight is not model.embed.weight


@pytest.mark.exact
@pytest.mark.parametrize("arch", ARCHS)
def test_recompute_same_loss_and_grads(arch):
    """Activation checkpointing equals the plain model, float64 (tests/exactness.py)."""
    cfg = small_cfg(arch, tie_embeddings=arch == "gpt2", n_kv_heads=2 if arch == "llama" else None)
    plain = to64(make_model(cfg))
    ckpt = copy.deepcopy(plain)
    ckpt.recompute = True
    tokens, targets = random_tokens(cfg.vocab_size, 6), random_tokens(cfg.vocab_size, 7)
    loss_plain = plain(tokens, targets)
    loss_ckpt = ckpt(tokens, targets)
    assert loss_ckpt.dtype == torch.float64
    torch.testing.assert_close(loss_ckpt, loss_plain, **EXACT64)
    loss_plain.backward()
    loss_ckpt.backward()
    grads_ckpt = dict(ckpt.named_parameters())
    for name, p in plain.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(grads_ckpt[name].grad, p.grad, **EXACT64, msg=name)
    # recompute does not change the no-grad (inference) path either
    with torch.no_grad():
        torch.testing.assert_close(ckpt(tokens), plain(tokens), **EXACT64)


@pytest.mark.parametrize("arch", ARCHS)
def test_dropout_train_vs_eval(arch):
    cfg = small_cfg(arch, dropout=0.1)
    model = make_model(cfg)
    tokens = random_tokens(cfg.vocab_size, 8)
    model.train()
    a, b = model(tokens), model(tokens)
    assert not torch.allclose(a, b), "dropout>0 in train mode should change the outputs"
    model.eval()
    with torch.no_grad():
        c, d = model(tokens), model(tokens)
    torch.testing.assert_close(c, d, rtol=0, atol=0)
    # in eval mode dropout is the identity: equal to the same weights with dropout 0
    no_drop = make_model(small_cfg(arch, dropout=0.0))
    no_drop.load_state_dict(model.state_dict())
    no_drop.eval()
    with torch.no_grad():
        torch.testing.assert_close(no_drop(tokens), c)
