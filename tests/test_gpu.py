"""The CUDA path (skipped without a GPU; ``benchmarks/gpu/run.sh`` runs it).

One process: every schedule against the single-device model in fp32 and, under the same bf16
autocast, in bf16; the device clock (events, no sync before ``resolve``); a timeline; no host
sync in a step of any schedule (``torch.cuda.set_sync_debug_mode``); the memory terms. On 2+
GPUs, NCCL ranks: every schedule at tp=2 and under a mixed plan against the single-device model
(float64: NCCL reduces float64), recompute under dropout against its twin, bf16 against the
single-device model, a timeline whose communication lane is not empty, and the profile's
collectives timed to their end (times that grow with size).

Tolerances: float64 as tests/exactness.py (1e-10). bf16 keeps 8 significant bits (eps 2^-8 =
3.9e-3); splitting a batch into sub-batches changes the row blocking of the matmuls, so an
activation may round one bf16 step apart and the difference travels through the layers: the
loss within 2% and each gradient's difference within 5% of its norm (a wrong scale, a missing
all-reduce or a lost sub-batch moves them by >= 50%).
"""

import copy
import warnings

import pytest
import torch

import oases
from distributed import run_ranks
from exactness import EXACT64, to64
from oases.memory import device_baseline_bytes, peak_memory_mb, peak_reserved_mb
from oases.parallel import comm
from oases.schedule import SCHEDULES, record_timeline
from oases.timing import DeviceClock

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 GPUs (NCCL ranks)",
)

BF16_LOSS = {"atol": 0.0, "rtol": 2e-2}
BF16_GRAD = 5e-2  # |g - g_ref| <= 5% |g_ref| per tensor


def _setup():
    ctx = oases.init_distributed(tp=1)  # a single process: no process group, CUDA device
    cfg = oases.ModelConfig(
        arch="llama", dim=64, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=101, seq_len=32
    )
    torch.manual_seed(0)
    ref = oases.build_model(cfg).cuda()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 101, (4, 32), generator=g).cuda()
    targets = torch.randint(0, 101, (4, 32), generator=g).cuda()
    return ctx, ref, tokens, targets


def _assert_bf16_grads(model, ref, where: str) -> None:
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        err = float((p.grad - q.grad).norm())
        assert err <= BF16_GRAD * float(q.grad.norm()) + 1e-6, f"{where}: {n}: {err}"


def test_every_schedule_equals_the_single_device_model_on_cuda():
    ctx, ref, tokens, targets = _setup()
    expected = ref(tokens, targets)
    expected.backward()
    for name in SCHEDULES:
        model = oases.parallelize(copy.deepcopy(ref), ctx)
        model.zero_grad(set_to_none=True)
        loss = oases.build_schedule(name, n_sub=2).step(model, tokens, targets)
        torch.testing.assert_close(loss, expected.detach(), atol=1e-4, rtol=1e-4)
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=n)


def test_bf16_autocast_step_runs_and_keeps_fp32_master_weights():
    ctx, ref, tokens, targets = _setup()
    model = oases.parallelize(ref, ctx)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = oases.build_schedule("oases", n_sub=2).step(model, tokens, targets)
    assert torch.isfinite(loss)
    for p in model.parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32


def test_bf16_every_schedule_against_the_single_device_model_under_autocast():
    ctx, ref, tokens, targets = _setup()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected = ref(tokens, targets)
    expected.backward()
    for name in SCHEDULES:
        model = oases.parallelize(copy.deepcopy(ref), ctx)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = oases.build_schedule(name, n_sub=2).step(model, tokens, targets)
        torch.testing.assert_close(loss.float(), expected.detach().float(), **BF16_LOSS)
        _assert_bf16_grads(model, ref, f"bf16 {name}")


def test_device_clock_uses_events_without_a_sync():
    clock = DeviceClock(torch.device("cuda", torch.cuda.current_device()))
    small, big = torch.randn(256, 256, device="cuda"), torch.randn(4096, 4096, device="cuda")
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call raises
    try:
        a = clock.now()
        small @ small
        b = clock.now()
        big @ big
        c = clock.now()
        d = clock.after(comm.Handle(big, None))  # a finished collective's end: on the side stream
    finally:
        torch.cuda.set_sync_debug_mode("default")
    clock.resolve()
    assert 0.0 <= clock.elapsed_s(a, b) < clock.elapsed_s(b, c)
    assert clock.seconds(a) <= clock.seconds(b) <= clock.seconds(c) <= clock.seconds(d)
    assert clock.time_s(lambda: big @ big) > 0.0


def test_timeline_on_cuda_is_ordered():
    ctx, ref, tokens, targets = _setup()
    model = oases.parallelize(ref, ctx)
    sched = oases.build_schedule("oases", n_sub=2)
    sched.step(model, tokens, targets)  # warm-up
    with record_timeline() as tl:
        sched.step(model, tokens, targets)
    compute = sorted((e for e in tl.events if e.lane == "compute"), key=lambda e: e.start_s)
    assert compute and all(e.end_s >= e.start_s for e in compute)
    assert all(a.end_s <= b.start_s + 1e-6 for a, b in zip(compute, compute[1:]))


def test_no_host_sync_in_a_step_of_every_schedule():
    ctx, ref, tokens, targets = _setup()
    for name in SCHEDULES:
        model = oases.parallelize(copy.deepcopy(ref), ctx)
        sched = oases.build_schedule(name, n_sub=2)
        sched.step(model, tokens, targets)  # warm-up: first-use allocations and handles
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a synchronizing call's warning fails the test
            torch.cuda.set_sync_debug_mode("warn")
            try:
                sched.step(model, tokens, targets)
            finally:
                torch.cuda.set_sync_debug_mode("default")


def test_memory_terms_on_cuda():
    ctx, ref, tokens, targets = _setup()
    oases.build_schedule("oases", n_sub=2).step(oases.parallelize(ref, ctx), tokens, targets)
    dev = ctx.device
    assert device_baseline_bytes(dev) > 0  # the CUDA context at least
    assert peak_reserved_mb(dev) >= peak_memory_mb(dev) > 0


# ------------------------------------------------------------------------ NCCL (2+ GPUs)


def _rank_nccl(rank, world_size):
    from oases.bench.profile_collectives import measure_collectives
    from test_mixed_plans import layout_rows, region_of
    from test_mixed_schedules import TWINS, _batches, _cfg, _expected, _global_mean, _plan

    ctx0 = oases.init_distributed(tp=1, degrees=(2,))
    assert ctx0.backend == "nccl" and ctx0.device == torch.device("cuda", rank)
    dev = ctx0.device
    out = {}
    cases = [("gpt2", (2, 2, 2, 2, 2, 2)), ("llama", (2, 2, 1, 2, 1, 1))]  # uniform, mixed
    for arch, degrees in cases:
        cfg = _cfg(arch, degrees)
        plan = _plan(cfg, degrees, world_size)
        t_embed = plan.tp_of("embed")
        tokens, targets = (t.to(dev) for t in _batches(1)[0])
        torch.manual_seed(0)
        ref = to64(oases.build_model(cfg)).to(dev)
        expected = ref(tokens, targets)
        expected.backward()
        full = dict(ref.named_parameters())
        for name in SCHEDULES:
            where = f"nccl {arch} {degrees} rank {rank} {name}"
            model = oases.parallelize(copy.deepcopy(ref), ctx0, plan)
            model.zero_grad(set_to_none=True)
            local = oases.build_schedule(name, n_sub=2).step(
                model,
                layout_rows(tokens, rank, world_size, t_embed),
                layout_rows(targets, rank, world_size, t_embed),
            )
            torch.testing.assert_close(
                _global_mean(local, world_size),
                expected.detach(),
                **EXACT64,
                msg=lambda m, w=where: f"{w}: {m}",
            )
            for n, p in model.named_parameters():
                want = _expected(full[n].grad, p, rank, plan.tp_of(region_of(n)))
                torch.testing.assert_close(
                    p.grad, want, **EXACT64, msg=lambda m, w=where, n=n: f"{w} {n}: {m}"
                )
        # dropout: each recompute schedule against its twin (the masks come back from the
        # CUDA RNG state the forward kept)
        cfg_d = _cfg(arch, degrees, dropout=0.1)
        torch.manual_seed(2)
        base = to64(oases.build_model(cfg_d)).to(dev)
        runs = {}
        for name in ("megatron", "overlap", *TWINS):
            model = oases.parallelize(copy.deepcopy(base), ctx0, plan).train()
            torch.manual_seed(1234)
            loss = oases.build_schedule(name, n_sub=2).step(
                model,
                layout_rows(tokens, rank, world_size, t_embed),
                layout_rows(targets, rank, world_size, t_embed),
            )
            runs[name] = (loss, {n: p.grad.clone() for n, p in model.named_parameters()})
        for name, twin in TWINS.items():
            torch.testing.assert_close(runs[name][0], runs[twin][0], **EXACT64)
            for n, g in runs[twin][1].items():
                torch.testing.assert_close(
                    runs[name][1][n], g, **EXACT64, msg=f"dropout {arch} {name} vs {twin} {n}"
                )
        out[arch] = float(_global_mean(runs["oases"][0], world_size))
    # bf16 at tp=2 against the single-device model under the same autocast
    cfg = _cfg("llama", (2,) * 6)
    plan = _plan(cfg, (2,) * 6, world_size)
    tokens, targets = (t.to(dev) for t in _batches(3)[0])
    torch.manual_seed(3)
    ref = oases.build_model(cfg).to(dev)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected = ref(tokens, targets)
    expected.backward()
    model = oases.parallelize(copy.deepcopy(ref), ctx0, plan)
    model.zero_grad(set_to_none=True)
    sched = oases.build_schedule("oases", n_sub=2)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = sched.step(model, tokens, targets)
    torch.testing.assert_close(loss.float(), expected.detach().float(), **BF16_LOSS)
    full = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        want = _expected(full[n].grad, p, rank, 2)
        err = float((p.grad - want).norm())
        assert err <= BF16_GRAD * float(want.norm()) + 1e-6, f"bf16 nccl {n}: {err}"
    # a timeline under NCCL: the communication lane has the collectives, ended on the device
    with record_timeline() as tl:
        sched.step(model, tokens, targets)
    comm_events = [e for e in tl.events if e.lane == "comm"]
    assert comm_events and all(e.end_s >= e.start_s for e in tl.events)
    # the profile's collectives, timed to their end: times grow with size (and the fit holds)
    rows = measure_collectives(ctx0, 2, [2**16, 2**20, 2**24], repeats=3)
    for op in {e["op"] for e in rows}:
        s = sorted((e["nbytes"], e["s"]) for e in rows if e["op"] == op)
        assert s[-1][1] > s[0][1], f"{op}: {s}"
    out["comm_events"] = len(comm_events)
    return out


@two_gpus
def test_nccl_schedules_mixed_plan_dropout_bf16_timeline_and_profile(tmp_path):
    results = run_ranks(_rank_nccl, 2, tmp_path, backend="nccl", timeout_s=150)
    assert results[0] == results[1]
