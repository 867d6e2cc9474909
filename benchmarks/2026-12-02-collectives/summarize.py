"""Tables, results.json and sweep.png from the `oases simulate` runs of run.sh.

    python benchmarks/2026-12-02-collectives/summarize.py runs/collectives

Errors are |simulated / paper - 1| of the throughput normalized to Megatron-LM (the Oases
paper, Li et al., IEEE TPDS 2025, arXiv 2305.16121: its evaluation on the 32-GPU RTX 3090
cluster without NVLink, read off the authors' figure). The paper's per-model gains on its
NVLink cluster were not found in public text; its abstract's low end (1.01x over the fastest
of four baselines) is the smallest model on the NVLink cluster.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PAPER = {  # model: (Merak, Oases), Megatron-LM = 1, cluster without NVLink
    "paper-h1024-l24": (1.28, 1.53),
    "paper-h2048-l24": (1.27, 1.95),
    "paper-h3072-l24": (1.26, 1.78),
    "paper-h4096-l16": (1.28, 1.73),
    "paper-h6144-l16": (1.26, 1.67),
    "paper-h8192-l8": (1.18, 1.71),
    "paper-h12288-l4": (1.22, 1.81),
}
PCIE, NVLINK = "paper-3090-pcie-32", "paper-3090-nvlink-32"
GBPS = (10, 25, 40, 100, 200)
OLD = HERE.parent / "2026-11-30-paper-simulation" / "results.json"


def load(out: Path, cluster: str, gbps: int, model: str) -> dict:
    data = json.loads((out / cluster / str(gbps) / model / "simulate.json").read_text())
    rows = {(r["schedule"], r["plan_spec"].startswith("auto")): r for r in data["rows"]}
    return {
        "data": data,
        "megatron": rows["megatron-recompute", False],
        "merak": rows["merak", False],
        "oases": rows["oases", False],
        "auto": rows["oases", True],
        "megatron_auto": rows["megatron-recompute", True],
    }


def err(sim: float, paper: float) -> float:
    return abs(sim / paper - 1)


def stats(errors: list[float]) -> str:
    return f"median {statistics.median(errors):.1%}, worst {max(errors):.1%}"


def short(model: str) -> str:
    h, layers = model.removeprefix("paper-h").split("-l")
    return f"H={h} L={layers}"


def rng(row: dict, key: str = "speedup") -> str:
    u = row.get("uncertainty")
    return "" if u is None else f"{u[key][0]:.2f}-{u[key][1]:.2f}"


def scenarios_smaller(pcie: dict, nvlink: dict) -> tuple[int, int]:
    """(scenarios where the NVLink row's speedup is below the PCIe row's, scenarios): each
    uncertain input at each bound, the same on both clusters (the pair link, which the cluster
    without NVLink has not, at its preset value there)."""
    a, b = pcie["uncertainty"]["by_input"], nvlink["uncertainty"]["by_input"]
    hits = total = 0
    for name in b:
        for bound in ("low", "high"):
            p = a[name][bound]["speedup"] if name in a else pcie["speedup"]
            hits += b[name][bound]["speedup"] < p
            total += 1
    return hits, total


def prototype(cluster: str, model: str, tp: int) -> dict:
    """The paper's prototype planner's pick (planner/prototype.py), simulated."""
    from oases.planner.clusters import get_cluster
    from oases.planner.hardware import HardwareCosts
    from oases.planner.models import MODELS
    from oases.planner.prototype import prototype_plan
    from oases.planner.simulate import BatchShape

    micro = 4 * 32 // tp
    cfg = MODELS[model]
    choice = prototype_plan(
        cfg, HardwareCosts(get_cluster(cluster), cfg), BatchShape(20 * micro, micro), 0.95 * 24e9
    )
    return {
        "label": choice.label(),
        "step_s": choice.result.step_s,
        "model_s": choice.model_s,
        "degrees": choice.plan.degree_runs(),
        "tried": choice.tried,
    }


def main(out: Path) -> None:
    tp = {m: load(out, PCIE, 100, m)["megatron"]["plan"]["regions"][0]["tp"] for m in PAPER}
    head = {c: {m: load(out, c, 100, m) for m in PAPER} for c in (PCIE, NVLINK)}
    sweep_runs = {g: {m: load(out, PCIE, g, m) for m in PAPER} for g in GBPS}
    proto = {c: {m: prototype(c, m, tp[m]) for m in PAPER} for c in (PCIE, NVLINK)}
    results: dict = {"paper": PAPER, "tp": tp}
    md = []

    # 1. the cluster without NVLink, against the paper
    errs: dict[str, list[float]] = {"merak": [], "oases": [], "auto": []}
    md += [
        "## 1. Cluster without NVLink (100 GbE between servers) beside the paper",
        "",
        "| model | Megatron tp | Merak paper | Merak sim | error | Oases paper | (a) Oases "
        "at Megatron's tp | range | error | (b) Oases + planner | error | planner's degrees "
        "| moves (a) most |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, (p_merak, p_oases) in PAPER.items():
        r = head[PCIE][m]
        s = {k: r[k]["speedup"] for k in ("merak", "oases", "auto")}
        for k, ref in (("merak", p_merak), ("oases", p_oases), ("auto", p_oases)):
            errs[k].append(err(s[k], ref))
        md.append(
            f"| {short(m)} | {tp[m]} | {p_merak:.2f} | {s['merak']:.2f} | "
            f"{err(s['merak'], p_merak):.0%} | {p_oases:.2f} | {s['oases']:.2f} | "
            f"{rng(r['oases'])} | {err(s['oases'], p_oases):.0%} | {s['auto']:.2f} | "
            f"{err(s['auto'], p_oases):.0%} | {r['auto']['degrees_by_region']} | "
            f"{r['oases']['uncertainty']['most_sensitive']} |"
        )
    md += [
        "",
        f"- Merak / Megatron: {stats(errs['merak'])}",
        f"- (a) Oases schedule at Megatron's degree / Megatron: {stats(errs['oases'])} "
        "(target 15% / 30%)",
        f"- (b) Oases + this project's planner / Megatron: {stats(errs['auto'])}",
        "",
    ]
    results["errors_pcie_100gbps"] = {
        k: {"median": statistics.median(v), "worst": max(v)} for k, v in errs.items()
    }

    # 2. both clusters: the direction of the paper
    md += [
        "## 2. Both clusters: is the gain smaller with NVLink?",
        "",
        "| model | (a) no NVLink (range) | (a) NVLink (range) | smaller? | (b) no NVLink | "
        "(b) NVLink | "
        "smaller? | (b) NVLink degrees | Oases (b) over Megatron at its best degree: no "
        "NVLink / NVLink | Megatron's best degree (NVLink) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    direction = {"a": 0, "b": 0, "best": 0}
    results["clusters"] = {}
    for m in PAPER:
        a = {c: head[c][m]["oases"]["speedup"] for c in (PCIE, NVLINK)}
        b = {c: head[c][m]["auto"]["speedup"] for c in (PCIE, NVLINK)}
        best = {
            c: head[c][m]["megatron_auto"]["step_s"] / head[c][m]["auto"]["step_s"]
            for c in (PCIE, NVLINK)
        }
        for k, v in (("a", a), ("b", b), ("best", best)):
            direction[k] += v[NVLINK] < v[PCIE]
        held = scenarios_smaller(head[PCIE][m]["oases"], head[NVLINK][m]["oases"])
        md.append(
            f"| {short(m)} | {a[PCIE]:.2f} ({rng(head[PCIE][m]['oases'])}) | "
            f"{a[NVLINK]:.2f} ({rng(head[NVLINK][m]['oases'])}) | "
            f"{'yes' if a[NVLINK] < a[PCIE] else 'no'} ({held[0]} of {held[1]}) | "
            f"{b[PCIE]:.2f} | {b[NVLINK]:.2f} | "
            f"{'yes' if b[NVLINK] < b[PCIE] else 'no'} | "
            f"{head[NVLINK][m]['auto']['degrees_by_region']} | {best[PCIE]:.2f} / "
            f"{best[NVLINK]:.2f} | {head[NVLINK][m]['megatron_auto']['degrees_by_region']} |"
        )
        results["clusters"][m] = {
            "a": a,
            "b": b,
            "over_best_megatron": best,
            "a_smaller_in_scenarios": held,
            "ranges_a": {c: head[c][m]["oases"]["uncertainty"]["speedup"] for c in (PCIE, NVLINK)},
        }
    n = len(PAPER)
    md += [
        "",
        "(a) 'smaller?' (k of n): in k of the n uncertainty scenarios (each input at each bound, "
        "the same on both clusters) the NVLink gain is the smaller.",
        "",
        f"Gain smaller with NVLink: (a) {direction['a']} of {n} models, (b) "
        f"{direction['b']} of {n}, Oases + planner over Megatron at its best degree "
        f"{direction['best']} of {n}.",
        "",
    ]
    results["direction"] = direction

    # 3. the prototype planner beside this project's
    md += [
        "## 3. What the paper's prototype planner would choose (two degrees, one cut, low "
        "first, world-size all-reduces in its model), simulated",
        "",
        "| cluster | model | prototype's plan | prototype / Megatron | this planner / Megatron "
        "| this planner / prototype |",
        "|---|---|---|---|---|---|",
    ]
    results["prototype"] = {}
    for c in (PCIE, NVLINK):
        for m in PAPER:
            mega = head[c][m]["megatron"]["step_s"]
            p, ours = proto[c][m], head[c][m]["auto"]
            md.append(
                f"| {c} | {short(m)} | {p['label']} | {mega / p['step_s']:.2f} | "
                f"{ours['speedup']:.2f} | {p['step_s'] / ours['step_s']:.2f} |"
            )
            results["prototype"].setdefault(c, {})[m] = p | {
                "speedup": mega / p["step_s"],
                "ours": ours["speedup"],
            }
    md.append("")

    # 4. the link between servers
    md += [
        "## 4. How the answer moves with the link between servers (no NVLink)",
        "",
        "| Gb/s | " + " | ".join(short(m) for m in PAPER) + " | error (a) | error (b) |",
        "|---" * (n + 3) + "|",
    ]
    sweep = {}
    for g in GBPS:
        sched = [sweep_runs[g][m]["oases"]["speedup"] for m in PAPER]
        auto = [sweep_runs[g][m]["auto"]["speedup"] for m in PAPER]
        e_s = [err(v, PAPER[m][1]) for v, m in zip(sched, PAPER)]
        e_a = [err(v, PAPER[m][1]) for v, m in zip(auto, PAPER)]
        sweep[g] = {"schedule": sched, "auto": auto}
        md.append(
            f"| {g} | "
            + " | ".join(f"{x:.2f} / {y:.2f}" for x, y in zip(sched, auto))
            + f" | {stats(e_s)} | {stats(e_a)} |"
        )
    results["sweep"] = sweep
    md.append("")

    # 5. what moved since 2026-11-30
    if OLD.exists():
        old = json.loads(OLD.read_text())["headline"]
        md += [
            "## 5. What moved since 2026-11-30 (cluster without NVLink, 100 GbE)",
            "",
            "| model | Merak old -> new | (a) old -> new | (b) old -> new |",
            "|---|---|---|---|",
        ]
        for m in PAPER:
            new = head[PCIE][m]
            md.append(
                f"| {short(m)} | {old[m]['merak']:.2f} -> {new['merak']['speedup']:.2f} "
                f"| {old[m]['oases']:.2f} -> {new['oases']['speedup']:.2f} | "
                f"{old[m]['auto']:.2f} -> {new['auto']['speedup']:.2f} |"
            )
        md.append("")
    planning = [head[c][m]["data"]["planning_s"] for c in head for m in PAPER]
    md.append(
        f"Simulating and planning the five rows took {min(planning):.2f}-"
        f"{max(planning):.2f} s per model (the ranges add 11 re-simulations per row)."
    )
    results["headline"] = {
        c: {
            m: {k: head[c][m][k]["speedup"] for k in ("merak", "oases", "auto")}
            | {"auto_degrees": head[c][m]["auto"]["degrees_by_region"]}
            for m in PAPER
        }
        for c in head
    }
    (HERE / "results.md").write_text("\n".join(md) + "\n")
    (HERE / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(sweep)
    print("\n".join(md))


def plot(sweep: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    colors = plt.get_cmap("tab10")
    for ax, key, title in (
        (axes[0], "schedule", "(a) Oases schedule at Megatron's degree"),
        (axes[1], "auto", "(b) Oases schedule + planner"),
    ):
        for i, model in enumerate(PAPER):
            ax.plot(
                GBPS,
                [sweep[g][key][i] for g in GBPS],
                marker="o",
                color=colors(i),
                label=short(model),
            )
            ax.axhline(PAPER[model][1], color=colors(i), linestyle=":", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xticks(GBPS, [str(g) for g in GBPS])
        ax.set_xlabel("link between servers (Gb/s, nominal)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("throughput / Megatron-LM (simulated; dotted: paper)")
    axes[1].legend(fontsize=8)
    fig.suptitle(
        "paper-3090-pcie-32, NCCL-priced collectives: simulated Oases speedup over "
        "Megatron-LM vs the link between servers"
    )
    fig.tight_layout()
    fig.savefig(HERE / "sweep.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE.parents[1] / "runs/collectives")
