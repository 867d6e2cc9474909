"""The per-rank side of ``oases profile``: measure this model's regions and this machine's
collectives, write a ``planner.profile.Profile`` (rank 0).

Run under torchrun (``python -m oases.bench.profile_runner SPEC.json``), all ranks together.
For every candidate TP degree t (powers of two dividing the world size and the model's heads and
ffn)::

    model at a uniform plan of degree t; steps (an AdamW step between them) of programs whose
    compute instructions are cut into single pieces, so each piece is timed, with every
    collective skipped (the executor's ``skip_comm``: shapes right, numbers not), so that a
    piece's time is its own:
        megatron             forward body/epi, backward norm/epi/tp
        megatron-recompute   recompute body (the whole body)
        commfree-recompute   recompute body-commfree (without the last row-parallel matmul)
        overlap, overlap-recompute, oases: the same pieces inside overlapped programs, at every
                             sub-batch count (the planner uses these for overlapped schedules)
        SP_RUNS (t > 1)      sequence parallelism's pieces (sp-norm, sp-core, sp-epi,
                             sp-core-commfree, sp-dx, sp-dw) and saved activations per sp mode
    saved activations per region and recompute mode; collectives: all-reduce, all-gather and
    reduce-scatter over groups of size t, sizes around the activations, and the all-reduce over
    every DP group size no TP degree has;
    one AdamW step per degree's model, timed between those steps; the memory a rank holds
    before any model exists;
    contention: how much slower a matmul of the model's MLP runs while an all-reduce, an
    all-gather or a reduce-scatter is in flight, and how much slower each collective runs
    beside those matmuls (``measure_contention``), which the simulator applies to the pieces
    that overlap collectives and to the collectives under compute.

Per piece the profile keeps the median over layers and repeats.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import statistics

import torch

from oases.bench import run_rank_spec
from oases.bench.profile_collectives import measure_collectives, measure_contention
from oases.config import Config, TrainConfig, config_to_dict, load_config
from oases.memory import device_baseline_bytes, resident_memory_bytes
from oases.model import build_model
from oases.parallel import comm
from oases.parallel.apply import parallelize
from oases.parallel.context import ParallelContext, init_distributed
from oases.plan import ParallelPlan
from oases.planner import batch_shape
from oases.planner.costs import sp_mode, sp_piece
from oases.planner.precision import PlanPrecision
from oases.planner.profile import Profile
from oases.planner.search import candidate_degrees
from oases.precision import Precision, resolve_precision
from oases.schedule import build_schedule, record_timeline
from oases.schedule.instructions import Compute, Instr, deferred_regions
from oases.timing import DeviceClock
from oases.train.optim import build_optimizer

MODES = {"megatron": "none", "megatron-recompute": "block", "commfree-recompute": "commfree"}


def split_pieces(program: list[Instr]) -> list[Instr]:
    """The same program with every compute instruction cut into one per piece (the executor
    runs a piece list in order, so this changes timing resolution, not results)."""
    out: list[Instr] = []
    for ins in program:
        if isinstance(ins, Compute) and len(ins.pieces) > 1:
            out += [Compute(ins.phase, (p,), ins.sub) for p in ins.pieces]
        else:
            out.append(ins)
    return out


def runtime_baseline_bytes() -> float:
    """Resident memory of a rank before any model: torch, the process groups, and the code the
    optimizer and autograd load on first use (constructing AdamW alone imports ~70 MB), so
    that everything a plan adds on top is the plan's."""
    w = torch.nn.Parameter(torch.ones(4))
    (w * w).sum().backward()
    torch.optim.AdamW([w], lr=1e-4).step()
    return resident_memory_bytes()


def device_baseline(ctx: ParallelContext) -> float:
    """A rank's memory before any model, in the terms its peak is measured in: on CUDA the
    device memory outside the allocator (``memory.device_baseline_bytes``: CUDA context, NCCL
    buffers, workspaces) after every group this rank belongs to has run a collective (NCCL
    sets a communicator's buffers up then) and a matmul has run (cuBLAS's handle); on a CPU
    ``runtime_baseline_bytes``. Collective: every rank calls it, groups in one order."""
    if ctx.device.type != "cuda":
        return runtime_baseline_bytes()
    groups = [g for d in sorted(ctx.groups) for g in ctx.groups[d]]
    groups += [ctx.merge_groups[k] for k in sorted(ctx.merge_groups)]
    for group in [ctx.world_group, *groups]:
        comm.all_reduce_(torch.zeros(1, device=ctx.device), group, tag="warm-up")
    x = torch.ones(8, 8, device=ctx.device)
    (x @ x).sum()
    runtime_baseline_bytes()  # autograd and AdamW's first use, as on CPU
    comm.barrier(ctx.world_group)
    return device_baseline_bytes(ctx.device)


def workspace_bytes(baseline: float, modules: list[torch.nn.Module]) -> float:
    """Resident memory beyond ``baseline`` and the tensors ``modules`` hold (parameters,
    buffers, gradients), after they ran warm steps: what the compute libraries keep (BLAS and
    attention workspaces, caches) and the allocator's slack, paid once by every rank that
    trains (measured 13 MiB for the bench model on this 2-core machine). Never negative; 0 on a
    GPU, whose allocator counts tensors only."""
    if torch.cuda.is_available() and any(p.is_cuda for m in modules for p in m.parameters()):
        return 0.0
    held, seen = 0, set()
    for m in modules:
        for t in [
            *m.parameters(),
            *m.buffers(),
            *(p.grad for p in m.parameters() if p.grad is not None),
        ]:
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                held += t.untyped_storage().nbytes()
    return max(0.0, resident_memory_bytes() - baseline - held)


def device_memory(device: torch.device) -> dict:
    """What the planner's default budget needs to know of the device the ranks ran on: its
    name and memory in bytes (``machine.device_name``, ``machine.device_memory_bytes``).
    CUDA: ``total_memory`` of the device. CPU ranks record none: they share the host's RAM
    with each other, the OS and whatever else runs, so a per-rank share of it is no limit a
    rank meets (one rank may take more than its share while another takes less); the planner
    plans them under no budget unless ``--memory-gb`` gives one."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"device_name": props.name, "device_memory_bytes": int(props.total_memory)}
    return {"device_name": device.type, "device_memory_bytes": None}


SYNC = ("megatron", "megatron-recompute", "commfree-recompute")
OVERLAPPED = ("overlap", "overlap-recompute", "oases")


# sequence-parallel programs a profile also runs at one sub-batch (``measure_compute``'s
# ``sp_runs``): forward and backward pieces, block recompute, and the communication-free
# recompute keeping gathered inputs or slices (each its saved activations)
SP_RUNS = (
    ("megatron-sp", "gathered"),
    ("megatron-recompute", "gathered"),
    ("commfree-recompute", "gathered"),
    ("commfree-recompute", "shards"),
)


def measure_compute(
    model: torch.nn.Module,
    ctx: ParallelContext,
    rows: int,
    k: int,
    repeats: int,
    train: TrainConfig,
    schedules: tuple[str, ...] | None = None,
    precision: Precision | None = None,
    sp: str | None = None,
    sp_runs: bool = False,
) -> tuple[list[dict], list[dict], list[float]]:
    """Per-piece compute times of ``model`` (each region at its plan's degree) running steps of
    ``rows`` local sequences (the embedding's layout) cut into k sub-batches: ``schedules``,
    by default the synchronous ones when k == 1, else the overlapped ones. Every collective is
    skipped (the executor's ``skip_comm``: shapes right, numbers not), so a piece's time is
    its own; the simulator adds the contention of the collectives beside it. Forward and
    backward pieces are taken from the schedules without recompute, recompute pieces from the
    others. With k == 1 also the activations each region keeps, per recompute mode (exact,
    from the executor, in bytes: bf16 activations under a bf16 ``precision``, whose autocast
    every step runs in). ``sp``: run ``schedules`` sequence-parallel in that mode (their
    pieces named as ``sp_piece`` says); ``sp_runs``: with k == 1, also the programs of
    ``SP_RUNS`` (saved activations under the modes ``costs.sp_mode`` names).

    Between steps the optimizer steps as in training (``build_optimizer``'s groups, at lr 0 so
    the weights stay put), on the gradients the step made; the third list is its seconds per
    timed step. Timed here rather than on a separate set-up: AdamW alone on all-zero gradients
    in a fresh loop ran 0.18-0.26 s for the bench model on this 2-core machine where training
    spends 0.07-0.10 s, and plans priced the optimizer at up to 3x its cost."""
    cfg = model.cfg
    gen = torch.Generator().manual_seed(ctx.rank)
    tokens = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len), generator=gen)
    tokens = tokens.to(ctx.device)
    times: dict[tuple[str, str, str, int, int], list[float]] = {}
    saved: dict[tuple[str, str, int, int], list[int]] = {}
    optimizer = build_optimizer(model, train)  # steps as in training
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer_s: list[float] = []
    clock = DeviceClock(ctx.device)
    autocast = contextlib.nullcontext() if precision is None else precision.autocast()
    runs = [(name, sp) for name in schedules or (SYNC if k == 1 else OVERLAPPED)]
    if sp_runs and k == 1:
        runs += [run for run in SP_RUNS if run not in runs]
    for name, run_sp in runs:
        sched = build_schedule(name, n_sub=k, sp=run_sp)
        mode = sched.spec.recompute
        saved_mode = sp_mode(mode, sched.sp)
        ex = sched.executor(model)
        ex.skip_comm = True  # a piece alone; the simulator adds the contention of collectives
        program = split_pieces(sched.program(model, rows))
        deferring = deferred_regions(program)
        region_rows = [rows * r.tp // ex.chain[0].tp for r in ex.chain]  # one micro-batch
        for rep in range(repeats + 1):
            model.zero_grad(set_to_none=True)
            ex.track_memory = rep == 0 and k == 1
            ex.saved_bytes = {}
            comm.barrier(ctx.world_group)
            with record_timeline() as tl, autocast:
                ex.run(program, list(tokens.chunk(k)), list(tokens.chunk(k)), 1.0 / k)
            step_s = clock.time_s(optimizer.step)  # CUDA: events, one sync after the step
            if rep > 0:
                optimizer_s.append(step_s)
            if rep == 0:  # warm-up; its saved-activation count is exact
                if k == 1:
                    for region, n in zip(ex.chain, region_rows):
                        saved.setdefault((region.kind, saved_mode, region.tp, n), []).append(
                            ex.saved_bytes.get(region.index, 0)
                        )
                continue
            for e in tl.events:
                if e.lane != "compute" or (mode != "none" and e.phase != "recompute"):
                    continue
                piece, index = e.name.split(":")
                region = ex.chain[int(index)]
                if e.phase == "recompute" and piece == "body" and mode == "commfree":
                    piece = "body-commfree"
                if sched.sp is not None:
                    piece = sp_piece(
                        piece, e.phase, int(index), mode == "commfree", int(index) in deferring
                    )
                key = (region.kind, e.phase, piece, region.tp, region_rows[region.index] // k)
                times.setdefault(key, []).append(e.end_s - e.start_s)
        ex.track_memory = False
    model.zero_grad(set_to_none=True)
    compute = [
        {
            "region": kind,
            "phase": ph,
            "piece": pc,
            "tp": t,
            "rows": n,
            "overlapped": k > 1,
            "s": statistics.median(v),
        }
        for (kind, ph, pc, t, n), v in sorted(times.items())
    ]
    memory = [
        {"region": kind, "mode": mode, "tp": t, "rows": n, "saved_bytes": statistics.median(v)}
        for (kind, mode, t, n), v in saved.items()
    ]
    return compute, memory, optimizer_s


def profile_rows(cfg: Config, world_size: int, t: int) -> int:
    """Local rows of one micro-batch in a region of degree t: the world's micro-batch
    (``planner.batch_shape``) shared by dp = world / t replicas."""
    return batch_shape(cfg, world_size).micro_rows * t // world_size


def run(spec: dict) -> None:
    import os

    cfg: Config = load_config(spec.get("config"), spec.get("overrides", ()))
    torch.set_num_threads(max(1, int(spec.get("threads", 1))))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    degrees = candidate_degrees(cfg.model, world_size)
    repeats = int(spec.get("repeats", 3))
    ctx = init_distributed(tp=1, timeout_s=cfg.parallel.timeout_s, degrees=tuple(degrees))
    precision = resolve_precision(cfg.train.precision, ctx.device, cfg.parallel.grad_reduce_dtype)
    comm.barrier(ctx.world_group)
    baseline = device_baseline(ctx)  # CPU: resident set; CUDA: context, NCCL, workspaces
    torch.manual_seed(cfg.train.seed)
    base = build_model(cfg.model)
    compute: list[dict] = []
    memory: list[dict] = []
    collectives: list[dict] = []
    models = []
    # bytes of one sequence's [S, H] activation
    act = cfg.model.seq_len * cfg.model.dim * precision.compute_dtype.itemsize
    optimizer: list[dict] = []  # one AdamW step per model size (one per degree)
    for t in degrees:
        optimizer_s: list[float] = []
        model = parallelize(
            copy.deepcopy(base), ctx, ParallelPlan.uniform(cfg.model, world_size, t)
        )
        model.train()
        rows = profile_rows(cfg, world_size, t)
        for k in [k for k in spec.get("n_subs", (1, 2, 4)) if rows >= k and rows % k == 0]:
            c, m, o = measure_compute(
                model,
                ctx,
                rows,
                k,
                repeats,
                cfg.train,
                precision=precision,
                sp_runs=t > 1 and cfg.model.seq_len % t == 0,
            )
            compute += c
            memory += m
            optimizer_s += o
            if ctx.rank == 0:
                print(
                    f"oases profile: tp={t}, {rows} rows in {k} sub-batches: {len(c)} pieces",
                    flush=True,
                )
        if t > 1 and rows > 0:
            sizes = sorted(
                {
                    max(act // 4, 1024),
                    act,
                    rows * act // 2,
                    rows * act,
                    4 * rows * act,
                    16 * rows * act,
                }
            )
            collectives += measure_collectives(ctx, t, sizes, repeats + 2, precision=precision)
        models.append(model)
        if optimizer_s:
            optimizer.append(
                {
                    "n_params": sum(p.numel() for p in model.parameters()),
                    "s": statistics.median(optimizer_s),
                }
            )
    tp_sizes = {t for t in degrees if t > 1}
    for t in degrees:  # DP gradient all-reduces over group sizes no TP degree covers
        if world_size // t > 1 and world_size // t not in tp_sizes:
            rows = max(1, profile_rows(cfg, world_size, t))
            sizes = sorted({act, rows * act, 16 * rows * act, 64 * rows * act})
            collectives += measure_collectives(
                ctx, t, sizes, repeats + 2, dp_only=True, precision=precision
            )
            tp_sizes.add(world_size // t)
    workspace = workspace_bytes(baseline, [base, *models])
    contention, comm_contention = measure_contention(
        ctx, cfg.model, profile_rows(cfg, world_size, 1), dtype=precision.compute_dtype
    )
    if ctx.rank == 0:
        from oases.bench.suite import machine_info

        machine = (
            machine_info()
            | {
                "world_size": world_size,
                "backend": ctx.backend,
                "device": str(ctx.device),
                "threads": torch.get_num_threads(),
                "link": spec.get("link_label", ""),
            }
            | device_memory(ctx.device)
        )
        created = datetime.datetime.now().isoformat(timespec="seconds")
        made_from = {
            "file": spec.get("config"),
            "overrides": list(spec.get("overrides", ())),
            "micro_batch": cfg.train.micro_batch,
            "global_batch": cfg.train.global_batch,
            "tp": cfg.parallel.tp,
        }
        profile = Profile(
            config_to_dict(cfg)["model"],
            machine,
            compute,
            collectives,
            memory,
            optimizer,
            baseline,
            created,
            made_from,
            workspace,
            contention,
            comm_contention,
            PlanPrecision.from_record(precision.describe()),
        )
        profile.save(spec["out"])
    comm.barrier(ctx.world_group)  # nobody exits while a peer still talks


if __name__ == "__main__":
    run_rank_spec(run)
