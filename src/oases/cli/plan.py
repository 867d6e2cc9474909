"""``oases plan``: a TP degree per region and a schedule under a memory budget, written as a plan
file; with ``--verify``, every candidate then measured beside its prediction."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from oases.cli.command import BENCH_CONFIG, SubCommand
from oases.config import Config, load_config
from oases.stages import PIPELINE_SCHEDULES

if TYPE_CHECKING:
    from oases.planner.pipeline_search import PipelineSearch
    from oases.planner.search import Candidate, SearchStats
    from oases.planner.search_prefetch import Beside


def _plan_arguments(plan: argparse.ArgumentParser) -> None:
    from oases.planner.budget import DEFAULT_BUDGET_HELP

    plan.add_argument(
        "config",
        nargs="?",
        default=str(BENCH_CONFIG),
        help=f"TOML run file (default: {BENCH_CONFIG})",
    )
    plan.add_argument(
        "--world-size",
        type=int,
        required=True,
        metavar="N",
        help="ranks (GPUs) to plan for; the batch is the config's "
        "train.global_batch, fed train.micro_batch sequences per model replica "
        "(per DP rank) at parallel.tp, which every plan keeps across the world",
    )
    plan.add_argument("--memory-gb", type=float, default=0.0, metavar="G", help=DEFAULT_BUDGET_HELP)
    source = plan.add_mutually_exclusive_group(required=True)
    source.add_argument("--profile", metavar="FILE", help="a profile from `oases profile`")
    source.add_argument(
        "--hardware",
        metavar="PRESET",
        help="a hardware/cluster preset name or a cluster TOML/JSON file",
    )
    plan.add_argument(
        "--schedules", default=None, help="comma-separated schedules to consider (default: all)"
    )
    plan.add_argument(
        "--zero",
        type=int,
        choices=(0, 1, 2, 3),
        default=None,
        help="ZeRO stage of every plan (default: search 0-3, one per plan)",
    )
    plan.add_argument(
        "--max-tp",
        type=int,
        default=None,
        metavar="T",
        help="search TP degrees up to T only (default: every candidate degree)",
    )
    plan.add_argument(
        "--sequence-parallel",
        default="auto",
        choices=("auto", "off", "gathered", "shards"),
        help="sequence parallelism: auto searches both recompute modes beside "
        "plans without it (default); off: none; gathered/shards: only that mode "
        "beside plans without it",
    )
    plan.add_argument(
        "--fixed-micro-batch",
        action="store_true",
        help="keep train.micro_batch (default: also search 2^j times it, "
        "|j| <= 3, under the same train.global_batch)",
    )
    plan.add_argument(
        "--exhaustive",
        action="store_true",
        help="the reference search: every chain solved and every plan simulated by walking "
        "its instructions (slow; the same plan as the default search)",
    )
    plan.add_argument(
        "--pp",
        default="1",
        metavar="auto|P[,P...]",
        help="pipeline stages: 1 none (default); auto every depth that divides the world "
        "and fits the servers; or the depths given. Searched together with the stage "
        "boundaries, the pipeline order, the micro-batch, TP, schedule, ZeRO and sp; the "
        "faster of the best plans with and without a pipeline is written",
    )
    plan.add_argument(
        "--pp-schedules",
        default=",".join(PIPELINE_SCHEDULES),
        help="with --pp: pipeline orders to consider (default: %(default)s)",
    )
    plan.add_argument("--out", default="plan.json", help="plan file to write")
    plan.add_argument(
        "--verify",
        metavar="DIR",
        default=None,
        help="then run every uniform candidate and the chosen plan on "
        "--world-size local ranks and write prediction vs measurement to DIR",
    )
    plan.add_argument(
        "--link", default="none", help="with --verify: none, a tbf rate (200mbit) or auto:PRESET"
    )
    plan.add_argument("--steps", type=int, default=4, help="with --verify: timed steps")
    plan.add_argument("--warmup", type=int, default=2, help="with --verify: warm-up steps")
    plan.add_argument(
        "--rounds", type=int, default=2, help="with --verify: launches per candidate, interleaved"
    )
    plan.add_argument(
        "--candidates",
        choices=("all", "chosen"),
        default="all",
        help="with --verify: every uniform candidate and the chosen plan, or only the chosen plan",
    )


def _plan(ns: argparse.Namespace, overrides: list[str]) -> int:
    from oases.planner import costs_budget, format_candidates, load_costs, search_plans
    from oases.planner.report import plan_header, run_command, searched_line
    from oases.planner.search import SearchStats
    from oases.planner.search_prefetch import use_spare_core

    use_spare_core()  # the search walks the next chain beside the current one
    cfg = load_config(ns.config, overrides)
    if ns.world_size < 1:
        raise ValueError(f"--world-size={ns.world_size} must be >= 1")
    costs = load_costs(
        ns.profile or f"hw:{ns.hardware}",
        cfg.model,
        cfg.train.precision,
        cfg.parallel.grad_reduce_dtype,
    )
    budget = costs_budget(ns.memory_gb, costs)
    schedules = tuple(s for s in ns.schedules.split(",") if s) if ns.schedules else None
    zeros = (0, 1, 2, 3) if ns.zero is None else (ns.zero,)
    sps = {"auto": ("gathered", "shards"), "off": ()}.get(
        ns.sequence_parallel, (ns.sequence_parallel,)
    )
    stats = SearchStats()
    # the pipeline search reads nothing of the flat one: beside it, on the spare core
    pipelines_job = _pipelines(ns, cfg, costs, budget.bytes, schedules, zeros, sps)
    found = search_plans(
        cfg,
        ns.world_size,
        costs,
        budget.bytes,
        schedules,
        zeros=zeros,
        search_micro_batch=not ns.fixed_micro_batch,
        max_tp=ns.max_tp,
        sps=sps,
        progress=_Progress(),
        stats=stats,
        exhaustive=ns.exhaustive,
    )
    best, candidates = found.best, found.candidates
    pipelines = None if pipelines_job is None else pipelines_job.result()
    if pipelines is not None:
        from oases.planner.pipeline_search import choose

        best = choose(best, pipelines)
        candidates = [*candidates, *pipelines.candidates]
    best.plan.save(ns.out)
    text = "\n".join(
        [
            plan_header(
                ns.config,
                cfg,
                costs,
                ns.profile,
                ns.world_size,
                budget,
                searched_micro_batch=not ns.fixed_micro_batch,
            ),
            "",
            format_candidates(
                best,
                candidates,
                budget.bytes,
                tokens_per_step=cfg.train.global_batch * cfg.model.seq_len,
                simulated=stats.simulated,
            ),
            searched_line(stats, ns.exhaustive),
            *([] if pipelines is None else _pipeline_lines(pipelines, found.best, best)),
            *(
                ["kept out of the search:", *(f"  {line}" for line in found.excluded)]
                if found.excluded
                else []
            ),
        ]
    )
    print(text)
    print(f"wrote {ns.out}")
    cluster = getattr(costs, "cluster", None)
    print(
        run_command(
            ns.config,
            overrides,
            ns.out,
            ns.world_size,
            None if cluster is None else cluster.server.gpus_per_server,
        )
    )
    if ns.verify:
        if pipelines is not None and pipelines.best is not None and pipelines.best is not best:
            best_pp = [pipelines.best]  # measured too: the best pipeline plan beside the chosen
        else:
            best_pp = []
        return _verify(ns, overrides, cfg, best, candidates, budget.bytes, text, costs, best_pp)
    from oases.planner.simulate import release_programs

    release_programs()  # (nothing more to build: freed here, faster than by the exit)
    return 0


def _pipelines(
    ns: argparse.Namespace,
    cfg: Config,
    costs: object,
    budget: float,
    schedules: tuple[str, ...] | None,
    zeros: tuple[int, ...],
    sps: tuple[str, ...],
) -> Beside | None:
    """``--pp``: the pipeline search, its options checked here and the search started beside
    the caller's (``search_prefetch.Beside``: ``result()`` is its ``PipelineSearch``); None at
    ``--pp 1``."""
    from oases.plan import region_names
    from oases.planner.jit import load_for
    from oases.planner.pipeline_search import (
        PIPELINE_ZEROS,
        search_config_pipelines,
    )
    from oases.planner.search_prefetch import Beside
    from oases.stages import check_pipeline_schedule

    if ns.pp == "1":
        return None
    try:
        depths = () if ns.pp == "auto" else tuple(int(p) for p in ns.pp.split(","))
    except ValueError:
        raise ValueError(f"--pp={ns.pp!r} must be 1, auto or depths like 2,4") from None
    for p in depths:
        if p < 2 or ns.world_size % p:
            raise ValueError(f"--pp {p} must be a divisor > 1 of --world-size {ns.world_size}")
    orders = tuple(o for o in ns.pp_schedules.split(",") if o)
    for o in orders:
        check_pipeline_schedule(o)
    kw = {"schedules": schedules} if schedules is not None else {}
    search = functools.partial(
        search_config_pipelines,
        cfg,
        ns.world_size,
        costs,
        budget,
        pp_options=depths,
        pp_schedules=orders,
        zeros=tuple(z for z in zeros if z in PIPELINE_ZEROS),
        sps=sps,
        search_micro_batch=not ns.fixed_micro_batch,
        max_tp=ns.max_tp,
        **kw,
    )
    load_for(len(region_names(cfg.model)))  # (the compiled walk loaded once, before the fork)
    return Beside(search)


def _pipeline_lines(found: PipelineSearch, flat: Candidate, chosen: Candidate) -> list[str]:
    """What the pipeline search found, beside the best plan without a pipeline."""
    lines = [
        f"pipelines: {found.screened} combinations screened ({found.mixed} stage layouts with "
        f"a TP degree per region), {found.walked} walked whole, {found.wall_s:.1f} s"
    ]
    fitting = sorted((c for c in found.candidates if c.fits), key=lambda c: c.result.step_s)
    for c in fitting[:5]:
        lines.append(
            f"  {c.result.step_s:.4g} s, {c.result.peak_mem_bytes / 2**30:.2f} GiB, "
            f"bound by {c.result.bound()}: {c.label()}"
        )
    if not fitting:
        lines.append("  no pipeline plan fits the budget")
    lines += [f"  {note}" for note in found.notes]
    lines.append(
        f"best without a pipeline {flat.result.step_s:.4g} s"
        + ("" if flat.fits else " (over the budget)")
        + (f"; best with one {found.best.result.step_s:.4g} s" if found.best is not None else "")
        + f"; chosen: {chosen.label()}"
    )
    return lines


class _Progress:
    """What ``oases plan`` prints while it searches (to stderr, from ``AFTER_S`` seconds on,
    every ``EVERY_S``): chains and plans so far and the best plan found that fits."""

    AFTER_S, EVERY_S = 3.0, 2.0

    def __init__(self) -> None:
        self.shown = 0.0

    def __call__(self, stats: SearchStats, n_candidates: int) -> None:
        if stats.wall_s < self.AFTER_S or stats.wall_s - self.shown < self.EVERY_S:
            return
        self.shown = stats.wall_s
        best = (
            "none fits yet"
            if stats.best is None
            else f"best so far {stats.best.result.step_s:.4g} s per step ({stats.best.label()})"
        )
        print(
            f"searching: {stats.wall_s:.0f} s, {stats.chains} chains solved "
            f"({stats.skipped_chains} skipped by their bounds), {stats.simulated} plans "
            f"simulated, {n_candidates} candidates; {best}",
            file=sys.stderr,
            flush=True,
        )


def _verify(
    ns: argparse.Namespace,
    overrides: list[str],
    cfg: Config,
    best: Candidate,
    candidates: list[Candidate],
    budget: float,
    text: str,
    costs: object,
    also: list[Candidate],
) -> int:
    from oases.bench.suite import resolve_link
    from oases.planner.profile import Profile
    from oases.planner.verify import (
        format_rows,
        format_summary,
        measure_candidates,
        predict_from_retimed,
        summarize,
        write_report,
    )

    if ns.steps < 1 or ns.warmup < 0 or ns.rounds < 1:
        raise ValueError(
            f"--steps={ns.steps} and --rounds={ns.rounds} must be >= 1 and "
            f"--warmup={ns.warmup} >= 0"
        )
    out = Path(ns.verify)
    out.mkdir(parents=True, exist_ok=True)
    rate, label, _ = resolve_link(ns.link, ns.config, overrides, ns.world_size, cfg.parallel.tp)
    chosen = [best, *also]
    if ns.candidates == "all":
        chosen += [
            c
            for c in candidates
            if c is not best
            and c not in also
            and (c.kind == "uniform" or (c.fits and not c.plan.is_uniform()))
        ]  # and every mixed plan the search found
    profiled = isinstance(costs, Profile)  # re-time the pieces as the profile timed them
    rows = measure_candidates(
        ns.config,
        overrides,
        chosen,
        ns.world_size,
        rate,
        ns.steps,
        ns.warmup,
        out,
        ns.rounds,
        retime=profiled,
    )
    if profiled:
        predict_from_retimed(
            rows, chosen, costs, cfg.model, ns.world_size, cfg.schedule.max_inflight
        )
    summary = summarize(rows, best.label(), budget) | {"link": label}
    write_report(rows, summary, out, text)
    print(format_rows(rows, summary["chosen"]))
    print(format_summary(summary))
    print(f"wrote {out / 'report.md'}")
    return 0


PLAN = SubCommand(
    name="plan",
    help="choose every region's TP degree and the schedule under a memory budget",
    description="Simulate every uniform plan and schedule, solve for a degree per region "
    "under the budget, print the chosen plan beside the others (each with what bounds its "
    "step), write it and print the command that runs it.",
    add_arguments=_plan_arguments,
    run=_plan,
    takes_overrides=True,
    launches_ranks=True,
)
