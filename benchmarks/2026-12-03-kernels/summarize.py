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


def main(before_path: str, after_path: str, out_path: str) -> None:
    before = json.load(open(before_path))["rows"]
    after = json.load(open(after_path))["rows"]
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
    lines += ["", f"{len(drops)} rows; MFU change after/before - 1: median "
              f"{drops[len(drops) // 2]:+.1%}, range {drops[0]:+.1%} to {drops[-1]:+.1%}; every "
              f"row sane: {all(a['kernels']['sane'] for a in after)}."]
    open(out_path, "w").write("\n".join(lines) + "\n")
    print("\n".join(lines[-1:]))


if __name__ == "__main__":
    main(*sys.argv[1:4])
