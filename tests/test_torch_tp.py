"""The "torch-tp" benchmark peer (PyTorch's parallelize_module) against the single-device model.

One spawn per world size (tp=2 on 2 gloo ranks; tp=2 x dp=2 on 4), several configs inside the
rank function. Each case, in float64 (DTensor works in float64; 1e-10, tests/exactness.py): the
loss equals the single-device loss, every parameter's local gradient equals the matching
(permuted, sharded) slice of the single-device gradient, the clipped grad norm is the model's,
and three optimizer steps give the single-device losses. The first case of each spawn runs once
more in fp32: loss and gradients of one backward within the bound derived from their reductions.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from exactness import BITWISE, EXACT64, fp32_tol, to64
from oases.bench.torch_tp import (
    TorchTPSchedule,
    build_tp_mesh,
    expected_local_shard,
    fused_row_permutation,
    parallelize_torch_tp,
    split_dtensor_groups,
    torch_tp_clip_grad_norm_,
    torch_tp_grad_shard,
    torch_tp_local,
)
from oases.config import ModelConfig
from oases.model import build_model
from oases.parallel.context import init_distributed

B, S = 4, 16
LR = 1e-2

GPT2 = dict(arch="gpt2", n_layers=2, dim=32, n_heads=4, vocab_size=128, seq_len=S)
LLAMA = dict(arch="llama", n_layers=2, dim=32, n_heads=4, n_kv_heads=2, vocab_size=128, seq_len=S)
GPT2_TIED = dict(GPT2, tie_embeddings=True)  # embed/head stay replicated (documented fallback)


def _tokens(vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(seed))


def _dp_loss(local: torch.Tensor, ctx) -> torch.Tensor:
    out = local.detach().clone()
    if ctx.dp > 1:
        dist.all_reduce(out, group=ctx.dp_group.pg)
    return out / ctx.dp


def _assert_grads_match(par, ref, ctx, where: str, tol=None) -> int:
    """Every local grad equals the expected shard of the single-device grad; returns #DTensors.
    ``tol(expected)``: assert_close arguments (EXACT64 by default)."""
    ref_params = dict(ref.named_parameters())
    n_dtensor = 0
    for name, p in par.named_parameters():
        n_dtensor += isinstance(p, DTensor)
        if isinstance(p, DTensor):  # step() leaves each grad in its parameter's placements
            assert p.grad.placements == p.placements, f"{where}: {name} {p.grad.placements}"
        got, full = torch_tp_grad_shard(p), ref_params[name].grad
        assert got is not None and full is not None, f"{where}: {name} has no grad"
        want = expected_local_shard(full, name, ref, ctx.tp, ctx.tp_rank)
        assert got.shape == torch_tp_local(p).shape, f"{where}: {name} grad/param shapes differ"
        torch.testing.assert_close(
            got,
            want,
            **(EXACT64 if tol is None else tol(want)),
            msg=lambda m, n=name: f"{where}: {n}: {m}",
        )
    return n_dtensor


def _check_case(
    cfg: ModelConfig, ctx, mesh, seed: int, optim: str, micro_batch, fp32: bool = False
) -> dict:
    """float64: three steps; ``fp32``: the loss and gradients of the first backward only."""
    where = (
        f"{'fp32 ' if fp32 else ''}{cfg.arch} tied={cfg.tie_embeddings} tp={ctx.tp} "
        f"dp={ctx.dp} rank={ctx.rank}"
    )
    torch.manual_seed(seed)
    ref = build_model(cfg) if fp32 else to64(build_model(cfg))
    par = parallelize_torch_tp(copy.deepcopy(ref), ctx, mesh)
    assert par.parallel_ctx is ctx
    if cfg.tie_embeddings:
        assert par.head.weight is par.embed.weight, f"{where}: tie lost"
    attn = par.blocks[0].attn
    assert (attn.n_heads, attn.n_kv_heads) == (cfg.n_heads // ctx.tp, cfg.n_kv_heads // ctx.tp)
    # this rank's qkv rows are exactly its heads: [Q_r | K_r | V_r]
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    full_qkv = ref.blocks[0].attn.qkv.weight.detach()
    r, tp = ctx.tp_rank, ctx.tp
    mine = torch.cat(
        [
            full_qkv[:q].chunk(tp)[r],
            full_qkv[q : q + kv].chunk(tp)[r],
            full_qkv[q + kv :].chunk(tp)[r],
        ]
    )
    torch.testing.assert_close(torch_tp_local(attn.qkv.weight).detach(), mine, **BITWISE)

    rows = slice(ctx.dp_rank * (B // ctx.dp), (ctx.dp_rank + 1) * (B // ctx.dp))
    sched = TorchTPSchedule(micro_batch=micro_batch)
    # foreach=True (torch's default on CUDA) needs DTensor and plain params in separate groups
    make_opt = {
        "sgd": lambda groups: torch.optim.SGD(groups, lr=LR * 10, momentum=0.9, foreach=True),
        "adamw": lambda groups: torch.optim.AdamW(groups, lr=LR, foreach=True),
    }[optim]
    ref_opt = make_opt(ref.parameters())
    par_opt = make_opt(split_dtensor_groups(par.parameters()))
    losses, n_dtensor = [], 0
    for step in range(3):
        tokens = _tokens(cfg.vocab_size, seed + 100 + 2 * step)
        targets = _tokens(cfg.vocab_size, seed + 101 + 2 * step)
        ref_opt.zero_grad()
        par_opt.zero_grad()
        ref_loss = ref(tokens, targets)
        ref_loss.backward()
        local = sched.step(par, tokens[rows], targets[rows])
        assert not local.requires_grad, f"{where}: step() loss is not detached"
        loss = _dp_loss(local, ctx)
        assert loss.dtype == ref_loss.dtype, where
        if fp32:  # B * S tokens in the batch
            torch.testing.assert_close(
                loss,
                ref_loss.detach(),
                **fp32_tol(ref_loss, cfg, B * S, False),
                msg=lambda m: f"{where}: loss {m}",
            )
            _assert_grads_match(par, ref, ctx, where, lambda want: fp32_tol(want, cfg, B * S, True))
            return {}
        torch.testing.assert_close(
            loss, ref_loss.detach(), **EXACT64, msg=lambda m, s=step: f"{where}: step {s} loss {m}"
        )
        n_dtensor = _assert_grads_match(par, ref, ctx, f"{where} step {step}")
        # global grad norm of the full model, then clip both to half of it
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")))
        max_norm = 0.5 * ref_norm
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        par_norm = torch_tp_clip_grad_norm_(par.parameters(), max_norm, ctx)
        assert par_norm == pytest.approx(ref_norm, rel=EXACT64["rtol"]), where
        ref_opt.step()
        par_opt.step()
        losses.append(loss.item())
    return {"losses": losses, "n_dtensor": n_dtensor}


def _rank_torch_tp(rank: int, world_size: int, tp: int, cases: list[tuple]) -> dict:
    start = time.monotonic()
    ctx = init_distributed(tp=tp)
    mesh = build_tp_mesh(ctx)  # one mesh (its process groups) for every case
    assert tuple(mesh.mesh.tolist()) == ctx.tp_group.ranks
    out = {}
    for i, (key, kwargs, optim, micro_batch) in enumerate(cases):
        out[key] = _check_case(ModelConfig(**kwargs), ctx, mesh, 10 + i, optim, micro_batch)
    key, kwargs, optim, micro_batch = cases[0]
    _check_case(ModelConfig(**kwargs), ctx, mesh, 10, optim, micro_batch, fp32=True)
    out["elapsed_s"] = time.monotonic() - start
    return out


def _check_results(results: list[dict], n_dtensors: dict[str, int]) -> None:
    for key, n in n_dtensors.items():
        losses = [r[key]["losses"] for r in results]
        assert all(ls == losses[0] for ls in losses), f"{key}: ranks disagree: {losses}"
        assert all(r[key]["n_dtensor"] == n for r in results), (
            f"{key}: expected {n} DTensor parameters, got {[r[key]['n_dtensor'] for r in results]}"
        )


# Sharded parameters per config (2 layers): gpt2 qkv w+b, proj w+b (bias Replicate DTensor),
# fc1 w+b, fc2 w+b = 8 per block, plus embed and head = 18; llama 4 per block + 2 = 10; tied gpt2
# keeps embed/head plain = 16.
_N_DTENSOR = {"gpt2": 18, "llama": 10, "gpt2-tied": 16}


def test_fused_row_permutation() -> None:
    perm = fused_row_permutation((4, 2, 2), 2)
    assert perm.tolist() == [0, 1, 4, 6, 2, 3, 5, 7]


@pytest.mark.exact
def test_torch_tp_tp2(spawn_ranks) -> None:
    cases = [
        ("gpt2", GPT2, "adamw", None),
        ("llama", LLAMA, "sgd", None),
        ("gpt2-tied", GPT2_TIED, "adamw", None),
    ]
    results = spawn_ranks(_rank_torch_tp, 2, 2, cases)
    _check_results(results, _N_DTENSOR)


@pytest.mark.exact
def test_torch_tp_tp2_dp2(spawn_ranks) -> None:
    cases = [
        ("gpt2", GPT2, "sgd", None),
        ("llama", LLAMA, "adamw", 1),  # gradient accumulation over 2 micro-batches of 1 row
    ]
    results = spawn_ranks(_rank_torch_tp, 4, 2, cases)
    _check_results(results, {k: _N_DTENSOR[k] for k in ("gpt2", "llama")})
