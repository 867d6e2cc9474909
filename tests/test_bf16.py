"""bf16 (``train.precision = "bf16"``) on real ranks, against the single-device model under the
same autocast.

Tolerances (bf16 keeps 8 bits of mantissa, a relative rounding of 2^-9 = 2e-3 per value): the
parallel step rounds differently from the single-device one (each TP rank's partial sum is
rounded to bf16 before the all-reduce adds it, a row-parallel bias is added after the sum
instead of inside the matmul), so losses agree to 1e-2 relative and every rank's gradient
shards, taken together, point the same way as the single-device model's shards (cosine
similarity above 0.999), through 3 AdamW steps. Recompute twins stay bit for bit equal: the
recompute runs the same bf16 kernels on the same saved bf16 tensors with the same masks.

Also: what bf16 moves and keeps, in bytes: TP all-reduces half of fp32's, the data-parallel
gradient reduction fp32 by default and bf16 on request, saved activations of ``oases`` at most
4*S*B*H elements x 2 bytes per block (half of fp32's bound).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

from oases import record_collectives
from oases.model import build_model
from oases.parallel.apply import parallelize, shard_spec, shard_tensor
from oases.parallel.context import init_distributed
from oases.precision import resolve_precision
from oases.schedule import SCHEDULES, build_schedule
from test_schedules import TWINS, B, S, _assert_grads_equal, _cfg, _tokens

LR = 1e-3
STEPS = 3
LOSS_RTOL = 1e-2
MIN_COSINE = 0.999
BF16 = resolve_precision("bf16", torch.device("cpu"))


def _shard(full: torch.Tensor, par_param: torch.Tensor, ctx) -> torch.Tensor:
    spec = shard_spec(par_param)
    return full if spec is None else shard_tensor(full, spec, ctx.tp_rank, ctx.tp)


def _cosine(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    x = torch.cat([t.double().flatten() for t in a])
    y = torch.cat([t.double().flatten() for t in b])
    return float(x @ y / (x.norm() * y.norm()))


def _rank_parity(rank: int, world_size: int) -> dict:
    """Every schedule x both flavours at tp = world size, 3 AdamW steps under bf16 autocast:
    loss and gradients against the single-device model stepped the same way."""
    ctx = init_distributed(tp=world_size)
    out = {}
    for f, arch in enumerate(("gpt2", "llama")):
        cfg = _cfg(arch, ctx.tp)
        torch.manual_seed(10 + f)
        pristine = build_model(cfg)
        ref = copy.deepcopy(pristine)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
        ref_losses, ref_grads = [], []
        for step in range(STEPS):
            ref_opt.zero_grad(set_to_none=True)
            with BF16.autocast():
                loss = ref(_tokens(20 + step), _tokens(30 + step))
            loss.backward()
            ref_losses.append(loss.item())
            ref_grads.append({n: p.grad.clone() for n, p in ref.named_parameters()})
            ref_opt.step()
        for name in SCHEDULES:
            where = f"{arch} tp={ctx.tp} rank={rank} {name}"
            model = parallelize(copy.deepcopy(pristine), ctx)
            sched = build_schedule(name, n_sub=2)
            opt = torch.optim.AdamW(model.parameters(), lr=LR)
            cosines = []
            for step in range(STEPS):
                opt.zero_grad(set_to_none=True)
                with BF16.autocast():
                    loss = sched.step(model, _tokens(20 + step), _tokens(30 + step))
                assert loss.dtype == torch.float32, where
                assert loss.item() == pytest.approx(ref_losses[step], rel=LOSS_RTOL), (
                    f"{where} step {step}: loss {loss.item()} vs single device {ref_losses[step]}"
                )
                got, want = [], []
                for n, p in model.named_parameters():
                    assert p.grad is not None and p.grad.dtype == torch.float32, (where, n)
                    got.append(p.grad)
                    want.append(_shard(ref_grads[step][n], p, ctx))
                cosines.append(_cosine(got, want))
                assert cosines[-1] > MIN_COSINE, f"{where} step {step}: cosine {cosines[-1]}"
                opt.step()
            out[arch, name] = cosines
    return out


def _rank_bf16_twins(rank: int, world_size: int) -> dict:
    """Dropout 0.1, bf16: each recompute schedule equals its twin bit for bit."""
    ctx = init_distributed(tp=world_size)
    out = {}
    for f, arch in enumerate(("gpt2", "llama")):
        cfg = _cfg(arch, ctx.tp, dropout=0.1)
        torch.manual_seed(40 + f)
        ref = build_model(cfg).train()
        runs = {}
        for name in ("megatron", "overlap", *TWINS):
            model = parallelize(copy.deepcopy(ref), ctx)
            model.zero_grad(set_to_none=True)
            sched = build_schedule(name, n_sub=2)
            torch.manual_seed(1234)  # the same dropout masks for every schedule
            with BF16.autocast():
                loss = sched.step(model, _tokens(50 + f), _tokens(60 + f))
            runs[name] = (loss, {n: p.grad.clone() for n, p in model.named_parameters()})
        for name, twin in TWINS.items():
            where = f"{arch} tp={ctx.tp} rank={rank} bf16 {name} vs {twin}"
            assert torch.equal(runs[name][0], runs[twin][0]), where
            _assert_grads_equal(runs[name][1], runs[twin][1], where, dict(rtol=0.0, atol=0.0))
        out[arch] = runs["megatron"][0].item()
    return out


def _rank_bytes(rank: int, world_size: int) -> dict:
    """What each precision moves and keeps, from the recording hook and the executor's own
    accounting: {precision: {"fwd"/"bwd"/"dp": {(nbytes, dtype)}, "saved": per block}}.
    tp=2 x dp=2 (4 ranks), so the data-parallel gradient reduction runs too."""
    ctx = init_distributed(tp=2)
    cfg = _cfg("gpt2", ctx.tp)
    torch.manual_seed(70)
    ref = build_model(cfg)
    out = {}
    for label, precision in (
        ("fp32", resolve_precision("fp32", ctx.device)),
        ("bf16", BF16),
        ("bf16+bf16 reduce", resolve_precision("bf16", ctx.device, "bf16")),
    ):
        model = parallelize(copy.deepcopy(ref), ctx)
        sched = build_schedule("oases", n_sub=2, grad_reduce_dtype=precision.grad_reduce_dtype)
        executor = sched.executor(model)
        executor.track_memory = True
        with record_collectives() as records, precision.autocast():
            sched.step(model, _tokens(71), _tokens(72))
        kinds: dict[str, set] = {"fwd": set(), "bwd": set(), "dp": set()}
        for r in records:
            m = re.match(r"(fwd|bwd|dp):", r.tag)
            if m:
                kinds[m[1]].add((r.nbytes, r.dtype))
        dp_elements = sum(p.numel() for p in model.parameters())
        saved = executor.saved_bytes
        out[label] = {
            **{k: sorted(v) for k, v in kinds.items()},
            "dp_elements": dp_elements,
            "saved": [
                saved.get(2 * b + 1, 0) + saved.get(2 * b + 2, 0) for b in range(cfg.n_layers)
            ],
        }
    return out


@pytest.mark.parametrize("tp", (2, 4))
def test_every_schedule_in_bf16_matches_the_single_device_model(spawn_ranks, tp):
    results = spawn_ranks(_rank_parity, tp, timeout_s=600)
    for r in results:
        assert len(r) == 2 * len(SCHEDULES)
        print({k: round(min(v), 6) for k, v in r.items()})


def test_recompute_equals_its_twin_under_bf16(spawn_ranks):
    results = spawn_ranks(_rank_bf16_twins, 2)
    assert all(r == results[0] for r in results)


def test_bf16_halves_tp_bytes_and_saved_activations(spawn_ranks):
    results = spawn_ranks(_rank_bytes, 4)
    act = (B // 2) * S * _cfg("gpt2", 2).dim  # one sub-batch's [b, S, H] elements
    for r in results:
        fp32, bf16, both = r["fp32"], r["bf16"], r["bf16+bf16 reduce"]
        for kind in ("fwd", "bwd"):  # every TP all-reduce: one activation, 4 bytes then 2
            assert fp32[kind] == [(act * 4, "torch.float32")], (kind, fp32[kind])
            assert bf16[kind] == both[kind] == [(act * 2, "torch.bfloat16")], (kind, bf16[kind])
        # the DP gradient reduction: fp32 by default, bf16 when asked (half the bytes)
        assert {d for _, d in fp32["dp"]} == {d for _, d in bf16["dp"]} == {"torch.float32"}
        assert [n for n, _ in bf16["dp"]] == [n for n, _ in fp32["dp"]]
        assert {d for _, d in both["dp"]} == {"torch.bfloat16"}
        assert sorted(2 * n for n, _ in both["dp"]) == sorted(n for n, _ in fp32["dp"])
        # saved activations per block: oases keeps 4*S*B*H elements, 2 bytes each in bf16
        limit = 4 * S * B * _cfg("gpt2", 2).dim
        for blk, (n32, n16) in enumerate(zip(fp32["saved"], bf16["saved"])):
            assert 0 < n32 <= limit * 4 and 0 < n16 <= limit * 2, (blk, n32, n16)
            assert n16 * 2 == n32, (blk, n32, n16)
