"""Tables, results.json and sweep.png from the `oases simulate` runs of run.sh.

    python summarize.py runs/paper-simulation

Errors are |simulated / paper - 1| of the throughput normalized to Megatron-LM (the Oases
paper, Li et al., IEEE TPDS 2025, arXiv 2305.16121: its evaluation on the 32-GPU RTX 3090
cluster without NVLink, read off the authors' figure).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PAPER = {  # model: (Merak, Oases), Megatron-LM = 1
    "paper-h1024-l24": (1.28, 1.53), "paper-h2048-l24": (1.27, 1.95),
    "paper-h3072-l24": (1.26, 1.78), "paper-h4096-l16": (1.28, 1.73),
    "paper-h6144-l16": (1.26, 1.67), "paper-h8192-l8": (1.18, 1.71),
    "paper-h12288-l4": (1.22, 1.81),
}
GBPS = (10, 25, 40, 100, 200)


def load(out: Path, gbps: int, model: str) -> dict:
    data = json.loads((out / str(gbps) / model / "simulate.json").read_text())
    rows = {(r["schedule"], r["plan_spec"].startswith("auto")): r for r in data["rows"]}
    return {"data": data, "megatron": rows["megatron-recompute", False],
            "merak": rows["merak", False], "oases": rows["oases", False],
            "auto": rows["oases", True]}


def err(sim: float, paper: float) -> float:
    return abs(sim / paper - 1)


def stats(errors: list[float]) -> str:
    return f"median {statistics.median(errors):.1%}, worst {max(errors):.1%}"


def check_megatron_degree(out: Path) -> list[str]:
    """The stated rule: Megatron at tp=4 unless it does not fit in 95% of 24 GB with 4
    sequences per TP group; then 8 (and 8 fits)."""
    from oases.plan import ParallelPlan
    from oases.planner.clusters import get_cluster
    from oases.planner.hardware import HardwareCosts
    from oases.planner.models import MODELS
    from oases.planner.simulate import BatchShape, simulate_plan

    cluster = get_cluster("paper-3090-pcie-32")
    lines = []
    for model in PAPER:
        cfg, used = MODELS[model], load(out, 100, model)["megatron"]["plan"]["regions"][0]["tp"]
        peaks = {}
        for t in (4, 8):
            micro = 4 * 32 // t
            plan = ParallelPlan.uniform(cfg, 32, t, schedule="megatron-recompute", n_sub=1)
            peaks[t] = simulate_plan(cfg, plan, HardwareCosts(cluster, cfg), 32,
                                     BatchShape(20 * micro, micro),
                                     timeline=False).peak_mem_bytes / 2**30
        want = 4 if peaks[4] <= 0.95 * 24e9 / 2**30 else 8
        assert used == want and peaks[want] <= 0.95 * 24e9 / 2**30, (model, used, peaks)
        lines.append(f"| {model} | {peaks[4]:.1f} | {peaks[8]:.1f} | {used} |")
    return lines


def main(out: Path) -> None:
    runs = {g: {m: load(out, g, m) for m in PAPER} for g in GBPS}
    head = runs[100]
    md = ["## Simulated vs paper (100 Gb Ethernet between servers)", "",
          "| model | Megatron tp | Merak paper | Merak sim | error | Oases paper | "
          "Oases schedule at Megatron's tp | error | Oases + planner | error | planner's "
          "degrees |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    errs: dict[str, list[float]] = {"merak": [], "oases": [], "auto": []}
    for model, (p_merak, p_oases) in PAPER.items():
        r = head[model]
        s = {k: r[k]["speedup"] for k in ("merak", "oases", "auto")}
        for k, ref in (("merak", p_merak), ("oases", p_oases), ("auto", p_oases)):
            errs[k].append(err(s[k], ref))
        tp = r["megatron"]["plan"]["regions"][0]["tp"]
        md.append(f"| {model} | {tp} | {p_merak:.2f} | {s['merak']:.2f} | "
                  f"{err(s['merak'], p_merak):.0%} | {p_oases:.2f} | {s['oases']:.2f} | "
                  f"{err(s['oases'], p_oases):.0%} | {s['auto']:.2f} | "
                  f"{err(s['auto'], p_oases):.0%} | {r['auto']['degrees_by_region']} |")
    md += ["", f"- Merak / Megatron: {stats(errs['merak'])}",
           f"- Oases schedule at Megatron's degree / Megatron: {stats(errs['oases'])}",
           f"- Oases + planner / Megatron: {stats(errs['auto'])}", "",
           "## Absolute predictions (100 Gb Ethernet)", "",
           "| model | schedule | plan | step (s) | tokens/s | peak GiB per GPU |",
           "|---|---|---|---|---|---|"]
    for model in PAPER:
        for key in ("megatron", "merak", "oases", "auto"):
            row = head[model][key]
            md.append(f"| {model} | {row['schedule']} | {row['label']} | {row['step_s']:.2f} | "
                      f"{row['tokens_per_s']:,.0f} | {row['peak_mem_bytes'] / 2**30:.1f} |")
    md += ["", "## Inter-server bandwidth sweep (nominal Gb/s; efficiency 0.8, 20 us)", "",
           "Oases schedule at Megatron's degree / Megatron, then Oases + planner / Megatron:", "",
           "| Gb/s | " + " | ".join(m.removeprefix("paper-") for m in PAPER)
           + " | error (schedule) | error (+ planner) |",
           "|---" * (len(PAPER) + 3) + "|"]
    sweep = {}
    for g in GBPS:
        sched = [runs[g][m]["oases"]["speedup"] for m in PAPER]
        auto = [runs[g][m]["auto"]["speedup"] for m in PAPER]
        e_s = [err(v, PAPER[m][1]) for v, m in zip(sched, PAPER)]
        e_a = [err(v, PAPER[m][1]) for v, m in zip(auto, PAPER)]
        sweep[g] = {"schedule": sched, "auto": auto, "merak": [runs[g][m]["merak"]["speedup"]
                                                               for m in PAPER]}
        md.append(f"| {g} | " + " | ".join(f"{a:.2f} / {b:.2f}" for a, b in zip(sched, auto))
                  + f" | {stats(e_s)} | {stats(e_a)} |")
    md += ["", "## The rule that picks Megatron's degree (peak GiB per GPU, budget 21.2)", "",
           "| model | tp=4, 32 per micro-batch | tp=8, 16 per micro-batch | used |",
           "|---|---|---|---|", *check_megatron_degree(out)]
    planning = [head[m]["data"]["planning_s"] for m in PAPER]
    md += ["", f"Simulating and planning the four rows took {min(planning):.2f}-"
           f"{max(planning):.2f} s per model."]
    (HERE / "results.md").write_text("\n".join(md) + "\n")
    results = {"paper": PAPER, "gbps": GBPS, "sweep": sweep,
               "errors_at_100gbps": {k: {"median": statistics.median(v), "worst": max(v)}
                                     for k, v in errs.items()},
               "headline": {m: {k: head[m][k]["speedup"] for k in ("merak", "oases", "auto")}
                            | {"auto_degrees": head[m]["auto"]["degrees_by_region"]}
                            for m in PAPER}}
    (HERE / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(sweep)
    print("\n".join(md))


def plot(sweep: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    colors = plt.get_cmap("tab10")
    for ax, key, title in ((axes[0], "schedule", "Oases schedule at Megatron's degree"),
                           (axes[1], "auto", "Oases schedule + planner")):
        for i, model in enumerate(PAPER):
            ax.plot(GBPS, [sweep[g][key][i] for g in GBPS], marker="o", color=colors(i),
                    label=model.removeprefix("paper-"))
            ax.axhline(PAPER[model][1], color=colors(i), linestyle=":", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xticks(GBPS, [str(g) for g in GBPS])
        ax.set_xlabel("link between servers (Gb/s, nominal)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("throughput / Megatron-LM (simulated; dotted: paper)")
    axes[1].legend(fontsize=8)
    fig.suptitle("paper-3090-pcie-32: simulated Oases speedup over Megatron-LM vs the assumed "
                 "inter-server bandwidth")
    fig.tight_layout()
    fig.savefig(HERE / "sweep.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE.parents[1] / "runs/paper-simulation")
