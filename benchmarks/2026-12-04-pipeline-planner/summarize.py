"""DIR/*.json -> DIR/results.md (DIR: out, default, or out-plans): per case the best plan
without a pipeline and with one, why the faster wins (the parts of its step), and the two
searches' wall times (measured only in out/, under the lock).

    python summarize.py [DIR]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

here = Path(__file__).parent
DIR = sys.argv[1] if len(sys.argv) > 1 else "out"
NETS = {"100": "3090s, 100 GbE", "25": "3090s, 25 GbE", "10": "3090s, 10 GbE", "a100": "a100-ib-64"}
MODELS = ["llama13b", "gpt96", "h1024-l24", "h2048-l24", "h3072-l24", "h4096-l16",
          "h6144-l16", "h8192-l8", "h12288-l4"]  # fmt: skip


def parts(d: dict) -> str:
    p = {k: v for k, v in d["parts"].items() if v >= 0.05 * d["step_s"]}
    return ", ".join(f"{k} {v:.3g}" for k, v in sorted(p.items(), key=lambda kv: -kv[1]))


def main() -> None:
    lines = [
        "| model | cluster | best without a pipeline | step s | peak GiB | with a pipeline "
        "| step s | peak GiB | with / without | search s (without, with) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    why = []
    for model in MODELS:
        for net, name in NETS.items():
            f = here / DIR / f"{model}-{net}.json"
            if not f.exists():
                continue
            r = json.loads(f.read_text())
            a, b = r["no_pipeline"], r["pipeline"]
            if b.get("step_s"):
                ratio = f"{b['step_s'] / a['step_s']:.2f}x"
                piped = (b["label"], f"{b['step_s']:.3g}", f"{b['peak_gib']:.1f}")
            else:
                ratio, piped = "-", ("none fits", "-", "-")
            over = "" if a["fits"] else " (over)"
            lines.append(
                f"| {model} | {name} | {a['label']}{over} | {a['step_s']:.3g} | "
                f"{a['peak_gib']:.1f} | {piped[0]} | {piped[1]} | {piped[2]} | {ratio} | "
                f"{a['search_s']:.1f}, {b['search_s']:.1f} |"
            )
            if b.get("step_s"):
                why.append(
                    f"- {model}, {name}: without: {parts(a)}; with: {parts(b)} "
                    f"({b['screened']} screened, {b['walked']} walked)"
                )
    text = "\n".join([*lines, "", "Parts of each step (s, the parts of 5% or more):", "", *why])
    (here / DIR / "results.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
