"""``oases bench --layouts``: one model, one batch, laid out several ways on the same ranks and
link, timed side by side (``layout_runner``): tensor against data parallelism, ZeRO, pipeline
stages under every pipeline order, and PyTorch's own pipelining (``torch_pp``).

A layout entry is ``SCHEDULE@tp=T[,pp=P][,zero=Z][,pps=ORDER][,v=V]`` (the rest of the world
is data parallelism: dp = W / (pp tp); ``pps``: ``parallel.pp_schedule``, default 1f1b; ``v``:
``parallel.pp_chunks``, default 2 under pps=interleaved, else 1), or
``torch-pp@pp=W[,pps=gpipe|1f1b|interleaved|zb][,v=V]`` (``v``: torch's stages a rank under
its interleaved orders, default 2). For example, on 2 ranks::

    megatron@tp=2   megatron@tp=1   megatron@tp=1,zero=1   megatron@pp=2
    oases@pp=2,pps=1f1b-pair   megatron@pp=2,pps=interleaved   torch-pp@pp=2,pps=1f1b
    torch-pp@pp=2,pps=interleaved   torch-pp@pp=2,pps=zb

The table gives each layout's median step (forward, backward and its gradient reduction),
tokens/s, peak resident memory, and its speed against the first entry.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

LAYOUT_SYNTAX = (
    "SCHEDULE@tp=T[,pp=P][,zero=Z][,pps=ORDER][,v=V] or "
    "torch-pp@pp=P[,pps=gpipe|1f1b|interleaved|zb][,v=V]"
)


class Layout(NamedTuple):
    name: str
    tp: int = 1
    pp: int = 1
    zero: int = 0
    pps: str = "1f1b"
    v: int = 1  # model chunks per stage (pps=interleaved)


def parse_layout(entry: str) -> Layout:
    """``megatron@tp=1,zero=1`` -> Layout("megatron", 1, 1, 1); ValueError naming the syntax."""
    from oases.schedule import SCHEDULES
    from oases.schedule.specs import BASELINES
    from oases.stages import check_pipeline_schedule

    name, _, opts = entry.partition("@")
    values: dict[str, str] = {}
    for opt in filter(None, opts.split(",")):
        key, _, value = opt.partition("=")
        if (
            key in values
            or key not in ("tp", "pp", "zero", "pps", "v")
            or not value
            or (key != "pps" and not value.isdigit())
        ):
            raise ValueError(f"layout {entry!r}: expected {LAYOUT_SYNTAX}")
        values[key] = value
    if name not in (*SCHEDULES, *BASELINES, "torch-pp"):
        raise ValueError(f"layout {entry!r}: unknown schedule {name!r}; expected {LAYOUT_SYNTAX}")
    lay = Layout(
        name,
        int(values.get("tp", 1)),
        int(values.get("pp", 1)),
        int(values.get("zero", 0)),
        values.get("pps", "1f1b"),
        int(values.get("v", 2 if values.get("pps") in ("interleaved", "zb") else 1)),
    )
    if lay.tp < 1 or lay.pp < 1 or lay.zero > 3:
        raise ValueError(f"layout {entry!r}: tp and pp at least 1, zero 0-3")
    if name == "torch-pp":
        from oases.bench.torch_pp import MULTI, ORDERS

        if (
            lay.tp != 1
            or lay.zero
            or lay.pps not in ORDERS
            or lay.pp < 2
            or (lay.pps in MULTI) != (lay.v >= 2)
        ):
            raise ValueError(
                f"layout {entry!r}: torch-pp runs a pipeline of pp >= 2 over the "
                f"whole world at tp=1 without ZeRO, pps {'/'.join(ORDERS)}, "
                f"v >= 2 exactly under {'/'.join(MULTI)}"
            )
    else:
        check_pipeline_schedule(lay.pps)
    return lay


def check_layouts(entries: list[str], nproc: int, cfg) -> list[Layout]:  # noqa: ANN001
    """Every entry parsed and fitted to ``nproc`` ranks and the model, before a rank starts."""
    from oases.plan import ParallelPlan

    out = []
    for entry in entries:
        lay = parse_layout(entry)
        if nproc % (lay.tp * lay.pp):
            raise ValueError(
                f"layout {entry!r}: tp={lay.tp} x pp={lay.pp} does not divide {nproc} ranks"
            )
        dp = nproc // (lay.tp * lay.pp)
        if lay.name == "torch-pp" and lay.pp != nproc:
            raise ValueError(f"layout {entry!r}: torch-pp's pp must be the world ({nproc})")
        if cfg.train.global_batch % (dp * cfg.train.micro_batch):
            raise ValueError(
                f"layout {entry!r}: train.global_batch={cfg.train.global_batch} "
                f"does not split into micro-batches of {cfg.train.micro_batch} "
                f"over dp={dp}"
            )
        if lay.name != "torch-pp":
            ParallelPlan.uniform(
                cfg.model, nproc, lay.tp, pp=lay.pp, pp_schedule=lay.pps, pp_chunks=lay.v
            ).check(cfg.model, nproc)
        out.append(lay)
    return out


def run_layouts(
    config: str | None,
    overrides: list[str],
    entries: list[str],
    link: str,
    steps: int,
    out: Path,
    nproc: int = 2,
    warmup: int = 2,
) -> dict:
    """Launch the ranks (on a loopback shaped to ``link``: none or a rate), write
    ``layouts.json`` and ``layouts.md`` into ``out``, print the table; returns the result."""
    from oases.bench.suite import launch_ranks, parse_rate
    from oases.config import load_config

    cfg = load_config(config, overrides)
    check_layouts(entries, nproc, cfg)
    if link.startswith("auto:"):
        raise ValueError(
            "--layouts takes --link none or a rate (200mbit, 25MB): auto:PRESET "
            "calibrates a TP all-reduce, which the layouts do not share"
        )
    rate = None if link == "none" else parse_rate(link)
    label = (
        "unshaped loopback" if rate is None else f"loopback shaped to {rate * 8 / 1e6:.1f} Mbit/s"
    )
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        launch_ranks(
            "oases.bench.layout_runner",
            {
                "config": config,
                "overrides": overrides,
                "out": str(out),
                "layouts": entries,
                "steps": steps,
                "warmup": warmup,
            },
            nproc,
            rate,
            Path(tmp),
            measures_memory=False,
        )
    raw = json.loads((out / "raw.json").read_text())
    base = statistics.median(raw["times_s"][entries[0]])
    rows = {}
    for entry in entries:
        med = statistics.median(raw["times_s"][entry])
        rows[entry] = {
            "median_step_s": med,
            "tokens_per_s": raw["tokens_per_step"] / med,
            "peak_mem_mb": raw["peak_mem_mb"][entry],
            "vs_first": base / med,
            "steps_s": raw["times_s"][entry],
        }
    result = {
        "link": label,
        "world_size": raw["world_size"],
        "steps": steps,
        "warmup": warmup,
        "layouts": rows,
        "argv": sys.argv,
    }
    (out / "layouts.json").write_text(json.dumps(result, indent=1))
    table = format_layouts(result)
    (out / "layouts.md").write_text(table + "\n")
    print(table, flush=True)
    return result


def format_layouts(result: dict) -> str:
    first = next(iter(result["layouts"]))
    lines = [
        f"{result['world_size']} ranks, {result['link']}; medians of {result['steps']} "
        f"steps after {result['warmup']} warm-up, interleaved",
        "",
        f"| layout | step s | tokens/s | peak MB | vs {first} |",
        "|---|---|---|---|---|",
    ]
    for name, r in result["layouts"].items():
        lines.append(
            f"| `{name}` | {r['median_step_s']:.3f} | {r['tokens_per_s']:,.0f} | "
            f"{r['peak_mem_mb']:.0f} | {r['vs_first']:.2f}x |"
        )
    return "\n".join(lines)
