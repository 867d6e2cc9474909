"""What a model would do on a cluster nobody has rented yet: ``oases simulate``.

For each schedule, a plan (a uniform TP degree, or the planner's choice of a degree per region)
is simulated on a cluster's analytic costs (``planner.hardware``): step time, throughput, peak
memory per GPU and the speedup over the first schedule listed. Entries look like::

    oases                  the default plan (--plan: "auto" or "tp=N")
    merak@tp=4             uniform tp=4
    megatron-recompute@tp=4+   uniform, the smallest degree >= 4 whose plan fits in memory
    oases@auto             the planner: a degree per region and a ZeRO stage, under the budget
    oases@tp=4,zero=3      uniform tp=4, every region's weights, gradients and moments sharded
                           over its data-parallel group (ZeRO stage 3; auto,zero=Z fixes it)
    oases@tp=4,sp=shards   uniform tp=4 with sequence parallelism, its communication-free
                           recompute keeping slices (sp=gathered: gathered inputs; auto searches
                           both beside plans without it unless sp=MODE or sp=off fixes it)
    megatron-sp@tp=4       Megatron-LM with --sequence-parallel (no overlap)
    oases@tp=4,pp=8        tp=4 in 8 pipeline stages simulated together (pipeline_walk), 1F1B
                           or ,pps=gpipe|1f1b|1f1b-pair|zb-h1|interleaved (2 chunks a
                           stage); zero=, sp= compose
    oases@auto,pp=8        the pipeline search at 8 stages (whatif_pipeline): stages, order,
                           degrees (mixed inside stages too), n_sub, ZeRO 0-2 and sp

"auto" searches the powers of two up to the GPUs of one server (``max_tp``), doubling that cap
while no plan fits, and 1, 2, 4 (and ``--n-sub``) sub-batches; then also the degrees every other
auto row's search found. Collectives are priced by their groups' ranks as NCCL runs them
(``planner.collectives``; TP groups are contiguous ranks, DP groups strided); with
``uncertainty`` every row gets its range over the uncertain inputs (``planner.uncertainty``).
The batch is given in training's terms (``planner.batch``: micro-batch per model replica);
each row says what bounds its step (``PlanResult.step_parts``) and where its time goes by
kernel class, with its MFU's sanity bound (``planner.kernels.step``); ``planner.report`` prints
the rows; ``planner.sim_inputs`` reads the entries, the precision and the cluster.

``dtype`` is the compute dtype (fp32, tf32, bf16, fp16: matmuls at that peak, activations and
TP collectives in its bytes), ``grad_reduce`` the DP gradient reduction's (``planner.precision``);
master weights, gradients and AdamW stay fp32. Every row has its tokens/s per GPU and its MFU::

    MFU = model_flops(cfg, tokens per step) / (step_s x world size x peak_flops[dtype])

with ``planner.costs.model_flops``: 6 N tokens + 12 L H S tokens (PaLM / Megatron-LM; recompute
not counted), the peak of the preset's GPU at the compute dtype (tf32: its tf32 peak).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from oases.config import ModelConfig
from oases.plan import ParallelPlan, RegionPlan
from oases.planner.batch import BatchShape, BatchSpec, BatchSplitError
from oases.planner.budget import Budget
from oases.planner.clusters import Cluster
from oases.planner.costs import model_flops
from oases.planner.hardware import HardwareCosts
from oases.planner.kernels.step import StepKernels, step_kernels
from oases.planner.search import candidate_degrees, solve_plan, with_zero
from oases.planner.sim_inputs import PlanSpec
from oases.planner.simulate import PlanResult, simulate_plan
from oases.planner.uncertainty import Range, input_bounds, simulate_ranges
from oases.planner.whatif_pipeline import auto_pipeline
from oases.schedule.program import SPECS
from oases.schedule.timeline import Timeline


@dataclass
class Row:
    schedule: str
    spec: PlanSpec
    plan: ParallelPlan
    result: PlanResult
    tokens_per_s: float
    fits: bool
    batch: BatchShape
    speedup: float = 1.0
    found_by: str = ""  # auto: the schedule whose search found these degrees, if another's
    mfu: float = 0.0  # model FLOPs utilization (see the module docstring)
    world_size: int = 1
    kernels: StepKernels | None = None  # the step by kernel class (planner.kernels.step)

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / self.world_size


@dataclass
class Report:
    model: ModelConfig
    model_name: str
    cluster: Cluster
    costs: HardwareCosts
    batch: BatchSpec
    global_batch: int
    budget: Budget
    rows: list[Row]
    planning_s: float
    ranges: list[Range] | None = None  # --uncertainty: each row's range (planner.uncertainty)
    bounds: dict[str, tuple[float, float]] | None = None
    precision_source: str = ""  # where the dtypes came from (``simulate_precision``)

    @property
    def budget_bytes(self) -> float:
        return self.budget.bytes


def simulate_cluster(
    cfg: ModelConfig,
    cluster: Cluster,
    entries: list[tuple[str, PlanSpec]],
    batch: BatchSpec | BatchShape,
    budget: Budget | float,
    *,
    n_sub: int = 2,
    max_tp: int | None = None,
    dtype: str = "fp32",
    grad_reduce: str = "fp32",
    attention: str = "materialized",
    model_name: str = "",
    uncertainty: bool = False,
    bounds: dict[str, tuple[float, float]] | None = None,
) -> Report:
    """Simulate every (schedule, plan) entry; the first is the speedups' baseline. An auto
    entry searches every sub-batch count (1, 2, 4 and ``n_sub``), then also the degrees every
    other auto entry's search found, so no schedule's plan is missed by another's search.
    ``batch``: a ``BatchSpec`` (or a ``BatchShape``: that cluster micro-batch for every row);
    ``budget``: a ``Budget`` (or bytes). ``uncertainty``: each row's range over the uncertain
    inputs (``planner.uncertainty``; ``bounds`` replaces some of their bounds), its plan held
    fixed. ``dtype``, ``grad_reduce``: the precision (see the module docstring);
    ``attention``: how attention is priced (``planner.hardware``: "materialized" scores as the
    paper's prototype, or "fused", a flash-style kernel as SDPA runs on GPUs)."""
    if n_sub < 1:
        raise ValueError(f"--n-sub={n_sub} must be >= 1")
    if isinstance(batch, BatchShape):  # a fixed cluster micro-batch: micro_batch_tp = GPUs
        batch = BatchSpec(batch.global_batch, batch.micro_rows, cluster.world_size)
    if not isinstance(budget, Budget):
        budget = Budget(budget, f"{budget / 2**30:.2f} GiB per device")
    costs = HardwareCosts(cluster, cfg, dtype, grad_reduce, attention=attention)
    world = cluster.world_size
    degrees = candidate_degrees(cfg, world)
    global_batch = batch.global_batch or max(
        batch.micro_rows(world // spec.pp, None if spec.auto else spec.tp) for _, spec in entries
    )
    start = time.perf_counter()
    rows, searched = [], {}
    for name, spec in entries:
        row, found = _row(
            cfg, costs, world, batch, global_batch, budget.bytes, name, spec, n_sub, max_tp, degrees
        )
        rows.append(row)
        if found is not None:
            searched[name] = found
    for row in rows:  # every auto row also tries the degrees the other auto rows found
        if row.spec.auto and row.spec.pp == 1:
            _reseed(cfg, costs, world, budget.bytes, row, searched)
    planning_s = time.perf_counter() - start
    peak = cluster.server.gpu.peak_flops[dtype]
    for row in rows:
        row.speedup = rows[0].result.step_s / row.result.step_s
        row.world_size = world
        row.mfu = mfu(cfg, row.batch.global_batch * cfg.seq_len, row.result.step_s, world, peak)
        row.kernels = (
            None
            if row.plan.pp > 1
            else step_kernels(  # (one program: not stages)
                cfg, row.plan, costs, world, row.batch, row.result, row.mfu, peak
            )
        )
    rep = Report(cfg, model_name, cluster, costs, batch, global_batch, budget, rows, planning_s)
    if uncertainty:
        rep.bounds = input_bounds(cluster, bounds)
        rep.ranges = simulate_ranges(
            cfg,
            cluster,
            [(r.plan, r.batch) for r in rows],
            dtype,
            rep.bounds,
            grad_reduce,
            attention,
        )
    return rep


def mfu(
    cfg: ModelConfig, tokens: float, step_s: float, world_size: int, peak_flops: float
) -> float:
    """Model FLOPs utilization of a step of ``tokens`` tokens taking ``step_s`` on
    ``world_size`` GPUs of ``peak_flops`` each: ``model_flops(cfg, tokens)`` (6 N tokens +
    12 L H S tokens, without recompute) / (step_s x world_size x peak_flops)."""
    return model_flops(cfg, tokens) / (step_s * world_size * peak_flops)


def _n_subs(name: str, n_sub: int) -> tuple[int, ...]:
    """Sub-batch counts an auto row searches: 1, 2, 4 and ``n_sub`` if overlapped (from the
    schedule's least, ``ScheduleSpec.min_sub``: merak's 2)."""
    if not SPECS[name].overlapped:
        return (1,)
    return tuple(k for k in sorted({1, 2, 4, n_sub}) if k >= SPECS[name].min_sub)


def _row(
    cfg: ModelConfig,
    costs: HardwareCosts,
    world: int,
    spec_batch: BatchSpec,
    global_batch: int,
    budget_bytes: float,
    name: str,
    spec: PlanSpec,
    n_sub: int,
    max_tp: int | None,
    degrees: list[int],
) -> tuple[Row, dict | None]:
    k = n_sub if SPECS[name].overlapped else 1
    if not spec.auto:
        SPECS[name].check_n_sub(k)
    found = None
    if spec.auto and spec.pp > 1:  # the pipeline search at that depth (whatif_pipeline)
        plan, batch = auto_pipeline(
            cfg, costs, world, spec_batch.shape(world, global_batch), budget_bytes, name, spec,
            _n_subs(name, n_sub), degrees, max_tp,
        )  # fmt: skip
    elif spec.auto:
        batch = spec_batch.shape(world, global_batch)
        plan, allowed = _auto(
            cfg,
            costs,
            world,
            batch,
            budget_bytes,
            name,
            _n_subs(name, n_sub),
            degrees,
            max_tp,
            (0, 1, 2, 3) if spec.zero is None else (spec.zero,),
            spec.sp_modes(),
        )
        found = {"degrees": tuple(r.tp for r in plan.regions), "allowed": allowed, "batch": batch}
    else:
        if world % spec.pp:
            raise ValueError(f"{name}@{spec}: pp={spec.pp} does not divide the {world} GPUs")
        stage = world // spec.pp  # ranks per pipeline stage
        tried = (
            [t for t in degrees if t >= spec.tp and stage % t == 0] if spec.at_least else [spec.tp]
        )
        if not tried or (not spec.at_least and (spec.tp not in degrees or stage % spec.tp)):
            raise ValueError(
                f"{name}@{spec}: tp={spec.tp} is not a candidate degree of this "
                f"model on {world} GPUs ({degrees})"
                + (f" in stages of {stage}" if spec.pp > 1 else "")
            )
        plan = None
        pipeline = {"pp": spec.pp, "pp_schedule": spec.pps or "1f1b"} if spec.pp > 1 else {}
        pipeline.update({"pp_chunks": 2} if spec.pps == "interleaved" else {})  # (v=2)
        for t in tried:
            batch = spec_batch.shape(stage, global_batch, t)
            plan = with_zero(
                ParallelPlan.uniform(
                    cfg,
                    world,
                    t,
                    schedule=name,
                    n_sub=k,
                    sequence_parallel="" if spec.sp in (None, "off") else spec.sp,
                    **pipeline,
                ),
                spec.zero or 0,
            )
            peak = simulate_plan(cfg, plan, costs, world, batch, timeline=False).peak_mem_bytes
            if not spec.at_least or peak <= budget_bytes:
                break
        else:
            raise ValueError(
                f"{name}@{spec}: no uniform degree in {tried} fits in "
                f"{budget_bytes / 2**30:.2f} GiB per GPU"
            )
    return _make_row(cfg, costs, world, batch, budget_bytes, name, spec, plan), found


def _make_row(
    cfg: ModelConfig,
    costs: HardwareCosts,
    world: int,
    batch: BatchShape,
    budget_bytes: float,
    name: str,
    spec: PlanSpec,
    plan: ParallelPlan,
    found_by: str = "",
) -> Row:
    result = simulate_plan(cfg, plan, costs, world, batch)
    tokens = batch.global_batch * cfg.seq_len / result.step_s
    return Row(
        name,
        spec,
        plan,
        result,
        tokens,
        result.peak_mem_bytes <= budget_bytes,
        batch,
        found_by=found_by,
    )


def _auto(
    cfg: ModelConfig,
    costs: HardwareCosts,
    world: int,
    batch: BatchShape,
    budget_bytes: float,
    name: str,
    n_subs: tuple[int, ...],
    degrees: list[int],
    max_tp: int | None,
    zeros: tuple[int, ...] = (0,),
    sps: tuple[str, ...] = (),
) -> tuple[ParallelPlan, list[int]]:
    """The planner's plan for this schedule, its degrees capped at ``max_tp`` (default: one
    server's GPUs, doubled while nothing fits), and the degrees it allowed; ``zeros``: the
    ZeRO stages searched; ``sps``: the sequence-parallel modes."""
    cap = max_tp or costs.cluster.server.gpus_per_server
    while True:
        allowed = [t for t in degrees if t <= cap]
        try:
            best, _ = solve_plan(
                cfg,
                costs,
                world,
                batch,
                budget_bytes,
                schedules=(name,),
                n_subs=n_subs,
                degrees=allowed,
                zeros=zeros,
                sps=sps,
            )
            return best.plan, allowed
        except ValueError:
            if max_tp is not None or cap >= max(degrees):
                raise
            cap *= 2


def _reseed(
    cfg: ModelConfig,
    costs: HardwareCosts,
    world: int,
    budget_bytes: float,
    row: Row,
    searched: dict[str, dict],
) -> None:
    """Replace an auto row's plan by the fastest fitting one made of degrees another auto
    row's search found (under this row's schedule, at each of its sub-batch counts)."""
    own = searched[row.schedule]
    best = row.result.step_s if row.fits else float("inf")
    for other, found in searched.items():
        degrees = found["degrees"]
        if (
            other == row.schedule
            or degrees == own["degrees"]
            or not set(degrees) <= set(own["allowed"])
        ):
            continue
        for k in _n_subs(row.schedule, row.plan.n_sub):
            plan = ParallelPlan(
                [
                    RegionPlan(r.name, t, world // t, r.zero)
                    for r, t in zip(row.plan.regions, degrees)
                ],
                n_sub=k,
                schedule=row.schedule,
            )
            try:
                res = simulate_plan(cfg, plan, costs, world, own["batch"], timeline=False)
            except BatchSplitError:
                continue
            if res.peak_mem_bytes <= budget_bytes and res.step_s < best - 1e-12:
                best = res.step_s
                new = _make_row(
                    cfg,
                    costs,
                    world,
                    own["batch"],
                    budget_bytes,
                    row.schedule,
                    row.spec,
                    plan,
                    found_by=other,
                )
                row.plan, row.result, row.tokens_per_s, row.fits, row.found_by = (
                    new.plan,
                    new.result,
                    new.tokens_per_s,
                    new.fits,
                    other,
                )


def last_micro_batch(row: Row) -> Timeline:
    """The last micro-batch of a row's step (with the DP all-reduces and the optimizer): a
    whole step of many micro-batches is too long to read."""
    k = row.plan.n_sub if SPECS[row.schedule].overlapped else 1
    first = (row.batch.n_micro() - 1) * k
    return Timeline(
        [e for e in row.result.timeline.events if e.sub >= first or e.phase in ("dp", "optimizer")]
    )


def timeline_stems(rows: list[Row]) -> list[str]:
    """A file stem per row, unique within the report: ``timeline-oases`` where a schedule has
    one row, else the row's plan too (``timeline-oases-tp4-zero3``, ``timeline-oases-auto``),
    and a count where two rows are the same entry."""
    names = [r.schedule for r in rows]
    stems = []
    for r in rows:
        stem = f"timeline-{r.schedule}"
        if names.count(r.schedule) > 1:
            spec = str(r.spec).replace("=", "").replace("+", "plus").replace(",", "-")
            stem += f"-{spec}"
        while stem in stems:
            stem += "-again"
        stems.append(stem)
    return stems


def write_report(rep: Report, out: Path) -> list[Path]:
    """``simulate.json`` and a timeline PNG of every oases row (each its own file,
    ``timeline_stems``), or of the last row where none is an oases row."""
    from oases.planner.report import plan_label, simulate_json

    out.mkdir(parents=True, exist_ok=True)
    path = out / "simulate.json"
    path.write_text(json.dumps(simulate_json(rep), indent=1), encoding="utf-8")
    stems = timeline_stems(rep.rows)
    drawn = [i for i, r in enumerate(rep.rows) if r.schedule == "oases"] or [len(rep.rows) - 1]
    paths = [path]
    for i in drawn:
        row = rep.rows[i]
        png = out / f"{stems[i]}.png"
        n = row.batch.n_micro()
        which = f"the last of {n} micro-batches" if n > 1 else "the step's one micro-batch"
        title = (
            f"{row.schedule} ({plan_label(row)}) on {rep.cluster.name}, predicted: rank 0, "
            f"{which} with the DP all-reduces and the optimizer "
            f"({row.result.step_s:.3f} s step, bound by {row.result.bound()})"
        )
        k = row.plan.n_sub if SPECS[row.schedule].overlapped else 1
        last_micro_batch(row).plot(png, title=title, n_sub=k)
        paths.append(png)
    return paths


def help_text() -> str:
    """``oases simulate --help``'s epilog: the presets and how to describe a cluster."""
    from oases.planner.clusters import CLUSTERS, GPUS, LINKS
    from oases.planner.models import MODELS

    return f"""\
A cluster preset names a whole machine room: servers x GPUs per server, the GPU (peak flops,
memory, bandwidth, efficiencies), the link inside a server (PCIe, NVLink bridges, NVSwitch) and
the link between servers (Ethernet, InfiniBand; ports per server). Every number comes from a
public specification or microbenchmark named in the preset (nccl-tests, p2pBandwidthLatencyTest;
compute: each piece's kernels, planner/kernels/sources.py).
  cluster presets: {", ".join(CLUSTERS)}
  model presets:   {", ".join(MODELS)} (or a TOML run file: its [model] table)

Describe your own cluster in a TOML (or JSON) file with the same fields; a GPU or link may be a
preset name or a table of its fields:

  name = "lab"                 # my-cluster.toml
  servers = 4
  nics_per_server = 1          # ports between servers, shared by the server's GPUs
  inter_link = "25gbe"         # {", ".join(k for k in LINKS if "gbe" in k or "ib" in k)}
  [server]
  gpus_per_server = 8
  gpu = "rtx3090"              # {", ".join(GPUS)}
  link = "pcie4-x16"           # {", ".join(k for k in LINKS if not ("gbe" in k or "ib" in k))}
  # or, instead of link = "...", a link of your own (same for gpu: a [server.gpu] table with
  # name, peak_flops = {{fp32 = 35.6e12, bf16 = 71e12}}, memory_bytes,
  # memory_bandwidth_bytes_per_s, matmul_efficiency, elementwise_efficiency, and optionally
  # dtype_efficiency = {{bf16 = 0.87}} where a dtype's matmuls reach another fraction, and
  # kernels = {{sms = 108, kernel_gap_s = 2e-6, host_op_s = 1e-5, nccl_ctas = 12, ...}}: the
  # kernel table, which `oases profile --kernels` measures on a GPU and writes in a file):
  # [server.link]
  # name = "PCIe 4.0 x16"
  # latency_s = 0                    # added to NCCL's per-step latency
  # bandwidth_bytes_per_s = 31.5e9   # nominal, per direction per GPU
  # efficiency = 0.86                # the fraction NCCL's ring reaches (nccl-tests busbw)
  # kind = "pcie"                    # nvlink | pcie | net: NCCL's latency row
  # host_staged = false              # GeForce without P2P: staged through host memory, with
  # duplex_efficiency = 0.0          #   this fraction when every GPU stages both ways

Collectives are priced as NCCL's tuner picks them (ring, tree, NVLS x LL/LL128/Simple) on the
paths a group uses (host-staged PCIe, bridged pairs, NVSwitch; across servers, the server's
share of its ports); TP groups are contiguous ranks, DP groups strided. --uncertainty adds each
row's range over the uncertain inputs. Schedules may carry their own plan:
"megatron-recompute@tp=4+,merak@tp=4+,oases@auto" (tp=N+: the smallest degree >= N that fits).
"""
