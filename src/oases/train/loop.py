"""The training loop of one rank: model, optimizer, LR schedule, clipping, logging, evaluation.

Every rank runs ``train(cfg)``. Order of one step::

    tokens, targets [B, S]  (this DP rank's rows; the same on every TP rank of the DP group)
    schedule.step           forward + backward over micro-batches, grads averaged over DP
    clip_grad_norm_         global norm over TP shards (all-reduce) + replicated params (once)
    optimizer.step, zero_grad

``parallel.plan`` (a plan file, or "auto") gives every region its own TP degree: the process
groups of every degree are built, the batch is dealt out in the embedding's layout (B = G / dp
of the embedding), the schedule reshards between regions, the gradient norm sums each degree's
shards over that degree's TP group, and losses are averaged over the head's DP group.

On CUDA the step runs under bf16 autocast (the parameters, gradients and AdamW state stay fp32:
fp32 master weights); on CPU everything is fp32.

Rank 0 prints a line every ``train.log_every`` steps (loss and tokens/s averaged over the steps
since the previous line; the loss is the mean over DP ranks) and appends JSON lines to
``train.metrics_file`` (default ``<run_dir>/metrics.jsonl``): one per step with ``step, loss, lr,
grad_norm, step_time_s, tokens_per_s, peak_mem_mb`` and one per evaluation with ``step,
val_loss`` (every ``train.eval_every`` steps and at the end). The resolved config goes to
``<run_dir>/config.toml``.

Checkpoints (``oases.train.checkpoint``): every ``checkpoint.every`` steps and at the end;
``checkpoint.resume`` picks one to continue from (model, AdamW state, step and so the LR
schedule, data position, RNG), at any tp or plan. A resumed run keeps the metrics lines up to
its step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time
import zlib
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

from oases.config import Config, config_to_dict, save_config
from oases.memory import peak_memory_mb
from oases.model import build_model, count_params
from oases.parallel import comm
from oases.parallel.apply import parallelize, parameter_degrees
from oases.parallel.context import Group, ParallelContext, build_tp_mesh, init_distributed
from oases.plan import ParallelPlan
from oases.schedule import Timeline, build_schedule, record_timeline
from oases.train import checkpoint as ckpt
from oases.train import faults
from oases.train.data import (
    Corpus,
    PackedBatches,
    build_tokenizer,
    load_corpus,
    stream_documents,
    tokenize_corpus,
)
from oases.train.generate import generate, sampling_generator
from oases.train.optim import build_optimizer, clip_grad_norm_, lr_at
from oases.train.progress import Progress
from oases.train.tokenizer import TOKENIZER_FILE, Tokenizer, check_tokenizer_name, save_tokenizer


def resolve_init_from(cfg: Config) -> None:
    """``model.init_from = "hf:PATH"``: the model's shape comes from PATH/config.json (seq_len
    capped by model.seq_len; dropout and init_std kept). Idempotent."""
    if cfg.model.init_from:
        from oases.hf import hf_model_config

        m = hf_model_config(cfg.model.init_from[3:], max_seq_len=cfg.model.seq_len,
                            dropout=cfg.model.dropout)
        cfg.model = dataclasses.replace(m, init_from=cfg.model.init_from,
                                        init_std=cfg.model.init_std)


def resolve_plan(cfg: Config, world_size: int) -> ParallelPlan | None:
    """``parallel.plan``: None for "" (every region at ``parallel.tp``), the planner's choice
    for "auto", else the plan file; checked against the model and the world size."""
    source = cfg.parallel.plan
    if not source:
        return None
    if source == "auto":
        from oases.planner import auto_plan

        plan = auto_plan(cfg, world_size)
    else:
        plan = ParallelPlan.load(source)
    plan.check(cfg.model, world_size)
    apply_plan_knobs(cfg, plan, world_size)
    return plan


def apply_plan_knobs(cfg: Config, plan: ParallelPlan, world_size: int) -> None:
    """A plan carries the schedule it was chosen with: its ``schedule`` and ``n_sub`` replace
    the config's, and a planned world micro-batch (``notes["micro_rows"]``, sequences across all
    ranks) sets ``train.micro_batch`` to the embedding layout's share of it. The effective
    config is the one logged and saved with the run."""
    cfg.schedule.name, cfg.schedule.n_sub = plan.schedule, plan.n_sub
    micro_rows = plan.notes.get("micro_rows")
    if micro_rows:
        local, left = divmod(int(micro_rows) * plan.tp_of("embed"), world_size)
        if left or local < 1:
            raise ValueError(f"the plan's micro-batch of {micro_rows} sequences does not split "
                             f"over dp={world_size // plan.tp_of('embed')} ranks")
        # micro_batch is per rank at parallel.tp: both in the embedding's layout, so planning
        # this config again (every rank does) sees the same world micro-batch
        cfg.train.micro_batch, cfg.parallel.tp = local, plan.tp_of("embed")


def check_config(cfg: Config, world_size: int) -> ParallelPlan | None:
    """Every user-input check that needs no data and no collective; ValueError with numbers.
    Returns the plan of ``parallel.plan`` (None: uniform at ``parallel.tp``)."""
    resolve_init_from(cfg)
    plan = resolve_plan(cfg, world_size)
    cfg.validate(world_size, None if plan is None else tuple(r.tp for r in plan.regions))
    hf_dir = cfg.model.init_from[3:]
    own_tokenizer = hf_dir and (Path(hf_dir) / TOKENIZER_FILE).is_file()
    if own_tokenizer and cfg.data.tokenizer != f"hf:{hf_dir}":
        raise ValueError(f"model.init_from={cfg.model.init_from!r} has its own {TOKENIZER_FILE}: "
                         f"train with it, --data.tokenizer=hf:{hf_dir}")
    build_schedule(
        cfg.schedule.name,
        n_sub=cfg.schedule.n_sub,
        micro_batch=cfg.train.micro_batch,
        max_inflight=cfg.schedule.max_inflight,
    )
    check_tokenizer_name(cfg.data.tokenizer)
    want = {"byte": 256, "bpe": cfg.data.vocab_size or cfg.model.vocab_size}.get(
        cfg.data.tokenizer, 0)  # hf:PATH is checked against its file when it is built
    if cfg.model.vocab_size < want:
        raise ValueError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the {cfg.data.tokenizer}"
            f" tokenizer's vocabulary of {want}"
        )
    return plan


def build_run_tokenizer(cfg: Config, corpus: Corpus, resume_from: Path | None) -> Tokenizer:
    """The run's tokenizer: bytes, or a BPE trained on the training split (deterministic, so
    every rank trains the same one without a collective) or reloaded from the checkpoint."""
    if cfg.data.tokenizer != "bpe":
        return build_tokenizer(cfg.data.tokenizer, vocab_size=cfg.model.vocab_size)
    saved = resume_from if resume_from and (resume_from / TOKENIZER_FILE).is_file() else None
    tok = build_tokenizer("bpe", None if saved else stream_documents(corpus.train),
                          cfg.data.vocab_size or cfg.model.vocab_size, path=saved)
    if cfg.model.vocab_size < tok.vocab_size:
        raise ValueError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the trained "
                         f"BPE vocabulary of {tok.vocab_size}")
    return tok


def loss_group(model: nn.Module, ctx: ParallelContext) -> Group:
    """The head's DP group: one rank of every head TP group, so the mean of the ranks' losses
    over it is the global loss (the DP group of a uniform plan)."""
    return ctx.groups_for(model.parallel_plan.tp_of("head"))[1]


@torch.no_grad()
def evaluate(model: nn.Module, batches: PackedBatches, ctx: ParallelContext, n: int) -> float:
    """Mean loss over the first ``n`` validation batches (fewer if the split is small)."""
    was_training = model.training
    model.eval()
    n = max(1, min(n, batches.n_windows // batches.global_batch))
    total = torch.zeros((), device=ctx.device)
    for i in range(n):
        tokens, targets = batches.batch(i)
        total += model(tokens.to(ctx.device), targets.to(ctx.device)).float()
    model.train(was_training)
    return float(comm.all_reduce_mean(total / n, loss_group(model, ctx)))


def _format_config(cfg: Config) -> str:
    return "\n".join(
        f"  [{section}] " + " ".join(f"{k}={v}" for k, v in values.items())
        for section, values in config_to_dict(cfg).items()
    )


class PeerError(ValueError):
    """A user error that another rank reports (one line in all); this rank stops quietly."""


# Settings that must not change on resume: the data position would mean another batch.
RESUME_FIXED = (("data", "source"), ("data", "tokenizer"), ("data", "vocab_size"),
                ("train", "seed"), ("train", "global_batch"), ("model", "seq_len"),
                ("model", "arch"))


def check_resume_compatible(cfg: Config, manifest: dict[str, Any], path: Path) -> None:
    """ValueError naming every setting that differs from the checkpoint's run."""
    saved, now = manifest.get("config", {}), config_to_dict(cfg)
    diff = [f"{s}.{k}={saved[s][k]!r} (now {now[s][k]!r})" for s, k in RESUME_FIXED
            if s in saved and k in saved[s] and saved[s][k] != now[s][k]]
    if diff:
        raise ValueError(f"checkpoint {path} was saved with {', '.join(diff)}; resume with the "
                         "same settings or start afresh (checkpoint.resume=never, another "
                         "checkpoint.dir)")


def agree_on_value(ctx: ParallelContext, value: int, what: str) -> None:
    """Every rank must hold the same ``value`` (e.g. the step it resumes from); else every rank
    raises the same ValueError. Min and max over the world via the TP then the DP groups."""
    t = torch.tensor([float(value), -float(value)], device=ctx.device)
    comm.all_reduce_(t, ctx.tp_group, op="max", tag="agree")
    comm.all_reduce_(t, ctx.dp_group, op="max", tag="agree")
    hi, lo = t[0].item(), -t[1].item()
    if hi != lo:
        raise ValueError(f"ranks disagree on {what}: from {lo:g} to {hi:g}")


def agree_on_setup(ctx: ParallelContext, error: ValueError | None) -> None:
    """Collective check after each rank's local setup: if any rank failed, all raise.

    The lowest failing rank re-raises its own error (the one line the user sees); the others
    raise ``PeerError``. Two max all-reduces (over TP, then DP) cover the whole world.
    """
    code = torch.tensor([float(ctx.world_size - ctx.rank) if error else 0.0], device=ctx.device)
    comm.all_reduce_(code, ctx.tp_group, op="max", tag="setup-check")
    comm.all_reduce_(code, ctx.dp_group, op="max", tag="setup-check")
    if code.item() == 0:
        return
    first = ctx.world_size - int(code.item())
    if ctx.rank == first:
        assert error is not None
        raise error if first == 0 else ValueError(f"rank {first}: {error}")
    raise PeerError(f"setup failed on rank {first}")


def metrics_path(cfg: Config) -> Path:
    return Path(cfg.train.metrics_file or Path(cfg.train.run_dir) / "metrics.jsonl")


def _open_metrics(path: Path, start_step: int) -> TextIO:
    """Open the metrics file: new for a fresh run, cut back to ``start_step`` when resuming."""
    kept: list[str] = []
    if start_step > 0 and path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                if json.loads(line).get("step", 0) <= start_step:
                    kept.append(line + "\n")
            except ValueError:
                continue
    fh = path.open("w", encoding="utf-8")
    fh.writelines(kept)
    fh.flush()
    return fh


def save_timeline(timeline: Timeline, ctx: ParallelContext, path: Path, title: str) -> None:
    """Gather one step's timeline from every rank; rank 0 draws it (and writes the trace)."""
    merged = timeline.gather(ctx.world_group)
    if ctx.rank == 0:  # rank 0 alone: nothing here may raise, or the others would wait on it
        try:
            merged.save_chrome_trace(path.with_suffix(".json"))
            merged.plot(path, title=title)
        except (ImportError, OSError, ValueError) as exc:
            print(f"warning: timeline picture not written ({exc})", file=sys.stderr, flush=True)


def _autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if device.type == "cuda":  # bf16 compute, fp32 parameters/grads/optimizer (master weights)
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train(
    cfg: Config, *, log: TextIO | None = None, stop_after: int | None = None
) -> dict[str, Any]:
    """Run ``cfg`` on this rank; returns a summary (losses, validation loss, checkpoint, time).

    ``stop_after`` ends this call after that many global steps (counted from step 0, so a
    resumed run stops at the same place), with a checkpoint, as a stopped job would; the LR
    schedule still follows ``train.steps``.
    """
    groups = dict(timeout_s=cfg.parallel.timeout_s, backend=cfg.parallel.backend)
    # with a plan, its degrees' groups are built once every rank has read it
    ctx = init_distributed(tp=1 if cfg.parallel.plan else cfg.parallel.tp, **groups)
    t, S = cfg.train, cfg.model.seq_len
    is_main = ctx.rank == 0
    end = t.steps if stop_after is None else min(t.steps, stop_after)

    bar: Progress | None = None

    def say(msg: str) -> None:
        if is_main:
            if bar is not None:
                bar.message(msg)  # keeps the progress bar intact
            else:
                print(msg, file=log, flush=True)

    error: ValueError | None = None
    resume_from: Path | None = None
    plan: ParallelPlan | None = None
    try:  # local setup only: no collective until every rank agrees it succeeded
        plan = check_config(cfg, ctx.world_size)
    except ValueError as exc:
        error = exc
    agree_on_setup(ctx, error)
    if plan is None:
        plan = ParallelPlan.uniform(cfg.model, ctx.world_size, ctx.tp)
    else:
        agree_on_value(ctx, zlib.crc32(plan.to_json().encode()) % (1 << 24),
                       "parallel.plan (every machine must read the same plan)")
        ctx = init_distributed(tp=plan.tp_of("embed"), degrees=plan.degrees(), **groups)
    try:
        resume_from = ckpt.resolve_resume(cfg)
        if resume_from is not None:
            check_resume_compatible(cfg, ckpt.read_manifest(resume_from), resume_from)
        corpus: Corpus = load_corpus(cfg.data.source)
        tok = build_run_tokenizer(cfg, corpus, resume_from)
        corpus = tokenize_corpus(corpus, tok)
        where = f"data.source={cfg.data.source!r}:"
        train_data = PackedBatches(
            corpus.train,
            S,
            t.global_batch,
            dp_rank=ctx.dp_rank,
            dp=ctx.dp,
            seed=t.seed,
            name=f"{where} the training split",
        )
        val_data = PackedBatches(
            corpus.val,
            S,
            t.global_batch,
            dp_rank=ctx.dp_rank,
            dp=ctx.dp,
            shuffle=False,
            name=f"{where} the validation split",
        )
        if is_main:
            for key, folder in (("train.run_dir", Path(t.run_dir)),
                                ("train.metrics_file", metrics_path(cfg).parent),
                                ("checkpoint.dir", ckpt.checkpoint_root(cfg))):
                try:
                    folder.mkdir(parents=True, exist_ok=True)
                except OSError as exc:
                    raise ValueError(f"{key}: cannot create {folder} ({exc.strerror})") from None
    except ValueError as exc:
        error = exc
    agree_on_setup(ctx, error)
    # every rank must resume from the same step (a checkpoint dir not shared by all machines,
    # or a lagging network filesystem, would otherwise split the job)
    resume_step = -1 if resume_from is None else int(ckpt.read_manifest(resume_from)["step"])
    agree_on_value(ctx, resume_step, "the checkpoint step to resume from "
                   "(checkpoint.dir must be one folder every machine sees)")

    torch.manual_seed(t.seed)  # same full model on every rank before sharding
    if cfg.model.init_from and resume_from is None:  # each rank reads only its own slices
        from oases.hf import load_hf

        _, model = load_hf(cfg.model.init_from[3:], ctx, plan, max_seq_len=cfg.model.seq_len,
                           dropout=cfg.model.dropout)
        n_params = cfg.model.num_params()
    else:
        model = build_model(cfg.model)
        n_params = count_params(model)
        parallelize(model, ctx, plan)
    model.train()
    optimizer = build_optimizer(model, t)
    schedule = build_schedule(
        cfg.schedule.name,
        n_sub=cfg.schedule.n_sub,
        micro_batch=t.micro_batch,
        max_inflight=cfg.schedule.max_inflight,
    )
    meshes = {d: build_tp_mesh(ctx, d) for d in plan.degrees()}  # checkpoints' DTensors
    tp_groups = {pid: ctx.groups_for(d)[0] for pid, d in parameter_degrees(model).items()}
    losses_over = loss_group(model, ctx)
    start_step = 0
    if resume_from is not None:
        try:  # local checks first (complete, sizes, shapes), so a bad checkpoint never hangs
            ckpt.check_checkpoint(resume_from, model, optimizer, ctx)
        except ValueError as exc:
            error = exc
        agree_on_setup(ctx, error)
        manifest = ckpt.load_checkpoint(resume_from, model, optimizer, ctx, meshes)
        start_step = int(manifest["step"])
        train_data.load_state_dict(manifest["extras"]["data"])

    run_dir = Path(t.run_dir)
    metrics: TextIO | None = None
    tokenizer_files: dict[str, Path] = {}
    if is_main:
        save_config(cfg, run_dir / "config.toml")
        metrics = _open_metrics(metrics_path(cfg), start_step)
        saved_tok = save_tokenizer(tok, run_dir)
        if saved_tok is not None:
            tokenizer_files[TOKENIZER_FILE] = saved_tok
    say(
        f"oases train: {ctx}\nconfig (written to {run_dir / 'config.toml'}; metrics to"
        f" {metrics_path(cfg)}):\n" + _format_config(cfg)
    )
    say(
        f"model: {cfg.model.arch} {n_params / 1e6:.2f}M parameters; data: {cfg.data.source}"
        f" {len(corpus.train) / 1e6:.2f}M train / {len(corpus.val) / 1e6:.2f}M val tokens"
        f" ({len(corpus.train_files)} + {len(corpus.val_files)} files)"
    )
    if cfg.parallel.plan:  # the plan's schedule runs it (apply_plan_knobs)
        layout = (f"every region tp={plan.degrees()[0]}" if plan.is_uniform() else
                  ", ".join(f"{r.name} tp={r.tp}" for r in plan.regions))
        say(f"plan ({cfg.parallel.plan}): {plan.schedule}, n_sub={plan.n_sub}; {layout}")
    if resume_from is not None:
        saved_degrees = sorted(set(manifest.get("degrees", {}).values()) | {manifest["tp"]})
        say(f"resumed from {resume_from} at step {start_step} (saved at tp="
            f"{'/'.join(map(str, saved_degrees))} on {manifest['world_size']} ranks)")

    def write(row: dict[str, Any]) -> None:
        if metrics is not None:
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()

    def run_eval(step: int) -> float:
        with _autocast(ctx.device):
            value = evaluate(model, val_data, ctx, t.eval_batches)
        write({"step": step, "val_loss": value})
        say(f"step {step:5d}/{t.steps}  validation loss {value:.4f}")
        return value

    def save(step: int) -> Path:
        extras = {"data": train_data.state_dict(), "lr": lr_at(max(0, step - 1), t)}
        path = ckpt.save_checkpoint(ckpt.checkpoint_root(cfg), step, model, optimizer, extras,
                                    cfg, ctx, meshes, cfg.checkpoint.keep, tokenizer_files)
        say(f"step {step:5d}/{t.steps}  checkpoint {path}")
        return path

    tokens_per_step = t.global_batch * S
    loss, val_loss = float("nan"), float("nan")
    losses: list[float] = []
    grad_norms: list[float] = []
    evaluated_at = saved_at = -1
    saved: Path | None = resume_from
    window: list[tuple[float, float]] = []  # (loss, step_time_s) since the last printed line
    # rank 0 on a terminal draws a progress bar; logs and pipes get plain lines
    tty = is_main and log is None and sys.stdout.isatty() and end > start_step
    bar = Progress(end - start_step, stream=sys.stdout) if tty else None
    timeline_step = start_step + 1 if end - start_step > 1 else start_step
    start = time.perf_counter()
    try:
        for step in range(start_step, end):
            faults.on_step(step + 1)  # testing hook (train/faults.py); returns at once unless armed
            t0 = time.perf_counter()
            lr = lr_at(step, t)
            for group in optimizer.param_groups:
                group["lr"] = lr
            tokens, targets = train_data.next_batch()
            recording = record_timeline() if step == timeline_step else contextlib.nullcontext()
            with _autocast(ctx.device), recording as timeline:
                local = schedule.step(model, tokens.to(ctx.device), targets.to(ctx.device))
            if timeline is not None:  # one step's picture, the second of the run (warmed up)
                save_timeline(timeline, ctx, run_dir / "timeline.png",
                              f"{cfg.schedule.name}, step {step + 1}, {ctx}")
            grad_norm = clip_grad_norm_(model.parameters(), t.grad_clip, ctx.tp_group,
                                        tp_groups)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss = float(comm.all_reduce_mean(local.float(), losses_over))
            if not math.isfinite(loss):  # the same on every rank: rank 0 reports it
                msg = f"loss became {loss} at step {step + 1}; try a lower train.lr={t.lr}"
                raise ValueError(msg) if is_main else PeerError(msg)
            dt = time.perf_counter() - t0
            losses.append(loss)
            grad_norms.append(grad_norm)
            write({
                "step": step + 1,
                "loss": loss,
                "lr": lr,
                "grad_norm": grad_norm,
                "step_time_s": dt,
                "tokens_per_s": tokens_per_step / dt,
                "peak_mem_mb": peak_memory_mb(ctx.device),
            })
            window.append((loss, dt))
            if bar is not None:
                bar.update(step + 1 - start_step, loss, tokens_per_step / dt)
            elif (step + 1) % t.log_every == 0 or step == start_step or step + 1 == end:
                mean_loss = sum(x for x, _ in window) / len(window)
                rate = tokens_per_step * len(window) / sum(d for _, d in window)
                say(
                    f"step {step + 1:5d}/{t.steps}  loss {mean_loss:.4f}  lr {lr:.2e}"
                    f"  grad_norm {grad_norm:.3f}  {rate:,.0f} tok/s"
                    f"  elapsed {time.perf_counter() - start:.1f}s"
                )
                window.clear()
            if t.eval_every and (step + 1) % t.eval_every == 0:
                val_loss, evaluated_at = run_eval(step + 1), step + 1
            if cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0:
                saved, saved_at = save(step + 1), step + 1
        final = max(start_step, end)
        if bar is not None:
            bar.close()
        if evaluated_at != final:
            val_loss = run_eval(final)
        if saved_at != final and final > start_step:
            saved = save(final)
        if t.sample_tokens:  # every rank samples (the logits are gathered over TP)
            prompt = torch.tensor([[tok.doc_sep_id]], device=ctx.device)
            out = generate(model, prompt, t.sample_tokens, generator=sampling_generator(t.seed),
                           replicas=plan.tp_of("embed") // min(plan.degrees()))
            say("sample:\n" + tok.decode(out[0, 1:].tolist()))
    finally:
        if metrics is not None:
            metrics.close()
    elapsed = time.perf_counter() - start
    say(
        f"done: step {max(start_step, end)}/{t.steps} in {elapsed:.1f}s; "
        + (f"final train loss {loss:.4f}, " if losses else "no steps left to train; ")
        + f"validation loss {val_loss:.4f}"
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
