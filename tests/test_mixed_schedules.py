"""Schedules under mixed-degree plans: every region at its own TP degree, reshard instructions
between them, gradients reduced per region; equal to the single-device model.

Numbers in float64 (1e-10) and once in fp32 within the bound derived from its reductions;
recompute twins bit for bit (tests/exactness.py).

Chain of R = 6 regions (2 layers): 0 embed, 1/2 block 0's attention/MLP, 3/4 block 1's, 5 head.
Each spawn runs many cases inside one rank function (starting processes is the expensive part).
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.distributed as dist

import oases
from exactness import BITWISE, EXACT64, fp32_tol, to64
from oases import record_collectives
from oases.parallel.apply import shard_spec, shard_tensor
from oases.plan import ParallelPlan, RegionPlan, region_names
from oases.schedule import SCHEDULES, build_schedule
from oases.schedule.instructions import Compute, Start, Wait
from oases.schedule.program import build_program
from oases.schedule.specs import SPECS, sub_batches
from test_mixed_plans import layout_rows, region_of

B, S, VOCAB = 8, 16, 101
TWINS = {
    "megatron-recompute": "megatron",
    "commfree-recompute": "megatron",
    "overlap-recompute": "overlap",
    "oases": "overlap",
}
STEPS = 3


def _cfg(arch: str, degrees: tuple[int, ...], dropout: float = 0.0) -> oases.ModelConfig:
    if arch == "gpt2":  # tied embeddings: embed and head share a degree
        return oases.ModelConfig(
            arch="gpt2",
            n_layers=2,
            dim=32,
            n_heads=4,
            vocab_size=VOCAB,
            seq_len=S,
            tie_embeddings=True,
            dropout=dropout,
        )
    heads = 8 if max(degrees) > 2 else 4  # grouped-query: fewer kv heads, split over every tp
    return oases.ModelConfig(
        arch="llama",
        n_layers=2,
        dim=32,
        n_heads=heads,
        n_kv_heads=heads // 2,
        vocab_size=VOCAB,
        seq_len=S,
        dropout=dropout,
    )


def _plan(cfg: oases.ModelConfig, degrees: tuple[int, ...], world: int) -> ParallelPlan:
    return ParallelPlan([RegionPlan(n, t, world // t) for n, t in zip(region_names(cfg), degrees)])


def _batches(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, VOCAB, (B, S), generator=g), torch.randint(0, VOCAB, (B, S), generator=g))
        for _ in range(STEPS)
    ]


def _global_mean(local: torch.Tensor, world: int) -> torch.Tensor:
    """Every head TP group appears tp_head times among the ranks: the mean over ranks."""
    out = local.detach().clone()
    dist.all_reduce(out)
    return out / world


def _expected(full: torch.Tensor, param: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    spec = shard_spec(param)
    return full if spec is None else shard_tensor(full, spec, rank % tp, tp)


def _expected_issues(sched, model, rows: int) -> list[str]:
    """The program's Starts that move data, in order: fwd/bwd over TP groups of size > 1,
    reshards in their gathering direction, DP means per group of size > 1."""
    ex = sched.executor(model)
    out = []
    for ins in sched.program(model, rows):
        if not isinstance(ins, Start):
            continue
        tag = f"{ins.kind}:{ins.index}:{ins.sub}"
        if ins.kind in ("fwd", "bwd"):
            out += [tag] if ex.degrees[ins.index] > 1 else []
        elif ins.kind in ("rsf", "rsb"):
            a, b = ex.degrees[ins.index - 1], ex.degrees[ins.index]
            out += [tag] if (b > a) == (ins.kind == "rsf") else []
        else:
            out += [tag for group, _ in ex.bucket_groups[ins.index] if group.size > 1]
    return out


def _rank_mixed(rank: int, world: int, cases: list, all_degrees: tuple[int, ...]) -> dict:
    """Every schedule on every (arch, degrees) case, in float64: loss and gradients of 3 AdamW
    steps and the weights after them equal the single-device model's; the collectives issued are
    the program's, in its order; a communication-free recompute issues exactly its twin's
    collectives. Then the first case once in fp32 (oases, one backward, the derived bound)."""
    ctx = oases.init_distributed(tp=1, degrees=all_degrees)
    out = {}
    for arch, degrees in cases:
        cfg = _cfg(arch, degrees)
        plan = _plan(cfg, degrees, world)
        torch.manual_seed(0)
        ref = to64(oases.build_model(cfg))
        base = copy.deepcopy(ref)
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        batches = _batches(1)
        want = []  # per step: loss, grads
        for tokens, targets in batches:
            loss = ref(tokens, targets)
            loss.backward()
            want.append((loss.detach(), {n: p.grad.clone() for n, p in ref.named_parameters()}))
            opt_ref.step()
            opt_ref.zero_grad()
        t_embed = plan.tp_of("embed")
        issued_by = {}
        for name in SCHEDULES:
            where = f"{arch} {degrees} rank {rank} {name}"
            model = oases.parallelize(copy.deepcopy(base), ctx, plan)
            sched = build_schedule(name, n_sub=2)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            losses = []
            for step, (tokens, targets) in enumerate(batches):
                with record_collectives() as records:
                    local = sched.step(
                        model,
                        layout_rows(tokens, rank, world, t_embed),
                        layout_rows(targets, rank, world, t_embed),
                    )
                loss = _global_mean(local, world)
                torch.testing.assert_close(
                    loss,
                    want[step][0],
                    **EXACT64,
                    msg=lambda m, w=where, s=step: f"{w} step {s}: {m}",
                )
                for n, p in model.named_parameters():
                    exp = _expected(want[step][1][n], p, rank, plan.tp_of(region_of(n)))
                    torch.testing.assert_close(
                        p.grad, exp, **EXACT64, msg=lambda m, w=where, n=n: f"{w} grad {n}: {m}"
                    )
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.item())
            for n, p in model.named_parameters():  # float64: the bound holds through AdamW
                exp = _expected(
                    dict(ref.named_parameters())[n].detach(), p, rank, plan.tp_of(region_of(n))
                )
                torch.testing.assert_close(
                    p.detach(), exp, **EXACT64, msg=lambda m, w=where, n=n: f"{w} param {n}: {m}"
                )
            rows = B * t_embed // world
            issued = [
                r.tag for r in records if r.tag.split(":")[0] in ("fwd", "bwd", "rsf", "rsb", "dp")
            ]
            assert issued == _expected_issues(sched, model, rows), where
            assert all(
                r.direction == ("forward" if r.tag.startswith(("fwd", "rsf")) else "backward")
                for r in records
                if r.tag.startswith(("fwd", "bwd", "rsf", "rsb"))
            ), where
            issued_by[name] = collections.Counter((r.op, r.group, r.tag) for r in records)
            out[arch, degrees, name] = losses
        for name in ("commfree-recompute", "oases"):  # the recompute repeats no collective
            assert issued_by[name] == issued_by[TWINS[name]], (arch, degrees, name)
        if t_embed > min(degrees):  # a sub-batch of one row cannot be sliced further
            with pytest.raises(ValueError, match="no whole share"):
                build_schedule("oases", n_sub=2).step(model, tokens[:2], targets[:2])
    _check_fp32(rank, world, ctx, *cases[0])
    return out


def _check_fp32(rank: int, world: int, ctx, arch: str, degrees: tuple[int, ...]) -> None:
    """fp32, the mixed schedules' one case: oases under a mixed plan, loss and gradients of one
    backward against the single-device model within the bound derived from their reductions."""
    cfg = _cfg(arch, degrees)
    plan = _plan(cfg, degrees, world)
    torch.manual_seed(0)
    ref = oases.build_model(cfg)
    model = oases.parallelize(copy.deepcopy(ref), ctx, plan)
    tokens, targets = _batches(1)[0]
    want = ref(tokens, targets)
    want.backward()
    t_embed = plan.tp_of("embed")
    local = build_schedule("oases", n_sub=2).step(
        model, layout_rows(tokens, rank, world, t_embed), layout_rows(targets, rank, world, t_embed)
    )
    assert local.dtype == torch.float32
    n = tokens.numel()
    where = f"fp32 {arch} {degrees} rank {rank} oases"
    torch.testing.assert_close(
        _global_mean(local, world), want.detach(), **fp32_tol(want, cfg, n, False), msg=where
    )
    full = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        exp = _expected(full[name].grad, p, rank, plan.tp_of(region_of(name)))
        torch.testing.assert_close(
            p.grad,
            exp,
            **fp32_tol(exp, cfg, n, True),
            msg=lambda m, n=name: f"{where} grad {n}: {m}",
        )


def _rank_dropout_twins(rank: int, world: int, cases: list, all_degrees: tuple[int, ...]) -> dict:
    """Dropout 0.1: each recompute schedule equals its twin bit for bit under a mixed plan."""
    ctx = oases.init_distributed(tp=1, degrees=all_degrees)
    out = {}
    for arch, degrees in cases:
        cfg = _cfg(arch, degrees, dropout=0.1)
        plan = _plan(cfg, degrees, world)
        torch.manual_seed(2)
        base = oases.build_model(cfg)
        tokens, targets = _batches(3)[0]
        t_embed = plan.tp_of("embed")
        runs = {}
        for name in ("megatron", "overlap", *TWINS):
            model = oases.parallelize(copy.deepcopy(base), ctx, plan).train()
            torch.manual_seed(1234)  # the same masks for every schedule
            loss = build_schedule(name, n_sub=2).step(
                model,
                layout_rows(tokens, rank, world, t_embed),
                layout_rows(targets, rank, world, t_embed),
            )
            runs[name] = (loss, {n: p.grad.clone() for n, p in model.named_parameters()})
        for name, twin in TWINS.items():
            where = f"{arch} {degrees} rank {rank} {name} vs {twin}"
            torch.testing.assert_close(runs[name][0], runs[twin][0], **BITWISE, msg=where)
            for n, g in runs[twin][1].items():
                torch.testing.assert_close(
                    runs[name][1][n], g, **BITWISE, msg=lambda m, w=where, n=n: f"{w} grad {n}: {m}"
                )
        ref = copy.deepcopy(base).eval()  # control: dropout is really in play
        out[arch, degrees] = (runs["megatron"][0].item(), ref(tokens, targets).item())
    return out


# ------------------------------------------------------------------------------------- tests

# 2 ranks: tp=1 x dp=2 and tp=2 x dp=1; changes at the embedding, inside a block, at a
# block's start and at the head (gpt2); inside both blocks and at the head, targets resharded
# from tp=2 to tp=1 (llama)
CASES_2 = [("gpt2", (1, 2, 1, 2, 2, 1)), ("llama", (2, 2, 1, 1, 2, 1))]
CASES_4 = [("gpt2", (2, 4, 1, 2, 4, 2)), ("llama", (1, 2, 4, 4, 2, 4))]


@pytest.mark.exact
def test_mixed_plans_every_schedule_two_ranks(spawn_ranks):
    results = spawn_ranks(_rank_mixed, 2, CASES_2, (1, 2))
    assert results[0] == results[1]


@pytest.mark.exact
def test_mixed_plans_every_schedule_four_ranks(spawn_ranks):
    results = spawn_ranks(_rank_mixed, 4, CASES_4, (1, 2, 4), timeout_s=180)
    assert all(r == results[0] for r in results)


@pytest.mark.exact
def test_recompute_equals_its_twin_under_dropout_mixed(spawn_ranks):
    results = spawn_ranks(_rank_dropout_twins, 2, CASES_2, (1, 2))
    for r in results:
        for case, (train, evaluated) in r.items():
            assert train != evaluated, case


# ----------------------------------------------------------------------- programs (no ranks)

PROGRAM_CASES = [(1, 2, 1, 2, 2, 1), (2, 2, 1, 1, 2, 1), (2, 4, 1, 2, 4, 2), (1, 1, 1, 1, 1, 2)]


def _key(ins: Start | Wait) -> tuple:
    return (ins.kind, ins.index, ins.sub)


@pytest.mark.parametrize("degrees", PROGRAM_CASES)
@pytest.mark.parametrize("name", SCHEDULES)
def test_reshards_sit_exactly_where_the_degree_changes(name, degrees):
    R = len(degrees)
    changes = {i for i in range(1, R) if degrees[i] != degrees[i - 1]}
    for n_micro in (1, 2):
        program = build_program(
            name, R, 2, n_micro=n_micro, degrees=degrees, dp_tasks=tuple(range(R))
        )
        k = sub_batches(name, 2)
        subs = range(n_micro * k)
        starts = collections.Counter(_key(i) for i in program if isinstance(i, Start))
        waits = collections.Counter(_key(i) for i in program if isinstance(i, Wait))
        assert starts == waits
        # once per sub-batch, plus the repeat of a block recompute's change inside the block
        repeat = 2 if SPECS[name].recompute == "block" else 1
        for i in range(R):
            for j in subs:
                inside_block = i in changes and i % 2 == 0 and 0 < i < R - 1
                want = (repeat if inside_block else 1) if i in changes else 0
                assert starts["rsf", i, j] == want, (i, j, starts["rsf", i, j])
                assert starts["rsb", i, j] == (1 if i in changes else 0), (i, j)
        # the split tasks: epi i-1 alone produces x_i, norm i alone produces dx_i
        waited: set[tuple] = set()
        for ins in program:
            if isinstance(ins, Wait):
                waited.add(_key(ins))
            if not isinstance(ins, Compute):
                continue
            for kind, i in ins.pieces:
                if ins.phase != "backward" and kind == "body" and i in changes:
                    assert ins.pieces == (("body", i),)
                    # a block recompute repeats the rsf inside the block, not at its start
                    if ins.phase == "forward" or (repeat == 2 and i % 2 == 0):
                        assert ("rsf", i, ins.sub) in waited
                        waited.discard(("rsf", i, ins.sub))
                if ins.phase == "backward" and kind == "epi" and i + 1 in changes:
                    assert ins.pieces == (("epi", i), ("tp", i))
                    assert ("rsb", i + 1, ins.sub) in waited
                if ins.phase == "backward" and kind == "norm" and i in changes:
                    assert ins.pieces == (("norm", i),)
        # every piece still runs once per sub-batch and phase
        for j in subs:
            fwd = sorted(
                pc
                for c in program
                if isinstance(c, Compute) and c.sub == j and c.phase == "forward"
                for pc in c.pieces
            )
            assert fwd == sorted(
                [("body", i) for i in range(R)] + [("epi", i) for i in range(R - 1)]
            )


@pytest.mark.parametrize("degrees", PROGRAM_CASES)
@pytest.mark.parametrize("name", ("commfree-recompute", "oases"))
def test_commfree_recompute_starts_no_collective_at_a_degree_change(name, degrees):
    """No Start follows a recompute Compute before the next Compute, and once the backward has
    begun no forward collective (fwd, rsf) starts; across a change the segment is the body."""
    R = len(degrees)
    changes = {i for i in range(1, R) if degrees[i] != degrees[i - 1]}
    program = build_program(name, R, 2, degrees=degrees, dp_tasks=tuple(range(R)))
    started_by_recompute = 0
    for p, ins in enumerate(program):
        if isinstance(ins, Compute) and ins.phase == "recompute":
            nxt = next(
                (q for q in range(p + 1, len(program)) if isinstance(program[q], Compute)),
                len(program),
            )
            started_by_recompute += sum(isinstance(c, Start) for c in program[p + 1 : nxt])
            (_, i), *_ = [pc for pc in ins.pieces if pc[0] == "body"]
            assert ins.pieces == (
                (("body", i),) if i in changes else (("epi", i - 1), ("body", i))
            ), ins
    assert started_by_recompute == 0
    first_bwd = min(
        p for p, c in enumerate(program) if isinstance(c, Compute) and c.phase != "forward"
    )
    assert not [c for c in program[first_bwd:] if isinstance(c, Start) and c.kind in ("fwd", "rsf")]


def test_degrees_must_fit_the_chain():
    with pytest.raises(ValueError, match="positive TP degree for each of the 6 regions"):
        build_program("oases", 6, 2, degrees=(1, 2))
