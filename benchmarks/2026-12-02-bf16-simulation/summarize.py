"""results.md and results.json from the `oases simulate` runs of run.sh.

    python summarize.py runs/bf16-simulation

Every number is read from a run's simulate.json: step time, tokens/s per GPU, MFU (model
FLOPs per step, 6 N tokens + 12 L H S tokens, over step x GPUs x the GPU's peak at the run's
dtype: 35.58 TFLOP/s fp32 and 71 bf16 on the RTX 3090), peak memory, what bounds the step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PAPER = ("paper-h1024-l24", "paper-h2048-l24", "paper-h3072-l24", "paper-h4096-l16",
         "paper-h6144-l16", "paper-h8192-l8", "paper-h12288-l4")
LLAMA = [(m, c, "fused") for m in ("llama2-7b", "llama2-13b")
         for c in ("a100-ib-64", "h100-ib-64")] + [("llama2-7b", "a100-ib-64", "materialized")]


def load(out: Path, name: str) -> dict:
    return json.loads((out / name / "simulate.json").read_text())


def row_json(r: dict) -> dict:
    keys = ("schedule", "plan_spec", "label", "degrees_by_region", "step_s", "micro_rows",
            "n_micro", "tokens_per_s", "tokens_per_s_per_gpu", "mfu", "peak_mem_bytes",
            "fits", "speedup", "bound", "step_parts_s")
    return {k: r[k] for k in keys}


def best(rows: list[dict]) -> dict:
    """The fastest row that fits the budget."""
    return min((r for r in rows if r["fits"]), key=lambda r: r["step_s"])


def cell(r: dict) -> str:
    return f"{r['step_s']:.3f} s, {r['mfu']:.1%}"


def paper_table(out: Path, results: dict) -> list[str]:
    lines = ["| model | dtype | Megatron-LM (megatron-recompute) | Merak | Oases at Megatron's tp "
             "| Oases + planner: plan | step, MFU | fastest: row | tokens/s/GPU | MFU | peak GiB "
             "| bound | exposed TP / DP comm s | bf16 / fp32 tokens/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for model in PAPER:
        fast = {}
        for dtype in ("fp32", "bf16"):
            data = load(out, f"{dtype}-{model}")
            rows = data["rows"]
            results["paper"].setdefault(model, {})[dtype] = {
                "dtype": data["dtype"], "precision": data["precision"],
                "peak_flops_per_gpu": data["peak_flops_per_gpu"],
                "rows": [row_json(r) for r in rows]}
            b = fast[dtype] = best(rows)
            auto = rows[3]
            parts = b["step_parts_s"]
            ratio = (f"{fast['bf16']['tokens_per_s'] / fast['fp32']['tokens_per_s']:.2f}x"
                     if dtype == "bf16" else "")
            lines.append(
                f"| {model} | {dtype} | {cell(rows[0])} | {cell(rows[1])} | {cell(rows[2])} | "
                f"{auto['label'].split(': ', 1)[1]} | {cell(auto)} | "
                f"{b['schedule']}@{b['label']} | {b['tokens_per_s_per_gpu']:,.0f} | "
                f"{b['mfu']:.1%} | {b['peak_mem_bytes'] / 2**30:.2f} | {b['bound']} | "
                f"{parts['TP comm']:.3f} / {parts['DP comm']:.3f} | {ratio} |")
    return lines


def grad_reduce_lines(out: Path, results: dict) -> list[str]:
    fp = load(out, "bf16-paper-h2048-l24")
    gr = load(out, "bf16-gr16-paper-h2048-l24")
    results["grad_reduce_bf16"] = {"paper-h2048-l24": [row_json(r) for r in gr["rows"]]}
    lines = ["| row | grad reduce fp32: step s | DP comm s | MFU | grad reduce bf16: step s "
             "| DP comm s | MFU |", "|---|---|---|---|---|---|---|"]
    for a, b in zip(fp["rows"], gr["rows"]):
        lines.append(f"| {a['schedule']}@{a['label']} | {a['step_s']:.3f} | "
                     f"{a['step_parts_s']['DP comm']:.3f} | {a['mfu']:.1%} | "
                     f"{b['step_s']:.3f} | {b['step_parts_s']['DP comm']:.3f} | "
                     f"{b['mfu']:.1%} |")
    return lines


def llama_table(out: Path, results: dict) -> list[str]:
    lines = ["| model | cluster | attention | schedule | planner's plan | micro x n | step s | "
             "tokens/s/GPU | MFU | peak GiB | bound |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for model, cluster, attention in LLAMA:
        name = f"{model}-{cluster}" + ("-materialized" if attention == "materialized" else "")
        data = load(out, name)
        results["llama"][name] = {"model": model, "cluster": cluster, "attention":
                                  data["attention"], "precision": data["precision"],
                                  "peak_flops_per_gpu": data["peak_flops_per_gpu"],
                                  "rows": [row_json(r) for r in data["rows"]]}
        for r in data["rows"]:
            lines.append(
                f"| {model} | {cluster} | {data['attention']} | {r['schedule']} | "
                f"{r['label'].split(': ', 1)[1]} | {r['micro_rows']} x {r['n_micro']} | "
                f"{r['step_s']:.3f} | {r['tokens_per_s_per_gpu']:,.0f} | {r['mfu']:.1%} | "
                f"{r['peak_mem_bytes'] / 2**30:.2f} | {r['bound']} |")
    return lines


def main(out: Path) -> None:
    results: dict = {"paper": {}, "llama": {}}
    md = ["# Results (written by summarize.py from the runs of run.sh)", "",
          "## (a) The paper's seven models on paper-3090-pcie-32, fp32 and bf16", "",
          "Each schedule cell: step time, MFU (against the RTX 3090's peak at the run's dtype: "
          "35.58 TFLOP/s fp32, 71 bf16). Fastest: the fastest row that fits the budget.", "",
          *paper_table(out, results), "",
          "## (a2) paper-h2048-l24 in bf16: DP gradient reduction in fp32 (default) or bf16", "",
          *grad_reduce_lines(out, results), "",
          "## (b) LLaMA-2-shaped models on 64 A100s and 64 H100s, bf16, the planner's choice",
          "", *llama_table(out, results), ""]
    (HERE / "results.md").write_text("\n".join(md), encoding="utf-8")
    (HERE / "results.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    print("\n".join(md))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
