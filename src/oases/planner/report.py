"""What ``oases plan`` and ``oases simulate`` print: the setting echoed at the top, each plan's
step cut into what bounds it, and (for ``oases plan``) the command that runs the chosen plan.

A step's parts (``PlanResult.step_parts``) add up to the step::

    step = compute + TP comm + DP comm + reshard + optimizer

compute: the compute stream busy (recompute included); TP comm, DP comm, reshard: the time the
compute stream waits on those collectives (what overlap does not hide); optimizer: the AdamW
step. The largest part bounds the step.
"""

from __future__ import annotations

import shlex

from oases.config import Config
from oases.planner.budget import Budget
from oases.planner.search import Candidate
from oases.planner.simulate import PlanResult

PARTS = ("compute", "TP comm", "DP comm", "reshard", "optimizer")
PARTS_NOTE = ("step = compute + TP comm + DP comm + reshard + optimizer (seconds): compute is the "
              "compute stream busy (recompute included); TP comm, DP comm and reshard are the "
              "time it waits on those collectives (exposed, not hidden by overlap); the largest "
              "part bounds the step")
DP_NOTE = ("bound by DP comm: the gradient all-reduce outlasts the backward it overlaps, so "
           "compute added to the backward (recompute) hides under it and such plans can take "
           "the same time; more micro-batches per step or a faster link between servers "
           "shorten its share")


def fmt_time(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.3f} s"


def parts_header() -> str:
    return f"{'bound':>10}" + "".join(f"{p:>10}" for p in PARTS)


def parts_cells(result: PlanResult) -> str:
    """The bound and the step's parts in seconds, aligned with ``parts_header``."""
    parts = result.step_parts()
    return f"{result.bound():>10}" + "".join(f"{parts[p]:>10.3f}" for p in PARTS)


def parts_json(result: PlanResult) -> dict:
    return {"bound": result.bound(), "step_parts_s": result.step_parts()}


def format_candidates(best: Candidate, candidates: list[Candidate], budget_bytes: float,
                      top: int = 12, tokens_per_step: int | None = None) -> str:
    """The chosen plan, then the fastest uniform plan of each degree that fits, then the
    fastest other plans, each group fastest first with plans over the budget last; each row
    with tokens/s (given ``tokens_per_step``), peak memory, what bounds it and its parts, and
    why it loses (slower by how much, or over the budget by how much)."""

    def why(c: Candidate) -> str:
        if c is best:
            return "chosen"
        if not c.fits:
            return f"over budget by {(c.result.peak_mem_bytes - budget_bytes) / 2**30:.3f} GiB"
        return f"{c.result.step_s / best.result.step_s - 1:+.1%} slower"

    def row(c: Candidate) -> str:
        tokens = (f"{tokens_per_step / c.result.step_s:>12,.0f}" if tokens_per_step else "")
        return (f"  {c.label():<{width}}{fmt_time(c.result.step_s):>12}{tokens}"
                f"{c.result.peak_mem_bytes / 2**30:>10.3f}{parts_cells(c.result)}  {why(c)}")

    def order(c: Candidate) -> tuple[bool, float]:  # fastest first, over the budget last
        return (not c.fits, c.result.step_s)

    s = best.result
    width = max(44, *(len(c.label()) + 2 for c in candidates))
    tokens = (f" = {tokens_per_step / s.step_s:,.0f} tokens/s" if tokens_per_step else "")
    lines = [f"chosen: {best.label()}; predicted {fmt_time(s.step_s)} per step{tokens}, peak "
             f"{s.peak_mem_bytes / 2**30:.3f} GiB per device"
             + ("" if budget_bytes == float("inf") else
                f" (budget {budget_bytes / 2**30:.3f} GiB)") + f"; bound by {s.bound()}",
             f"degrees by region: {best.plan.degree_runs()}", "",
             f"  {'plan':<{width}}{'step':>12}{'tokens/s' if tokens_per_step else '':>12}"
             f"{'peak GiB':>10}{parts_header()}"]
    uniform: dict[int, Candidate] = {}
    for c in candidates:
        if c.kind == "uniform" and c.fits and c is not best:
            t = c.plan.degrees()[0]
            if t not in uniform or c.result.step_s < uniform[t].result.step_s:
                uniform[t] = c
    shown = sorted(uniform.values(), key=order)
    rest = sorted((c for c in candidates if c is not best and c not in shown), key=order)
    room = max(top - 1 - len(shown), 0)
    groups = [("chosen plan", [best]),
              ("fastest uniform plan of each TP degree that fits", shown),
              (f"other plans, fastest first, over the budget last ({min(room, len(rest))} of "
               f"{len(rest)})", rest[:room])]
    for title, members in groups:
        if members:
            lines.append(f"{title}:")
            lines += [row(c) for c in members]
    lines.append(f"({len(candidates)} plans simulated; {PARTS_NOTE})")
    if s.bound() == "DP comm":
        lines.append(DP_NOTE)
    return "\n".join(lines)


def plan_header(config: str, cfg: Config, costs: object, profile: str | None, world_size: int,
                budget: Budget) -> str:
    """``oases plan``'s first lines: the model, the costs, the world, the batch, the budget."""
    from oases.planner import describe_batch
    from oases.planner.models import describe_model

    if getattr(costs, "cluster", None) is not None:
        where = f"hardware {costs.describe().split(' Sources: ')[0]}"
    else:
        m = getattr(costs, "machine", {}) or {}
        where = (f"profile {profile}: measured on {m.get('world_size', '?')} "
                 f"{m.get('device', 'cpu')} ranks ({m.get('cpu', 'unknown CPU')}), "
                 f"{m.get('backend', '?')}, link {m.get('link', 'unknown')}")
    return "\n".join([f"model    {config}: {describe_model(cfg.model)}", f"costs    {where}",
                      f"world    {world_size} ranks",
                      f"batch    {describe_batch(cfg, world_size)}", f"budget   {budget.text}"])


def run_command(config: str, overrides: list[str], plan_path: str, world_size: int,
                gpus_per_server: int | None) -> str:
    """The command that trains ``config`` with the plan: local ranks, or torchrun on every
    server of a cluster (``gpus_per_server`` ranks each) when the world spans servers."""
    args = " ".join(shlex.quote(a) for a in [config, *overrides,
                                             f"--parallel.plan={plan_path}"])
    if gpus_per_server is None or world_size <= gpus_per_server:
        return f"run it:  oases train {args} --nproc-per-node {world_size}"
    nodes = world_size // gpus_per_server
    return (f"run it on each of the {nodes} servers ({plan_path} and the data where every "
            f"server reads them; HOST0 = the first server):\n"
            f"  torchrun --nnodes {nodes} --nproc-per-node {gpus_per_server} --rdzv-backend "
            f"c10d --rdzv-endpoint HOST0:29500 --rdzv-id myjob -m oases train {args}")
