"""Settings that do nothing in a run's layout: one warning line each, naming why.

``no_effect_warnings(given, resolved, plan, world_size)`` compares the config as the user gave
it (``given``) with the one ``setup.resolve_setup`` made of it (``resolved``: the plan's knobs
applied) and the layout (``plan``: every region's degree and stage), and says, per setting:

    replaced by the plan      schedule.name, schedule.n_sub, parallel.zero,
                              parallel.sequence_parallel, parallel.sp_recompute: a value other
                              than the built-in default that the plan's replaced (one line for
                              all of them)
    no data parallelism       parallel.zero > 0, parallel.grad_reduce_dtype = "bf16" where
                              every region has dp = 1: nothing to shard or reduce
    nothing to slice          parallel.sequence_parallel at tp = 1 in every region
    nothing it changes        parallel.sp_recompute = "shards" without sequence parallelism, or
                              with a block-recompute schedule (the same program);
                              parallel.reshard_after_forward = false without a stage-3 region;
                              schedule.n_sub for a schedule that runs micro-batches whole;
                              parallel.high_priority_tp on gloo (CUDA streams only);
                              checkpoint.allow_data_change with checkpoint.resume = "never"

Settings that are surely a mistake are errors where they are checked (``config.sections``:
``parallel.profile`` or ``parallel.memory_gb`` without ``parallel.plan = "auto"``;
``schedule.program.ScheduleSpec.check_n_sub``: merak with one sub-batch), not here. Only
values other than the built-in default are named for the "replaced" and "nothing it changes"
kinds: a default was not the user's choice.
"""

from __future__ import annotations

import dataclasses

from oases.config import Config
from oases.plan import ParallelPlan
from oases.schedule.program import SPECS
from oases.schedule.specs import shards_differ

# (section, key) a plan replaces and ignores, in the order the warning names them. Not
# parallel.tp and train.micro_batch: with a plan they are the unit its batch counts in (the
# micro-batch per replica at parallel.tp that ``oases plan`` read), so they are used, and the
# start-up block's batch line says what runs.
PLAN_KEYS = (
    ("schedule", "name"),
    ("schedule", "n_sub"),
    ("parallel", "zero"),
    ("parallel", "sequence_parallel"),
    ("parallel", "sp_recompute"),
)


def _default(section: str, key: str) -> object:
    cls = type(getattr(Config(), section))
    return next(f.default for f in dataclasses.fields(cls) if f.name == key)


def _value(cfg: Config, section: str, key: str) -> object:
    return getattr(getattr(cfg, section), key)


def _set(cfg: Config, section: str, key: str) -> bool:
    """Did the user set ``section.key`` to something other than its built-in default?"""
    return _value(cfg, section, key) != _default(section, key)


def no_effect_warnings(
    given: Config, resolved: Config, plan: ParallelPlan | None, world_size: int
) -> list[str]:
    """The warning lines (see the module docstring); ``plan`` None: uniform at
    ``resolved.parallel.tp``."""
    p, g = resolved.parallel, given.parallel
    layout = plan or ParallelPlan.uniform(
        resolved.model, world_size, p.tp, pp=p.pp, pp_schedule=p.pp_schedule
    )
    out: list[str] = []
    if plan is not None:
        replaced = [
            f"{s}.{k}={_value(given, s, k)!r} (runs {_value(resolved, s, k)!r})"
            for s, k in PLAN_KEYS
            if _set(given, s, k) and _value(given, s, k) != _value(resolved, s, k)
        ]
        if replaced:
            out.append(
                f"the plan ({p.plan}) replaces {', '.join(replaced)}: those settings "
                "have no effect with parallel.plan"
            )
    dps = {r.dp for r in layout.regions}
    stages = layout.zero_stages(p.zero)
    if any(stages) and all(r.dp == 1 for r, z in zip(layout.regions, stages) if z):
        out.append(
            f"ZeRO stage {max(stages)} has no effect: dp=1 (world size {world_size} / "
            f"tp {layout.tp_of('embed')}), no data-parallel group to shard over"
        )
    if g.grad_reduce_dtype != "fp32" and dps == {1}:
        out.append(
            f"parallel.grad_reduce_dtype={g.grad_reduce_dtype!r} has no effect: dp=1, "
            "no data-parallel gradient reduction"
        )
    sp_on = resolved.parallel.sp() is not None
    if sp_on and layout.degrees() == (1,):
        out.append(
            "sequence parallelism has no effect at tp=1: nothing to slice "
            "(parallel.sequence_parallel with a degree above 1 slices the sequence)"
        )
    spec = SPECS.get(resolved.schedule.name)
    if _set(given, "parallel", "sp_recompute") and not sp_on:
        out.append(
            f"parallel.sp_recompute={g.sp_recompute!r} has no effect without "
            "sequence parallelism (parallel.sequence_parallel=false)"
        )
    elif (
        _set(given, "parallel", "sp_recompute")
        and resolved.parallel.sp() == "shards"
        and spec is not None
        and not shards_differ(spec.recompute)
    ):
        out.append(
            f"parallel.sp_recompute='shards' has no effect: {resolved.schedule.name} "
            "recomputes each block from its input's slice either way (it changes the "
            "schedules without recompute and the communication-free recompute)"
        )
    if not g.reshard_after_forward and 3 not in stages:
        out.append(
            "parallel.reshard_after_forward=false has no effect: no region is at ZeRO "
            "stage 3, whose gathered weights it keeps"
        )
    if (
        plan is None
        and spec is not None
        and not spec.overlapped
        and given.schedule.n_sub != _default("schedule", "n_sub")
        and given.schedule.n_sub != 1
    ):
        overlapped = ", ".join(n for n, s in SPECS.items() if s.overlapped)
        out.append(
            f"schedule.n_sub={given.schedule.n_sub} has no effect: "
            f"{resolved.schedule.name} runs each micro-batch whole (sub-batches are "
            f"the overlapped schedules': {overlapped})"
        )
    if layout.pp == 1 and _set(given, "parallel", "pp_schedule"):
        out.append(
            f"parallel.pp_schedule={g.pp_schedule!r} has no effect at parallel.pp=1: "
            "it orders the passes of pipeline stages"
        )
    if layout.pp == 1 and _set(given, "parallel", "pp_chunks"):
        out.append(
            f"parallel.pp_chunks={g.pp_chunks} has no effect at parallel.pp=1: it cuts "
            "pipeline stages into model chunks"
        )
    if g.high_priority_tp and _on_gloo(g.backend):
        out.append(
            "parallel.high_priority_tp=true has no effect on gloo: it sets NCCL's CUDA "
            "stream priority"
        )
    if given.checkpoint.allow_data_change and given.checkpoint.resume == "never":
        out.append(
            "checkpoint.allow_data_change=true has no effect with "
            "checkpoint.resume='never': a fresh run resumes on no data"
        )
    return out


def _on_gloo(backend: str) -> bool:
    if backend != "auto":
        return backend == "gloo"
    import torch

    return not torch.cuda.is_available()


def bench_entry_warnings(entries: list[tuple[str, int]], dp: int) -> list[str]:
    """``oases bench``: an entry's ZeRO stage (``(entry, zero)``) at dp=1 shards nothing."""
    return [
        f"bench entry {entry!r}: ZeRO stage {zero} has no effect at dp=1 (no data-parallel "
        "group to shard over)"
        for entry, zero in entries
        if zero and dp == 1
    ]
