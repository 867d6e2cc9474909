"""What rank 0 says about a run as a whole: the start-up block (the resolved config, the model and
data, the effective run), the resume line and the done line; and the step's timeline picture.

    oases train: rank 0/2 tp=1 (tp_rank 0) dp=2 (dp_rank 0) gloo on cpu
    config (written to runs/x/config.toml; metrics to runs/x/metrics.jsonl):
      [model] arch=gpt2 n_layers=2 ...                  the resolved config, as config.toml
    model: gpt2 0.14 M parameters; data: stdlib ...
    layout:    2 ranks = tp=1 x dp=2; every region tp=1  EffectiveRun.describe: the one place
    plan (plan.json): megatron, n_sub=1, zero=1; ...     the layout, plan, schedule, ZeRO,
    schedule:  megatron, n_sub=1; no sequence parallelism  precision and batch are logged
    ZeRO:      stage 1 over dp=2
    precision: auto = fp32 compute and activations, ...
    batch:     8 sequences a step = 1 micro-batch x 4 sequences (per model replica) x dp=2
    resumed from runs/x/checkpoints/step_000006 at step 6 (saved at tp=1 on 2 ranks); changed
      since: zero 1 -> 0, precision auto -> fp64, compute_dtype fp32 -> fp64, ...
    ...
    done: step 12/12; steps 7-12 in 0.9s (resumed at step 6: ...); final train loss ...
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from oases.config import Config, config_to_dict, format_params
from oases.parallel.context import ParallelContext
from oases.plan import ParallelPlan
from oases.schedule import Timeline
from oases.train.effective import EffectiveRun, saved_record


def format_config(cfg: Config) -> str:
    """The resolved config, a line per section."""
    return "\n".join(
        f"  [{section}] " + " ".join(f"{k}={v}" for k, v in values.items())
        for section, values in config_to_dict(cfg).items()
    )


def startup_lines(
    ctx: ParallelContext,
    cfg: Config,
    run: EffectiveRun,
    config_path: Path,
    metrics: Path,
    model: str,
) -> list[str]:
    """Rank 0's first lines: who it is, the config, ``model`` (the model and data line), and
    the effective run (``EffectiveRun.describe``)."""
    return [
        f"oases train: {ctx}",
        f"config (written to {config_path}; metrics to {metrics}):\n" + format_config(cfg),
        model,
        *run.describe(),
    ]


def model_line(cfg: Config, n_params: int, data: str) -> str:
    return f"model: {cfg.model.arch} {format_params(n_params)} parameters; data: {data}"


def resume_line(path: Path, step: int, manifest: dict[str, Any], run: EffectiveRun) -> str:
    """``resumed from PATH at step N (saved at tp=... on W ranks)``, and every field of the
    effective run that differs from the checkpoint's record (``EffectiveRun.changes``)."""
    degrees = sorted(set(manifest.get("degrees", {}).values()) | {manifest["tp"]})
    pp = manifest.get("run", {}).get("pp", 1)
    stages = f"pp={pp} x " if pp > 1 else ""
    line = (
        f"resumed from {path} at step {step} (saved at {stages}"
        f"tp={'/'.join(map(str, degrees))} on {manifest['world_size']} "
        f"rank{'s' if manifest['world_size'] > 1 else ''})"
    )
    changed = run.changes(saved_record(manifest))
    if changed:
        return f"{line}; changed since: {', '.join(changed)}"
    return f"{line}; the same layout, schedule, ZeRO, precision and batch"


def done_line(end: int, steps: int, start_step: int, elapsed_s: float) -> str:
    """The head of the last line: what ``elapsed_s`` counts (this launch's steps only: a
    resumed run's earlier steps ran in an earlier launch, which ``--max-restarts`` times with
    its own line)."""
    if start_step == 0:
        return f"done: step {end}/{steps} in {elapsed_s:.1f}s"
    if end <= start_step:
        return f"done: step {end}/{steps} (resumed at step {start_step}, nothing left to train)"
    return (
        f"done: step {end}/{steps}; steps {start_step + 1}-{end} in {elapsed_s:.1f}s "
        f"(resumed at step {start_step}: steps 1-{start_step} ran in an earlier launch)"
    )


def timeline_title(cfg: Config, plan: ParallelPlan, world_size: int, step: int) -> str:
    """What ``timeline.png`` shows: the schedule, the step, the layout and the ranks drawn
    (every rank: ``save_timeline`` gathers them all)."""
    if plan.is_uniform():
        tp = plan.degrees()[0]
        layout = f"tp={tp} x dp={world_size // (plan.pp * tp)}"
    else:
        layout = f"mixed plan ({plan.degree_runs()})"
    if plan.pp > 1:
        layout = f"pp={plan.pp} ({plan.pp_schedule}) x {layout}"
    ranks = f"ranks 0-{world_size - 1}" if world_size > 1 else "rank 0"
    return f"{cfg.schedule.name} (n_sub={cfg.schedule.n_sub}), step {step}, {layout}: {ranks}"


def save_timeline(
    timeline: Timeline, ctx: ParallelContext, path: Path, title: str, n_sub: int | None = None
) -> None:
    """Gather one step's timeline from every rank; rank 0 draws it (and writes the trace).
    ``n_sub``: the sub-batches per micro-batch (None: read off the events, which a pipeline's
    warm-up forwards of several micro-batches mislead)."""
    merged = timeline.gather(ctx.world_group)
    if ctx.rank == 0:  # rank 0 alone: nothing here may raise, or the others would wait on it
        try:
            merged.save_chrome_trace(path.with_suffix(".json"))
            merged.plot(path, title=title, n_sub=n_sub)
        except Exception as exc:  # a picture never ends a run (and never strands the peers)
            print(
                f"warning: timeline picture not written ({type(exc).__name__}: {exc})",
                file=sys.stderr,
                flush=True,
            )
