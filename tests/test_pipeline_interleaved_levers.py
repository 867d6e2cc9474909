"""The interleaved schedule (2 model chunks a stage) composed with the other levers, on real
ranks, as ``test_pipeline.py`` checks the other pipeline orders:

    pp=2 x dp=2   ZeRO 1 (gpt2, tied) and ZeRO 2 (llama)       float64 parity, 3 AdamW steps
    pp=2 x tp=2   sequence parallelism, both recompute modes    float64 parity, 3 AdamW steps
    pp=2 x tp=2   mixed TP degrees inside each stage's chunks   float64 parity, 3 AdamW steps
    pp=2 x tp=2   dropout: the recompute twins draw the same masks (bit for bit)
    pp=2          bf16 autocast: the loss within 1e-2 of the single-device model's, gradients
                  pointing its way (cosine > 0.999), boundary traffic in bf16

Parity is ``EXACT64`` against the single-device model trained on the whole batch (every
step's loss, every parameter a stage holds after the steps; clipping over all stages)."""

from __future__ import annotations

import copy

import pytest
import torch

import oases
from exactness import BITWISE, to64
from oases.plan import ParallelPlan
from oases.schedule import build_schedule
from test_pipeline import S, _batches, _cfg, _rank_parity, _spawn

V = 2  # model chunks a stage
# mixed degrees on 4 ranks (10 regions: the embedding, 8 block regions, the head): the chunk
# boundaries of pp=2 x 2 chunks fall at regions 3, 5 and 7, tp=2 on both sides of each
MIXED = (2, 1, 2, 2, 2, 2, 2, 2, 1, 2)


def _rank_levers(rank: int, world: int) -> dict:
    out = _rank_parity(rank, world, 2, 1, [("gpt2", "interleaved", "oases")], zero=1, pp_chunks=V)
    out |= _rank_parity(
        rank, world, 2, 1, [("llama", "interleaved", "megatron")], zero=2, pp_chunks=V
    )
    for sp in ("gathered", "shards"):
        out |= _rank_parity(
            rank, world, 2, 2, [("gpt2", "interleaved", "oases")], sp=sp, pp_chunks=V
        )
    out |= _rank_parity(
        rank, world, 2, 2, [("llama", "interleaved", "megatron")], degrees=MIXED, pp_chunks=V
    )
    return out


@pytest.mark.exact
def test_interleaved_with_zero_sequence_parallel_and_mixed_degrees(tmp_path):
    results = _spawn(tmp_path, _rank_levers, 4)
    assert all(len(r) == 5 for r in results), results


def _rank_dropout_twins(rank: int, world: int) -> dict:
    """pp=2 x tp=2, 2 chunks a stage, dropout 0.1: each recompute schedule's loss and every
    gradient equal its twin's without recompute bit for bit (the recompute redraws the same
    masks in every chunk)."""
    ctx = oases.init_distributed(tp=2, pp=2, timeout_s=20.0)
    cfg = _cfg("gpt2", dropout=0.1)
    torch.manual_seed(0)
    base = to64(oases.build_model(cfg))
    plan = ParallelPlan.uniform(cfg, world, 2, pp=2, pp_schedule="interleaved", pp_chunks=V)
    tokens, targets = _batches(8)[0]
    out = {}
    for twin, names in (
        ("megatron", ("megatron-recompute", "commfree-recompute")),
        ("overlap", ("oases", "overlap-recompute")),
    ):
        got = {}
        for name in (twin, *names):
            model = oases.parallelize(copy.deepcopy(base), ctx, plan)
            torch.manual_seed(7)
            loss = build_schedule(name, n_sub=2, micro_batch=2).step(model, tokens, targets)
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            assert grads, (name, rank)
            got[name] = (loss, grads)
        for name in names:
            torch.testing.assert_close(got[name][0], got[twin][0], **BITWISE)
            for n, g in got[twin][1].items():
                torch.testing.assert_close(
                    got[name][1][n], g, **BITWISE, msg=lambda m, n=n, x=name: f"{x} {n}: {m}"
                )
        out[twin] = float(got[twin][0])
    return out


@pytest.mark.exact
def test_interleaved_dropout_recompute_twins(tmp_path):
    _spawn(tmp_path, _rank_dropout_twins, 4)


def _rank_bf16(rank: int, world: int) -> dict:
    """pp=2, 2 chunks a stage, under bf16 autocast (fp32 weights): every boundary (the wrap
    from the last stage back to the first included) carries bf16, the loss is within 1e-2 of
    the single-device model's under the same autocast, and the stage's gradients point its
    way (cosine > 0.999), the bounds of ``tests/test_bf16.py``."""
    from oases.precision import resolve_precision

    bf16 = resolve_precision("bf16", torch.device("cpu"))
    ctx = oases.init_distributed(tp=1, pp=2, timeout_s=20.0)
    tokens, targets = _batches(4)[0]
    out = {}
    for arch in ("gpt2", "llama"):
        cfg = _cfg(arch)
        torch.manual_seed(0)
        ref = oases.build_model(cfg)
        plan = ParallelPlan.uniform(cfg, world, 1, pp=2, pp_schedule="interleaved", pp_chunks=V)
        model = oases.parallelize(copy.deepcopy(ref), ctx, plan)
        with bf16.autocast():
            want = ref(tokens, targets)
        want.backward()
        with oases.record_collectives() as log, bf16.autocast():
            got = build_schedule("oases", n_sub=1, micro_batch=2).step(model, tokens, targets)
        p2p = [r for r in log if r.op in ("send", "recv")]
        assert p2p, (arch, rank)
        assert all(r.dtype == "torch.bfloat16" and r.nbytes == 2 * S * 32 * 2 for r in p2p), p2p[:2]
        torch.testing.assert_close(got.float(), want.float().detach(), rtol=1e-2, atol=0)
        ref_grads = dict(ref.named_parameters())
        a = torch.cat([p.grad.flatten() for _, p in model.named_parameters()])
        b = torch.cat([ref_grads[n].grad.flatten() for n, _ in model.named_parameters()])
        cosine = float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))
        assert cosine > 0.999, (arch, rank, cosine)
        out[arch] = cosine
    return out


def test_interleaved_bf16_within_the_single_device_model_bounds(tmp_path):
    _spawn(tmp_path, _rank_bf16, 2)
