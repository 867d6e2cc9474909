"""Sampling: greedy equals step-by-step argmax, top_k=1 equals greedy, the global RNG is left
alone, and a tp=2 model generates the single-device model's tokens, identically on both ranks
(in float64, so that no rounding difference between the layouts can flip a near tie:
tests/exactness.py)."""

import copy

import pytest
import torch

from exactness import to64
from oases.config import ModelConfig
from oases.model import build_model
from oases.train.generate import generate, sampling_generator

CFG = dict(n_layers=2, dim=32, n_heads=4, vocab_size=101, seq_len=16, init_std=0.2)


def _model(seed: int = 0, **kw) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelConfig(**{**CFG, **kw}))


def _prompt(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG["vocab_size"], (batch, length), generator=g)


def _greedy_reference(model, tokens: torch.Tensor, n: int) -> torch.Tensor:
    S = model.cfg.seq_len
    with torch.no_grad():
        for _ in range(n):
            nxt = model(tokens[:, -S:])[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], dim=1)
    return tokens


def test_greedy_matches_argmax_and_crops_the_context():
    model = _model(dropout=0.1)  # eval mode must switch dropout off
    prompt = _prompt(3, 10)
    out = generate(model, prompt, 12, temperature=0.0)  # 22 tokens > seq_len 16
    assert out.shape == (3, 22) and out.dtype == torch.long
    assert torch.equal(out[:, :10], prompt)
    assert torch.equal(out, generate(model, prompt, 12, temperature=0.0))
    assert model.training  # restored
    model.eval()
    assert torch.equal(out, _greedy_reference(model, prompt, 12))
    generate(model, prompt, 1, temperature=0.0)
    assert not model.training  # eval stays eval


def test_top_k_one_is_greedy_and_sampling_follows_the_generator():
    model = _model()
    prompt = _prompt(2, 5)
    greedy = generate(model, prompt, 8, temperature=0.0)
    top1 = generate(model, prompt, 8, temperature=0.8, top_k=1, generator=sampling_generator(3))
    assert torch.equal(top1, greedy)
    a = generate(model, prompt, 20, temperature=1.0, top_k=None, generator=sampling_generator(7))
    b = generate(model, prompt, 20, temperature=1.0, top_k=None, generator=sampling_generator(7))
    c = generate(model, prompt, 20, temperature=1.0, top_k=None, generator=sampling_generator(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert not torch.equal(a, greedy)
    # top_k restricts every draw to the k most likely tokens of its step
    k = 3
    out = generate(model, prompt, 10, temperature=2.0, top_k=k, generator=sampling_generator(1))
    model.eval()
    with torch.no_grad():
        logits = model(out[:, :-1])  # [B, S-1, V]
    for t in range(5, out.shape[1]):
        allowed = logits[:, t - 1].topk(k, dim=-1).indices  # [B, k]
        assert (allowed == out[:, t : t + 1]).any(-1).all()


def test_global_rng_state_is_untouched():
    model = _model()
    prompt = _prompt(1, 4)[0]  # a 1-D prompt is one row
    state = torch.get_rng_state()
    out = generate(model, prompt, 5)  # default sampling without a generator
    generate(model, prompt[None], 5, generator=sampling_generator(0))
    assert torch.equal(torch.get_rng_state(), state)
    assert out.shape == (1, 9)
    assert generate(model, prompt, 0).shape == (1, 4)


def test_bad_arguments():
    model = _model()
    with pytest.raises(ValueError, match="P >= 1"):
        generate(model, torch.zeros(1, 0, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="temperature=-1"):
        generate(model, _prompt(1, 2), 3, temperature=-1)
    with pytest.raises(ValueError, match="top_k=0"):
        generate(model, _prompt(1, 2), 3, top_k=0)
    with pytest.raises(ValueError, match="max_new_tokens=-1"):
        generate(model, _prompt(1, 2), -1)


def _rank_tp2_generate(rank: int, world_size: int) -> dict:
    from oases.parallel.apply import parallelize
    from oases.parallel.context import init_distributed

    ctx = init_distributed(tp=world_size)
    out = {}
    for arch in ("gpt2", "llama"):
        ref = to64(_model(seed=5, arch=arch, tie_embeddings=arch == "gpt2"))
        par = parallelize(copy.deepcopy(ref), ctx)
        prompt = _prompt(2, 6)
        state = torch.get_rng_state()
        greedy = generate(par, prompt, 14, temperature=0.0)
        sampled = generate(par, prompt, 14, generator=sampling_generator(11))
        assert torch.equal(torch.get_rng_state(), state)
        out[arch] = dict(
            greedy=greedy,
            ref_greedy=generate(ref, prompt, 14, temperature=0.0),
            sampled=sampled,
            ref_sampled=generate(ref, prompt, 14, generator=sampling_generator(11)),
        )
    return out


@pytest.mark.exact
def test_tp2_generates_the_single_device_tokens(spawn_ranks):
    results = spawn_ranks(_rank_tp2_generate, 2)
    for arch in ("gpt2", "llama"):
        r0, r1 = results[0][arch], results[1][arch]
        assert torch.equal(r0["greedy"], r0["ref_greedy"]), arch
        assert torch.equal(r0["greedy"], r1["greedy"]), arch
        assert torch.equal(r0["sampled"], r1["sampled"]), arch  # identical on both TP ranks
        assert torch.equal(r0["sampled"], r0["ref_sampled"]), arch
