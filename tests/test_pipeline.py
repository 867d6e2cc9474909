"""Pipeline stages on real ranks: float64 parity with the single-device model, point-to-point
counts from the recording hook, recompute twins under dropout.

Parity (``EXACT64``): gpt2 (tied embeddings) and llama, 4 layers, pipeline schedules x inner
schedules, 4 micro-batches a step, 3 AdamW steps with clipping that triggers: every step's loss
and every parameter the stage holds after the steps equal the single-device model trained on
the whole batch. Layouts on 4 ranks: pp=4, pp=2 x tp=2, pp=2 x dp=2 (with ZeRO 1); on 2 ranks:
pp=2.

Each rank function builds its process groups once and runs many cases (process start
dominates); ranks use a short collective timeout so a mismatch fails in seconds.
"""

from __future__ import annotations

import collections
import copy
import re

import pytest
import torch

import oases
from distributed import run_ranks
from exactness import BITWISE, EXACT64, to64
from oases.config import TrainConfig
from oases.parallel.apply import parameter_degrees, shard_spec, shard_tensor
from oases.parallel.shard import materialized, shard_model
from oases.parallel.stage_model import tied_copy
from oases.plan import ParallelPlan, RegionPlan
from oases.schedule import build_schedule
from oases.train.optim import build_optimizer, clip_grad_norm_
from test_mixed_plans import layout_rows, region_of

S, VOCAB, N_LAYERS, STEPS, MAX_NORM, N_MICRO = 8, 101, 4, 3, 0.5, 4
TRAIN = TrainConfig(lr=1e-2, warmup_steps=0, weight_decay=0.1, grad_clip=MAX_NORM, steps=STEPS)
TIMEOUT_S = 20.0  # collectives inside the ranks: a mismatch fails fast


def _cfg(arch: str, dropout: float = 0.0) -> oases.ModelConfig:
    if arch == "gpt2":
        return oases.ModelConfig(
            arch="gpt2",
            n_layers=N_LAYERS,
            dim=32,
            n_heads=4,
            vocab_size=VOCAB,
            seq_len=S,
            tie_embeddings=True,
            dropout=dropout,
        )
    return oases.ModelConfig(
        arch="llama",
        n_layers=N_LAYERS,
        dim=32,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=VOCAB,
        seq_len=S,
        dropout=dropout,
    )


def _batches(batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [
        (
            torch.randint(0, VOCAB, (batch, S), generator=g),
            torch.randint(0, VOCAB, (batch, S), generator=g),
        )
        for _ in range(STEPS)
    ]


def _reference(base: torch.nn.Module, batches: list) -> tuple[list, dict]:
    """The single-device model on the whole batch: each step's loss, the weights after."""
    ref = copy.deepcopy(base)
    opt = build_optimizer(ref, TRAIN)
    losses = []
    for tokens, targets in batches:
        loss = ref(tokens, targets)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        assert norm > MAX_NORM  # the clipping is really in play
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses, {n: p.detach().clone() for n, p in ref.named_parameters()}


def _local(full: torch.Tensor, p: torch.nn.Parameter, tp_rank: int, tp: int) -> torch.Tensor:
    spec = shard_spec(p)
    return full if spec is None else shard_tensor(full, spec, tp_rank, tp)


def _train(model, ctx, name: str, batches: list, n_sub: int, sp: str | None = None) -> list:
    """STEPS steps of ``name`` on this rank's rows, clipped over every stage; the losses."""
    plan = model.parallel_plan
    tp = plan.tp_of("embed")
    rows = batches[0][0].shape[0] * tp // ctx.stage_size
    sched = build_schedule(name, n_sub=n_sub, micro_batch=rows // N_MICRO, sp=sp)
    opt = build_optimizer(model, TRAIN)
    tp_groups = {pid: ctx.groups_for(d)[0] for pid, d in parameter_degrees(model).items()}
    tied = tied_copy(model)
    losses = []
    for tokens, targets in batches:
        mine = [layout_rows(t, ctx.stage.rank, ctx.stage_size, tp) for t in (tokens, targets)]
        local = sched.step(model, *mine)
        clip_grad_norm_(
            model.parameters(),
            MAX_NORM,
            ctx.groups_for(tp)[0],
            tp_groups,
            getattr(model, "zero_shards", None),
            ctx.stage,
            ctx.pp_group,
            frozenset() if tied is None else frozenset({id(tied)}),
        )
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = local.detach().clone().reshape(1)
        oases.parallel.comm.all_reduce_(loss, ctx.groups_for(plan.tp_of("head"))[1])
        losses.append(loss[0] / ctx.dp)
    return losses


def _check(model, ctx, losses: list, want_losses: list, want_params: dict, where: str) -> None:
    for step, (got, want) in enumerate(zip(losses, want_losses)):
        torch.testing.assert_close(
            got, want, **EXACT64, msg=lambda m, s=step: f"{where} step {s} loss: {m}"
        )
    plan = model.parallel_plan
    names = [n for n, _ in model.named_parameters()]
    assert names, where
    with materialized(model):
        for n, p in model.named_parameters():
            tp = plan.tp_of(region_of(n))
            exp = _local(want_params[n], p, ctx.groups_for(tp)[0].rank, tp)
            torch.testing.assert_close(
                p.detach(), exp, **EXACT64, msg=lambda m, n=n: f"{where} {n}: {m}"
            )


def _rank_parity(
    rank: int,
    world: int,
    pp: int,
    tp: int,
    cases: list,
    zero: int = 0,
    sp: str | None = None,
    pp_outer: bool = True,
    degrees: tuple[int, ...] | None = None,
    pp_chunks: int = 1,
) -> dict:
    """Every (arch, pp_schedule, inner schedule) case against the reference; ``degrees``: a
    mixed plan's TP degree per region (``tp`` the embedding's); ``pp_chunks``: model chunks a
    stage (the interleaved order)."""
    ctx = oases.init_distributed(
        tp=tp, pp=pp, timeout_s=TIMEOUT_S, pp_outer=pp_outer, degrees=degrees or ()
    )
    dp = world // (pp * tp)
    n_sub = 2
    # (a mixed plan's lower degrees split each sub-batch's rows: two rows a sub-batch)
    batches = _batches(N_MICRO * n_sub * dp * (2 if degrees else 1))
    out = {}
    refs: dict = {}
    for arch, pp_schedule, name in cases:
        cfg = _cfg(arch)
        if arch not in refs:
            torch.manual_seed(0)
            base = to64(oases.build_model(cfg))
            refs[arch] = (base, *_reference(base, batches))
        base, want_losses, want_params = refs[arch]
        where = (
            f"{arch} pp={pp} tp={degrees or tp} dp={dp} {pp_schedule} {name} "
            f"zero={zero} sp={sp} pp_outer={pp_outer} v={pp_chunks} rank {rank}"
        )
        plan = ParallelPlan.uniform(
            cfg, world, tp, pp=pp, pp_schedule=pp_schedule, pp_chunks=pp_chunks
        )
        if degrees is not None:
            plan.regions = [
                RegionPlan(r.name, t, world // (pp * t)) for r, t in zip(plan.regions, degrees)
            ]
        model = oases.parallelize(copy.deepcopy(base), ctx, plan)
        if zero:
            shard_model(model, zero)
        losses = _train(model, ctx, name, batches, n_sub, sp)
        _check(model, ctx, losses, want_losses, want_params, where)
        out[where] = [float(x) for x in losses]
    return out


def _spawn(tmp_path, fn, world: int, *args, timeout_s: float = 600.0) -> list:
    return run_ranks(
        fn, world, tmp_path, *args, timeout_s=timeout_s, collective_timeout_s=TIMEOUT_S
    )


# gpt2 (tied) and llama x gpipe and 1f1b x megatron and oases; 1f1b-pair with oases; zb-h1
# (its W passes: every block's weight gradients deferred) with megatron on gpt2, oases on llama
CASES = (
    [
        (arch, order, name)
        for arch in ("gpt2", "llama")
        for order in ("gpipe", "1f1b")
        for name in ("megatron", "oases")
    ]
    + [(a, "1f1b-pair", "oases") for a in ("gpt2", "llama")]
    + [("gpt2", "zb-h1", "megatron"), ("llama", "zb-h1", "oases")]
)


@pytest.mark.exact
def test_pp2_equals_the_single_device_model(tmp_path):
    _spawn(tmp_path, _rank_parity, 2, 2, 1, CASES)


@pytest.mark.exact
def test_pp4_equals_the_single_device_model(tmp_path):
    _spawn(tmp_path, _rank_parity, 4, 4, 1, CASES)


@pytest.mark.exact
def test_pp2_tp2_equals_the_single_device_model(tmp_path):
    """pp=2 x tp=2, and once with the stages' ranks interleaved (``pp_outer=False``)."""
    _spawn(tmp_path, _rank_parity, 4, 2, 2, CASES)


@pytest.mark.exact
def test_pp2_dp2_zero1_and_sequence_parallel(tmp_path):
    """pp=2 x dp=2 with ZeRO 1; pp=2 x tp=2 with sequence parallelism; pp=2 x tp=2 laid out
    with the pipeline innermost; pp=2 with mixed TP degrees inside each stage."""
    cases = [
        ("gpt2", "1f1b", "megatron"),
        ("gpt2", "1f1b", "oases"),
        ("llama", "1f1b-pair", "oases"),
        ("llama", "zb-h1", "overlap"),
    ]
    _spawn(tmp_path, _rank_more, 4, cases)


@pytest.mark.exact
def test_pp2_dp2_zero2(tmp_path):
    """pp=2 x dp=2 with ZeRO 2 (each micro-batch's gradients reduce-scattered into the shards
    as its backward ends, every pipeline order; llama: GPT-2's tied embedding needs its full
    gradient once a step, refused at stage 2 with one line)."""
    cases = [
        ("llama", "gpipe", "megatron"),
        ("llama", "1f1b", "oases"),
        ("llama", "1f1b-pair", "oases"),
        ("llama", "zb-h1", "overlap"),
    ]
    _spawn(tmp_path, _rank_parity, 4, 2, 1, cases, 2)


# mixed degrees inside both stages of pp=2 on 4 ranks (the boundary at region 5: tp=2 both sides)
MIXED = (2, 1, 2, 2, 2, 2, 1, 1, 2, 2)


def _rank_more(rank: int, world: int, cases: list) -> dict:
    out = _rank_parity(rank, world, 2, 1, cases, zero=1)
    out.update(_rank_parity(rank, world, 2, 2, cases, sp="shards"))
    out.update(_rank_parity(rank, world, 2, 2, cases[1:2], pp_outer=False))
    out.update(_rank_parity(rank, world, 2, 2, cases[:2], degrees=MIXED))
    return out


# ------------------------------------------------------------------ counts and recompute twins


def _tag_counts(records, op: str) -> collections.Counter:
    """{(kind, index, sub): how many ``op`` records carry the tag "kind:index:sub"}."""
    out: collections.Counter = collections.Counter()
    for r in records:
        m = re.fullmatch(r"(\w+):(\d+):(\d+)", r.tag)
        if r.op == op and m:
            out[m[1], int(m[2]), int(m[3])] += 1
    return out


def _rank_counts(rank: int, world: int) -> dict:
    """pp=2 x tp=2, one step: per boundary and sub-batch exactly one send and one receive each
    way (with their bytes and peer); the communication-free recompute repeats no TP
    all-reduce inside a stage, the block recompute repeats both of each block; dropout's
    recompute twins equal bit for bit."""
    ctx = oases.init_distributed(tp=2, pp=2, timeout_s=TIMEOUT_S)
    cfg = _cfg("gpt2")
    torch.manual_seed(0)
    base = to64(oases.build_model(cfg))
    tokens, targets = _batches(8)[0]
    plan = ParallelPlan.uniform(cfg, world, 2, pp=2)
    lo, hi = plan.stage_layout().bounds(ctx.pp_rank)
    b = plan.stage_layout().starts[0]
    n_sub, subs = 2, 8  # 4 micro-batches of 2 sub-batches
    bytes_ = 1 * S * cfg.dim * 8  # [1 row, S, H] float64 per sub-batch
    for name, fwd_per_block in (("oases", 2), ("megatron-recompute", 4), ("overlap", 2)):
        model = oases.parallelize(copy.deepcopy(base), ctx, plan)
        sched = build_schedule(name, n_sub=n_sub, micro_batch=2)
        with oases.record_collectives() as log:
            sched.step(model, tokens, targets)
        k = subs if name != "megatron-recompute" else 4
        sends, recvs = _tag_counts(log, "send"), _tag_counts(log, "recv")
        if ctx.pp_rank == 0:
            assert sends == {("sf", b, j): 1 for j in range(k)}, (name, sends)
            assert recvs == {("rb", b, j): 1 for j in range(k)}, (name, recvs)
        else:
            assert sends == {("sb", b, j): 1 for j in range(k)}, (name, sends)
            assert recvs == {("rf", b, j): 1 for j in range(k)}, (name, recvs)
        rows = 2 // (k // 4)
        for r in log:
            if r.op in ("send", "recv"):
                assert r.nbytes == bytes_ * rows and r.group_size == 2, r
                assert r.peer == (ctx.next_rank if ctx.pp_rank == 0 else ctx.prev_rank), r
        fwd = _tag_counts(log, "all_reduce")
        for i in range(lo, hi):
            if i in (0, 2 * N_LAYERS + 1):
                continue
            for j in range(k):
                assert fwd[("fwd", i, j)] == fwd_per_block // 2, (name, i, j, fwd)
    # recompute twins under dropout: the same masks, bit for bit
    cfg_d = _cfg("gpt2", dropout=0.1)
    torch.manual_seed(0)
    base_d = to64(oases.build_model(cfg_d))
    plan_d = ParallelPlan.uniform(cfg_d, world, 2, pp=2)
    out = {}
    for twin, names in (
        ("megatron", ("megatron-recompute", "commfree-recompute")),
        ("overlap", ("oases", "overlap-recompute")),
    ):
        got = {}
        for name in (twin, *names):
            model = oases.parallelize(copy.deepcopy(base_d), ctx, plan_d)
            torch.manual_seed(7)
            loss = build_schedule(name, n_sub=2, micro_batch=2).step(model, tokens, targets)
            got[name] = (loss, {n: p.grad.clone() for n, p in model.named_parameters()})
        for name in names:
            torch.testing.assert_close(got[name][0], got[twin][0], **BITWISE)
            for n, g in got[twin][1].items():
                torch.testing.assert_close(
                    got[name][1][n], g, **BITWISE, msg=lambda m, n=n, x=name: f"{x} {n}: {m}"
                )
        out[twin] = float(got[twin][0])
    return out


def test_pp2_tp2_point_to_point_counts_and_recompute_twins(tmp_path):
    _spawn(tmp_path, _rank_counts, 4)


# ------------------------------------------------------------------------- oases train, CLI


@pytest.mark.slow
@pytest.mark.exact
def test_cli_train_pp2_equals_one_rank(tmp_path):
    """``oases train --parallel.pp=2`` on 2 ranks (float64): every step's loss, the gradient
    norm and the validation losses equal a one-rank run's in this process; the loss line, the
    metrics and checkpoints come out (the sample is skipped with a line); resumed from its
    step-3 checkpoint it repeats steps 4-6 exactly."""
    import io
    import json
    import shutil

    from oases.config import load_config
    from oases.train.loop import train
    from test_train_cli import TINY, _run_cli

    run_dir = tmp_path / "run"
    args = [
        "--nproc-per-node",
        "2",
        f"--train.run_dir={run_dir}",
        "--train.precision=fp64",
        "--parallel.tp=1",
        "--parallel.pp=2",
        "--schedule.name=oases",
        "--train.micro_batch=1",
        "--schedule.n_sub=1",
        "--parallel.pp_schedule=1f1b-pair",
    ]
    proc, _ = _run_cli([str(TINY), *args], 240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pp=2 (stage 0)" in proc.stdout and "no sample at the end" in proc.stderr
    ref = train(
        load_config(
            TINY,
            [
                f"--train.run_dir={tmp_path / 'one'}",
                "--parallel.tp=1",
                "--train.precision=fp64",
                "--train.sample_tokens=0",
                "--checkpoint.resume=never",
            ],
        ),
        log=io.StringIO(),
    )
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in lines if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 7))
    torch.testing.assert_close([r["loss"] for r in rows], ref["losses"], **EXACT64)
    torch.testing.assert_close([r["grad_norm"] for r in rows], ref["grad_norms"], **EXACT64)
    evals = [r["val_loss"] for r in lines if "val_loss" in r]
    torch.testing.assert_close(evals[-1], ref["val_loss"], **EXACT64)
    # resumed from its step-3 checkpoint at pp=2, the run repeats steps 4-6 exactly
    again = tmp_path / "again"
    shutil.copytree(run_dir, again)
    shutil.rmtree(again / "checkpoints" / "step_000006")
    proc, _ = _run_cli(
        [
            str(TINY),
            "--nproc-per-node",
            "2",
            f"--train.run_dir={again}",
            *args[3:],
            "--train.sample_tokens=0",
        ],
        240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resumed from" in proc.stdout and "at step 3" in proc.stdout
    resumed = [json.loads(x) for x in (again / "metrics.jsonl").read_text().splitlines()]
    resumed = [r["loss"] for r in resumed if "loss" in r]
    torch.testing.assert_close(resumed, [r["loss"] for r in rows], **EXACT64)


@pytest.mark.slow
@pytest.mark.exact
def test_cli_resume_pp2_tp2_at_pp1_and_at_pp4(tmp_path):
    """Issue 28 item 5: a pp=2 x tp=2 run's step-3 checkpoint (4 ranks, float64) resumes at
    pp=1 x tp=2 (2 ranks) and at pp=4 x tp=1 (4 ranks); steps 4-6 equal the uninterrupted run's
    (losses, gradient norms, the validation loss), and the resume line names what changed."""
    import json
    import shutil

    from test_train_cli import TINY, _run_cli

    common = [
        str(TINY),
        "--train.precision=fp64",
        "--model.n_layers=4",
        "--schedule.name=oases",
        "--schedule.n_sub=1",
        "--train.micro_batch=1",
        "--train.sample_tokens=0",
    ]
    run_dir = tmp_path / "pp2"
    proc, _ = _run_cli(
        [
            *common,
            "--nproc-per-node",
            "4",
            "--parallel.tp=2",
            "--parallel.pp=2",
            f"--train.run_dir={run_dir}",
        ],
        300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "layout:    4 ranks = pp=2 (1f1b) x tp=2 x dp=1" in proc.stdout, proc.stdout

    def rows(path):
        lines = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]
        return (
            [(r["step"], r["loss"], r["grad_norm"]) for r in lines if "loss" in r],
            [r["val_loss"] for r in lines if "val_loss" in r],
        )

    want, want_val = rows(run_dir)
    for name, ranks, layout, said in (
        ("pp1", 2, ["--parallel.tp=2", "--parallel.pp=1"], "pp 2 -> 1"),
        ("pp4", 4, ["--parallel.tp=1", "--parallel.pp=4"], "pp 2 -> 4"),
    ):
        again = tmp_path / name
        shutil.copytree(run_dir, again)
        shutil.rmtree(again / "checkpoints" / "step_000006")
        proc, _ = _run_cli(
            [*common, "--nproc-per-node", str(ranks), *layout, f"--train.run_dir={again}"], 300
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "saved at pp=2 x tp=2 on 4 ranks" in proc.stdout and said in proc.stdout, proc.stdout
        got, got_val = rows(again)
        assert [r[0] for r in got] == list(range(1, 7))
        torch.testing.assert_close([r[1:] for r in got[3:]], [r[1:] for r in want[3:]], **EXACT64)
        torch.testing.assert_close(got_val[-1], want_val[-1], **EXACT64)


@pytest.mark.slow
def test_cli_train_pp_errors_are_one_line(tmp_path):
    """What a pipeline does not run yet fails before training, with the numbers."""
    from test_train_cli import TINY, _run_cli

    for extra, want in (
        (["--parallel.zero=3"], "ZeRO stage 2 at most"),
        (
            ["--parallel.zero=2", "--model.tie_embeddings=true"],
            "runs the embedding and head at ZeRO stage 1 at most (got 2)",
        ),
        (["--model.n_layers=1"], "model.n_layers=1 blocks do not fill"),
        (["--parallel.pp_schedule=interleaved"], "needs parallel.pp_chunks >= 2 model chunks"),
        (
            ["--parallel.pp_schedule=interleaved", "--parallel.pp_chunks=2"],
            "blocks do not divide into parallel.pp=2 x parallel.pp_chunks=2 = 4 model chunks",
        ),
    ):
        proc, _ = _run_cli(
            [
                str(TINY),
                "--nproc-per-node",
                "2",
                "--parallel.tp=1",
                "--parallel.pp=2",
                f"--train.run_dir={tmp_path / 'x'}",
                *extra,
            ],
            120,
        )
        assert proc.returncode != 0 and want in proc.stdout + proc.stderr, (extra, proc.stderr)


# ---------------------------------------------------------------------------------- bf16


def _rank_bf16(rank: int, world: int) -> dict:
    """pp=2 under bf16 autocast (fp32 weights): activations and their gradients cross the
    boundary in bf16 (half the bytes), the loss is within 1e-2 of the single-device model's
    under the same autocast and each stage's gradients point its way (cosine > 0.999), as
    ``tests/test_bf16.py`` bounds it."""
    from oases.precision import resolve_precision

    bf16 = resolve_precision("bf16", torch.device("cpu"))
    ctx = oases.init_distributed(tp=1, pp=2, timeout_s=TIMEOUT_S)
    tokens, targets = _batches(4)[0]
    out = {}
    for arch in ("gpt2", "llama"):
        cfg = _cfg(arch)
        torch.manual_seed(0)
        ref = oases.build_model(cfg)
        model = oases.parallelize(
            copy.deepcopy(ref),
            ctx,
            ParallelPlan.uniform(cfg, world, 1, pp=2, pp_schedule="1f1b-pair"),
        )
        with bf16.autocast():
            want = ref(tokens, targets)
        want.backward()
        with oases.record_collectives() as log, bf16.autocast():
            got = build_schedule("oases", n_sub=1, micro_batch=1).step(model, tokens, targets)
        p2p = [r for r in log if r.op in ("send", "recv")]
        assert p2p and all(r.dtype == "torch.bfloat16" and r.nbytes == S * 32 * 2 for r in p2p), (
            p2p[:2]
        )
        torch.testing.assert_close(got.float(), want.float().detach(), rtol=1e-2, atol=0)
        ref_grads = dict(ref.named_parameters())
        if ctx.pp_rank == 1 and cfg.tie_embeddings:  # the tied copy: its sum with stage 0's
            assert model.embed.weight.grad is not None
        a = torch.cat([p.grad.flatten() for _, p in model.named_parameters()])
        b = torch.cat([ref_grads[n].grad.flatten() for n, _ in model.named_parameters()])
        cosine = float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))
        assert cosine > 0.999, (arch, rank, cosine)
        out[arch] = cosine
    return out


def test_pp2_bf16_within_the_single_device_model_bounds(tmp_path):
    _spawn(tmp_path, _rank_bf16, 2)
