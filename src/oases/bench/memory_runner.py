"""The per-rank side of ``oases bench --memory``: one entry per launch, its memory per rank.

Peak memory on a CPU is the process's peak resident set (``oases.memory``), which also holds
torch itself, the other entries' models and whatever the allocator kept: so a memory table needs
one process per entry and a baseline. Each launch (``python -m oases.bench.memory_runner
SPEC.json`` under torchrun, ``MALLOC_MMAP_THRESHOLD_`` fixed by ``suite.launch_ranks`` so that
freed tensors go back to the system instead of staying in malloc's heap) does::

    init process groups            baseline = resident set after a first autograd and AdamW
                                   step on a 4-element tensor (the code they load: ~70 MB)
    build the entry's model        parallelize, shard (ZeRO stage Z) or fully_shard (fsdp2)
    warm-up + measured steps       forward, backward, clipping, AdamW, as ``oases bench
                                   --with-optimizer``; the peak window spans every measured step
    model state                    ``model_state_bytes`` after the last backward, before zero_grad
    one counted step               after the peak window: saved bytes per block and the peak
                                   of live tensor bytes, gradients' allocation included
                                   (``activation_memory.measure_step``; not for fsdp2)

and rank 0 writes ``memory-ENTRY.json``: per rank, the model-state bytes by kind (weights,
gradients, optimizer) from the tensors themselves, and the measured peak minus the baseline (on a
GPU: CUDA's allocator peak, which starts at zero). A rank's peak includes its activations, the
transient buffers of collectives and its share of the batch; the baseline excludes torch's own
code and the gloo process groups.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from oases.bench import parse_entry, run_rank_spec
from oases.bench.activation_memory import measure_step
from oases.bench.profile_runner import runtime_baseline_bytes
from oases.config import load_config
from oases.memory import file_backed_memory_bytes, peak_memory_mb, reset_peak_memory
from oases.model import build_model
from oases.parallel import comm
from oases.parallel.apply import parallelize
from oases.parallel.context import init_distributed
from oases.parallel.shard import shard_model
from oases.precision import resolve_precision
from oases.schedule import build_schedule
from oases.train.optim import build_optimizer, clip_grad_norm_, model_state_bytes


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def fsdp2_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """``model_state_bytes`` for a ``fully_shard`` model: the local shards of its DTensors."""
    out = {"weights": 0, "gradients": 0, "optimizer": 0}
    for p in model.parameters():
        out["weights"] += _local(p).numel() * p.element_size()
        if p.grad is not None:
            out["gradients"] += _local(p.grad).numel() * p.grad.element_size()
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                out["optimizer"] += _local(state[key]).numel() * state[key].element_size()
    return out


def run(spec: dict) -> None:
    cfg = load_config(spec.get("config"), spec.get("overrides", ()))
    ctx = init_distributed(tp=cfg.parallel.tp, timeout_s=cfg.parallel.timeout_s)
    cfg.validate(ctx.world_size)
    torch.set_num_threads(1)
    entry: str = spec["entry"]
    name, zero, precision_name, sp, dw = parse_entry(entry)
    precision = resolve_precision(
        precision_name or cfg.train.precision, ctx.device, cfg.parallel.grad_reduce_dtype
    )
    rows, seq = cfg.train.micro_batch, cfg.model.seq_len
    gen = torch.Generator().manual_seed(cfg.train.seed + ctx.dp_rank)
    tokens = torch.randint(0, cfg.model.vocab_size, (rows, seq), generator=gen).to(ctx.device)
    targets = torch.randint(0, cfg.model.vocab_size, (rows, seq), generator=gen).to(ctx.device)
    comm.barrier(ctx.world_group)
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    # after the code autograd and AdamW load on first use, as the profile's baseline
    base_mb = 0.0 if ctx.device.type == "cuda" else runtime_baseline_bytes() / 2**20
    code_base_mb = file_backed_memory_bytes() / 2**20  # code pages before the entry's model

    torch.manual_seed(cfg.train.seed)
    if name == "fsdp2":
        from oases.bench.fsdp2 import (
            FSDP2Schedule,
            build_world_mesh,
            fsdp2_optimizer_step,
            shard_fsdp2,
        )
        from oases.bench.runner import fsdp2_rows

        share = fsdp2_rows(rows, ctx.tp, ctx.tp_rank)
        tokens, targets = tokens[share], targets[share]
        model = shard_fsdp2(build_model(cfg.model).to(ctx.device), build_world_mesh(ctx), precision)
        schedule = FSDP2Schedule()
    else:
        model = parallelize(build_model(cfg.model), ctx)
        if zero:
            shard_model(model, zero, cfg.parallel.reshard_after_forward)
        schedule = build_schedule(
            name,
            n_sub=cfg.schedule.n_sub,
            max_inflight=cfg.schedule.max_inflight,
            grad_reduce_dtype=precision.grad_reduce_dtype,
            sp=sp or None,
            defer_weight_grads=dw != "off",
        )
    optimizer = build_optimizer(model, cfg.train)

    state: dict[str, int] = {}
    warmup, n_steps = int(spec.get("warmup", 1)), int(spec["steps"])
    for it in range(warmup + n_steps):
        if it == warmup:
            comm.barrier(ctx.world_group)
            reset_peak_memory(ctx.device)
        with precision.autocast():
            schedule.step(model, tokens, targets)
        if name == "fsdp2":
            state = fsdp2_state_bytes(model, optimizer)  # moments exist from step 2 on
            fsdp2_optimizer_step(model, optimizer, it, cfg.train)
            continue
        clip_grad_norm_(
            model.parameters(),
            cfg.train.grad_clip,
            ctx.tp_group,
            None,
            getattr(model, "zero_shards", None),
            ctx.world_group,
        )
        state = model_state_bytes(model, optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    peak = peak_memory_mb(ctx.device) - base_mb
    counted = {"saved_per_block": [], "peak_live": 0}
    if name != "fsdp2":  # one more step, counted in tensors (after the resident peak's window)
        with precision.autocast():
            counted = measure_step(schedule, model, tokens, targets, ctx.device)
        optimizer.zero_grad(set_to_none=True)
    counted_all = comm.all_gather_objects(counted, ctx.world_group)
    # code pages the entry's first steps paged in (kernels torch ran for the first time): in a
    # CPU's resident peak, not in any tensor (0 on CUDA, whose peak is the allocator's)
    code_mb = (
        0.0 if ctx.device.type == "cuda" else file_backed_memory_bytes() / 2**20 - code_base_mb
    )
    mine = torch.tensor([peak, base_mb, code_mb, *state.values()], dtype=torch.float64)
    every = comm.all_gather_objects(mine.tolist(), ctx.world_group)
    if ctx.rank == 0:
        ranks = [
            {
                "peak_over_base_mb": r[0],
                "base_mb": r[1],
                "code_pages_mb": r[2],
                **dict(zip(state, (int(v) for v in r[3:]))),
                **c,
            }
            for r, c in zip(every, counted_all)
        ]
        out = Path(spec["out"])
        out.mkdir(parents=True, exist_ok=True)
        (out / f"memory-{parse_entry(entry).stem()}.json").write_text(
            json.dumps(
                {
                    "entry": entry,
                    "world_size": ctx.world_size,
                    "tp": ctx.tp,
                    "dp": ctx.dp,
                    "rows": rows,
                    "seq_len": seq,
                    "steps": n_steps,
                    "ranks": ranks,
                },
                indent=1,
            )
        )
    comm.barrier(ctx.world_group)  # nobody exits while a peer still talks


if __name__ == "__main__":
    run_rank_spec(run)
