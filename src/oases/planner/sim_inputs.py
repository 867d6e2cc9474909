"""What ``oases simulate`` is asked: plan specs, the precision it prices, the cluster.

``parse_entries("oases,megatron@tp=4,zero=1", default)`` -> [(schedule, PlanSpec)]; a spec is
"auto", "tp=N" or "tp=N+" with optional ",zero=Z", ",sp=MODE", ",pp=P" and ",pps=NAME" (the
grammar is ``parse_plan``'s docstring; what each means is ``planner.whatif``'s).
``simulate_precision`` resolves the compute and grad-reduce dtypes as ``oases plan`` does, and
``load_any_cluster`` reads a preset or a cluster file, optionally at another inter-server rate.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from oases.planner.clusters import Cluster, get_cluster, load_cluster
from oases.schedule.program import SPECS
from oases.stages import PIPELINE_SCHEDULES


@dataclass(frozen=True)
class PlanSpec:
    """ "auto", or a uniform degree ``tp`` (``at_least``: the smallest fitting degree >= tp);
    ``zero``: the ZeRO stage of every region (None: auto searches 0-3, a degree takes 0);
    ``sp``: sequence parallelism ("gathered" | "shards" | "off"; None: auto searches it
    beside plans without it, a degree takes "off")."""

    auto: bool
    tp: int = 0
    at_least: bool = False
    zero: int | None = None
    sp: str | None = None
    pp: int = 1  # pipeline stages
    pps: str | None = None  # pipeline schedule (None: the plan's default)

    def __str__(self) -> str:
        zero = "" if self.zero is None else f",zero={self.zero}"
        sp = "" if self.sp is None or (self.sp == "off" and not self.auto) else f",sp={self.sp}"
        pp = (f",pp={self.pp}" if self.pp > 1 else "") + (
            f",pps={self.pps}" if self.pps is not None else ""
        )
        return (
            ("auto" if self.auto else f"tp={self.tp}{'+' if self.at_least else ''}")
            + pp
            + zero
            + sp
        )

    def sp_modes(self) -> tuple[str, ...]:
        """The sequence-parallel modes an auto row searches."""
        if self.sp is None:
            return ("gathered", "shards")
        return () if self.sp == "off" else (self.sp,)


def parse_plan(text: str) -> PlanSpec:
    """ "auto", "tp=N" or "tp=N+", each optionally followed by ",zero=Z", ",sp=MODE" (MODE:
    gathered, shards or off), ",pp=P" (P pipeline stages) and ",pps=NAME" (the pipeline
    schedule, ``stages.PIPELINE_SCHEDULES``); ValueError otherwise. "auto,pp=P" searches
    stages, order and degrees at that depth (``planner.whatif_pipeline``)."""
    head, *tails = text.split(",")
    zero, sp, pp, pps = None, None, None, None
    for tail in tails:
        if tail.startswith("zero=") and tail[5:] in ("0", "1", "2", "3") and zero is None:
            zero = int(tail[5:])
        elif tail.startswith("sp=") and tail[3:] in ("gathered", "shards", "off") and sp is None:
            sp = tail[3:]
        elif tail.startswith("pp=") and tail[3:].isdigit() and int(tail[3:]) >= 1 and pp is None:
            pp = int(tail[3:])
        elif tail.startswith("pps=") and tail[4:] in PIPELINE_SCHEDULES and pps is None:
            pps = tail[4:]
        else:
            raise ValueError(
                f"plan {text!r}: after the degree, give zero=Z (Z = 0, 1, 2 or 3), "
                "sp=gathered|shards|off, pp=P (P >= 1 pipeline stages) and/or "
                f"pps={'|'.join(PIPELINE_SCHEDULES)}"
            )
    if pps is not None and (pp or 1) == 1:
        raise ValueError(
            f"plan {text!r}: pps={pps} names a pipeline schedule: give pp=P (P >= 2 stages) too"
        )
    if head == "auto":  # with pp=P: the pipeline search at P stages (whatif_pipeline)
        return PlanSpec(True, zero=zero, sp=sp, pp=pp or 1, pps=pps)
    body = head[3:].removesuffix("+") if head.startswith("tp=") else ""
    if not body.isdigit() or int(body) < 1:
        raise ValueError(
            f"plan {text!r}: give auto, tp=N or tp=N+ (N >= 1), then optionally "
            ",zero=Z, ,sp=MODE, ,pp=P and ,pps=NAME"
        )
    return PlanSpec(False, int(body), head.endswith("+"), zero, sp, pp or 1, pps)


def parse_entries(text: str, default: str) -> list[tuple[str, PlanSpec]]:
    """ "a,b@tp=4,c@auto,d@tp=2,zero=1" -> [(schedule, plan)], the default plan where none is
    given (a ",zero=Z", ",sp=MODE", ",pp=P" or ",pps=NAME" belongs to the entry before it)."""
    items: list[str] = []
    for item in (s.strip() for s in text.split(",")):
        if item.startswith(("zero=", "sp=", "pp=", "pps=")) and items:
            items[-1] += "," + item
        elif item:
            items.append(item)
    entries = []
    for item in items:
        name, _, plan = item.partition("@")
        if name not in SPECS:
            raise ValueError(f"unknown schedule {name!r}; valid: {', '.join(SPECS)}")
        entries.append((name, parse_plan(plan or default)))
    if not entries:
        raise ValueError("--schedules lists no schedule")
    return entries


def simulate_precision(
    model: str, dtype: str = "auto", grad_reduce: str = "auto"
) -> tuple[str, str, str]:
    """``oases simulate``'s (compute dtype, grad-reduce dtype, where they came from). "auto":
    for a TOML run file, its ``train.precision`` and ``parallel.grad_reduce_dtype`` as
    training resolves them on GPUs (``planner.precision.resolve_plan_precision``: "auto" is
    bf16), the dtypes ``oases plan`` prices the same file in; for a model preset, the paper's
    fp32. A flag given wins."""
    from oases.planner.precision import resolve_plan_precision

    if Path(model).suffix == ".toml":
        from oases.config import load_config

        cfg = load_config(model, [])
        run = resolve_plan_precision(cfg.train.precision, cfg.parallel.grad_reduce_dtype)
        if run.compute == "fp64" and dtype == "auto":
            raise ValueError(
                f"{model}: train.precision=fp64 has no GPU peak to price; give "
                "--dtype fp32, tf32, bf16 or fp16"
            )
        where = f"{model}'s train.precision={cfg.train.precision}" + (
            " as on GPUs" if cfg.train.precision == "auto" else ""
        )
        auto = (run.compute, run.grad_reduce) if run.compute != "fp64" else ("fp32", "fp32")
    else:
        where, auto = "the paper's fp32 (a model preset)", ("fp32", "fp32")
    picked = (
        auto[0] if dtype == "auto" else dtype,
        auto[1] if grad_reduce == "auto" else grad_reduce,
    )
    given = [
        f for f, v in (("--dtype", dtype), ("--grad-reduce-dtype", grad_reduce)) if v != "auto"
    ]
    source = (
        " and ".join(given) if len(given) == 2 else f"{where}" + (f"; {given[0]}" if given else "")
    )
    return picked[0], picked[1], source


def load_any_cluster(source: str, inter_gbps: float | None = None) -> Cluster:
    """A preset name or a TOML/JSON cluster file; ``inter_gbps`` replaces the nominal rate of
    the link between servers (Gb/s; its efficiency and latency stay)."""
    cluster = (
        load_cluster(source) if Path(source).suffix in (".toml", ".json") else get_cluster(source)
    )
    if inter_gbps is not None:
        if inter_gbps <= 0 or cluster.inter_link is None:
            raise ValueError(
                f"--inter-gbps={inter_gbps}: needs a rate > 0 and a cluster of "
                f"several servers ({cluster.name} has {cluster.servers})"
            )
        link = dataclasses.replace(
            cluster.inter_link,
            bandwidth_bytes_per_s=inter_gbps * 1e9 / 8,
            name=f"{cluster.inter_link.name} at {inter_gbps:g} Gb/s",
        )
        cluster = dataclasses.replace(
            cluster, inter_link=link, name=f"{cluster.name}@{inter_gbps:g}gbps"
        )
    return cluster
