"""before.json + after.json (sweep.py) -> results.md: predicted MFU before and after the kernel
model, each row beside the kernel efficiencies that bound it and its sanity line.

    python summarize.py before.json after.json results.md
"""

from __future__ import annotations

import json
import sys

CLASSES = ("gemm", "attention", "norm", "rotary", "activation", "elementwise", "cross-entropy",
           "cast", "launch", "interference", "optimizer")


def pct(x: float) -> str:
    return f"{x:.1%}"


def condensed(before: list[dict], after: list[dict]) -> list[str]:
    """One line per cluster, model and config: MFU before -> after at each S, and the GEMM and
    attention efficiencies and memory-bound share at S=4096."""
    lines = ["## Condensed: MFU before -> after at S = 2k / 4k / 8k; kernels at S = 4k", "",
             "| cluster | model | config | S=2048 | S=4096 | S=8192 | GEMM eff | attention eff "
             "| memory-bound share | launch share | fits at 4k |", "|---" * 11 + "|"]
    keyed = {(a["cluster"], a["model"], a["config"], a["seq"]): (b, a)
             for b, a in zip(before, after, strict=True) if not a.get("example")}
    for cluster, model, config in dict.fromkeys((c, m, g) for c, m, g, _ in keyed):
        pairs = [keyed[cluster, model, config, s] for s in (2048, 4096, 8192)]
        cells = [f"{pct(b['mfu'])} -> **{pct(a['mfu'])}**" for b, a in pairs]
        a = keyed[cluster, model, config, 4096][1]
        k = a["kernels"]
        mem = sum(k["shares"].get(c, 0.0) for c in ("norm", "rotary", "activation",
                                                     "elementwise", "cross-entropy", "cast",
                                                     "embedding", "optimizer", "grad-norm"))
        lines.append(f"| {cluster} | {model} | {config} | {' | '.join(cells)} | "
                     f"{pct(k['efficiency'].get('gemm', 0))} | "
                     f"{pct(k['efficiency'].get('attention', 0))} | {pct(mem)} | "
                     f"{pct(k['shares'].get('launch', 0))} | {'yes' if a['fits'] else 'no'} |")
    return lines


def main(before_path: str, after_path: str, out_path: str) -> None:
    with open(before_path) as f:
        before = json.load(f)["rows"]
    with open(after_path) as f:
        after = json.load(f)["rows"]
    head = ("| cluster | model | S | config | fits | MFU before | MFU after | GEMM share @ eff | "
            "attention share @ eff | memory-bound share | launch | interference | comm | "
            "bound | sane |")
    lines = ["# Predicted MFU before and after the kernel model", "",
             "bf16, fused attention, 64 GPUs, one sequence per model replica per micro-batch, "
             "2M tokens per step (the examples: the issue's batches). 'fits': peak memory "
             "within 95% of 80 GB (rows that do not fit are simulated all the same). Shares are "
             "of the step; memory-bound = norms, rotary, activations, elementwise, "
             "cross-entropy, casts, optimizer; bound = sum over GEMM and attention of share x "
             "efficiency, attention's flops counted over the full S x S as the MFU formula "
             "counts them (so its term is share x 2 x eff for causal fused attention); sane: "
             "MFU <= bound.", "", head, "|" + "---|" * (head.count("|") - 1)]
    drops = []
    for b, a in zip(before, after, strict=True):
        assert (b["model"], b["seq"], b["cluster"], b["config"]) == (
            a["model"], a["seq"], a["cluster"], a["config"])
        k = a["kernels"]
        sh, eff = k["shares"], k["efficiency"]
        mem = sum(sh.get(c, 0.0) for c in ("norm", "rotary", "activation", "elementwise",
                                            "cross-entropy", "cast", "embedding", "optimizer",
                                            "grad-norm"))
        comm = max(0.0, 1 - sum(sh.values()))
        name = a["config"] + (" (issue example)" if a.get("example") else "")
        lines.append(
            f"| {a['cluster']} | {a['model']} | {a['seq']} | {name} | "
            f"{'yes' if a['fits'] else 'no'} | {pct(b['mfu'])} | **{pct(a['mfu'])}** | "
            f"{pct(sh.get('gemm', 0))} @ {pct(eff.get('gemm', 0))} | "
            f"{pct(sh.get('attention', 0))} @ {pct(eff.get('attention', 0))} | {pct(mem)} | "
            f"{pct(sh.get('launch', 0))} | {pct(sh.get('interference', 0))} | {pct(comm)} | "
            f"{pct(k['bound'])} | {'yes' if k['sane'] else 'NO'} |")
        drops.append(a["mfu"] / b["mfu"] - 1)
    drops.sort()
    lines += ["", *condensed(before, after)]
    lines += ["", f"{len(drops)} rows; MFU change after/before - 1: median "
              f"{drops[len(drops) // 2]:+.1%}, range {drops[0]:+.1%} to {drops[-1]:+.1%}; every "
              f"row sane: {all(a['kernels']['sane'] for a in after)}."]
    with open(out_path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[-1:]))


if __name__ == "__main__":
    main(*sys.argv[1:4])
