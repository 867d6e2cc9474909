"""Tensor parallelism against the single-device model, on 2 and 4 gloo ranks.

Every case builds the single-device model from a seed on every rank, parallelizes a deep copy and
compares logits, loss, each rank's gradient shard and a few AdamW steps in float64 (1e-10), and
the first case of each spawn once more in fp32 (logits, loss, gradients of one backward, within
the bound derived from its reductions): tolerances in tests/exactness.py. Each test is one spawn
of the ranks with several cases inside the rank function (starting the processes is most of the
cost).
"""

from __future__ import annotations

import copy
import dataclasses
import time

import pytest
import torch
import torch.distributed as dist

from exactness import EXACT64, fp32_tol, to64
from oases.config import ModelConfig
from oases.model import build_model
from oases.parallel.apply import parallelize, shard_spec, shard_tensor
from oases.parallel.comm import record_collectives
from oases.parallel.context import init_distributed
from oases.schedule import build_schedule

B, S = 4, 16
LR = 1e-2


# --------------------------------------------------------------------------------------------
# helpers (run inside the ranks)


def _tokens(vocab: int, seed: int, batch: int = B) -> torch.Tensor:
    """Random tokens, identical on every rank."""
    return torch.randint(0, vocab, (batch, S), generator=torch.Generator().manual_seed(seed))


def _build(cfg: ModelConfig, seed: int, fp32: bool = False) -> torch.nn.Module:
    """The single-device model from ``seed``, in float64 unless ``fp32``."""
    torch.manual_seed(seed)
    model = build_model(cfg)
    return model if fp32 else to64(model)


def _expected_shard(full: torch.Tensor, par_param: torch.Tensor, ctx) -> torch.Tensor:
    spec = shard_spec(par_param)
    return full if spec is None else shard_tensor(full, spec, ctx.tp_rank, ctx.tp)


def _assert_grads_match(par, ref, ctx, where: str, tol=None) -> None:
    """Each parallel parameter's grad equals the matching shard of the single-device grad
    (``tol(expected)``: assert_close arguments; float64's EXACT64 by default)."""
    ref_params = dict(ref.named_parameters())
    par_params = dict(par.named_parameters())
    assert set(par_params) == set(ref_params), (
        f"{where}: parameter names differ: {sorted(set(par_params) ^ set(ref_params))}"
    )
    for name, p in par_params.items():
        full = ref_params[name].grad
        assert p.grad is not None and full is not None, f"{where}: {name} has no grad"
        expected = _expected_shard(full, p, ctx)
        torch.testing.assert_close(
            p.grad,
            expected,
            **(EXACT64 if tol is None else tol(expected)),
            msg=lambda m, n=name: f"{where}: grad of {n}: {m}",
        )


def _assert_params_match(par, ref, ctx, where: str) -> None:
    """float64 parameters after AdamW steps (the bound of exactness.py holds through AdamW)."""
    ref_params = dict(ref.named_parameters())
    for name, p in par.named_parameters():
        expected = _expected_shard(ref_params[name].detach(), p, ctx)
        torch.testing.assert_close(
            p.detach(), expected, **EXACT64, msg=lambda m, n=name: f"{where}: param {n}: {m}"
        )


def _check_fp32_case(cfg: ModelConfig, ctx, seed: int) -> None:
    """fp32: logits, loss and the gradients of one backward from equal weights, each within
    the bound derived from its reductions (exactness.fp32_tol); no AdamW steps (see there)."""
    where = f"fp32 {cfg.arch} tp={ctx.tp} rank={ctx.rank}"
    ref = _build(cfg, seed, fp32=True)
    par = parallelize(copy.deepcopy(ref), ctx)
    tokens, targets = _tokens(cfg.vocab_size, seed + 1), _tokens(cfg.vocab_size, seed + 2)
    n = tokens.numel()
    with torch.no_grad():
        ref_logits, par_logits = ref(tokens), par(tokens)
    assert par_logits.dtype == torch.float32
    torch.testing.assert_close(
        par_logits,
        ref_logits,
        **fp32_tol(ref_logits, cfg, n, False),
        msg=lambda m: f"{where}: logits {m}",
    )
    ref_loss, par_loss = ref(tokens, targets), par(tokens, targets)
    torch.testing.assert_close(
        par_loss, ref_loss, **fp32_tol(ref_loss, cfg, n, False), msg=lambda m: f"{where}: loss {m}"
    )
    ref_loss.backward()
    par_loss.backward()
    _assert_grads_match(par, ref, ctx, where, tol=lambda want: fp32_tol(want, cfg, n, True))


def _check_tp_case(cfg: ModelConfig, ctx, seed: int, n_steps: int = 5) -> list[float]:
    """float64: logits, loss, grads and AdamW steps of one config; returns the per-step
    losses."""
    where = f"{cfg.arch} tp={ctx.tp} rank={ctx.rank}"
    ref = _build(cfg, seed)
    par = parallelize(copy.deepcopy(ref), ctx)
    assert par.parallel_ctx is ctx, f"{where}: parallelize did not set model.parallel_ctx"
    if cfg.tie_embeddings:
        assert par.head.weight is par.embed.weight, f"{where}: tie lost by parallelize"

    tokens, targets = _tokens(cfg.vocab_size, seed + 1), _tokens(cfg.vocab_size, seed + 2)
    with torch.no_grad():
        ref_logits, par_logits = ref(tokens), par(tokens)
    assert par_logits.shape == (B, S, cfg.vocab_size), f"{where}: {tuple(par_logits.shape)}"
    assert par_logits.dtype == torch.float64, f"{where}: {par_logits.dtype}"
    torch.testing.assert_close(par_logits, ref_logits, **EXACT64, msg=lambda m: f"{where}: {m}")

    ref_loss, par_loss = ref(tokens, targets), par(tokens, targets)
    assert par_loss.dtype == torch.float64, f"{where}: loss in {par_loss.dtype}"
    torch.testing.assert_close(par_loss, ref_loss, **EXACT64, msg=lambda m: f"{where}: loss {m}")
    ref_loss.backward()
    par_loss.backward()
    _assert_grads_match(par, ref, ctx, where)

    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    par_opt = torch.optim.AdamW(par.parameters(), lr=LR)
    losses = []
    for step in range(n_steps):
        tokens = _tokens(cfg.vocab_size, seed + 100 + 2 * step)
        targets = _tokens(cfg.vocab_size, seed + 101 + 2 * step)
        ref_opt.zero_grad()
        par_opt.zero_grad()
        ref_loss, par_loss = ref(tokens, targets), par(tokens, targets)
        torch.testing.assert_close(
            par_loss, ref_loss, **EXACT64, msg=lambda m, s=step: f"{where}: step {s} loss {m}"
        )
        ref_loss.backward()
        par_loss.backward()
        ref_opt.step()
        par_opt.step()
        losses.append(par_loss.item())
    _assert_params_match(par, ref, ctx, f"{where} after {n_steps} AdamW steps")
    return losses


# --------------------------------------------------------------------------------------------
# rank functions (module level so the spawned children can import them)


def _rank_tp_matches_single_device(rank: int, world_size: int, cases: list[dict]) -> list:
    ctx = init_distributed(tp=world_size)
    assert (ctx.tp, ctx.dp, ctx.tp_rank) == (world_size, 1, rank)
    _check_fp32_case(ModelConfig(**cases[0]), ctx, seed=10)
    return [_check_tp_case(ModelConfig(**c), ctx, seed=10 + i) for i, c in enumerate(cases)]


def _count_activation_all_reduces(records, direction: str, nbytes: int) -> int:
    return sum(
        1
        for r in records
        if r.op == "all_reduce"
        and r.group == "tp"
        and r.direction == direction
        and r.nbytes == nbytes
    )


def _rank_tp2_dp2_schedules(rank: int, world_size: int) -> dict:
    ctx = init_distributed(tp=2)
    assert (ctx.tp, ctx.dp) == (2, 2)
    cfg = ModelConfig(
        arch="gpt2",
        n_layers=2,
        dim=32,
        n_heads=4,
        vocab_size=101,
        seq_len=S,
        tie_embeddings=True,
    )
    where = f"tp=2 dp=2 rank={rank}"
    half = B // ctx.dp
    rows = slice(ctx.dp_rank * half, (ctx.dp_rank + 1) * half)  # contiguous share of the batch

    # 3 AdamW steps with the megatron schedule vs the single-device model on the full batch.
    ref = _build(cfg, 7)
    par = parallelize(copy.deepcopy(ref), ctx)
    sched = build_schedule("megatron")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    par_opt = torch.optim.AdamW(par.parameters(), lr=LR)
    losses = []
    for step in range(3):
        tokens, targets = _tokens(cfg.vocab_size, 200 + step), _tokens(cfg.vocab_size, 300 + step)
        ref_opt.zero_grad()
        par_opt.zero_grad()
        ref_loss = ref(tokens, targets)
        ref_loss.backward()
        local_loss = sched.step(par, tokens[rows], targets[rows])
        assert local_loss.requires_grad is False, f"{where}: step() loss is not detached"
        global_loss = local_loss.detach().clone()
        dist.all_reduce(global_loss, group=ctx.dp_group.pg)
        global_loss /= ctx.dp
        torch.testing.assert_close(
            global_loss,
            ref_loss.detach(),
            **EXACT64,
            msg=lambda m, s=step: f"{where}: step {s} {m}",
        )
        _assert_grads_match(par, ref, ctx, f"{where} step {step}")
        ref_opt.step()
        par_opt.step()
        losses.append(global_loss.item())
    _assert_params_match(par, ref, ctx, f"{where} after 3 AdamW steps")

    # megatron-recompute: same grads as megatron; forward all-reduces repeat in the recompute.
    tokens, targets = _tokens(cfg.vocab_size, 400), _tokens(cfg.vocab_size, 401)
    counts: dict[str, dict[int, tuple[int, int]]] = {}
    nbytes = half * S * cfg.dim * 8  # one float64 activation [B_local, S, H]
    for n_layers in (1, 2):
        layer_cfg = dataclasses.replace(cfg, n_layers=n_layers)
        base = _build(layer_cfg, 8)
        grads = {}
        for name in ("megatron", "megatron-recompute"):
            model = parallelize(copy.deepcopy(base), ctx)
            with record_collectives() as records:
                loss = build_schedule(name).step(model, tokens[rows], targets[rows])
            grads[name] = (loss, {n: p.grad.clone() for n, p in model.named_parameters()})
            counts.setdefault(name, {})[n_layers] = (
                _count_activation_all_reduces(records, "forward", nbytes),
                _count_activation_all_reduces(records, "backward", nbytes),
            )
        (loss_a, grads_a), (loss_b, grads_b) = grads["megatron"], grads["megatron-recompute"]
        torch.testing.assert_close(loss_b, loss_a, **EXACT64)
        for n, g in grads_a.items():
            torch.testing.assert_close(
                grads_b[n], g, **EXACT64, msg=lambda m, n=n: f"{where}: recompute grad {n}: {m}"
            )
    return {"losses": losses, "counts": counts}


def _rank_invalid_tp_degree(rank: int, world_size: int) -> dict:
    start = time.monotonic()
    try:
        init_distributed(tp=3)
    except ValueError as e:
        message = str(e)
    else:
        message = None
    return {"message": message, "elapsed_s": time.monotonic() - start}


def _rank_indivisible_heads(rank: int, world_size: int) -> dict:
    ctx = init_distributed(tp=world_size)
    start = time.monotonic()
    messages = {}
    cases = {
        "n_heads": dict(arch="gpt2", n_heads=6, dim=48),
        "n_kv_heads": dict(arch="llama", n_heads=8, n_kv_heads=2, dim=64),
    }
    for key, kwargs in cases.items():
        model = _build(ModelConfig(n_layers=1, vocab_size=101, seq_len=S, **kwargs), 0)
        with torch.no_grad():
            before = model(_tokens(101, 0))  # valid single-device
        try:
            parallelize(model, ctx)
        except ValueError as e:
            messages[key] = str(e)
        else:
            messages[key] = None
            continue
        # the check ran before anything changed: still the intact single-device model
        assert getattr(model, "parallel_ctx", None) is None, key
        with torch.no_grad():
            torch.testing.assert_close(model(_tokens(101, 0)), before, rtol=0, atol=0)
    # the groups still work afterwards: nothing was left half-issued
    t = torch.ones(1)
    dist.all_reduce(t)
    return {"messages": messages, "elapsed_s": time.monotonic() - start, "sum": t.item()}


# --------------------------------------------------------------------------------------------
# tests


@pytest.mark.exact
def test_tp2_matches_single_device(spawn_ranks):
    cases = [
        dict(
            arch="gpt2",
            n_layers=2,
            dim=32,
            n_heads=4,
            vocab_size=101,
            seq_len=S,
            tie_embeddings=True,
        ),
        dict(arch="llama", n_layers=2, dim=32, n_heads=4, n_kv_heads=2, vocab_size=101, seq_len=S),
    ]
    results = spawn_ranks(_rank_tp_matches_single_device, 2, cases)
    assert results[0] == results[1]  # the same losses on every TP rank


@pytest.mark.exact
def test_tp4_matches_single_device(spawn_ranks):
    cases = [
        dict(
            arch="gpt2",
            n_layers=2,
            dim=32,
            n_heads=4,
            vocab_size=101,
            seq_len=S,
            tie_embeddings=True,
        ),
        dict(arch="llama", n_layers=2, dim=64, n_heads=8, n_kv_heads=4, vocab_size=101, seq_len=S),
    ]
    results = spawn_ranks(_rank_tp_matches_single_device, 4, cases)
    assert all(r == results[0] for r in results)


@pytest.mark.exact
def test_tp2_dp2_megatron_and_recompute(spawn_ranks):
    results = spawn_ranks(_rank_tp2_dp2_schedules, 4)
    assert all(r["losses"] == results[0]["losses"] for r in results)
    for r in results:
        meg, rec = r["counts"]["megatron"], r["counts"]["megatron-recompute"]
        # per block = difference between the 2-layer and the 1-layer model; the remainder
        # (embedding forward all-reduce, head-input backward all-reduce) is outside the blocks.
        meg_fwd, rec_fwd = meg[2][0] - meg[1][0], rec[2][0] - rec[1][0]
        meg_bwd, rec_bwd = meg[2][1] - meg[1][1], rec[2][1] - rec[1][1]
        assert meg_fwd == 2, r["counts"]
        # the recompute repeats both forward all-reduces of a block (3 here would mean the
        # checkpoint's recompute stopped early, before the block's trailing all-reduce)
        assert rec_fwd == 4, r["counts"]
        assert meg_bwd == 2 and rec_bwd == 2, r["counts"]
        # outside the blocks both schedules issue the same collectives
        assert meg[1][0] - meg_fwd == rec[1][0] - rec_fwd, r["counts"]
        assert meg[1][1] == rec[1][1], r["counts"]


def test_invalid_tp_degree_raises_on_every_rank(spawn_ranks):
    start = time.monotonic()
    results = spawn_ranks(_rank_invalid_tp_degree, 2, timeout_s=60)
    for rank, r in enumerate(results):
        assert r["message"] is not None, f"rank {rank} did not raise ValueError"
        assert "3" in r["message"] and "2" in r["message"], r["message"]
        # a hang would end only at the 30 s collective timeout; an up-front check is immediate
        assert r["elapsed_s"] < 10, r
    assert time.monotonic() - start < 60


def test_indivisible_heads_raise_on_every_rank(spawn_ranks):
    results = spawn_ranks(_rank_indivisible_heads, 4, timeout_s=60)
    for rank, r in enumerate(results):
        msg = r["messages"]["n_heads"]
        assert msg is not None, f"rank {rank}: n_heads=6 at tp=4 did not raise"
        assert "6" in msg and "4" in msg and "n_heads" in msg, msg
        msg = r["messages"]["n_kv_heads"]
        assert msg is not None, f"rank {rank}: n_kv_heads=2 at tp=4 did not raise"
        assert "2" in msg and "4" in msg and "n_kv_heads" in msg, msg
        assert r["elapsed_s"] < 10, r
        assert r["sum"] == 4.0
