"""The per-collective table: predictions of planner.collectives beside the public figures.

    python benchmarks/2026-12-02-collectives/collectives.py

For every preset, collective (all-reduce, all-gather, reduce-scatter), group of 2, 4 and 8
GPUs and message of 1 MiB to 1 GiB: the predicted bus bandwidth, the algorithm and protocol
NCCL's tuner picks, and where a public figure exists (tests/data/collective_figures.json, each
with its source and the mode it was run in) the figure and the error of the predicted time, with
the median and worst error per figure set and per collective. Writes collectives.md and
collectives.json beside this script.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from oases.planner.clusters import cluster_from_dict, get_cluster
from oases.planner.collectives import OPS, bus_factor, collective

HERE = Path(__file__).resolve().parent
FIGURES = HERE.parents[1] / "tests" / "data" / "collective_figures.json"
MiB = 1 << 20
SIZES = [MiB << i for i in range(11)]  # 1 MiB .. 1 GiB
# (preset, cluster preset, ranks of a group of 2, 4, 8: TP-style contiguous ranks)
GRID = [
    ("pcie4-x16-geforce (4 RTX 3090; 8 = two servers, 100 GbE)", "paper-3090-pcie-32"),
    ("nvlink-bridge-3090 pairs (4 RTX 3090; 8 = two servers)", "paper-3090-nvlink-32"),
    ("nvswitch-a100 (DGX A100)", "a100-ib-64"),
    ("nvswitch-h100 (DGX H100)", "h100-ib-64"),
]


def cluster_of(spec: str | dict) -> object:
    return get_cluster(spec) if isinstance(spec, str) else cluster_from_dict(spec)


def compare(figures: dict) -> list[dict]:
    """One row per figure: the figure's and the predicted bus bandwidth, the time error."""
    out = []
    for s in figures["sets"]:
        cluster = cluster_of(s["cluster"])
        n = len(s["ranks"])
        for size, busbw in s["busbw_GBps"].items():
            nbytes = int(size)
            choice = collective(cluster, s["op"], s["ranks"], nbytes)
            measured_s = bus_factor(s["op"], n) * nbytes / (busbw * 1e9)
            out.append(
                {
                    "preset": s["preset"],
                    "op": s["op"],
                    "ranks": n,
                    "bytes": nbytes,
                    "figure_busbw_GBps": busbw,
                    "predicted_busbw_GBps": bus_factor(s["op"], n) * nbytes / choice.seconds / 1e9,
                    "figure_s": measured_s,
                    "predicted_s": choice.seconds,
                    "error": choice.seconds / measured_s - 1,
                    "algorithm": choice.algorithm,
                    "protocol": choice.protocol,
                    "held_out": size not in s["sets_preset"],
                    "latency": size in s.get("latency_sizes", []),
                    "source": s["source"],
                    "mode": s.get("mode", ""),
                }
            )
    return out


def summary(rows: list[dict], by_op: bool = False) -> dict[str, dict]:
    """Median and worst |time error| per figure set (``preset``; per preset and collective,
    keyed "preset op", with ``by_op``), over every figure and over held-out ones."""
    out = {}
    key = (lambda r: f"{r['preset']} {r['op']}") if by_op else (lambda r: r["preset"])
    for preset in dict.fromkeys(key(r) for r in rows):
        mine = [r for r in rows if key(r) == preset]
        held = [abs(r["error"]) for r in mine if r["held_out"]]
        every = [abs(r["error"]) for r in mine]
        out[preset] = {
            "figures": len(every),
            "median": statistics.median(every),
            "worst": max(every),
            "held_out": len(held),
            "held_out_median": statistics.median(held) if held else None,
        }
    return out


def grid() -> list[dict]:
    rows = []
    for label, name in GRID:
        cluster = get_cluster(name)
        for n in (2, 4, 8):
            for op in OPS:
                for nbytes in SIZES:
                    c = collective(cluster, op, range(n), nbytes)
                    rows.append(
                        {
                            "preset": label,
                            "ranks": n,
                            "op": op,
                            "bytes": nbytes,
                            "busbw_GBps": bus_factor(op, n) * nbytes / c.seconds / 1e9,
                            "seconds": c.seconds,
                            "algorithm": c.algorithm,
                            "protocol": c.protocol,
                        }
                    )
    return rows


def fmt_size(nbytes: int) -> str:
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if nbytes >= 1 << shift:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def fmt_gbps(gbps: float) -> str:
    return f"{gbps:.2f}" if gbps >= 1 else f"{gbps:.4f}"


def main() -> None:
    figures = json.loads(FIGURES.read_text())
    rows, table = compare(figures), grid()
    summ, summ_op = summary(rows), summary(rows, by_op=True)
    every = [abs(r["error"]) for r in rows]
    held = [abs(r["error"]) for r in rows if r["held_out"]]
    md = [
        "## Predictions beside the public figures",
        "",
        "Error = predicted time / figure's time - 1 (time = bus factor x bytes / busbw). "
        "'set' marks a figure a preset's efficiency was taken from, 'latency' a figure below "
        "the 1 MiB-1 GiB grid kept as a latency check.",
        "",
        "| preset | op | GPUs | size | figure busbw GB/s | predicted | error | NCCL's pick |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        md.append(
            f"| {r['preset']} | {r['op']} | {r['ranks']} | {fmt_size(r['bytes'])} | "
            f"{fmt_gbps(r['figure_busbw_GBps'])} | {fmt_gbps(r['predicted_busbw_GBps'])} | "
            f"{r['error']:+.0%}{'' if r['held_out'] else ' (set)'}"
            f"{' (latency)' if r['latency'] else ''} | "
            f"{r['algorithm']}/{r['protocol']} |"
        )
    md += [
        "",
        "| preset | figures | median error | worst | held-out figures | held-out median |",
        "|---|---|---|---|---|---|",
    ]
    for preset, s in summ.items():
        ho = "-" if s["held_out_median"] is None else f"{s['held_out_median']:.1%}"
        md.append(
            f"| {preset} | {s['figures']} | {s['median']:.1%} | {s['worst']:.1%} | "
            f"{s['held_out']} | {ho} |"
        )
    md += [
        "",
        "| preset | collective | figures | median error | worst |",
        "|---|---|---|---|---|",
    ]
    for key, s in summ_op.items():
        preset, op = key.split(" ")
        md.append(
            f"| {preset} | {op} | {s['figures']} | {s['median']:.1%} | {s['worst']:.1%} |"
        )
    md += ["", "How each figure set was run:", ""]
    for preset in summ:
        modes = dict.fromkeys(r["mode"] for r in rows if r["preset"] == preset and r["mode"])
        if modes:
            md.append(f"- {preset}: " + "; ".join(modes))
    md += [
        "",
        f"All {len(every)} figures: median {statistics.median(every):.1%}; the "
        f"{len(held)} held out: median {statistics.median(held):.1%}.",
        "",
        "## Predicted bus bandwidth (GB/s) per preset, collective and group",
        "",
    ]
    for label, _ in GRID:
        md += [
            f"### {label}",
            "",
            "| op | GPUs | " + " | ".join(fmt_size(s) for s in SIZES) + " |",
            "|---|---|" + "---|" * len(SIZES),
        ]
        for n in (2, 4, 8):
            for op in OPS:
                cells = [
                    r for r in table if r["preset"] == label and r["ranks"] == n and r["op"] == op
                ]
                md.append(
                    f"| {op} | {n} | "
                    + " | ".join(
                        f"{c['busbw_GBps']:.1f} {c['algorithm'][0]}{c['protocol'][:2]}"
                        for c in cells
                    )
                    + " |"
                )
        md.append("")
    md.append(
        "Cell: bus bandwidth and NCCL's pick (r ring, t tree, n NVLS; LL, LL128 as 'LL', "
        "Si Simple)."
    )
    (HERE / "collectives.md").write_text("\n".join(md) + "\n")
    (HERE / "collectives.json").write_text(
        json.dumps(
            {
                "figures": rows,
                "summary": summ,
                "summary_by_collective": summ_op,
                "grid": table,
                "median_all": statistics.median(every),
                "median_held_out": statistics.median(held),
            },
            indent=1,
        )
        + "\n"
    )
    print(
        "\n".join(
            md[
                md.index(
                    "| preset | figures | median error | worst | held-out figures "
                    "| held-out median |"
                ) :
            ]
        ).split("## Predicted")[0]
    )


if __name__ == "__main__":
    main()
