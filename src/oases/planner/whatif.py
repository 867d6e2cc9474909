"""What a model would do on a cluster nobody has rented yet: ``oases simulate``.

For each schedule, a plan (a uniform TP degree, or the planner's choice of a degree per region)
is simulated on a cluster's analytic costs (``planner.hardware``): step time, throughput, peak
memory per GPU and the speedup over the first schedule listed. Entries look like::

    oases                  the default plan (--plan: "auto" or "tp=N")
    merak@tp=4             uniform tp=4
    megatron-recompute@tp=4+   uniform, the smallest degree >= 4 whose plan fits in memory
    oases@auto             the planner: a degree per region, under the memory budget

"auto" searches the powers of two up to the GPUs of one server (``max_tp``), doubling that cap
while no plan fits. Collectives are priced by their groups' ranks (ring inside a server,
hierarchical across servers; TP groups are contiguous ranks, DP groups strided).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

from oases.config import ModelConfig
from oases.plan import ParallelPlan
from oases.planner.clusters import Cluster, get_cluster, load_cluster
from oases.planner.hardware import HardwareCosts
from oases.planner.search import candidate_degrees, solve_plan
from oases.planner.simulate import BatchShape, PlanResult, simulate_plan
from oases.schedule.program import SPECS
from oases.schedule.timeline import Timeline


@dataclass(frozen=True)
class PlanSpec:
    """"auto", or a uniform degree ``tp`` (``at_least``: the smallest fitting degree >= tp)."""

    auto: bool
    tp: int = 0
    at_least: bool = False

    def __str__(self) -> str:
        return "auto" if self.auto else f"tp={self.tp}{'+' if self.at_least else ''}"


def parse_plan(text: str) -> PlanSpec:
    """"auto", "tp=N" or "tp=N+" (ValueError otherwise)."""
    if text == "auto":
        return PlanSpec(True)
    body = text[3:].removesuffix("+") if text.startswith("tp=") else ""
    if not body.isdigit() or int(body) < 1:
        raise ValueError(f"plan {text!r}: give auto, tp=N or tp=N+ (N >= 1)")
    return PlanSpec(False, int(body), text.endswith("+"))


def parse_entries(text: str, default: str) -> list[tuple[str, PlanSpec]]:
    """"a,b@tp=4,c@auto" -> [(schedule, plan)], the default plan where none is given."""
    entries = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        name, _, plan = item.partition("@")
        if name not in SPECS:
            raise ValueError(f"unknown schedule {name!r}; valid: {', '.join(SPECS)}")
        entries.append((name, parse_plan(plan or default)))
    if not entries:
        raise ValueError("--schedules lists no schedule")
    return entries


def load_any_cluster(source: str, inter_gbps: float | None = None) -> Cluster:
    """A preset name or a TOML/JSON cluster file; ``inter_gbps`` replaces the nominal rate of
    the link between servers (Gb/s; its efficiency and latency stay)."""
    cluster = load_cluster(source) if Path(source).suffix in (".toml", ".json") else \
        get_cluster(source)
    if inter_gbps is not None:
        if inter_gbps <= 0 or cluster.inter_link is None:
            raise ValueError(f"--inter-gbps={inter_gbps}: needs a rate > 0 and a cluster of "
                             f"several servers ({cluster.name} has {cluster.servers})")
        link = dataclasses.replace(cluster.inter_link, bandwidth_bytes_per_s=inter_gbps * 1e9 / 8,
                                   name=f"{cluster.inter_link.name} at {inter_gbps:g} Gb/s")
        cluster = dataclasses.replace(cluster, inter_link=link,
                                      name=f"{cluster.name}@{inter_gbps:g}gbps")
    return cluster


@dataclass
class Row:
    schedule: str
    spec: PlanSpec
    plan: ParallelPlan
    result: PlanResult
    tokens_per_s: float
    fits: bool
    speedup: float = 1.0


@dataclass
class Report:
    model: ModelConfig
    model_name: str
    cluster: Cluster
    costs: HardwareCosts
    batch: BatchShape
    budget_bytes: float
    rows: list[Row]
    planning_s: float


def simulate_cluster(cfg: ModelConfig, cluster: Cluster, entries: list[tuple[str, PlanSpec]],
                     batch: BatchShape, budget_bytes: float, *, n_sub: int = 2,
                     max_tp: int | None = None, dtype: str = "fp32",
                     model_name: str = "") -> Report:
    """Simulate every (schedule, plan) entry; the first is the speedups' baseline."""
    if dtype not in ("fp32", "tf32"):  # the planner's sizes are 4-byte elements
        raise ValueError(f"dtype={dtype!r}: the planner sizes fp32 elements; use fp32 or tf32")
    costs = HardwareCosts(cluster, cfg, dtype)
    world = cluster.world_size
    start = time.perf_counter()
    rows = [_row(cfg, costs, world, batch, budget_bytes, name, spec, n_sub, max_tp)
            for name, spec in entries]
    planning_s = time.perf_counter() - start
    for row in rows:
        row.speedup = rows[0].result.step_s / row.result.step_s
    return Report(cfg, model_name, cluster, costs, batch, budget_bytes, rows, planning_s)


def _row(cfg: ModelConfig, costs: HardwareCosts, world: int, batch: BatchShape,
         budget_bytes: float, name: str, spec: PlanSpec, n_sub: int,
         max_tp: int | None) -> Row:
    k = n_sub if SPECS[name].overlapped else 1
    degrees = candidate_degrees(cfg, world)
    if spec.auto:
        plan = _auto(cfg, costs, world, batch, budget_bytes, name, k, degrees, max_tp)
    else:
        tried = [t for t in degrees if t >= spec.tp] if spec.at_least else [spec.tp]
        if not tried or (not spec.at_least and spec.tp not in degrees):
            raise ValueError(f"{name}@{spec}: tp={spec.tp} is not a candidate degree of this "
                             f"model on {world} GPUs ({degrees})")
        plan = None
        for t in tried:
            plan = ParallelPlan.uniform(cfg, world, t, schedule=name, n_sub=k)
            peak = simulate_plan(cfg, plan, costs, world, batch, timeline=False).peak_mem_bytes
            if not spec.at_least or peak <= budget_bytes:
                break
        else:
            raise ValueError(f"{name}@{spec}: no uniform degree in {tried} fits in "
                             f"{budget_bytes / 2**30:.2f} GiB per GPU")
    result = simulate_plan(cfg, plan, costs, world, batch)
    tokens = batch.global_batch * cfg.seq_len / result.step_s
    return Row(name, spec, plan, result, tokens, result.peak_mem_bytes <= budget_bytes)


def _auto(cfg: ModelConfig, costs: HardwareCosts, world: int, batch: BatchShape,
          budget_bytes: float, name: str, k: int, degrees: list[int],
          max_tp: int | None) -> ParallelPlan:
    """The planner's plan for this schedule, its degrees capped at ``max_tp`` (default: one
    server's GPUs, doubled while nothing fits)."""
    cap = max_tp or costs.cluster.server.gpus_per_server
    while True:
        allowed = [t for t in degrees if t <= cap]
        try:
            best, _ = solve_plan(cfg, costs, world, batch, budget_bytes, schedules=(name,),
                                 n_subs=(k,), degrees=allowed)
            return best.plan
        except ValueError:
            if max_tp is not None or cap >= max(degrees):
                raise
            cap *= 2


def plan_label(row: Row) -> str:
    degrees = row.plan.degrees()
    layout = f"tp={degrees[0]}" if len(degrees) == 1 else "mixed tp " + "/".join(map(str, degrees))
    k = f", n_sub={row.plan.n_sub}" if SPECS[row.schedule].overlapped else ""
    return f"{row.spec}: {layout}{k}"


def format_report(rep: Report) -> str:
    """The table ``oases simulate`` prints."""
    from oases.planner.models import describe_model

    b = rep.batch
    base = rep.rows[0].schedule
    gpu_bytes = rep.cluster.memory_bytes
    lines = [f"model    {rep.model_name + ': ' if rep.model_name else ''}"
             f"{describe_model(rep.model)}",
             f"cluster  {rep.costs.describe().split(' Sources: ')[0]}",
             f"batch    {b.global_batch} sequences per step = {b.n_micro()} micro-batch(es) of "
             f"{b.micro_rows} across the cluster (a TP group of degree t gets "
             f"{b.micro_rows / rep.cluster.world_size:g}·t); fp32 weights, AdamW",
             f"budget   {rep.budget_bytes / 2**30:.2f} GiB per GPU "
             f"({rep.budget_bytes / gpu_bytes:.0%} of {gpu_bytes / 1e9:.0f} GB)", "",
             f"  {'schedule':<20}{'plan':<30}{'step':>10}{'tokens/s':>12}{'peak/GPU':>12}"
             f"{'vs ' + base:>24}"]
    for row in rep.rows:
        over = "" if row.fits else "  over budget"
        lines.append(f"  {row.schedule:<20}{plan_label(row):<30}{row.result.step_s:>9.3f}s"
                     f"{row.tokens_per_s:>12,.0f}{row.result.peak_mem_bytes / 2**30:>8.2f} GiB"
                     f"{row.speedup:>23.2f}x{over}")
    lines.append("")
    for row in rep.rows:
        if row.spec.auto:
            lines.append(f"{row.schedule} (auto) degrees by region: {row.plan.degree_runs()}")
    lines.append(f"simulated and planned in {rep.planning_s:.2f} s")
    return "\n".join(lines)


def to_json(rep: Report) -> dict:
    return {
        "model": {"name": rep.model_name, **dataclasses.asdict(rep.model)},
        "cluster": dataclasses.asdict(rep.cluster),
        "costs": rep.costs.describe(),
        "dtype": rep.costs.dtype,
        "batch": {"global_batch": rep.batch.global_batch, "micro_rows": rep.batch.micro_rows,
                  "n_micro": rep.batch.n_micro()},
        "budget_bytes": rep.budget_bytes,
        "planning_s": rep.planning_s,
        "baseline": rep.rows[0].schedule,
        "rows": [{"schedule": r.schedule, "plan_spec": str(r.spec), "label": plan_label(r),
                  "degrees_by_region": r.plan.degree_runs(),
                  "plan": json.loads(r.plan.to_json()), "step_s": r.result.step_s,
                  "tokens_per_s": r.tokens_per_s, "peak_mem_bytes": r.result.peak_mem_bytes,
                  "fits": r.fits, "speedup": r.speedup, "breakdown": r.result.breakdown}
                 for r in rep.rows],
    }


def last_micro_batch(row: Row, batch: BatchShape) -> Timeline:
    """The last micro-batch of a row's step (with the DP all-reduces and the optimizer): a
    whole step of many micro-batches is too long to read."""
    k = row.plan.n_sub if SPECS[row.schedule].overlapped else 1
    first = (batch.n_micro() - 1) * k
    return Timeline([e for e in row.result.timeline.events
                     if e.sub >= first or e.phase in ("dp", "optimizer")])


def write_report(rep: Report, out: Path) -> list[Path]:
    """``simulate.json`` and the timeline PNG of the oases row (the planned one if there are
    several; else the last row)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "simulate.json"
    path.write_text(json.dumps(to_json(rep), indent=1), encoding="utf-8")
    oases = [r for r in rep.rows if r.schedule == "oases"]
    row = next((r for r in oases if r.spec.auto), oases[-1] if oases else rep.rows[-1])
    png = out / f"timeline-{row.schedule}.png"
    title = (f"{row.schedule} ({plan_label(row)}) on {rep.cluster.name}, predicted: last of "
             f"{rep.batch.n_micro()} micro-batch(es), rank 0")
    last_micro_batch(row, rep.batch).plot(png, title=title)
    return [path, png]


def help_text() -> str:
    """``oases simulate --help``'s epilog: the presets and how to describe a cluster."""
    from oases.planner.clusters import CLUSTERS, GPUS, LINKS
    from oases.planner.models import MODELS

    return f"""\
A cluster preset names a whole machine room: servers x GPUs per server, the GPU (peak flops,
memory, bandwidth, efficiencies), the link inside a server (PCIe, NVLink bridges, NVSwitch) and
the link between servers (Ethernet, InfiniBand; ports per server). Every number comes from a
public specification, efficiencies calibrated where the paper measured them (RTX 3090).
  cluster presets: {', '.join(CLUSTERS)}
  model presets:   {', '.join(MODELS)} (or a TOML run file: its [model] table)

Describe your own cluster in a TOML (or JSON) file with the same fields; a GPU or link may be a
preset name or a table of its fields:

  name = "lab"                 # my-cluster.toml
  servers = 4
  nics_per_server = 1          # ports between servers, shared by the server's GPUs
  inter_link = "25gbe"         # {', '.join(k for k in LINKS if 'gbe' in k or 'ib' in k)}
  [server]
  gpus_per_server = 8
  gpu = "rtx3090"              # {', '.join(GPUS)}
  link = "pcie4-x16"           # {', '.join(k for k in LINKS if not ('gbe' in k or 'ib' in k))}
  # or, instead of link = "...", a link of your own (same for gpu: a [server.gpu] table with
  # name, peak_flops = {{fp32 = 35.6e12}}, memory_bytes, memory_bandwidth_bytes_per_s,
  # matmul_efficiency, elementwise_efficiency):
  # [server.link]
  # name = "PCIe 4.0 x16"
  # latency_s = 5e-6
  # bandwidth_bytes_per_s = 31.5e9   # nominal, per direction per GPU
  # efficiency = 0.8                 # the fraction a ring collective reaches

Collectives are priced for the topology: a ring inside a server, hierarchical (reduce-scatter
inside, ring across servers on the server's share of its ports, all-gather inside) across
servers; TP groups are contiguous ranks, DP groups strided. Schedules may carry their own plan:
"megatron-recompute@tp=4+,merak@tp=4+,oases@auto" (tp=N+: the smallest degree >= N that fits).
"""
