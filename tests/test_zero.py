"""ZeRO 1-3 (``parallel/shard.py``): sharded optimizer state, gradients and weights, equal to the
single-device model and to zero=0.

Parity (float64, ``EXACT64``): stages 0-3 x schedules megatron, megatron-recompute, oases x
layouts tp1 x dp2, tp1 x dp4 and tp2 x dp2, with 2 micro-batches of accumulation and clipping
that triggers: the loss of each of 3 AdamW steps and every parameter after them equal the
single-device model trained on the whole batch. The model has hidden size 34, so its norms'
34 elements do not divide by dp = 4 (a parameter split unevenly between shards, units padded).
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import oases
from exactness import EXACT64, to64
from oases.config import TrainConfig
from oases.parallel.apply import parameter_degrees, shard_spec, shard_tensor
from oases.parallel.shard import materialized, shard_model
from oases.plan import ParallelPlan, RegionPlan, region_names
from oases.schedule import build_schedule
from oases.schedule.dp_insert import ZeroLayout
from oases.schedule.instructions import Release, Start, Wait
from oases.schedule.program import build_program
from oases.train.checkpoint import read_full_tensors
from oases.train.optim import ZeroAdamW, build_optimizer, clip_grad_norm_
from test_mixed_plans import layout_rows, region_of
from test_train_loop import FP64, run, tiny_cfg, write_text

B, S, VOCAB, STEPS, MAX_NORM = 16, 8, 101, 3, 0.5
SCHEDULES = ("megatron", "megatron-recompute", "oases")
TRAIN = TrainConfig(lr=1e-2, warmup_steps=0, weight_decay=0.1, grad_clip=MAX_NORM, steps=STEPS)


def _cfg() -> oases.ModelConfig:
    return oases.ModelConfig(
        arch="gpt2", n_layers=2, dim=34, n_heads=2, vocab_size=VOCAB, seq_len=S, tie_embeddings=True
    )


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [
        (torch.randint(0, VOCAB, (B, S), generator=g), torch.randint(0, VOCAB, (B, S), generator=g))
        for _ in range(STEPS)
    ]


def _reference(base: torch.nn.Module, batches: list) -> tuple[list, dict, dict]:
    """The single-device model on the whole batch: losses, the first step's gradients (before
    clipping) and the weights after the steps."""
    ref = copy.deepcopy(base)
    opt = build_optimizer(ref, TRAIN)
    losses, grads = [], {}
    for tokens, targets in batches:
        loss = ref(tokens, targets)
        loss.backward()
        grads = grads or {n: p.grad.clone() for n, p in ref.named_parameters()}
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        assert norm > MAX_NORM  # the clipping is really in play
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses, grads, {n: p.detach().clone() for n, p in ref.named_parameters()}


def _local(full: torch.Tensor, p: torch.nn.Parameter, rank: int, tp: int) -> torch.Tensor:
    spec = shard_spec(p)
    return full if spec is None else shard_tensor(full, spec, rank % tp, tp)


def _check_grads(model, want: dict, rank: int, plan: ParallelPlan, where: str) -> None:
    """The first step's gradients: whole ``.grad`` of unsharded parameters, and each piece of a
    sharded one in this rank's gradient shard, against the reference's."""
    shards = getattr(model, "zero_shards", None)
    names = {id(p): n for n, p in model.named_parameters()}
    tp = {n: plan.tp_of(region_of(n)) for n in names.values()}
    for n, p in model.named_parameters():
        if shards is None or not shards.is_sharded(p):
            torch.testing.assert_close(
                p.grad,
                _local(want[n], p, rank, tp[n]),
                **EXACT64,
                msg=lambda m, n=n: f"{where} grad {n}: {m}",
            )
    for u in ({} if shards is None else shards.units).values():
        for seg in u.segments:
            n = names[id(seg.param)]
            exp = _local(want[n], seg.param, rank, tp[n]).reshape(-1)[seg.start : seg.stop]
            got = u.grad_shard[seg.offset : seg.offset + seg.size]
            torch.testing.assert_close(
                got, exp, **EXACT64, msg=lambda m, n=n: f"{where} grad shard {n}: {m}"
            )


def _train(
    model,
    ctx,
    name: str,
    batches: list,
    rank: int,
    world: int,
    plan: ParallelPlan,
    want_grads: dict,
    where: str,
    sp: str | None = None,
) -> list:
    tp = plan.tp_of("embed")  # the batch's layout
    rows = B * tp // world
    sched = build_schedule(name, n_sub=2, micro_batch=rows // 2, sp=sp)  # 2 micro-batches
    opt = build_optimizer(model, TRAIN)
    tp_groups = {pid: ctx.groups_for(d)[0] for pid, d in parameter_degrees(model).items()}
    losses = []
    for tokens, targets in batches:
        local = sched.step(
            model, layout_rows(tokens, rank, world, tp), layout_rows(targets, rank, world, tp)
        )
        if not losses:
            _check_grads(model, want_grads, rank, plan, where)
        clip_grad_norm_(
            model.parameters(),
            MAX_NORM,
            ctx.groups_for(tp)[0],
            tp_groups,
            getattr(model, "zero_shards", None),
            ctx.world_group,
        )
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = local.detach().clone()
        dist.all_reduce(loss)
        losses.append(loss / world)
    return losses


def _rank_parity(
    rank: int, world: int, layouts: list, stage_sets: list, sps: tuple = (None,)
) -> dict:
    """Every (degrees, schedule, stages) case against the reference; ``layouts`` holds one
    TP degree (uniform) or a degree per region (mixed), ``stage_sets`` one stage for every
    region or one per region; ``sps``: sequence parallelism's modes (None: off)."""
    cfg = _cfg()
    degrees = sorted({d for lay in layouts for d in ((lay,) if isinstance(lay, int) else lay)})
    ctx = oases.init_distributed(tp=1, degrees=tuple(degrees))
    torch.manual_seed(0)
    base = to64(oases.build_model(cfg))
    batches = _batches()
    want_losses, want_grads, want_params = _reference(base, batches)
    out = {}
    for lay in layouts:
        plan = (
            ParallelPlan.uniform(cfg, world, lay)
            if isinstance(lay, int)
            else ParallelPlan(
                [RegionPlan(n, t, world // t) for n, t in zip(region_names(cfg), lay)]
            )
        )
        for name, stages, sp in [(n, z, sp) for n in SCHEDULES for z in stage_sets for sp in sps]:
            where = f"degrees={lay} world={world} {name} zero={stages} sp={sp} rank {rank}"
            model = oases.parallelize(copy.deepcopy(base), ctx, plan)
            shard_model(model, stages)
            assert (stages == 0) != isinstance(build_optimizer(model, TRAIN), ZeroAdamW)
            losses = _train(model, ctx, name, batches, rank, world, plan, want_grads, where, sp)
            for step, (got, want) in enumerate(zip(losses, want_losses)):
                torch.testing.assert_close(
                    got, want, **EXACT64, msg=lambda m, w=where, s=step: f"{w} step {s}: {m}"
                )
            with materialized(model):
                for n, p in model.named_parameters():
                    exp = _local(want_params[n], p, rank, plan.tp_of(region_of(n)))
                    torch.testing.assert_close(
                        p.detach(), exp, **EXACT64, msg=lambda m, w=where, n=n: f"{w} {n}: {m}"
                    )
            out[where] = [x.item() for x in losses]
    return out


STAGES = [0, 1, 2, 3]
MIXED = (1, 2, 1, 2, 2, 1)  # 2 ranks: embed and head at tp=1 (dp=2), blocks at 2 and 1
PER_REGION = (3, 1, 2, 3, 0, 3)


@pytest.mark.exact
def test_zero_stages_equal_the_single_device_model_tp1_dp2(spawn_ranks):
    spawn_ranks(_rank_parity, 2, [1], STAGES)


@pytest.mark.exact
def test_zero_stages_equal_the_single_device_model_four_ranks(spawn_ranks):
    """tp1 x dp4 and tp2 x dp2."""
    spawn_ranks(_rank_parity, 4, [1, 2], STAGES, timeout_s=300)


@pytest.mark.exact
def test_zero_per_region_under_a_mixed_degree_plan(spawn_ranks):
    """Each region its own degree and its own stage (one region not sharded)."""
    spawn_ranks(_rank_parity, 2, [MIXED], [3, PER_REGION])


# ----------------------------------------------------------------------- programs (no ranks)

R = 6  # 2 layers: embed, 2 x (attn, mlp), head
TIED = ZeroLayout((3,) * R, tuple((i,) if i < R - 1 else (i, 0) for i in range(R)))


def _layout(stage: int, reshard: bool = True) -> ZeroLayout:
    return ZeroLayout((stage,) * R, TIED.uses, reshard)


@pytest.mark.parametrize("name", ["megatron", "megatron-recompute", "oases"])
@pytest.mark.parametrize("n_micro", [1, 2])
def test_stage3_every_compute_finds_its_weights_gathered(name, n_micro):
    """Walk the program: every compute reads only gathered regions; a gather is waited before
    use and started one compute earlier (prefetch); every gather is released by the end."""
    for reshard in (True, False):
        prog = build_program(name, R, 2, n_micro=n_micro, zero=_layout(3, reshard))
        started, gathered, computes_since_start = set(), set(), {}
        for ins in prog:
            if isinstance(ins, Start) and ins.kind == "ag":
                assert ins.index not in gathered
                started.add(ins.index)
                computes_since_start[ins.index] = 0
            elif isinstance(ins, Wait) and ins.kind == "ag":
                started.remove(ins.index)
                gathered.add(ins.index)
            elif isinstance(ins, Release):
                gathered.remove(ins.index)
            elif hasattr(ins, "pieces"):
                for u in computes_since_start:
                    computes_since_start[u] += 1
                for piece in ins.pieces:
                    assert set(TIED.units(piece, ins.phase)) <= gathered, (ins, gathered)
        assert not gathered and not started
        n_gathers = sum(isinstance(i, Start) and i.kind == "ag" for i in prog)
        if reshard:  # forward and backward gather separately (the head's two passes touch)
            assert n_gathers > R * n_micro
        else:
            assert n_gathers <= R * n_micro


@pytest.mark.parametrize("name", ["megatron", "megatron-recompute", "oases"])
@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_2_gather_the_updated_weights_under_the_first_forward(name, stage):
    """The previous step's updated shards: every region's all-gather starts at the program's
    head, in chain order, before any compute, and is waited right before the first forward
    compute reading it (no compute between), once per step; a program built without the head
    (``gather_updated=False``, a later micro-batch in the simulator) has none."""
    for n_micro in (1, 2):
        layout = _layout(stage)
        prog = build_program(name, R, 2, n_micro=n_micro, zero=layout)
        first_compute = next(p for p, i in enumerate(prog) if hasattr(i, "pieces"))
        starts = [i for i in prog if isinstance(i, Start) and i.kind == "ag"]
        assert [i.index for i in starts] == list(range(R))
        assert all(isinstance(i, Start) and i.kind == "ag" for i in prog[:R])
        for u in range(R):
            wait = prog.index(Wait("ag", u, 0))
            use = next(
                p
                for p, c in enumerate(prog)
                if hasattr(c, "pieces") and any(u in layout.units(pc, c.phase) for pc in c.pieces)
            )
            assert prog[use].phase == "forward" and prog[use].sub < 2
            assert wait < use and not any(hasattr(c, "pieces") for c in prog[wait:use])
            assert wait >= first_compute or u == 0
        later = build_program(
            name, R, 2, n_micro=n_micro, zero=replace(layout, gather_updated=False)
        )
        assert not any(isinstance(i, Start | Wait) and i.kind == "ag" for i in later)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradient_reduce_scatters_follow_their_last_backward(stage):
    """Each region's reduce-scatter starts right after the last backward compute reading its
    parameters (past that compute's own TP collective): in the last micro-batch at stage 1, in
    every micro-batch at 2-3; each is waited once, at most 2 are in flight."""
    n_micro = 2
    prog = build_program("oases", R, 2, n_micro=n_micro, zero=_layout(stage))
    starts = [(p, ins) for p, ins in enumerate(prog) if isinstance(ins, Start) and ins.kind == "rs"]
    micros = range(n_micro) if stage >= 2 else [n_micro - 1]
    assert sorted((i.index, i.sub) for _, i in starts) == sorted(
        (u, m) for u in range(R) for m in micros
    )
    for pos, ins in starts:
        last = max(
            p
            for p, c in enumerate(prog)
            if hasattr(c, "pieces")
            and c.phase == "backward"
            and c.sub // 2 == ins.sub
            and any(ins.index in _layout(stage).units(pc, "backward") for pc in c.pieces)
        )
        between = prog[last + 1 : pos]
        assert all(isinstance(b, Start | Wait | Release) for b in between), between
        assert not any(hasattr(b, "pieces") for b in between)
    inflight = 0
    for ins in prog:
        if isinstance(ins, Start) and ins.kind == "rs":
            inflight += 1
            assert inflight <= 2
        elif isinstance(ins, Wait) and ins.kind == "rs":
            inflight -= 1
    assert inflight == 0


def test_plan_files_carry_a_zero_stage_per_region():
    cfg = _cfg()
    plan = ParallelPlan.uniform(cfg, 2, 1)
    assert plan.zero_stages(2) == (2,) * len(plan.regions)
    text = plan.to_json()
    assert '"zero"' not in text  # absent: the run's parallel.zero
    raw = text.replace('"dp": 2\n', '"dp": 2, "zero": 3\n', 1)
    assert ParallelPlan.from_json(raw).zero_stages(1)[:2] == (3, 1)
    with pytest.raises(ValueError, match="zero=5 must be 0, 1, 2 or 3"):
        ParallelPlan.from_json(text.replace('"dp": 2\n', '"dp": 2, "zero": 5\n', 1))


def test_config_rejects_a_zero_stage_out_of_range():
    from oases.config import ParallelConfig

    with pytest.raises(ValueError, match="parallel.zero=4 must be 0, 1, 2 or 3"):
        ParallelConfig(zero=4)


# ------------------------------------------------------------------- checkpoints and resume


def _resume_rank(rank: int, world: int, root: str) -> dict:
    """zero=2 at tp=1 x dp=2 for 6 steps (checkpoints at 3 and 6); then from step 3 again at
    zero=3 (dp=2) and at zero=0 with tp=2 (dp=1)."""
    root = Path(root)
    step3 = root / "z2" / "checkpoints" / "step_000003"
    out = {
        "z2": run(
            tiny_cfg(
                root, "z2", "--parallel.tp=1", "--parallel.zero=2", FP64, "--checkpoint.every=3"
            )
        )
    }
    for name, *overrides in (
        ("z3", "--parallel.tp=1", "--parallel.zero=3"),
        ("z0-tp2", "--parallel.tp=2", "--parallel.zero=0"),
    ):
        out[name] = run(tiny_cfg(root, name, *overrides, FP64, f"--checkpoint.resume={step3}"))
    return out


@pytest.mark.exact
def test_a_zero2_checkpoint_resumes_at_zero3_and_at_zero0_tp2(spawn_ranks, tmp_path):
    write_text(tmp_path / "text.txt")
    r0, r1 = spawn_ranks(_resume_rank, 2, str(tmp_path), timeout_s=180)
    full = r0["z2"]
    assert full["end_step"] == 6 and len(full["losses"]) == 6
    for name in ("z3", "z0-tp2"):
        assert r0[name]["start_step"] == 3, name
        torch.testing.assert_close(
            r0[name]["losses"], full["losses"][3:], **EXACT64, msg=lambda m, n=name: f"{n}: {m}"
        )
    # the checkpoint holds whole tensors (an unsharded layout): the zero=2 run's step 6 equals
    # the run resumed at zero=0, tp=2
    a = read_full_tensors(tmp_path / "z2" / "checkpoints" / "step_000006")
    b = read_full_tensors(tmp_path / "z0-tp2" / "checkpoints" / "step_000006")
    assert a.keys() == b.keys()
    for k in a:
        if not k.startswith("rng."):
            torch.testing.assert_close(a[k], b[k], **EXACT64, msg=k)
    assert r1["z2"]["losses"] == full["losses"]


def _recorded_rank(rank: int, world: int, root: str) -> dict:
    """``oases train`` records the timeline of its second step: zero=0, 2 and 3 (tp=1, dp=2)
    for 4 steps, clipping off (Adam's first step hides a gradient's scale, the second not)."""
    root = Path(root)
    return {
        z: run(
            tiny_cfg(
                root,
                f"z{z}",
                "--parallel.tp=1",
                f"--parallel.zero={z}",
                FP64,
                "--train.steps=4",
                "--train.grad_clip=0",
            )
        )
        for z in (0, 2, 3)
    }


@pytest.mark.exact
def test_a_recorded_step_trains_like_any_other(spawn_ranks, tmp_path):
    """Recording a timeline must not change a step's numbers. It did: the watcher thread that
    timed gloo's future-less reduce-scatters called ``wait()`` on the same work as the executor,
    and the second step's ZeRO gradients came out wrong (grad norm 2.7-3.3 for 2.09)."""
    write_text(tmp_path / "text.txt")
    r0, _ = spawn_ranks(_recorded_rank, 2, str(tmp_path), timeout_s=180)
    assert (tmp_path / "z2" / "timeline.png").exists()  # step 2 was recorded
    for z in (2, 3):
        for key in ("losses", "grad_norms"):
            torch.testing.assert_close(
                r0[z][key],
                r0[0][key],
                **EXACT64,
                msg=lambda m, z=z, key=key: f"zero={z} {key}: {m}",
            )


# ------------------------------------------------------------------ collectives, as issued


def _bus_bytes(rec) -> float:
    """Bytes one rank sends in a ring: all-reduce 2 (d-1)/d n, reduce-scatter (d-1)/d n (n its
    input), all-gather (d-1) n (n its input, the shard)."""
    d = rec.group_size
    return {
        "all_reduce": 2 * (d - 1) / d * rec.nbytes,
        "reduce_scatter": (d - 1) / d * rec.nbytes,
        "all_gather": (d - 1) * rec.nbytes,
    }[rec.op]


def _rank_collectives(rank: int, world: int) -> dict:
    """One optimizer step (2 micro-batches, oases, tp=1 x dp=2) per stage: the collectives the
    DP group sees, and the executor's issue order against the program's."""
    from oases.parallel.comm import record_collectives

    ctx = oases.init_distributed(tp=1)
    cfg = _cfg()
    torch.manual_seed(0)
    base = to64(oases.build_model(cfg))
    tokens, targets = _batches()[0]
    out = {}
    for stage in (0, 1, 2, 3):
        model = oases.parallelize(copy.deepcopy(base), ctx)
        shards = shard_model(model, stage)
        sched = build_schedule("oases", n_sub=2, micro_batch=B // world // 2)
        opt = build_optimizer(model, TRAIN)
        x, y = layout_rows(tokens, rank, world, 1), layout_rows(targets, rank, world, 1)
        sched.step(model, x, y)
        opt.step()  # stages 1-2: the next step's program gathers the updated shards
        opt.zero_grad(set_to_none=True)
        with record_collectives() as records:
            sched.step(model, x, y)
        with record_collectives() as after:
            opt.step()
        assert not after, [r.tag for r in after]  # the optimizer step issues nothing
        program = [
            f"{i.kind}:{i.index}:{i.sub}"
            for i in sched.program(model, x.shape[0])
            if isinstance(i, Start) and i.kind in ("rs", "ag", "dp")
        ]
        issued = [r.tag for r in records if r.tag.split(":")[0] in ("rs", "ag", "dp")]
        assert issued == program, (stage, issued, program)
        by_op: dict = {}
        for r in [*records, *after]:
            if r.group == "dp":
                by_op[r.op] = by_op.get(r.op, 0.0) + _bus_bytes(r)
        padding = (
            0
            if shards is None
            else sum((u.flat.numel() - u.numel) * 8 for u in shards.units.values())
        )
        n_params = sum(p.numel() for p in model.parameters())
        out[stage] = {
            "bus": by_op,
            "padding": padding,
            "param_bytes": n_params * 8,
            "gathers": sum(t.startswith("ag:") for t in issued),
        }
    return out


def test_collectives_per_stage_from_the_recording_hook(spawn_ranks):
    """Stages 1-2 move what one all-reduce of the gradients moves (the previous step's updated
    weights' all-gather at the head, a reduce-scatter; up to the padding); stage 2
    reduce-scatters every micro-batch; stage 3 gathers the weights in every pass instead. (The
    second of two steps is recorded: the first has nothing to gather.)"""
    r0, _ = spawn_ranks(_rank_collectives, 2)
    n = r0[0]["param_bytes"]
    ar = r0[0]["bus"]["all_reduce"]
    assert ar == pytest.approx(n)  # d = 2: 2 (d-1)/d n = n
    for stage in (1, 2, 3):
        assert "all_reduce" not in r0[stage]["bus"], stage
    pad = r0[1]["padding"]
    one_rs = r0[1]["bus"]["reduce_scatter"]
    assert one_rs == pytest.approx((n + pad) / 2)  # once, in the last micro-batch
    assert one_rs + r0[1]["bus"]["all_gather"] == pytest.approx(ar + pad)
    assert r0[2]["bus"]["reduce_scatter"] == pytest.approx(2 * one_rs)  # every micro-batch
    assert r0[2]["bus"]["all_gather"] == pytest.approx(r0[1]["bus"]["all_gather"])
    gathers = r0[3]["gathers"]
    assert gathers > 2 * 6  # two micro-batches, forward and backward gathers
    assert r0[3]["bus"]["all_gather"] > r0[2]["bus"]["all_gather"] * 2


def test_bench_entries_name_a_zero_stage_and_a_precision():
    from oases.bench import parse_entry

    assert parse_entry("oases") == ("oases", 0, "", "", "")
    assert parse_entry("megatron@zero=2") == ("megatron", 2, "", "", "")
    assert parse_entry("oases@precision=bf16") == ("oases", 0, "bf16", "", "")
    assert parse_entry("oases@zero=1,precision=fp32") == ("oases", 1, "fp32", "", "")
    assert parse_entry("fsdp2@precision=bf16") == ("fsdp2", 0, "bf16", "", "")
    assert parse_entry("oases@sp=shards,zero=1").stem() == "oases_zero1_sp-shards"
    assert parse_entry("oases@zero=3,precision=bf16").stem() == "oases_zero3_bf16"
    for bad in (
        "oases@zero=4",
        "oases@tp=2",
        "fsdp2@zero=1",
        "oases@precision=fp16",
        "oases@zero=1,zero=2",
        "oases@",
        "@zero=1",
        "oases@sp=all",
        "fsdp2@sp=shards",
    ):
        with pytest.raises(ValueError, match=r"expected SCHEDULE\[@zero"):
            parse_entry(bad)


def test_zero_collectives_have_lanes_and_colours_of_their_own(tmp_path):
    """Reduce-scatters on the DP lane, weight gathers on a lane of their own, each in the
    legend; neither counts as a sub-batch or micro-batch of the compute."""
    from oases.schedule.timeline import Event, Timeline, lane_of

    events = [
        Event(0, "compute", "body:0", "forward", 0, 0.0, 1.0),
        Event(0, "compute", "body:0", "forward", 1, 1.0, 2.0),
        Event(0, "comm", "ag 1", "ag", 0, 0.5, 1.5),
        Event(0, "compute", "tp:0", "backward", 0, 2.0, 3.0),
        Event(0, "compute", "tp:0", "backward", 1, 3.0, 4.0),
        Event(0, "comm", "rs 0", "rs", 0, 4.0, 4.5),
    ]
    assert [lane_of(e) for e in events if e.lane == "comm"] == ["ZeRO gather", "DP comm"]
    tl = Timeline(events)
    assert tl.lanes() == ["compute", "DP comm", "ZeRO gather"]
    assert tl.sub_batches_per_micro_batch() == 2
    tl.plot(tmp_path / "t.png", title="zero")
    assert (tmp_path / "t.png").stat().st_size > 0


def _rank_state_bytes(rank: int, world: int) -> dict:
    """Model-state bytes per rank after one step, from the tensors, for stages 0-3."""
    from oases.train.optim import model_state_bytes

    ctx = oases.init_distributed(tp=1)
    cfg = _cfg()
    torch.manual_seed(0)
    base = oases.build_model(cfg)
    tokens, targets = _batches()[0]
    out = {}
    for stage in (0, 1, 2, 3):
        model = oases.parallelize(copy.deepcopy(base), ctx)
        shards = shard_model(model, stage)
        opt = build_optimizer(model, TRAIN)
        sched = build_schedule("oases", n_sub=2)
        sched.step(model, layout_rows(tokens, rank, world, 1), layout_rows(targets, rank, world, 1))
        opt.step()
        sched.step(model, layout_rows(tokens, rank, world, 1), layout_rows(targets, rank, world, 1))
        padded = (
            sum(p.numel() for p in model.parameters())
            if shards is None
            else sum(u.flat.numel() for u in shards.units.values())
        )
        out[stage] = (model_state_bytes(model, opt), padded)
    return out


def test_model_state_bytes_per_stage_follow_the_closed_form(spawn_ranks):
    """fp32, d = 2, P padded elements: stage 0 holds 4P weights, 4P gradients, 8P moments;
    1: 4P, 4P/2, 8P/2; 2: the same; 3: 4P/2, 4P/2, 8P/2."""
    r0, r1 = spawn_ranks(_rank_state_bytes, 2)
    for stage, (got, padded) in r0.items():
        n = 4 * padded
        want = {0: (n, n, 2 * n), 1: (n, n // 2, n), 2: (n, n // 2, n), 3: (n // 2, n // 2, n)}[
            stage
        ]
        assert (got["weights"], got["gradients"], got["optimizer"]) == want, (stage, got)
        assert r1[stage][0] == got  # every rank holds the same share
