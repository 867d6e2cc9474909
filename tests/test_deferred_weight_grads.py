"""Deferred weight gradients under sequence parallelism: a block region's TP backward cut into
its input gradient ("tp", after which its reduce-scatter starts) and its weight gradients
("dw", which run once the next gather has started, under both collectives).

The executor's results with the split are covered by ``test_sequence_parallel.py`` (every
schedule against the single-device model in float64); here: the layer's mechanism, where the
programs put the pieces, and how the planner prices and counts them.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from exactness import EXACT64
from oases.config import ModelConfig
from oases.parallel.context import Group
from oases.parallel.layers import ColumnParallelLinear, RowParallelLinear, deferred_weight_grads
from oases.schedule.dw_tasks import defers_weight_grad
from oases.schedule.instructions import Compute, Start, Wait
from oases.schedule.program import build_program
from oases.schedule.specs import SP_MODES, SPECS

N_REGIONS = 2 * 3 + 2  # three layers: embedding, 3 x (attention, MLP), head
SOLO = Group("tp", (0,), 0)  # a TP group of one rank: no communication


def _column(seed: int, bias: bool = True) -> ColumnParallelLinear:
    torch.manual_seed(seed)
    return ColumnParallelLinear(nn.Linear(12, 20, bias=bias).double(), SOLO)


@pytest.mark.parametrize("bias", (True, False))
def test_a_deferred_column_backward_leaves_exactly_the_weight_gradients(bias):
    """Inside ``deferred_weight_grads`` an armed layer's backward gives dx alone and records
    (x, dY); accumulating them later gives autograd's dW and db (float64), on top of what
    the gradient already held; outside the block, or unarmed, the layer is F.linear."""
    x = torch.randn(3, 5, 12, dtype=torch.float64)
    dy = torch.randn(3, 5, 20, dtype=torch.float64)
    ref = _column(0, bias)
    xr = x.clone().requires_grad_()
    ref.local(xr).backward(dy)
    ref.local(xr.detach()).backward(dy)  # twice: the second accumulates

    layer = _column(0, bias)
    layer.defers_weight_grad = True
    xl = x.clone().requires_grad_()
    with deferred_weight_grads() as stash:
        layer.local(xl).backward(dy)
    assert layer.weight.grad is None and (layer.bias is None or layer.bias.grad is None)
    torch.testing.assert_close(xl.grad, xr.grad, **EXACT64)
    assert [entry[0] for entry in stash] == [layer]
    for owner, saved_x, grad in stash:
        owner.accumulate_weight_grad(saved_x, grad)
    layer.local(xl.detach()).backward(dy)  # outside the block: all three gradients at once
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad, **EXACT64)
    if bias:
        torch.testing.assert_close(layer.bias.grad, ref.bias.grad, **EXACT64)
    layer.defers_weight_grad = False
    with torch.no_grad():
        torch.testing.assert_close(layer.local(x), ref.local(x), rtol=0, atol=0)


def test_a_deferred_row_backward_leaves_exactly_the_weight_gradient():
    torch.manual_seed(1)
    full = nn.Linear(20, 12, bias=True).double()
    ref, row = RowParallelLinear(full, SOLO), RowParallelLinear(full, SOLO)
    y = torch.randn(3, 5, 20, dtype=torch.float64)
    dp = torch.randn(3, 5, 12, dtype=torch.float64)
    dx_ref = ref.backward_partial(y, dp)
    dx = row.backward_partial(y, dp, weight_grad=False)
    assert row.weight.grad is None
    row.accumulate_weight_grad(y, dp)
    torch.testing.assert_close(dx, dx_ref, rtol=0, atol=0)
    torch.testing.assert_close(row.weight.grad, ref.weight.grad, **EXACT64)


def test_a_deferred_column_backward_under_bf16_autocast_matches_autograd():
    """bf16 activations on fp32 master weights: dW computed in bf16 and accumulated in fp32,
    as autograd's cast back does: the same bf16 matmuls over 15 rows, which may only sum in
    another order (a few bf16 ulps of unit-sized terms: 2^-8 each, inside 2e-2)."""
    torch.manual_seed(3)
    x = torch.randn(3, 5, 12).bfloat16()
    dy = torch.randn(3, 5, 20).bfloat16()
    torch.manual_seed(2)
    ref = ColumnParallelLinear(nn.Linear(12, 20), SOLO)
    torch.manual_seed(2)
    layer = ColumnParallelLinear(nn.Linear(12, 20), SOLO)
    layer.defers_weight_grad = True
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref.local(x).backward(dy)
        out = layer.local(x)
    with deferred_weight_grads() as stash:
        out.backward(dy)
    for owner, saved_x, grad in stash:
        owner.accumulate_weight_grad(saved_x, grad)
    assert layer.weight.grad.dtype == torch.float32
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad, rtol=2e-2, atol=2e-2)


def _position(program: list, want) -> int:  # noqa: ANN001
    hits = [n for n, ins in enumerate(program) if ins == want]
    assert len(hits) == 1, (want, hits)
    return hits[0]


@pytest.mark.parametrize("name", [*SPECS])
@pytest.mark.parametrize("sp", SP_MODES)
def test_sequence_parallel_programs_defer_each_block_regions_weight_gradients(name, sp):
    """In an overlapped schedule without communication-free recompute, every block region i
    and sub-batch has one "dw" piece, after its "tp" piece and its reduce-scatter's start,
    and after the sub-batch's next backward gather has started, while that one flies (its
    Wait comes later; merak's waits close its block); in a block recompute, where the next
    block's rebuild comes before that gather, before the rebuild. Not the embedding's nor the
    head's, not in oases, commfree-recompute or a synchronous schedule; never without
    sequence parallelism."""
    program = build_program(name, N_REGIONS, 2, sp=sp)
    overlapped = SPECS[name].overlapped
    for j in range(2 if overlapped else 1):
        for i in range(N_REGIONS):
            dw = [
                n
                for n, ins in enumerate(program)
                if isinstance(ins, Compute) and ("dw", i) in ins.pieces and ins.sub == j
            ]
            if not (overlapped and defers_weight_grad(i, N_REGIONS, SPECS[name].recompute)):
                assert not dw
                continue
            assert len(dw) == 1
            tp = _position(program, Compute("backward", (("tp", i),), j))
            start = _position(program, Start("bwd", i, j))
            assert tp < start < dw[0]
            rebuilt = [
                n
                for n in range(tp, len(program))
                if isinstance(program[n], Compute)
                and program[n].phase == "recompute"
                and program[n].sub == j
            ]
            if rebuilt and rebuilt[0] < _position(program, Start("gb", i - 1, j)):
                # block recompute: the next block's rebuild comes first; dw runs before it
                assert dw[0] < rebuilt[0]
                continue
            gather = [
                n
                for n in range(start + 1, dw[0])
                if isinstance(program[n], Start) and program[n].sub == j and program[n].kind == "gb"
            ]
            assert gather, "dw waits for the sub-batch's next backward gather to start"
            if SPECS[name].scope == "chain":
                assert _position(program, Wait("gb", program[gather[0]].index, j)) > dw[0]
    plain = build_program(name, N_REGIONS, 2) if name != "megatron-sp" else []
    assert not [
        ins
        for ins in plain
        if isinstance(ins, Compute) and any(kind == "dw" for kind, _ in ins.pieces)
    ]


def test_a_data_parallel_bucket_starts_after_its_deferred_weight_gradients():
    """A bucket of a deferring region starts after its "dw" piece of the last sub-batch (the
    gradients are final only then); the embedding's, which defers nothing, after its "tp"."""
    tasks = (0, 3, 5)
    program = build_program("overlap", N_REGIONS, 2, sp="gathered", dp_tasks=tasks)
    for t in tasks:
        start = _position(program, Start("dp", t))
        deferred = defers_weight_grad(t, N_REGIONS, "none")
        last = Compute("backward", (("dw" if deferred else "tp", t),), 1)
        assert _position(program, last) < start
        if t:
            assert program[start - 1] == last or isinstance(program[start - 1], Start | Wait)


def test_the_hardware_model_splits_a_backward_into_input_and_weight_gradients():
    from oases.planner.clusters import get_cluster
    from oases.planner.hardware import HardwareCosts

    for arch in ("gpt2", "llama"):
        cfg = ModelConfig(
            arch=arch, n_layers=2, dim=1024, n_heads=16, vocab_size=50304, seq_len=1024
        )
        costs = HardwareCosts(get_cluster("paper-3090-pcie-32"), cfg)
        for region in ("attn", "mlp"):
            whole = costs.work(region, "backward", "tp", 4, 2)
            dx = costs.work(region, "backward", "sp-dx", 4, 2)
            dw = costs.work(region, "backward", "sp-dw", 4, 2)
            assert dx[0] + dw[0] == pytest.approx(whole[0], rel=1e-12)
            assert dx[1] + dw[1] == pytest.approx(whole[1], rel=1e-12)  # dW's bytes: its
            assert 0 < dw[1] < whole[1]  # casts and the gradient accumulation
            assert 0.25 < dw[0] / whole[0] <= 0.5  # a matmul's dW: half its backward or less


def test_a_profile_without_the_split_prices_the_whole_backward_as_the_input_gradient():
    from oases.planner.profile import Profile

    compute = [{"region": "attn", "phase": "backward", "piece": "tp", "tp": 2, "rows": 1, "s": 0.4}]
    p = Profile({"arch": "gpt2"}, {"backend": "gloo"}, compute, [], [])
    assert p.compute_s("attn", "backward", "sp-dx", 2, 1) == 0.4
    assert p.compute_s("attn", "backward", "sp-dw", 2, 1) == 0.0
    split = compute + [
        {"region": "attn", "phase": "backward", "piece": p_, "tp": 2, "rows": 1, "s": s}
        for p_, s in (("sp-dx", 0.3), ("sp-dw", 0.12))
    ]
    p = Profile({"arch": "gpt2"}, {"backend": "gloo"}, split, [], [])
    assert p.compute_s("attn", "backward", "sp-dx", 2, 1) == 0.3
    assert p.compute_s("attn", "backward", "sp-dw", 2, 1) == 0.12


def test_the_simulator_prices_the_split_backward_as_the_whole_one():
    """In a simulated two-sub-batch overlap step with sequence parallelism each block region's
    "tp" and "dw" computes take what its whole TP backward takes (plus one more kernel
    launch), and the "dw" starts after the next gather, gb(i-1), was issued."""
    from oases.plan import ParallelPlan
    from oases.planner.batch import BatchShape
    from oases.planner.clusters import get_cluster
    from oases.planner.hardware import HardwareCosts
    from oases.planner.simulate import simulate_plan

    cfg = ModelConfig(arch="gpt2", n_layers=3, dim=1024, n_heads=16, vocab_size=50304, seq_len=1024)
    cluster = get_cluster("paper-3090-pcie-32")
    costs = HardwareCosts(cluster, cfg)
    plan = ParallelPlan.uniform(  # (shards: h_i is gathered again, "gh")
        cfg, 4, 4, schedule="overlap", n_sub=2, sequence_parallel="shards"
    )
    res = simulate_plan(cfg, plan, costs, 4, BatchShape(4, 4))
    compute = {(e.name, e.sub): e for e in res.timeline.events if e.lane == "compute"}
    comm = {(e.name, e.sub): e for e in res.timeline.events if e.lane == "comm"}
    dws = [key for key in compute if key[0].startswith("dw:")]
    assert len(dws) == 2 * 6
    for name, sub in dws:
        i = int(name.split(":")[1])
        kind = "attn" if i % 2 else "mlp"
        dw, tp = compute[name, sub], compute[f"tp:{i}", sub]
        whole = costs.compute_s(kind, "backward", "tp", 4, 2)  # 4 sequences, 2 sub-batches
        split = sum(costs.compute_s(kind, "backward", p, 4, 2) for p in ("sp-dx", "sp-dw"))
        took = (dw.end_s - dw.start_s) + (tp.end_s - tp.start_s)  # beside collectives: up
        assert split * (1 - 1e-9) <= took <= split * costs.contention("all_gather") * (1 + 1e-9)
        assert split >= whole * (1 - 1e-12)  # the same kernels, launched as two pieces
        # after the task that issues gb(i-1) (on the link it may queue behind gh(i-1), the
        # re-gather of h_{i-1} started with bwd(i): ``regather``)
        assert compute[f"norm:{i} epi:{i - 1}", sub].end_s <= dw.start_s
        assert i - 1 == 0 or (f"gh {i - 1}", sub) in comm  # (no embedding re-gather)


def test_bench_entries_take_several_options_and_the_inline_comparison():
    from oases.bench import parse_entry, split_entries

    assert split_entries("megatron,oases@sp=gathered,dw=off,oases@zero=1,precision=bf16,fsdp2") == [
        "megatron",
        "oases@sp=gathered,dw=off",
        "oases@zero=1,precision=bf16",
        "fsdp2",
    ]
    entry = parse_entry("oases@sp=gathered,dw=off")
    assert (entry.sp, entry.dw, entry.stem()) == ("gathered", "off", "oases_sp-gathered_dw-off")
    with pytest.raises(ValueError, match="dw=off"):
        parse_entry("oases@dw=on")
    inline = build_program("overlap", N_REGIONS, 2, sp="gathered", defer_weight_grads=False)
    assert not [
        ins
        for ins in inline
        if isinstance(ins, Compute) and any(kind == "dw" for kind, _ in ins.pieces)
    ]
