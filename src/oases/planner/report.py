"""What ``oases plan`` and ``oases simulate`` print: the setting echoed at the top, each plan's
step cut into what bounds it, ``oases simulate``'s table and ``simulate.json``, and (for
``oases plan``) the command that runs the chosen plan.

A step's parts (``PlanResult.step_parts``) add up to the step::

    step = compute + TP comm + DP comm + reshard + bubble + optimizer

compute: the compute stream busy (recompute included); TP comm, DP comm, reshard: the time the
compute stream waits on those collectives (what overlap does not hide); bubble: the time a
pipeline stage waits on its neighbours' sends (of the slowest stage: ``planner.pipeline_walk``;
0 without a pipeline); optimizer: the AdamW step. The largest part bounds the step.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING

from oases.config import Config, format_params
from oases.planner.budget import Budget
from oases.planner.costs import matmul_params
from oases.planner.precision import precision_of
from oases.planner.search import Candidate, SearchStats
from oases.planner.simulate import PlanResult
from oases.planner.uncertainty import INPUTS
from oases.schedule.program import SPECS

if TYPE_CHECKING:
    from oases.planner.whatif import Report, Row

PARTS = ("compute", "TP comm", "DP comm", "reshard", "bubble", "optimizer")
DP_NOTE = (
    "bound by DP comm: the gradient all-reduce outlasts the backward it overlaps, so "
    "compute added to the backward (recompute) hides under it and such plans can take "
    "the same time; more micro-batches per step or a faster link between servers "
    "shorten its share"
)


@dataclass(frozen=True)
class TimeUnit:
    """One unit for every time of a table (its step and parts columns), named in its header:
    ms where the fastest step is under a second, else s."""

    name: str
    scale: float
    digits: int

    @staticmethod
    def for_step(fastest_s: float) -> TimeUnit:
        return TimeUnit("ms", 1e3, 2) if fastest_s < 1 else TimeUnit("s", 1.0, 3)

    def cell(self, seconds: float, width: int = 10) -> str:
        return f"{seconds * self.scale:>{width}.{self.digits}f}"


def parts_note(unit: TimeUnit) -> str:
    return (
        f"step = compute + TP comm + DP comm + reshard + bubble + optimizer (in {unit.name}, "
        "as the step column): compute is the compute stream busy (recompute included); TP "
        "comm, DP comm and reshard are the time it waits on those collectives (exposed, not "
        "hidden by overlap); bubble the time a pipeline stage waits on its neighbours (the "
        "slowest stage's parts); the largest part bounds the step"
    )


def searched_line(stats: SearchStats, exhaustive: bool = False) -> str:
    """One line: how long the search took and what it did (``search.SearchStats``)."""
    how = "exhaustive search" if exhaustive else "searched"
    return (
        f"{how} in {stats.wall_s:.1f} s: {stats.simulated} plans simulated, "
        f"{stats.chains} chains solved, {stats.skipped_chains} skipped by their bounds"
    )


def fmt_time(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.3f} s"


def parts_header() -> str:
    return f"{'bound':>10}" + "".join(f"{p:>10}" for p in PARTS)


def parts_cells(result: PlanResult, unit: TimeUnit) -> str:
    """The bound and the step's parts in ``unit``, aligned with ``parts_header``."""
    parts = result.step_parts()
    return f"{result.bound():>10}" + "".join(unit.cell(parts[p]) for p in PARTS)


def parts_json(result: PlanResult) -> dict:
    return {"bound": result.bound(), "step_parts_s": result.step_parts()}


def format_candidates(
    best: Candidate,
    candidates: list[Candidate],
    budget_bytes: float,
    top: int = 12,
    tokens_per_step: int | None = None,
    simulated: int | None = None,
) -> str:
    """The chosen plan, then the fastest uniform plan of each degree that fits, then the
    fastest other plans, each group fastest first with plans over the budget last; each row
    with tokens/s (given ``tokens_per_step``), peak memory, what bounds it and its parts, and
    why it loses (slower by how much, or over the budget by how much). ``simulated``: how many
    plans the search simulated in all (default: the candidates)."""

    def why(c: Candidate) -> str:
        if c is best:
            return "chosen"
        if not c.fits:
            return f"over budget by {(c.result.peak_mem_bytes - budget_bytes) / 2**30:.3f} GiB"
        return f"{c.result.step_s / best.result.step_s - 1:+.1%} slower"

    def row(c: Candidate) -> str:
        tokens = f"{tokens_per_step / c.result.step_s:>12,.0f}" if tokens_per_step else ""
        return (
            f"  {c.label():<{width}}{unit.cell(c.result.step_s, 12)}{tokens}"
            f"{c.result.peak_mem_bytes / 2**30:>10.3f}{parts_cells(c.result, unit)}  {why(c)}"
        )

    def order(c: Candidate) -> tuple[bool, float]:  # fastest first, over the budget last
        return (not c.fits, c.result.step_s)

    s = best.result
    unit = TimeUnit.for_step(min(c.result.step_s for c in candidates))
    width = max(44, *(len(c.label()) + 2 for c in candidates))
    tokens = f" = {tokens_per_step / s.step_s:,.0f} tokens/s" if tokens_per_step else ""
    lines = [
        f"chosen: {best.label()}; predicted {fmt_time(s.step_s)} per step{tokens}, peak "
        f"{s.peak_mem_bytes / 2**30:.3f} GiB per device"
        + ("" if budget_bytes == float("inf") else f" (budget {budget_bytes / 2**30:.3f} GiB)")
        + f"; bound by {s.bound()}",
        f"degrees by region: {best.plan.degree_runs()}",
        "",
        f"  {'plan':<{width}}{'step ' + unit.name:>12}"
        f"{'tokens/s' if tokens_per_step else '':>12}"
        f"{'peak GiB':>10}{parts_header()}",
    ]
    chosen_tp = best.plan.degrees()[0] if best.plan.is_uniform() else None
    uniform: dict[int, Candidate] = {}
    for c in candidates:  # the chosen plan is already the fastest of its degree
        if c.kind != "uniform" or not c.fits or c is best:
            continue
        t = c.plan.degrees()[0]
        if t != chosen_tp and (t not in uniform or c.result.step_s < uniform[t].result.step_s):
            uniform[t] = c
    shown = sorted(uniform.values(), key=order)
    rest = sorted((c for c in candidates if c is not best and c not in shown), key=order)
    room = max(top - 1 - len(shown), 0)
    each = (
        "fastest uniform plan of each TP degree that fits"
        if chosen_tp is None
        else f"fastest uniform plan of each other TP degree that fits (tp={chosen_tp}: the "
        "chosen plan)"
    )
    groups = [
        ("chosen plan", [best]),
        (each, shown),
        (
            f"other plans, fastest first, over the budget last ({min(room, len(rest))} of "
            f"{len(rest)})",
            rest[:room],
        ),
    ]
    for title, members in groups:
        if members:
            lines.append(f"{title}:")
            lines += [row(c) for c in members]
    count = (
        f"{len(candidates)} plans simulated"
        if simulated is None
        else f"{len(candidates)} candidates of {simulated} plans simulated"
    )
    lines.append(f"({count}; {parts_note(unit)})")
    if s.bound() == "DP comm":
        lines.append(DP_NOTE)
    return "\n".join(lines)


def plan_header(
    config: str,
    cfg: Config,
    costs: object,
    profile: str | None,
    world_size: int,
    budget: Budget,
    searched_micro_batch: bool = False,
) -> str:
    """``oases plan``'s first lines: the model, the costs, the world, the batch, the budget."""
    from oases.planner.batch import config_batch
    from oases.planner.models import describe_model

    if getattr(costs, "cluster", None) is not None:
        where = f"hardware {costs.describe().split(' Sources: ')[0]}"
    else:
        m = getattr(costs, "machine", {}) or {}
        where = (
            f"profile {profile}: measured on {m.get('world_size', '?')} "
            f"{m.get('device', 'cpu')} ranks ({m.get('cpu', 'unknown CPU')}), "
            f"{m.get('backend', '?')}, link {m.get('link', 'unknown')}, "
            f"{precision_of(costs).label()}"
        )
    batch = config_batch(cfg).describe(
        world_size, cfg.train.global_batch, every_plan=True, searched=searched_micro_batch
    )
    as_gpus = (
        ", auto resolved as on GPUs"
        if cfg.train.precision == "auto" and getattr(costs, "cluster", None) is not None
        else ""
    )
    priced = (
        f"{precision_of(costs).label()} (train.precision={cfg.train.precision}{as_gpus}; "
        "the plan records it, and a run in other dtypes says so)"
    )
    return "\n".join(
        [
            f"model    {config}: {describe_model(cfg.model)}",
            f"costs    {where}",
            f"world    {world_size} ranks",
            f"batch    {batch}",
            f"budget   {budget.text}",
            f"priced   {priced}",
        ]
    )


def run_command(
    config: str, overrides: list[str], plan_path: str, world_size: int, gpus_per_server: int | None
) -> str:
    """The command that trains ``config`` with the plan: local ranks, or torchrun on every
    server of a cluster (``gpus_per_server`` ranks each) when the world spans servers."""
    args = " ".join(shlex.quote(a) for a in [config, *overrides, f"--parallel.plan={plan_path}"])
    if gpus_per_server is None or world_size <= gpus_per_server:
        return f"run it:  oases train {args} --nproc-per-node {world_size}"
    nodes = world_size // gpus_per_server
    return (
        f"run it on each of the {nodes} servers ({plan_path} and the data where every "
        f"server reads them; HOST0 = the first server):\n"
        f"  torchrun --nnodes {nodes} --nproc-per-node {gpus_per_server} --rdzv-backend "
        f"c10d --rdzv-endpoint HOST0:29500 --rdzv-id myjob -m oases train {args}"
    )


def plan_label(row: Row) -> str:
    """A simulate row's plan: ``auto: mixed tp 2/4, n_sub=2``."""
    degrees = row.plan.degrees()
    layout = f"tp={degrees[0]}" if len(degrees) == 1 else "mixed tp " + "/".join(map(str, degrees))
    k = f", n_sub={row.plan.n_sub}" if SPECS[row.schedule].overlapped else ""
    zero = max(row.plan.zero_stages())
    searched = f", zero={zero}" if zero and row.spec.zero is None else ""
    if row.plan.sequence_parallel and row.spec.sp is None:
        searched += f", sp={row.plan.sequence_parallel}"
    if row.spec.auto and row.plan.pp > 1 and row.spec.pps is None:
        searched += f", {row.plan.pp_schedule}"
    return f"{row.spec}: {layout}{k}{searched}"


def format_report(rep: Report) -> str:
    """The table ``oases simulate`` prints."""
    from oases.planner.models import describe_model

    base = rep.rows[0].schedule
    unit = TimeUnit.for_step(min(r.result.step_s for r in rep.rows))
    batch = rep.batch.describe(
        rep.cluster.world_size,
        rep.global_batch,
        every_plan=False,
        auto_rows=any(r.spec.auto for r in rep.rows),
    )
    # columns as wide as their longest cell (and a space), so no row shifts the next columns
    sched_w = max(20, *(len(r.schedule) + 2 for r in rep.rows))
    plan_w = max(30, *(len(plan_label(r)) + 2 for r in rep.rows))
    lines = [
        f"model    {rep.model_name + ': ' if rep.model_name else ''}{describe_model(rep.model)}",
        f"cluster  {rep.costs.describe().split(' Sources: ')[0]}",
        f"batch    {batch}; {rep.costs.precision.label()}"
        + (f" (dtypes: {rep.precision_source})" if rep.precision_source else ""),
        f"budget   {rep.budget.text}",
        "",
        f"  {'schedule':<{sched_w}}{'plan':<{plan_w}}{'micro x n':>11}"
        f"{'step ' + unit.name:>10}"
        f"{'tokens/s':>11}{'tok/s/GPU':>10}{'MFU':>7}"
        f"{'peak GiB':>10}{'vs ' + base:>24}{parts_header()}",
    ]
    if rep.ranges is not None:
        lines[-1] += f"{'tokens/s range':>20}{'vs ' + base + ' range':>30}  moves it most"
    for i, row in enumerate(rep.rows):
        over = "" if row.fits else "  over budget"
        micro = f"{row.batch.micro_rows} x {row.batch.n_micro()}"
        lines.append(
            f"  {row.schedule:<{sched_w}}{plan_label(row):<{plan_w}}{micro:>11}"
            f"{unit.cell(row.result.step_s)}{row.tokens_per_s:>11,.0f}"
            f"{row.tokens_per_s_per_gpu:>10,.0f}{row.mfu:>7.1%}"
            f"{row.result.peak_mem_bytes / 2**30:>10.2f}{row.speedup:>23.2f}x"
            f"{parts_cells(row.result, unit)}{range_cells(rep, i)}{over}"
        )
    peak = rep.cluster.server.gpu.peak_flops[rep.costs.dtype]
    lines += [
        "",
        f"micro x n: sequences per micro-batch across the cluster x micro-batches per "
        f"step. {parts_note(unit)}.",
        f"MFU = model FLOPs per step (6 N tokens + 12 L H S tokens, N = "
        f"{format_params(matmul_params(rep.model))} matmul parameters; recompute not "
        "counted) "
        f"/ (step x {rep.cluster.world_size} GPUs x {peak / 1e12:.1f} TFLOP/s "
        f"{rep.costs.dtype} peak).",
    ]
    if rep.ranges is not None:
        lines.append(uncertainty_note(rep))
    if any(row.kernels is not None for row in rep.rows):
        lines += ["", *kernel_lines(rep)]
    if any(row.result.bound() == "DP comm" for row in rep.rows):
        lines.append(f"{DP_NOTE}.")
    for row in rep.rows:
        if row.spec.auto:
            by = f", found by {row.found_by}@auto's search" if row.found_by else ""
            if row.plan.pp > 1:  # auto,pp=P: what the pipeline search chose
                starts = ",".join(map(str, row.plan.stage_layout().starts))
                by = f", pp={row.plan.pp} {row.plan.pp_schedule}, stages at regions {starts}"
            lines.append(f"{row.schedule}@auto degrees by region{by}: {row.plan.degree_runs()}")
    lines.append(f"simulated and planned in {rep.planning_s:.2f} s")
    return "\n".join(lines)


KERNEL_COLUMNS = (
    ("gemm", "GEMM"),
    ("attention", "attn"),
    ("norm", "norm"),
    ("rotary", "rotary"),
    ("activation", "act"),
    ("elementwise", "elemw"),
    ("cross-entropy", "CE"),
    ("cast", "cast"),
    ("embedding", "embed"),
    ("launch", "launch"),
    ("interference", "interf"),
    ("optimizer", "optim"),
    ("grad-norm", "gnorm"),
)


def kernel_lines(rep: Report) -> list[str]:
    """Where each row's step goes by kernel class (% of the step; the exposed communication
    is the rest), each flop class's efficiency, and the MFU's sanity bound
    (``planner.kernels.step``)."""
    head = "".join(f"{short:>7}" for _, short in KERNEL_COLUMNS)
    lines = [
        "where the step goes, by kernel class, row by row (% of the step; the rest is exposed "
        "communication), the GEMM and attention kernels' efficiency, and the sanity "
        "check: MFU <= bound = sum of (share x efficiency) over the flop classes",
        f"  {'row':<24}{head}{'comm':>7}{'eff GEMM':>10}{'eff attn':>10}"
        f"{'MFU':>7}{'bound':>7}  sane",
    ]
    for i, row in enumerate(rep.rows):
        k = row.kernels
        if k is None:
            continue
        share = k.shares()
        comm = max(0.0, 1 - sum(share.values()))
        cells = "".join(f"{share.get(c, 0.0):>7.1%}" for c, _ in KERNEL_COLUMNS)
        eff = "".join(
            f"{k.efficiency[c]:>10.1%}" if c in k.efficiency else f"{'-':>10}"
            for c in ("gemm", "attention")
        )
        lines.append(
            f"  {'#' + str(i + 1) + ' ' + row.schedule:<24}{cells}{comm:>7.1%}{eff}"
            f"{k.mfu:>7.1%}"
            f"{k.bound:>7.1%}  {'yes' if k.sane() else 'NO'}"
        )
    return lines


def kernels_json(row: Row) -> dict:
    """A row's ``kernels`` entry of simulate.json."""
    k = row.kernels
    if k is None:
        return {}
    return {
        "kernels": {
            "seconds": k.seconds,
            "shares": k.shares(),
            "efficiency": k.efficiency,
            "flops": k.flops,
            "mfu": k.mfu,
            "mfu_bound": k.bound,
            "sane": k.sane(),
        }
    }


def range_cells(rep: Report, i: int) -> str:
    """A row's tokens/s and speedup ranges and the input that moves it most (--uncertainty)."""
    if rep.ranges is None:
        return ""
    r = rep.ranges[i]
    tokens = f"{r.tokens_per_s[0]:,.0f}-{r.tokens_per_s[1]:,.0f}"
    speed = f"{r.speedup[0]:.2f}-{r.speedup[1]:.2f}x"
    return f"{tokens:>20}{speed:>30}  {r.most_sensitive}"


def uncertainty_note(rep: Report) -> str:
    """What the ranges are (--uncertainty)."""
    bounds = ", ".join(
        f"{name} x{lo:.3g}-{hi:.3g}" for name, (lo, hi) in (rep.bounds or {}).items()
    )
    return (
        "ranges: each row's plan re-simulated with every uncertain input at each bound "
        f"and all at once at both ends ({bounds}; planner/uncertainty.py says why); "
        "'moves it most': the input whose bounds are furthest apart in the row's speedup "
        "(the first row: in its tokens/s)"
    )


def simulate_json(rep: Report) -> dict:
    """``simulate.json``: the setting, and every row with its plan, step, parts and peak."""
    b = rep.batch
    return {
        "model": {"name": rep.model_name, **dataclasses.asdict(rep.model)},
        "cluster": dataclasses.asdict(rep.cluster),
        "costs": rep.costs.describe(),
        "dtype": rep.costs.dtype,
        "precision": rep.costs.precision.describe(),
        "attention": rep.costs.attention,
        "precision_source": rep.precision_source,
        "peak_flops_per_gpu": rep.cluster.server.gpu.peak_flops[rep.costs.dtype],
        "mfu_formula": "(6 N tokens + 12 L H S tokens) / (step_s x world_size x peak_flops)",
        "batch": {
            "global_batch": rep.global_batch,
            "micro_batch": b.micro_batch,
            "micro_batch_unit": "sequences per model replica (per DP rank)",
            "micro_batch_tp": b.micro_batch_tp,
            "source": b.source,
        },
        "budget_bytes": rep.budget.bytes,
        "budget": rep.budget.text,
        "planning_s": rep.planning_s,
        "baseline": rep.rows[0].schedule,
        "rows": [
            {
                "schedule": r.schedule,
                "plan_spec": str(r.spec),
                "label": plan_label(r),
                "degrees_by_region": r.plan.degree_runs(),
                "plan": json.loads(r.plan.to_json()),
                "step_s": r.result.step_s,
                "micro_rows": r.batch.micro_rows,
                "n_micro": r.batch.n_micro(),
                "tokens_per_s": r.tokens_per_s,
                "tokens_per_s_per_gpu": r.tokens_per_s_per_gpu,
                "mfu": r.mfu,
                "peak_mem_bytes": r.result.peak_mem_bytes,
                "fits": r.fits,
                "speedup": r.speedup,
                "found_by": r.found_by,
                **parts_json(r.result),
                "breakdown": r.result.breakdown,
                **kernels_json(r),
                **({} if rep.ranges is None else {"uncertainty": rep.ranges[i].to_json()}),
            }
            for i, r in enumerate(rep.rows)
        ],
        **(
            {}
            if rep.bounds is None
            else {
                "uncertain_inputs": {
                    name: {
                        "low": lo,
                        "high": hi,
                        "why": next(inp.why for inp in INPUTS if inp.name == name),
                    }
                    for name, (lo, hi) in rep.bounds.items()
                }
            }
        ),
    }
