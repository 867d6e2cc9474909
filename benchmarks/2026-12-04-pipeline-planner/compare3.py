"""Round 3 against before: out-round3/*.json (the pipeline search with mixed stage layouts and
every depth's best screen walked) beside the earlier runs' pipeline plans (out/ for LLaMA,
timed under the lock; out-plans/ for the others) -> out-round3/compare.md: per case the best
plan without a pipeline (the earlier runs'), the pipeline plan before and after, and which
plan ``choose`` writes before and after.

    python compare3.py
"""

from __future__ import annotations

import json
from pathlib import Path

from summarize import MODELS, NETS

here = Path(__file__).parent


def cell(d: dict) -> tuple[str, float | None]:
    if not d.get("step_s"):
        return "none fits", None
    return f"{d['label']} ({d['peak_gib']:.1f} GiB)", d["step_s"]


def chosen(step_s: float | None, flat_s: float) -> str:
    return "pipeline" if step_s is not None and step_s < flat_s else "without"


def main() -> None:
    lines = [
        "| model | cluster | without: step s | pipeline before | step s | pipeline after | "
        "step s | mixed layouts | chosen before -> after | search s after |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model in MODELS:
        for net, name in NETS.items():
            f = here / "out-round3" / f"{model}-{net}.json"
            if not f.exists():
                continue
            after = json.loads(f.read_text())
            old_dir = "out" if model == "llama13b" else "out-plans"
            before = json.loads((here / old_dir / f"{model}-{net}.json").read_text())
            flat = after["no_pipeline"]["step_s"]
            # NOLOCK=1 run3.sh 100 a100: not under the lock, the wall time is no measurement
            nolock = " (no lock)" if model != "llama13b" and net in ("100", "a100") else ""
            (bl, bs), (al, as_) = cell(before["pipeline"]), cell(after["pipeline"])

            lines.append(
                f"| {model} | {name} | {flat:.3g} | {bl} | {bs or 0:.3g} | {al} | "
                f"{as_ or 0:.3g} | {after['pipeline'].get('mixed_layouts', 0)} | "
                f"{chosen(bs, flat)} -> {chosen(as_, flat)} | "
                f"{after['pipeline']['search_s']:.1f}{nolock} |"
            )
    text = "\n".join(lines)
    (here / "out-round3" / "compare.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
