"""``oases plan --verify``: run the candidates for real and put prediction beside measurement.

For every candidate (each uniform degree x schedule x sub-batch count the machine can run, and
the chosen plan) the ranks are launched once (``oases.bench.plan_runner``: warm-up, then timed
steps of forward + backward + DP reduction + AdamW) and the median step time and peak memory are
compared with the simulator's. Writes ``verify.json`` and ``report.md``:

    error        predicted / measured - 1, per candidate; median and worst of |error|
    plan quality the chosen plan's measured time / the best measured time of all candidates

A profile is measured minutes or days before the verification, and a machine does not run at
one speed: on this project's 2-core CPU machine two launches of one program differed by 12%
in median step time. So every launch also re-times the candidate's pieces and optimizer step
after its timed steps, the way ``oases profile`` times them (``plan_runner.retime``), and the
simulator predicts the step again from those (``Profile.retimed``: the profile with the
re-timed pieces; collectives, contention and memory as profiled)::

    now error    predicted from this launch's pieces / measured - 1: the model's own error
    drift        the plan's compute priced with this launch's pieces / with the profile's - 1:
                 how much faster (-) or slower (+) the machine computes now than when profiled
"""

from __future__ import annotations

import datetime
import json
import statistics
import sys
import tempfile
from pathlib import Path

from oases.config import ModelConfig
from oases.planner.profile import Profile
from oases.planner.search import Candidate


def measure_candidates(
    config: str | None,
    overrides: list[str],
    candidates: list[Candidate],
    nproc: int,
    rate: float | None,
    steps: int,
    warmup: int,
    out: Path,
    rounds: int = 2,
    retime: bool = False,
) -> list[dict]:
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
            print(
                f"oases plan --verify: round {r + 1}/{rounds}, [{n + 1}/{len(candidates)}] "
                f"{cand.label()}",
                flush=True,
            )
            with tempfile.TemporaryDirectory() as tmp:
                launch_ranks(
                    "oases.bench.plan_runner",
                    {
                        "config": config,
                        "overrides": overrides,
                        "plan": str(plan_path),
                        "steps": steps,
                        "warmup": warmup,
                        "out": str(result_path),
                        "retime": retime,
                    },
                    nproc,
                    rate,
                    Path(tmp),
                )
            runs[n].append(json.loads(result_path.read_text()))
    rows = []
    for n, cand in enumerate(candidates):
        steps_s = [s for got in runs[n] for s in got["steps_s"]]
        measured = statistics.median(steps_s)
        peak = max(got["peak_mem_bytes"] for got in runs[n])
        baseline = max(got["baseline_bytes"] for got in runs[n])
        reserved = max(got.get("reserved_peak_bytes", peak) for got in runs[n])
        predicted = predicted_peak_bytes(
            cand.result.peak_mem_bytes, cand.result.breakdown, runs[n][0].get("device", "cpu")
        )
        rows.append(
            {
                "plan": cand.label(),
                "kind": cand.kind,
                "file": f"plans/{n:02d}.json",
                "degrees": [r.tp for r in cand.plan.regions],
                "predicted_step_s": cand.result.step_s,
                "measured_step_s": measured,
                "steps_s": steps_s,
                "step_error": cand.result.step_s / measured - 1.0,
                "predicted_peak_mem_bytes": predicted,
                "measured_peak_mem_bytes": peak,
                "mem_error": predicted / peak - 1.0,
                "device": runs[n][0].get("device", "cpu"),
                # what the device must hold: the baseline (CUDA: context, NCCL, workspaces) and
                # the allocator's reserved peak, beside the simulator's whole peak
                "predicted_device_bytes": cand.result.peak_mem_bytes,
                "measured_device_bytes": baseline + reserved,
                "measured_reserved_peak_bytes": reserved,
                "predicted_baseline_bytes": cand.result.breakdown.get("baseline_bytes", 0.0),
                "measured_baseline_bytes": baseline,
                "retimed_pieces": _median_entries(
                    [got.get("pieces", []) for got in runs[n]],
                    ("region", "phase", "piece", "tp", "rows", "overlapped"),
                ),
                "retimed_optimizer": _median_entries(
                    [got.get("optimizer", []) for got in runs[n]], ("n_params",)
                ),
            }
        )
    return rows


def predicted_peak_bytes(peak_bytes: float, breakdown: dict, device: str) -> float:
    """The simulator's peak in the terms the runner measured it: on a CPU the whole peak (the
    peak resident set holds the baseline and workspaces too); on CUDA the tensors alone
    (``allocated_bytes``: the allocator's peak counts neither the context nor NCCL's buffers,
    which the profile's baseline holds)."""
    if device == "cuda":
        return float(
            breakdown.get(
                "allocated_bytes",
                peak_bytes
                - breakdown.get("baseline_bytes", 0.0)
                - breakdown.get("workspace_bytes", 0.0),
            )
        )
    return peak_bytes


def _median_entries(rounds: list[list[dict]], keys: tuple[str, ...]) -> list[dict]:
    """One entry per key over the rounds' lists, its ``s`` the median of the rounds'."""
    by_key: dict[tuple, list[float]] = {}
    for entries in rounds:
        for e in entries:
            by_key.setdefault(tuple(e[k] for k in keys), []).append(float(e["s"]))
    return [dict(zip(keys, key)) | {"s": statistics.median(v)} for key, v in by_key.items()]


def predict_from_retimed(
    rows: list[dict],
    candidates: list[Candidate],
    profile: Profile,
    cfg: ModelConfig,
    world_size: int,
    max_inflight: int,
) -> None:
    """Add to each row the step predicted from its launches' re-timed pieces
    (``predicted_now_step_s``, ``now_error``) and the machine's drift since the profile
    (``drift``: the plan's compute priced both ways); rows without re-timed pieces get
    None."""
    from oases.planner.simulate import simulate_plan

    for row, cand in zip(rows, candidates):
        if not row["retimed_pieces"] or cand.batch is None:
            row.update(predicted_now_step_s=None, now_error=None, drift=None)
            continue
        now = profile.retimed(row["retimed_pieces"], row["retimed_optimizer"])
        res = simulate_plan(
            cfg, cand.plan, now, world_size, cand.batch, max_inflight=max_inflight, timeline=False
        )
        row["predicted_now_step_s"] = res.step_s
        row["now_error"] = res.step_s / row["measured_step_s"] - 1.0
        row["drift"] = res.breakdown["compute_s"] / cand.result.breakdown["compute_s"] - 1.0


def summarize(rows: list[dict], chosen: str, budget_bytes: float) -> dict:
    step_err = [abs(r["step_error"]) for r in rows]
    mem_err = [abs(r["mem_error"]) for r in rows]
    now_err = [abs(r["now_error"]) for r in rows if r.get("now_error") is not None]
    drift = [r["drift"] for r in rows if r.get("drift") is not None]
    best = min(rows, key=lambda r: r["measured_step_s"])
    mine = next(r for r in rows if r["plan"] == chosen)
    return {
        "median_abs_step_error": statistics.median(step_err),
        "worst_abs_step_error": max(step_err),
        "median_abs_now_error": statistics.median(now_err) if now_err else None,
        "worst_abs_now_error": max(now_err) if now_err else None,
        "median_drift": statistics.median(drift) if drift else None,
        "median_abs_mem_error": statistics.median(mem_err),
        "worst_abs_mem_error": max(mem_err),
        "chosen": chosen,
        "chosen_measured_step_s": mine["measured_step_s"],
        "best_measured": best["plan"],
        "best_measured_step_s": best["measured_step_s"],
        "chosen_vs_best": mine["measured_step_s"] / best["measured_step_s"] - 1.0,
        "budget_bytes": None if budget_bytes == float("inf") else budget_bytes,
        # on a GPU what the device must hold: baseline + the allocator's reserved peak
        "chosen_peak_under_budget": mine.get(
            "measured_device_bytes" if mine.get("device") == "cuda" else "measured_peak_mem_bytes",
            mine["measured_peak_mem_bytes"],
        )
        <= budget_bytes,
    }


def format_rows(rows: list[dict], chosen: str | None = None) -> str:
    """The prediction-against-measurement table (``chosen`` marked with *)."""
    gib = 2**30
    now = any(r.get("predicted_now_step_s") is not None for r in rows)
    lines = [
        f"{'plan':<44}{'predicted':>11}{'measured':>10}{'error':>8}"
        + (f"{'now pred':>10}{'error':>8}{'drift':>8}" if now else "")
        + f"{'pred GiB':>10}{'meas GiB':>10}{'error':>8}"
    ]
    for r in rows:
        mark = " *" if r["plan"] == chosen else ""
        again = ""
        if now:
            again = (
                f"{'-':>10}{'-':>8}{'-':>8}"
                if r.get("predicted_now_step_s") is None
                else f"{r['predicted_now_step_s']:>9.3f}s{r['now_error']:>+8.1%}{r['drift']:>+8.1%}"
            )
        lines.append(
            f"{r['plan'] + mark:<44}{r['predicted_step_s']:>10.3f}s"
            f"{r['measured_step_s']:>9.3f}s{r['step_error']:>+8.1%}{again}"
            f"{r['predicted_peak_mem_bytes'] / gib:>10.3f}"
            f"{r['measured_peak_mem_bytes'] / gib:>10.3f}{r['mem_error']:>+8.1%}"
        )
    return "\n".join(lines)


def format_summary(s: dict) -> str:
    lines = [
        f"step time: median |error| {s['median_abs_step_error']:.1%}, worst "
        f"{s['worst_abs_step_error']:.1%}; peak memory: median |error| "
        f"{s['median_abs_mem_error']:.1%}, worst {s['worst_abs_mem_error']:.1%}"
    ]
    if s.get("median_abs_now_error") is not None:
        pace = "slower" if s["median_drift"] > 0 else "faster"
        lines.append(
            f"step time predicted from the pieces re-timed in each launch (now): "
            f"median |error| {s['median_abs_now_error']:.1%}, worst "
            f"{s['worst_abs_now_error']:.1%}; the machine computed "
            f"{abs(s['median_drift']):.1%} {pace} than when profiled (median drift)"
        )
    lines.append(
        f"chosen (*) {s['chosen']}: measured {s['chosen_measured_step_s']:.3f} s, "
        f"{s['chosen_vs_best']:+.1%} against the best measured ({s['best_measured']}, "
        f"{s['best_measured_step_s']:.3f} s)"
    )
    if s["budget_bytes"] is not None:
        lines.append(
            f"budget {s['budget_bytes'] / 2**30:.3f} GiB: the chosen plan's measured "
            f"peak is {'under' if s['chosen_peak_under_budget'] else 'OVER'} it"
        )
    return "\n".join(lines)


def write_report(rows: list[dict], summary: dict, out: Path, plan_text: str) -> None:
    from oases.bench.suite import machine_info

    (out / "verify.json").write_text(json.dumps({"summary": summary, "candidates": rows}, indent=1))
    info = machine_info()
    text = [
        f"# oases plan --verify, {datetime.date.today().isoformat()}",
        "",
        "Command: `" + " ".join(["oases", *sys.argv[1:]]) + "`",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in info.items()),
        "",
        "Planner output:",
        "",
        "```",
        plan_text,
        "```",
        "",
        "Prediction against measurement (median of the timed steps; peak memory is the "
        "largest rank's peak: on a CPU its peak resident set, which includes the process "
        "baseline the profile measured, against the whole predicted peak; on a GPU the "
        "allocator's peak against the predicted tensors alone, and verify.json adds the "
        "device's baseline + reserved peak beside the whole predicted peak):",
        "",
        "```",
        format_rows(rows, summary["chosen"]),
        "",
        format_summary(summary),
        "```",
        "",
    ]
    (out / "report.md").write_text("\n".join(text))
