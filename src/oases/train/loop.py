"""The training loop of one rank: model, optimizer, LR schedule, clipping, logging, evaluation.

Every rank runs ``train(cfg)``. Order of one step::

    tokens, targets [B, S]  (this DP rank's rows; the same on every TP rank of the DP group)
    schedule.step           forward + backward over micro-batches, grads averaged over DP
                            (schedule.cuda_graphs: captured once, replayed: schedule.graphed)
    clip_grad_norm_         global norm over TP shards (all-reduce) + replicated params (once)
    optimizer.step, zero_grad

``parallel.plan`` (a plan file, or "auto") gives every region its own TP degree: the process
groups of every degree are built, the batch is dealt out in the embedding's layout (B = G / dp
of the embedding), the schedule reshards between regions, the gradient norm sums each degree's
shards over that degree's TP group, and losses are averaged over the head's DP group.

``train.precision`` (``oases.precision``) sets the dtypes: "bf16" runs the step under bf16
autocast with bf16 activations and TP collectives (fp32 master weights, gradients, AdamW state
and checkpoints; the DP gradient reduction in ``parallel.grad_reduce_dtype``), "auto" is bf16 on
CUDA and fp32 on CPU; "fp32" and "fp64" run everything in that dtype.

``parallel.zero`` (or a plan region's ``zero``) shards regions over data parallelism
(``oases.parallel.shard``): the schedule then reduce-scatters their gradients (and at stage 3
gathers their weights around each pass), the optimizer is ``ZeroAdamW`` over the shards, the
gradient norm adds the shards' squares over all ranks, and evaluation, sampling and checkpoints
see whole weights and AdamW state (``whole_state``: gathered; checkpoints keep an unsharded
layout, so any stage, tp or dp resumes any other).

Rank 0 prints (``console``) a line every ``train.log_every`` steps, or a progress bar on a
terminal, and records (``metrics``) ``<run_dir>/metrics.jsonl`` (one JSON line per step and per
evaluation), TensorBoard events with ``train.tensorboard`` and ``<run_dir>/loss.png`` at every
evaluation (every ``train.eval_every`` steps) and at the end. The resolved config goes to
``<run_dir>/config.toml``; the second step's timeline of every rank to ``timeline.png``.

Checkpoints (``oases.train.checkpoint``): every ``checkpoint.every`` steps and at the end, with
the corpus fingerprint; ``checkpoint.resume`` picks one to continue from (model, AdamW state,
step and so the LR schedule, data position, RNG), at any tp or plan, once ``oases.train.resume``
has checked that the checkpoint can serve this config and data - before anything is written.
A resumed run keeps the metrics lines up to its step.

Setup before the model (``setup``: config, plan, tokenizer name; ``run_data``: the dataset,
prepared once into ``<run_dir>/data`` when ``data.source`` is not a prepared folder, memory-
mapped, its tokenizer) runs on every rank without a collective; ``agree`` then makes every rank
stop with the same one line if any rank failed.
"""

from __future__ import annotations

import contextlib
import math
import time
import zlib
from pathlib import Path
from typing import Any, TextIO

import torch

from oases.config import Config, format_params, save_config
from oases.data.dataset import split_batches
from oases.memory import peak_live_bytes, peak_memory_mb, state_tensors, tensor_bytes
from oases.model import build_model, check_batch, count_params
from oases.parallel import comm
from oases.parallel.apply import parallelize, parameter_degrees
from oases.parallel.context import (
    build_tp_mesh,
    init_distributed,
    release_groups,
)
from oases.parallel.shard import materialized, shard_model
from oases.plan import ParallelPlan
from oases.precision import resolve_precision, upcast
from oases.schedule import build_schedule, record_timeline
from oases.schedule.graphed import GraphedStep
from oases.schedule.specs import sub_batches
from oases.train import checkpoint as ckpt
from oases.train import faults
from oases.train.agree import PeerError, agree_on_setup, agree_on_value
from oases.train.console import Console
from oases.train.effective import EffectiveRun
from oases.train.evaluate import evaluate, loss_group
from oases.train.generate import generate, sampling_generator
from oases.train.metrics import LOSS_PLOT, TENSORBOARD_DIR, MetricsLog, metrics_path
from oases.train.optim import build_optimizer, clip_grad_norm_, lr_at, whole_state
from oases.train.pipeline_run import counted_once, pipeline_warnings
from oases.train.resume import (
    check_corpus,
    check_resume_compatible,
    resolve_resume,
    schedule_change,
)
from oases.train.run_data import data_fingerprint, default_log, open_run_data
from oases.train.run_log import (
    done_line,
    model_line,
    resume_line,
    save_timeline,
    startup_lines,
    timeline_title,
)
from oases.train.setup import resolve_setup
from oases.train.tokenizer import TOKENIZER_FILE, save_tokenizer, tokenizer_info


def train(
    cfg: Config, *, log: TextIO | None = None, stop_after: int | None = None
) -> dict[str, Any]:
    """Run ``cfg`` on this rank; returns a summary (losses, validation loss, checkpoint, time).

    ``stop_after`` ends this call after that many global steps (counted from step 0, so a
    resumed run stops at the same place), with a checkpoint, as a stopped job would; the LR
    schedule still follows ``train.steps``.
    """
    groups = dict(
        timeout_s=cfg.parallel.timeout_s,
        backend=cfg.parallel.backend,
        high_priority_tp=cfg.parallel.high_priority_tp,
    )
    # with a plan, its degrees' groups are built once every rank has read it
    ctx = init_distributed(tp=1 if cfg.parallel.plan else cfg.parallel.tp, **groups)
    t, S = cfg.train, cfg.model.seq_len
    precision = resolve_precision(t.precision, ctx.device, cfg.parallel.grad_reduce_dtype)
    is_main = ctx.rank == 0
    end = t.steps if stop_after is None else min(t.steps, stop_after)
    console = Console(is_main, log)  # a bar on a terminal, plain lines elsewhere
    say = console.say

    error: ValueError | None = None
    resume_from: Path | None = None
    manifest: dict[str, Any] = {}
    warnings: list[str] = []
    plan: ParallelPlan | None = None
    try:  # local setup only: no collective until every rank agrees it succeeded
        setup = resolve_setup(cfg, ctx.world_size)  # cfg becomes the effective config
        plan, warnings = setup.plan, setup.warnings
    except ValueError as exc:
        error = exc
    agree_on_setup(ctx, error)
    if plan is None:
        plan = ParallelPlan.uniform(cfg.model, ctx.world_size, ctx.tp)
    else:
        agree_on_value(
            ctx,
            zlib.crc32(plan.to_json().encode()) % (1 << 24),
            "parallel.plan (every machine must read the same plan)",
        )
        release_groups(ctx)  # the first context's groups (a communicator each on NCCL)
        ctx = init_distributed(tp=plan.tp_of("embed"), degrees=plan.degrees(), pp=plan.pp, **groups)
    run = EffectiveRun.build(cfg, plan, ctx.world_size, precision)  # what this run does
    warnings += filter(None, [run.precision_mismatch()])
    try:  # nothing is written before every check of a resumed run has passed
        resume_from = resolve_resume(cfg, warnings)
        if resume_from is not None:
            manifest = ckpt.read_manifest(resume_from)
            warnings += check_resume_compatible(cfg, manifest, resume_from)
        fingerprint = data_fingerprint(cfg)  # before anything is written
        if resume_from is not None:
            warnings += filter(None, [check_corpus(cfg, manifest, fingerprint, resume_from)])
        data = open_run_data(cfg, fingerprint, resume_from, default_log(is_main, console.stream))
        tok = data.tokenizer
        where = f"data.source={cfg.data.source!r}:"
        train_data = split_batches(
            data.dataset,
            "train",
            S,
            t.global_batch,
            dp_rank=ctx.dp_rank,
            dp=ctx.dp,
            seed=t.seed,
            name=f"{where} the training split",
        )
        val_data = split_batches(
            data.dataset,
            "val",
            S,
            t.global_batch,
            dp_rank=ctx.dp_rank,
            dp=ctx.dp,
            name=f"{where} the validation split",
        )
        if is_main:
            for key, folder in (
                ("train.run_dir", Path(t.run_dir)),
                ("train.metrics_file", metrics_path(cfg).parent),
                ("checkpoint.dir", ckpt.checkpoint_root(cfg)),
            ):
                try:
                    folder.mkdir(parents=True, exist_ok=True)
                except OSError as exc:
                    raise ValueError(f"{key}: cannot create {folder} ({exc.strerror})") from None
    except ValueError as exc:
        error = exc
    agree_on_setup(ctx, error)
    # every rank must resume from the same step (a checkpoint dir not shared by all machines,
    # or a lagging network filesystem, would otherwise split the job) and read the same files
    resume_step = -1 if resume_from is None else int(manifest["step"])
    agree_on_value(
        ctx,
        resume_step,
        "the checkpoint step to resume from (checkpoint.dir must be one folder every machine sees)",
    )
    agree_on_value(
        ctx,
        int(data.fingerprint.digest[:6], 16),
        f"the data (data.source={cfg.data.source!r} must be the same files on every machine)",
    )

    torch.manual_seed(t.seed)  # same full model on every rank before sharding
    if cfg.model.init_from and resume_from is None:  # each rank reads only its own slices
        from oases.hf import load_hf

        _, model = load_hf(
            cfg.model.init_from[3:],
            ctx,
            plan,
            max_seq_len=cfg.model.seq_len,
            dropout=cfg.model.dropout,
        )
        n_params = cfg.model.num_params()
    else:
        model = build_model(cfg.model)
        n_params = count_params(model)
        parallelize(model, ctx, plan)
    model.to(precision.param_dtype).train()  # shards keep their identity: .data is cast
    shards = shard_model(
        model, plan.zero_stages(cfg.parallel.zero), cfg.parallel.reshard_after_forward
    )  # ZeRO (None: off)
    optimizer = build_optimizer(model, t)
    schedule = build_schedule(
        cfg.schedule.name,
        n_sub=cfg.schedule.n_sub,
        micro_batch=t.micro_batch,
        max_inflight=cfg.schedule.max_inflight,
        grad_reduce_dtype=precision.grad_reduce_dtype,
        sp=cfg.parallel.sp(),
    )
    stepper = GraphedStep(schedule, say=say) if cfg.schedule.cuda_graphs else schedule
    meshes = {d: build_tp_mesh(ctx, d) for d in plan.degrees()}  # checkpoints' DTensors
    tp_groups = {pid: ctx.groups_for(d)[0] for pid, d in parameter_degrees(model).items()}
    losses_over = loss_group(model, ctx)
    norm_skips = counted_once(model)  # (pipeline stages: a tied embedding's second copy)
    start_step = 0
    if resume_from is not None:
        try:  # local checks first (complete, sizes, shapes), so a bad checkpoint never hangs
            with whole_state(model, optimizer):
                ckpt.check_checkpoint(resume_from, model, optimizer, ctx)
        except ValueError as exc:
            error = exc
        agree_on_setup(ctx, error)
        with whole_state(model, optimizer, write_back=True):
            manifest = ckpt.load_checkpoint(resume_from, model, optimizer, ctx, meshes)
        start_step = int(manifest["step"])
        train_data.load_state_dict(manifest["extras"]["data"])

    run_dir = Path(t.run_dir)
    metrics: MetricsLog | None = None
    tokenizer_files: dict[str, Path] = {}
    if is_main:
        save_config(cfg, run_dir / "config.toml", header=run.toml_header())
        metrics = MetricsLog(
            metrics_path(cfg),
            start_step,
            plot_path=run_dir / LOSS_PLOT,
            tensorboard_dir=run_dir / TENSORBOARD_DIR if t.tensorboard else None,
            title=f"{run_dir}: {cfg.model.arch} {format_params(n_params)}",
        )
        saved_tok = save_tokenizer(tok, run_dir)
        if saved_tok is not None:
            tokenizer_files[TOKENIZER_FILE] = saved_tok
    n_train, n_val = (
        sum(len(s) for s in streams) for streams in (data.dataset.train, data.dataset.val)
    )
    data_line = (
        f"{cfg.data.source} {n_train / 1e6:.2f}M train / {n_val / 1e6:.2f}M val tokens"
        f" ({data.dataset.files} files, memory-mapped from {data.dataset.root},"
        f" fingerprint {data.fingerprint.digest})"
    )
    for line in startup_lines(
        ctx,
        cfg,
        run,
        run_dir / "config.toml",
        metrics_path(cfg),
        model_line(cfg, n_params, data_line),
    ):
        say(line)
    if resume_from is not None:
        say(resume_line(resume_from, start_step, manifest, run))
        warnings += filter(None, [schedule_change(cfg, manifest, start_step)])
    warnings += pipeline_warnings(cfg, plan, t.global_batch // (t.micro_batch * ctx.dp))
    for line in warnings:
        console.warn(line)

    def write(row: dict[str, Any]) -> None:
        if metrics is not None:
            metrics.write(row)

    def run_eval(step: int) -> float:
        with precision.autocast(), materialized(model):
            value = evaluate(model, val_data, ctx, t.eval_batches)
        write({"step": step, "val_loss": value})
        say(f"step {step:5d}/{t.steps}  validation loss {value:.4f}")
        if metrics is not None:
            metrics.plot()
        return value

    def save(step: int) -> Path:
        extras = {
            "data": train_data.state_dict(),
            "lr": lr_at(max(0, step - 1), t),
            "tokenizer": tokenizer_info(tok),
            "corpus": data.fingerprint.to_dict(),
        }
        with whole_state(model, optimizer):
            path = ckpt.save_checkpoint(
                ckpt.checkpoint_root(cfg),
                step,
                model,
                optimizer,
                extras,
                cfg,
                ctx,
                meshes,
                cfg.checkpoint.keep,
                tokenizer_files,
                run=run.record(),
            )
        say(f"step {step:5d}/{t.steps}  checkpoint {path}")
        return path

    tokens_per_step = t.global_batch * S
    loss, val_loss = float("nan"), float("nan")
    losses: list[float] = []
    grad_norms: list[float] = []
    evaluated_at = saved_at = -1
    run_peak_mb = 0.0  # the resident (CUDA: allocated) peak so far, kept across the resets
    saved: Path | None = resume_from
    timeline_step = start_step + 1 if end - start_step > 1 else start_step
    start = time.perf_counter()
    console.start(start_step, end, t.steps, t.log_every, tokens_per_step)
    try:
        for step in range(start_step, end):
            faults.on_step(step + 1)  # testing hook (train/faults.py); returns at once unless armed
            t0 = time.perf_counter()
            lr = lr_at(step, t)
            for group in optimizer.param_groups:
                group["lr"] = lr
            tokens, targets = train_data.next_batch()
            if ctx.device.type != "cpu":  # ids checked on the host (no device sync); the
                check_batch(cfg.model, tokens, targets)  # schedule checks CPU batches itself
            recording = record_timeline() if step == timeline_step else contextlib.nullcontext()
            # live tensors: the model and optimizer state at the step start, + the step's peak
            # above it (``memory.peak_live_bytes``): every step on a GPU (the allocator's
            # statistics); on a CPU (the profiler's allocator events, which cost the step
            # time of recording every op) the run's first step and every log_every-th
            count_live = (
                ctx.device.type == "cuda" or step == start_step or (step + 1) % t.log_every == 0
            )
            state_bytes = tensor_bytes(state_tensors(model, optimizer)) if count_live else 0
            run_peak_mb = max(run_peak_mb, peak_memory_mb(ctx.device))  # (CUDA: reset below)
            counting = peak_live_bytes(ctx.device) if count_live else contextlib.nullcontext({})
            with counting as live:
                with precision.autocast(), recording as timeline:
                    local = stepper.step(model, tokens.to(ctx.device), targets.to(ctx.device))
                drawing_s = 0.0  # the timeline's picture is not the step's time
                if timeline is not None:  # one step's picture, the second of the run (warmed up)
                    drawn = time.perf_counter()
                    save_timeline(
                        timeline,
                        ctx,
                        run_dir / "timeline.png",
                        timeline_title(cfg, plan, ctx.world_size, step + 1),
                        sub_batches(cfg.schedule.name, cfg.schedule.n_sub),
                    )
                    drawing_s = time.perf_counter() - drawn
                    say(
                        f"step {step + 1:5d}/{t.steps}  timeline of this step recorded: "
                        f"{run_dir / 'timeline.png'} (gathered and drawn in {drawing_s:.2f}s, "
                        "outside the step's time)"
                    )
                grad_norm = clip_grad_norm_(
                    model.parameters(),
                    t.grad_clip,
                    ctx.tp_group,
                    tp_groups,
                    shards,
                    ctx.stage,
                    ctx.pp_group,
                    norm_skips,
                )
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            loss = float(comm.all_reduce_mean(upcast(local), losses_over))
            if not math.isfinite(loss):  # the same on every rank: rank 0 reports it
                msg = f"loss became {loss} at step {step + 1}; try a lower train.lr={t.lr}"
                raise ValueError(msg) if is_main else PeerError(msg)
            # host time: float(loss) above waited for the step's device work (the timeline's
            # events come from the executor's DeviceClock, without a sync inside the step)
            dt = time.perf_counter() - t0 - drawing_s - live.get("counting_s", 0.0)
            losses.append(loss)
            grad_norms.append(grad_norm)
            write(
                {
                    "step": step + 1,
                    "loss": loss,
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "step_time_s": dt,
                    "tokens_per_s": tokens_per_step / dt,
                    "peak_mem_mb": max(run_peak_mb, peak_memory_mb(ctx.device)),
                    **(
                        {"live_peak_mb": (state_bytes + live["peak"]) / 2**20} if count_live else {}
                    ),
                    **({"timeline": True} if timeline is not None else {}),
                }
            )
            console.step(step + 1, loss, lr, grad_norm, dt)
            if t.eval_every and (step + 1) % t.eval_every == 0:
                val_loss, evaluated_at = run_eval(step + 1), step + 1
            if cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0:
                saved, saved_at = save(step + 1), step + 1
        final = max(start_step, end)
        console.close()
        if evaluated_at != final:
            val_loss = run_eval(final)
        if saved_at != final and final > start_step:
            saved = save(final)
        if t.sample_tokens and plan.pp == 1:  # every rank samples (logits gathered over TP)
            prompt = torch.tensor([[tok.doc_sep_id]], device=ctx.device)
            with materialized(model):
                out = generate(
                    model,
                    prompt,
                    t.sample_tokens,
                    generator=sampling_generator(t.seed),
                    replicas=plan.tp_of("embed") // min(plan.degrees()),
                )
            say("sample:\n" + tok.decode(out[0, 1:].tolist()))
    finally:
        console.close()
        if metrics is not None:
            metrics.close()
    elapsed = time.perf_counter() - start
    say(
        done_line(max(start_step, end), t.steps, start_step, elapsed)
        + "; "
        + (f"final train loss {loss:.4f}, " if losses else "no steps left to train; ")
        + f"validation loss {val_loss:.4f}"
        + (f"; loss curve {metrics.plot_path}" if metrics and metrics.plot_path else "")
    )
    return {
        "loss": loss,
        "val_loss": val_loss,
        "elapsed_s": elapsed,
        "steps": t.steps,
        "start_step": start_step,
        "end_step": max(start_step, end),
        "losses": losses,
        "grad_norms": grad_norms,
        "checkpoint": None if saved is None else str(saved),
    }
