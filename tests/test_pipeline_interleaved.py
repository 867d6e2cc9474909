"""The interleaved schedule (``parallel.pp_chunks`` model chunks per stage) on real ranks:
float64 parity with the single-device model, as ``test_pipeline.py``'s (gpt2 with tied
embeddings and llama, megatron and oases inner schedules, 4 micro-batches, 3 AdamW steps with
clipping), at pp=2 and pp=2 x tp=2 with 2 chunks a stage; the point-to-point of one step."""

from __future__ import annotations

import copy

import pytest
import torch

import oases
from exactness import EXACT64, to64
from oases.plan import ParallelPlan
from test_pipeline import TIMEOUT_S, N_MICRO, _batches, _cfg, _check, _reference, _spawn, _train

CASES = [(arch, name) for arch in ("gpt2", "llama") for name in ("megatron", "oases")]


def _rank_parity(rank: int, world: int, pp: int, tp: int, chunks: int, cases: list) -> dict:
    ctx = oases.init_distributed(tp=tp, pp=pp, timeout_s=TIMEOUT_S)
    dp = world // (pp * tp)
    n_sub = 2
    batches = _batches(N_MICRO * n_sub * dp)
    out, refs = {}, {}
    for arch, name in cases:
        cfg = _cfg(arch)
        if arch not in refs:
            torch.manual_seed(0)
            base = to64(oases.build_model(cfg))
            refs[arch] = (base, *_reference(base, batches))
        base, want_losses, want_params = refs[arch]
        where = f"{arch} pp={pp} tp={tp} v={chunks} {name} rank {rank}"
        plan = ParallelPlan.uniform(
            cfg, world, tp, pp=pp, pp_schedule="interleaved", pp_chunks=chunks
        )
        plan.check(cfg, world)
        model = oases.parallelize(copy.deepcopy(base), ctx, plan)
        losses = _train(model, ctx, name, batches, n_sub)
        _check(model, ctx, losses, want_losses, want_params, where)
        out[where] = [float(x) for x in losses]
    return out


@pytest.mark.exact
def test_interleaved_pp2_equals_the_single_device_model(tmp_path):
    _spawn(tmp_path, _rank_parity, 2, 2, 1, 2, CASES)


@pytest.mark.exact
def test_interleaved_pp2_tp2_equals_the_single_device_model(tmp_path):
    _spawn(tmp_path, _rank_parity, 4, 2, 2, 2, CASES)
