"""The benchmark peer ``torch-pp`` (``bench/torch_pp.py``) computes the step it is timed for:
under every order (GPipe, 1F1B, interleaved 1F1B and the interleaved zero-bubble schedule of
``torch.distributed.pipelining``), 2 ranks, 4 micro-batches, float64, each rank's parameters
get the gradients of the single-device model's loss on the whole batch (``EXACT64``).

LLaMA (untied): GPT-2's tied embedding sits on the first and the last stage and torch's
pipelining leaves summing its two gradients to the user (the peer's step does not: a timing
peer, slightly cheaper than ours by that one all-reduce)."""

from __future__ import annotations

import copy

import pytest
import torch

import oases
from distributed import run_ranks
from exactness import EXACT64, to64
from oases.bench.torch_pp import ORDERS, torch_pp_step
from test_pipeline import _batches, _cfg

N_MICRO = 4


def _rank_grads(rank: int, world: int) -> dict:
    ctx = oases.init_distributed(tp=1, timeout_s=20.0)
    cfg = _cfg("llama")
    torch.manual_seed(0)
    base = to64(oases.build_model(cfg))
    tokens, targets = _batches(N_MICRO)[0]
    ref = copy.deepcopy(base)
    ref(tokens, targets).backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    out = {}
    for order in ORDERS:
        model = copy.deepcopy(base)
        chunks = 2 if order in ("interleaved", "zb") else 1
        step = torch_pp_step(model, ctx, order, N_MICRO, tokens, targets, chunks)
        step()
        got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert got, (order, rank)
        if rank == 0:
            assert "embed.weight" in got and not any(n.startswith("head") for n in got), order
        else:
            assert any(n.startswith("head") for n in got) and "embed.weight" not in got, order
        for n, g in got.items():
            torch.testing.assert_close(
                g, want[n], **EXACT64, msg=lambda m, n=n, o=order: f"{o} rank {rank} {n}: {m}"
            )
        out[order] = len(got)
    return out


@pytest.mark.exact
def test_torch_pp_gradients_equal_the_single_device_model(tmp_path):
    results = run_ranks(_rank_grads, 2, tmp_path, timeout_s=300)
    for order in ORDERS:  # every parameter on exactly one rank
        assert results[0][order] + results[1][order] == len(
            list(oases.build_model(_cfg("llama")).parameters())
        ), (order, results)
