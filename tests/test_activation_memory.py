"""Issue 32: the backward's re-gather of h_i under sequence parallelism ("gh", regather.py) as
instructions of the programs, and the per-tensor activation count (planner.activation_terms).
The executor's measured bytes against the count: test_sequence_parallel (multi-rank)."""

from __future__ import annotations

import pytest

from oases.config import ModelConfig
from oases.planner.activation_terms import block_terms, korthikanti_block_bytes, region_terms
from oases.schedule.instructions import Compute, Start, Wait
from oases.schedule.program import build_program

R = 6  # embedding, 2 blocks, head


def _position(program: list, ins: object) -> int:
    return program.index(ins)


@pytest.mark.parametrize("name", ["overlap", "megatron", "megatron-sp"])
def test_schedules_without_recompute_gather_h_again_before_each_block_region_backward(name):
    k = 2 if name == "overlap" else 1
    program = build_program(name, R, 2, sp="shards")
    for j in range(k):
        for i in range(1, R - 1):
            start = _position(program, Start("gh", i, j))
            wait = _position(program, Wait("gh", i, j))
            tp = next(
                n
                for n, ins in enumerate(program)
                if isinstance(ins, Compute) and ins.sub == j and ("tp", i) in ins.pieces
            )
            assert start < wait < tp
            if name == "overlap":  # flies with bwd(i+1), under the next tasks
                assert program[start - 1] == Start("bwd", i + 1, j)
                assert any(isinstance(ins, Compute) for ins in program[start:wait])
            else:  # a synchronous program overlaps nothing
                assert (wait, tp) == (start + 1, start + 2)
    assert not [
        ins
        for ins in program
        if isinstance(ins, Start) and ins.kind == "gh" and not 0 < ins.index < R - 1
    ]


@pytest.mark.parametrize(
    "name", ["oases", "commfree-recompute", "megatron-recompute", "overlap-recompute", "merak"]
)
def test_recompute_schedules_and_plain_programs_gather_nothing_again(name):
    for sp in ("gathered", "shards", None):
        program = build_program(name, R, 2, sp=sp)
        assert not [ins for ins in program if isinstance(ins, Start) and ins.kind == "gh"]
    for name in ("overlap", "megatron", "megatron-sp"):  # off, or keeping the gathered h_i
        for sp in (None, "gathered"):
            program = build_program(name, R, 2, sp=sp)
            assert not [ins for ins in program if isinstance(ins, Start) and ins.kind == "gh"]


@pytest.mark.parametrize("pp_schedule", ["1f1b", "1f1b-pair", "zb-h1", "gpipe"])
@pytest.mark.parametrize("name", ["megatron", "overlap"])
def test_pipeline_stages_gather_h_again_before_each_block_region_backward(name, pp_schedule):
    """Issue 32 (e): a stage's program under sp="shards" re-gathers each of its block regions'
    h_i once per sub-batch, started before it is waited, waited right before [tp i]; none
    for the other stages' regions, none under "gathered"."""
    from oases.schedule.pipeline_program import build_stage_program
    from oases.stages import StageLayout, default_stage_starts

    n_layers, pp, n_micro = 4, 2, 3
    n = 2 * n_layers + 2
    layout = StageLayout(n, default_stage_starts(n_layers, pp))
    k = 2 if name == "overlap" else 1
    for s in range(pp):
        lo, hi = layout.bounds(s)
        prog = build_stage_program(
            name, 2, layout, s, n_micro=n_micro, pp_schedule=pp_schedule, sp="shards"
        )
        starts = [ins for ins in prog if isinstance(ins, Start) and ins.kind == "gh"]
        want = {(i, j) for i in range(max(lo, 1), min(hi, n - 1)) for j in range(n_micro * k)}
        assert sorted((ins.index, ins.sub) for ins in starts) == sorted(want), s
        for i, j in want:
            start, wait = prog.index(Start("gh", i, j)), prog.index(Wait("gh", i, j))
            tp = next(
                n
                for n, ins in enumerate(prog)
                if isinstance(ins, Compute) and ins.sub == j and ("tp", i) in ins.pieces
            )
            assert start < wait == tp - 1, (s, i, j)
        plain = build_stage_program(
            name, 2, layout, s, n_micro=n_micro, pp_schedule=pp_schedule, sp="gathered"
        )
        assert not [ins for ins in plain if isinstance(ins, Start) and ins.kind == "gh"]


def test_korthikanti_counts_of_a_block():
    tokens, dim = 2048 * 4, 1024
    sbh = tokens * dim
    for t in (1, 2, 4, 8):  # 16-bit: sbh(10 + 24/t) and sbh(34/t)
        assert korthikanti_block_bytes(tokens, dim, t, False) == sbh * 10 + sbh * 24 // t
        assert korthikanti_block_bytes(tokens, dim, t, True) == sbh * 34 // t


def test_our_terms_split_by_sequence_parallelism_as_megatron_keeps_them():
    """With sp every term is 1/t of the replicated one; without it only the norms' inputs,
    outputs, statistics and masks stay whole (GPT-2's is the paper's block with the norms'
    statistics and logsumexp on top)."""
    for arch in ("gpt2", "llama"):
        cfg = ModelConfig(
            arch=arch, n_layers=2, dim=64, n_heads=4, vocab_size=256, seq_len=256, dropout=0.1
        )
        one = block_terms(cfg, 2, 1, False, 4)
        for t in (2, 4):
            plain, sp = block_terms(cfg, 2, t, False, 4), block_terms(cfg, 2, t, True, 4)
            for name, value in one.items():
                if name == "rope tables":  # per module, not per token
                    assert plain[name] == sp[name] == value
                    continue
                assert sp[name] == value // t, (arch, name)
                whole = name in ("x (norm input)", "norm stats", "h (norm output)", "mask")
                assert plain[name] == (value if whole else value // t), (arch, name)
    gpt2 = ModelConfig(
        arch="gpt2", n_layers=2, dim=64, n_heads=4, vocab_size=256, seq_len=256, dropout=0.1
    )
    n, h = 2 * 256, 64
    for t in (1, 2, 4):
        for sp in (False, True):
            ours = sum(block_terms(gpt2, 2, t, sp, 2, mask_bytes=1).values())
            # LayerNorm's mean and rstd, flash attention's logsumexp (2-byte elements)
            stats = (2 * 2 * n * 2 // (t if sp else 1)) + n * 4 * 2 // t
            assert ours - stats == korthikanti_block_bytes(n, h, t, sp), (t, sp)
    with pytest.raises(ValueError, match="must be attn or mlp"):
        region_terms(gpt2, "head", 2, 2, False, 4)


def _rank_seq_scatter(rank: int, world: int) -> list:
    import torch

    from oases.memory import peak_live_bytes
    from oases.parallel import comm
    from oases.parallel.context import init_distributed

    ctx = init_distributed(tp=world, timeout_s=60.0)
    out = []
    for rows in (1, 3):
        full = [
            torch.randn(
                rows, 8 * world, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(r)
            )
            for r in range(world)
        ]
        want = sum(full).chunk(world, dim=1)[rank]
        t = full[rank].clone()
        nbytes = t.untyped_storage().nbytes()
        with peak_live_bytes(ctx.device) as peak:
            handle = comm.seq_reduce_scatter_async(t, ctx.tp_group, consume=True)
            del t
            got = handle.wait()
        out.append((rows, (got - want).abs().max().item(), peak["peak"], nbytes))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_sequence_reduce_scatter_sums_and_holds_no_full_copy(spawn_ranks, world):
    """Issue 32 (c): gloo's sequence reduce-scatter (the other ranks' chunks only, one
    all-to-all) equals the sum's slice in float64 and allocates at most (2n - 1)/n of its
    input (NCCL's: 1 + 1/n; the path before: 2 + 1/n), one row or several."""
    for res in spawn_ranks(_rank_seq_scatter, world, timeout_s=120):
        for rows, err, peak, nbytes in res:
            assert err < 1e-12, (rows, err)
            assert peak <= (2 * world - 1) * nbytes // world, (rows, peak, nbytes)


def _rank_released(rank: int, world: int) -> list:
    import torch

    from oases.parallel import comm
    from oases.parallel.context import init_distributed

    ctx = init_distributed(tp=world, timeout_s=60.0)
    counts = []
    for _ in range(20):
        x = torch.randn(3, 4, 5, dtype=torch.float64)
        comm.seq_gather_async(x, ctx.tp_group).wait()
        t = torch.randn(3, 4 * world, 5, dtype=torch.float64)
        comm.all_reduce_async(t, ctx.tp_group).wait()
        counts.append((x._use_count(), t._use_count()))
    return counts


def test_gloo_collectives_let_go_of_their_buffers_by_the_wait(spawn_ranks):
    """After a gloo collective's wait, gloo's worker thread holds none of the tensors it was
    given (``comm.core._until_released``): their last references die on the caller's
    thread, whose frees the CPU profiler behind ``peak_live_bytes`` records."""
    for res in spawn_ranks(_rank_released, 2, timeout_s=120):
        assert set(res) == {(1, 1)}, res
