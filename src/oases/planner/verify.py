"""``oases plan --verify``: run the candidates for real and put prediction beside measurement.

For every candidate (each uniform degree x schedule x sub-batch count the machine can run, and
the chosen plan) the ranks are launched once (``oases.bench.plan_runner``: warm-up, then timed
steps of forward + backward + DP reduction + AdamW) and the median step time and peak memory are
compared with the simulator's. Writes ``verify.json`` and ``report.md``:

    error        predicted / measured - 1, per candidate; median and worst of |error|
    plan quality the chosen plan's measured time / the best measured time of all candidates
"""

from __future__ import annotations

import datetime
import json
import statistics
import sys
import tempfile
from pathlib import Path

from oases.planner.search import Candidate


def measure_candidates(config: str | None, overrides: list[str], candidates: list[Candidate],
                       nproc: int, rate: float | None, steps: int, warmup: int, out: Path,
                       rounds: int = 2) -> list[dict]:
    """Launch every candidate once per round, rounds interleaved (A B C A B C), so a slow
    minute of the machine does not land on one plan; medians over all timed steps."""
    from oases.bench.suite import launch_ranks

    (out / "plans").mkdir(parents=True, exist_ok=True)
    runs: list[list[dict]] = [[] for _ in candidates]
    for r in range(rounds):
        for n, cand in enumerate(candidates):
            plan_path = out / "plans" / f"{n:02d}.json"
            cand.plan.save(plan_path)
            result_path = out / "plans" / f"{n:02d}.round{r}.json"
            print(f"oases plan --verify: round {r + 1}/{rounds}, [{n + 1}/{len(candidates)}] "
                  f"{cand.label()}", flush=True)
            with tempfile.TemporaryDirectory() as tmp:
                launch_ranks("oases.bench.plan_runner",
                             {"config": config, "overrides": overrides, "plan": str(plan_path),
                              "steps": steps, "warmup": warmup, "out": str(result_path)},
                             nproc, rate, Path(tmp))
            runs[n].append(json.loads(result_path.read_text()))
    rows = []
    for n, cand in enumerate(candidates):
        steps_s = [s for got in runs[n] for s in got["steps_s"]]
        measured = statistics.median(steps_s)
        peak = max(got["peak_mem_bytes"] for got in runs[n])
        rows.append({
            "plan": cand.label(), "kind": cand.kind, "file": f"plans/{n:02d}.json",
            "degrees": [r.tp for r in cand.plan.regions],
            "predicted_step_s": cand.result.step_s, "measured_step_s": measured,
            "steps_s": steps_s, "step_error": cand.result.step_s / measured - 1.0,
            "predicted_peak_mem_bytes": cand.result.peak_mem_bytes,
            "measured_peak_mem_bytes": peak,
            "mem_error": cand.result.peak_mem_bytes / peak - 1.0,
            "predicted_baseline_bytes": cand.result.breakdown.get("baseline_bytes", 0.0),
            "measured_baseline_bytes": max(got["baseline_bytes"] for got in runs[n]),
        })
    return rows


def summarize(rows: list[dict], chosen: str, budget_bytes: float) -> dict:
    step_err = [abs(r["step_error"]) for r in rows]
    mem_err = [abs(r["mem_error"]) for r in rows]
    best = min(rows, key=lambda r: r["measured_step_s"])
    mine = next(r for r in rows if r["plan"] == chosen)
    return {
        "median_abs_step_error": statistics.median(step_err), "worst_abs_step_error": max(step_err),
        "median_abs_mem_error": statistics.median(mem_err), "worst_abs_mem_error": max(mem_err),
        "chosen": chosen, "chosen_measured_step_s": mine["measured_step_s"],
        "best_measured": best["plan"], "best_measured_step_s": best["measured_step_s"],
        "chosen_vs_best": mine["measured_step_s"] / best["measured_step_s"] - 1.0,
        "budget_bytes": None if budget_bytes == float("inf") else budget_bytes,
        "chosen_peak_under_budget": mine["measured_peak_mem_bytes"] <= budget_bytes,
    }


def format_rows(rows: list[dict], chosen: str | None = None) -> str:
    """The prediction-against-measurement table (``chosen`` marked with *)."""
    gib = 2**30
    lines = [f"{'plan':<44}{'predicted':>11}{'measured':>10}{'error':>8}"
             f"{'pred GiB':>10}{'meas GiB':>10}{'error':>8}"]
    for r in rows:
        mark = " *" if r["plan"] == chosen else ""
        lines.append(f"{r['plan'] + mark:<44}{r['predicted_step_s']:>10.3f}s"
                     f"{r['measured_step_s']:>9.3f}s{r['step_error']:>+8.1%}"
                     f"{r['predicted_peak_mem_bytes'] / gib:>10.3f}"
                     f"{r['measured_peak_mem_bytes'] / gib:>10.3f}{r['mem_error']:>+8.1%}")
    return "\n".join(lines)


def format_summary(s: dict) -> str:
    lines = [f"step time: median |error| {s['median_abs_step_error']:.1%}, worst "
             f"{s['worst_abs_step_error']:.1%}; peak memory: median |error| "
             f"{s['median_abs_mem_error']:.1%}, worst {s['worst_abs_mem_error']:.1%}",
             f"chosen (*) {s['chosen']}: measured {s['chosen_measured_step_s']:.3f} s, "
             f"{s['chosen_vs_best']:+.1%} against the best measured ({s['best_measured']}, "
             f"{s['best_measured_step_s']:.3f} s)"]
    if s["budget_bytes"] is not None:
        lines.append(f"budget {s['budget_bytes'] / 2**30:.3f} GiB: the chosen plan's measured "
                     f"peak is {'under' if s['chosen_peak_under_budget'] else 'OVER'} it")
    return "\n".join(lines)


def write_report(rows: list[dict], summary: dict, out: Path, plan_text: str) -> None:
    from oases.bench.suite import machine_info

    (out / "verify.json").write_text(json.dumps({"summary": summary, "candidates": rows},
                                                indent=1))
    info = machine_info()
    text = [f"# oases plan --verify, {datetime.date.today().isoformat()}", "",
            "Command: `" + " ".join(["oases", *sys.argv[1:]]) + "`", "",
            "Machine: " + ", ".join(f"{k} {v}" for k, v in info.items()), "",
            "Planner output:", "", "```", plan_text, "```", "",
            "Prediction against measurement (median of the timed steps; peak memory is the "
            "largest rank's peak: on a CPU its peak resident set, which includes the process "
            "baseline the profile measured; on a GPU the allocator's peak):", "", "```",
            format_rows(rows, summary["chosen"]), "",
            format_summary(summary), "```", ""]
    (out / "report.md").write_text("\n".join(text))
