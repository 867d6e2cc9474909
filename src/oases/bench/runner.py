"""The per-rank side of ``oases bench``: every schedule in one launch, interleaved A B C A B C.

Run under torchrun (``python -m oases.bench.runner SPEC.json``). Measures, per schedule, the
median step time (forward + backward + data-parallel gradient sync, after warm-up; with
``with_optimizer`` also the clipping and the AdamW step, as ``oases train`` runs them), the peak
memory of a step, and for Oases-executor schedules without ZeRO the compute-only time (same
program, collectives skipped) and communication-only time (the program's collectives alone, on
buffers of the same sizes). An entry ``NAME@zero=Z`` runs schedule NAME on its own copy of the
model sharded at ZeRO stage Z (``oases.parallel.shard``); ``NAME@precision=P`` (or
``NAME@zero=Z,precision=P``) runs it at precision P (``oases.precision``: under bf16 autocast,
bf16 activations and TP collectives) instead of the run's ``train.precision``. Rank 0 writes
``raw.json``; with ``timeline`` set, also the timeline of one step of ``oases`` (at every
precision) and of every ZeRO entry, gathered from every rank.
"""

from __future__ import annotations

import copy
import json
import statistics
from pathlib import Path

import torch

from oases.bench import PEERS, draws_timeline, parse_entry, run_rank_spec
from oases.config import Config, load_config
from oases.memory import peak_memory_mb, reset_peak_memory
from oases.model import build_model
from oases.parallel import comm
from oases.parallel.apply import parallelize
from oases.parallel.context import ParallelContext, init_distributed
from oases.parallel.shard import shard_model
from oases.precision import Precision, resolve_precision
from oases.schedule import Schedule, build_schedule, record_timeline
from oases.schedule.instructions import Start, Wait, label
from oases.schedule.timeline import Timeline
from oases.timing import DeviceClock
from oases.train.optim import build_optimizer, clip_grad_norm_


def _timed(ctx: ParallelContext, fn) -> float:  # noqa: ANN001
    """Seconds of ``fn()`` on every rank, barrier to barrier, on the device's clock
    (``oases.timing``: CUDA events, read after the closing barrier's synchronize)."""
    clock = DeviceClock(ctx.device)
    comm.barrier(ctx.world_group)
    start = clock.now()
    fn()
    comm.barrier(ctx.world_group)
    end = clock.now()
    clock.resolve()
    return clock.elapsed_s(start, end)


def comm_only_step(
    schedule: Schedule,
    model: torch.nn.Module,
    rows: int,
    seq: int,
    ctx: ParallelContext,
    precision: Precision,
) -> None:
    """Issue exactly the program's collectives, in its order, on same-sized dummy buffers (in
    the dtypes ``precision`` moves them in)."""
    ex = schedule.executor(model)
    n_micro, k = schedule.split(rows)
    act = torch.zeros(
        rows // (n_micro * k), seq, model.cfg.dim, device=ctx.device, dtype=precision.compute_dtype
    )  # [b, S, H]
    dp_sizes = {i: sum(p.numel() for p in ps) for i, ps in ex.buckets.items()}
    glue = sum(p.numel() for p in getattr(ex, "_sp_glue_params", ()))
    handles = {}
    for ins in schedule.program(model, rows):
        if isinstance(ins, Start):
            key = ins.kind, ins.index, ins.sub
            if ins.kind == "dp":
                buf = torch.zeros(
                    dp_sizes[ins.index], device=ctx.device, dtype=precision.grad_reduce_dtype
                )
                handles[key] = comm.all_reduce_async(buf, ctx.dp_group)
            elif ins.kind == "sg":  # sequence parallelism: the glue's gradients
                handles[key] = comm.all_reduce_async(
                    torch.zeros(glue, device=ctx.device), ctx.tp_group
                )
            elif ins.kind in ("gf", "gb", "gr", "gh"):  # sequence parallelism: gathers
                handles[key] = comm.seq_gather_async(
                    comm.seq_slice(act, ctx.tp_group), ctx.tp_group
                )
            elif ex.sp is not None:  # "fwd"/"bwd" reduce-scatter along the sequence
                handles[key] = comm.seq_reduce_scatter_async(
                    act.clone(), ctx.tp_group, consume=True
                )
            else:
                handles[key] = comm.all_reduce_async(act.clone(), ctx.tp_group)
        elif isinstance(ins, Wait):
            handles.pop((ins.kind, ins.index, ins.sub)).wait()


def measure_link_ratio(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    ctx: ParallelContext,
    n_sub: int,
    repeats: int = 3,
) -> dict:
    """Forward compute of one TP region (median over attention and MLP regions, compute-only
    megatron step) and one blocking all-reduce of that region's output, here and now."""
    sched = build_schedule("megatron")
    ex = sched.executor(model)
    ex.skip_comm = True
    fwd: list[float] = []
    for _ in range(repeats):
        with record_timeline() as tl:
            _timed(ctx, lambda: sched.step(model, tokens, targets))
        blocks = {f"body:{i}" for i in range(1, len(ex.chain) - 1)}  # not embedding, not head
        fwd += [
            e.end_s - e.start_s
            for e in tl.events
            if e.phase == "forward" and blocks & set(e.name.split())
        ]
    ex.skip_comm = False
    model.zero_grad(set_to_none=True)
    act = torch.zeros(*tokens.shape, model.cfg.dim, device=ctx.device)  # [B, S, H]
    ar = [_timed(ctx, lambda: comm.all_reduce_(act, ctx.tp_group)) for _ in range(repeats + 1)]
    region_s, ar_s = statistics.median(fwd), statistics.median(ar[1:])
    return {
        "region_forward_s": region_s,
        "allreduce_s": ar_s,
        "allreduce_bytes": act.numel() * act.element_size(),
        "comm_to_compute": ar_s / region_s,
    }


def fit_allreduce(ctx: ParallelContext, rows: int, seq: int, dim: int) -> dict:
    """All-reduce time over the TP group as latency + bytes / bandwidth, fitted on the full and
    the half micro-batch activation (the sizes the schedules issue)."""
    points = []
    for r in (rows, max(1, rows // 2)):
        buf = torch.zeros(r, seq, dim, device=ctx.device)  # [b, S, H]
        t = [_timed(ctx, lambda buf=buf: comm.all_reduce_(buf, ctx.tp_group)) for _ in range(4)]
        points.append((buf.numel() * buf.element_size(), statistics.median(t[1:])))
    (b1, t1), (b2, t2) = points
    per_byte = (t1 - t2) / (b1 - b2) if b1 != b2 else t1 / b1
    return {
        "latency_s": max(0.0, t1 - per_byte * b1),
        "bandwidth_bytes_per_s": 1.0 / per_byte if per_byte > 0 else float("inf"),
        "points": points,
    }


def predict_step(
    sched: Schedule,
    model: torch.nn.Module,
    rows: int,
    seq: int,
    profile: Timeline,
    ar_fit: dict,
    precision: Precision,
) -> float:
    """The simulator's step time for this schedule: compute from this machine's measured
    compute-only timeline (median per instruction), collectives from the all-reduce fit, at
    the bytes ``precision`` moves."""
    from oases.planner.event_walk import StepCosts, simulate_program

    per: dict[tuple[str, str], list[float]] = {}
    for e in profile.events:
        if e.lane == "compute":
            per.setdefault((e.phase, e.name), []).append(e.end_s - e.start_s)
    med = {k: statistics.median(v) for k, v in per.items()}
    n_micro, k = sched.split(rows)
    act_elem = precision.compute_dtype.itemsize
    nbytes = rows // (n_micro * k) * seq * model.cfg.dim * act_elem

    ex = sched.executor(model)

    def collective_s(kind: str, index: int) -> float:
        if kind == "dp":
            size = sum(p.numel() for p in ex.buckets[index]) * precision.grad_reduce_dtype.itemsize
        elif kind == "sg":
            size = sum(p.numel() * p.element_size() for p in ex._sp_glue_params)
        elif ex.sp is not None:  # a gather or a reduce-scatter: half an all-reduce's traffic
            size = nbytes / 2
        else:
            size = nbytes
        return ar_fit["latency_s"] + size / ar_fit["bandwidth_bytes_per_s"]

    costs = StepCosts(
        piece_s=lambda *a: 0.0,
        collective_s=collective_s,
        compute_s=lambda ins: med[ins.phase, label(ins)],
    )
    return simulate_program(sched.program(model, rows), costs).step_s


def fsdp2_rows(rows: int, tp: int, tp_rank: int) -> slice:
    """The rows of its TP group's batch that rank ``tp_rank`` feeds to the fsdp2 peer: the same
    global batch as every schedule, split over all ranks instead of over the DP groups."""
    if rows % tp:
        raise ValueError(
            f"fsdp2 splits each TP group's {rows} rows over its {tp} ranks: "
            f"train.micro_batch={rows} must divide by parallel.tp={tp}"
        )
    return slice(tp_rank * (rows // tp), (tp_rank + 1) * (rows // tp))


def run(spec: dict) -> None:
    cfg: Config = load_config(spec.get("config"), spec.get("overrides", ()))
    ctx = init_distributed(tp=cfg.parallel.tp, timeout_s=cfg.parallel.timeout_s)
    cfg.validate(ctx.world_size)
    torch.set_num_threads(max(1, int(spec.get("threads", 1))))
    torch.manual_seed(cfg.train.seed)
    base = build_model(cfg.model)
    names: list[str] = spec["schedules"]
    rows, seq = cfg.train.micro_batch, cfg.model.seq_len
    gen = torch.Generator().manual_seed(cfg.train.seed + ctx.dp_rank)
    tokens = torch.randint(0, cfg.model.vocab_size, (rows, seq), generator=gen).to(ctx.device)
    targets = torch.randint(0, cfg.model.vocab_size, (rows, seq), generator=gen).to(ctx.device)
    steps = {}  # name -> (model, schedule, this rank's tokens, targets)
    precisions = {
        e: resolve_precision(
            parse_entry(e).precision or cfg.train.precision,
            ctx.device,
            cfg.parallel.grad_reduce_dtype,
        )
        for e in names
    }
    for entry in [n for n in names if parse_entry(n).name == "torch-tp"]:
        from oases.bench.torch_tp import TorchTPSchedule, parallelize_torch_tp

        steps[entry] = (
            parallelize_torch_tp(copy.deepcopy(base), ctx),
            TorchTPSchedule(),
            tokens,
            targets,
        )
    for entry in [n for n in names if parse_entry(n).name == "fsdp2"]:
        # pure DP over the world: each rank of a TP group takes its share
        from oases.bench.fsdp2 import FSDP2Schedule, build_world_mesh, shard_fsdp2

        share = fsdp2_rows(rows, ctx.tp, ctx.tp_rank)
        steps[entry] = (
            shard_fsdp2(
                copy.deepcopy(base).to(ctx.device), build_world_mesh(ctx), precisions[entry]
            ),
            FSDP2Schedule(),
            tokens[share],
            targets[share],
        )
    with_opt = bool(spec.get("with_optimizer"))
    pristine = copy.deepcopy(base)
    model = parallelize(base, ctx)
    for entry in [n for n in names if parse_entry(n).name not in PEERS]:
        name, zero, _, _, dw = parse_entry(entry)
        own = zero or with_opt  # an optimizer per entry: each on its own model
        m = parallelize(copy.deepcopy(pristine), ctx) if own else model
        if zero:
            shard_model(m, zero)
        steps[entry] = (
            m,
            build_schedule(
                name,
                n_sub=cfg.schedule.n_sub,
                max_inflight=cfg.schedule.max_inflight,
                grad_reduce_dtype=precisions[entry].grad_reduce_dtype,
                sp=parse_entry(entry).sp_mode(),
                defer_weight_grads=dw != "off",
            ),
            tokens,
            targets,
        )
    optimizers = {}
    if with_opt:
        for entry, (m, *_) in steps.items():
            optimizers[entry] = build_optimizer(m, cfg.train)

    def train_step(entry: str) -> None:
        m, sched, x, y = steps[entry]
        with precisions[entry].autocast():
            sched.step(m, x, y)
        if entry not in optimizers:
            return
        if parse_entry(entry).name == "fsdp2":
            from oases.bench.fsdp2 import fsdp2_optimizer_step

            fsdp2_optimizer_step(m, optimizers[entry], 0, cfg.train)
            return
        if parse_entry(entry).name != "torch-tp":
            clip_grad_norm_(
                m.parameters(),
                cfg.train.grad_clip,
                ctx.tp_group,
                None,
                getattr(m, "zero_shards", None),
                ctx.world_group,
            )
        optimizers[entry].step()
        optimizers[entry].zero_grad(set_to_none=True)

    calib = measure_link_ratio(model, tokens, targets, ctx, cfg.schedule.n_sub)
    if spec.get("calibrate_only"):
        if ctx.rank == 0:
            Path(spec["out"]).mkdir(parents=True, exist_ok=True)
            (Path(spec["out"]) / "calibration.json").write_text(json.dumps(calib, indent=1))
        comm.barrier(ctx.world_group)  # nobody exits while a peer still talks
        return
    times: dict[str, list[float]] = {n: [] for n in names}
    mems: dict[str, float] = {}
    warmup, n_steps = int(spec.get("warmup", 2)), int(spec["steps"])
    for it in range(warmup + n_steps):
        for name in names:
            m = steps[name][0]
            if name not in optimizers:
                m.zero_grad(set_to_none=True)
            reset_peak_memory(ctx.device)
            dt = _timed(ctx, lambda name=name: train_step(name))
            if it >= warmup:
                times[name].append(dt)
                mems[name] = max(mems.get(name, 0.0), peak_memory_mb(ctx.device))

    compute_only: dict[str, float] = {}
    comm_only: dict[str, float] = {}
    predicted: dict[str, float] = {}
    ar_fit = fit_allreduce(ctx, rows, seq, cfg.model.dim)
    for name in [n for n in names if parse_entry(n).name not in PEERS and not parse_entry(n).zero]:
        m, sched, _, _ = steps[name]
        ex = sched.executor(m)
        ex.skip_comm = True
        precision = precisions[name]

        def step(
            m: torch.nn.Module = m, sched: Schedule = sched, precision: Precision = precision
        ) -> None:
            with precision.autocast():
                sched.step(m, tokens, targets)

        with record_timeline() as profile_tl:
            _timed(ctx, step)
        predicted[name] = predict_step(sched, m, rows, seq, profile_tl, ar_fit, precision)

        def comm_step(
            m: torch.nn.Module = m, sched: Schedule = sched, precision: Precision = precision
        ) -> None:
            comm_only_step(sched, m, rows, seq, ctx, precision)

        c = [_timed(ctx, step) for _ in range(1 + n_steps)]
        ex.skip_comm = False
        compute_only[name] = statistics.median(c[1:])
        o = [_timed(ctx, comm_step) for _ in range(1 + n_steps)]
        comm_only[name] = statistics.median(o[1:])

    merged = {}
    drawn = [n for n in names if parse_entry(n).name not in PEERS and draws_timeline(n)]
    for name in drawn if spec.get("timeline") else []:
        with record_timeline() as tl:
            _timed(ctx, lambda name=name: train_step(name))
        merged[name] = tl.gather(ctx.world_group)

    if ctx.rank == 0:
        out = Path(spec["out"])
        out.mkdir(parents=True, exist_ok=True)
        result = {
            "world_size": ctx.world_size,
            "tp": ctx.tp,
            "dp": ctx.dp,
            "rows": rows,
            "seq_len": seq,
            "tokens_per_step": rows * seq * ctx.dp,
            "times_s": times,
            "peak_mem_mb": mems,
            "compute_only_s": compute_only,
            "comm_only_s": comm_only,
            "calibration": calib,
            "predicted_s": predicted,
            "allreduce_fit": ar_fit,
        }
        (out / "raw.json").write_text(json.dumps(result, indent=1))
        for name, tl in merged.items():
            stem = parse_entry(name).stem()  # oases_zero3, oases_bf16
            tl.save_chrome_trace(out / f"{stem}_trace.json")
            tl.plot(
                out / f"{stem}_timeline.png",
                title=f"{name}, tp={ctx.tp}, dp={ctx.dp}, {spec.get('link_label', '')}",
            )
    comm.barrier(ctx.world_group)  # nobody exits while a peer still talks


if __name__ == "__main__":
    run_rank_spec(run)
