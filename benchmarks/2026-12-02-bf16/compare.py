"""The 200-step default job in fp32 and bf16 side by side: compare.png and a table on stdout.

    python benchmarks/2026-12-02-bf16/compare.py
"""

import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent


def read(precision: str) -> tuple[list[dict], list[dict]]:
    rows = [json.loads(line) for line in (HERE / "runs" / precision / "metrics.jsonl").open()]
    return [r for r in rows if "loss" in r], [r for r in rows if "val_loss" in r]


runs = {p: read(p) for p in ("fp32", "bf16")}
fig, ax = plt.subplots(figsize=(7, 4))
for p, (train, val) in runs.items():
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], lw=0.8, alpha=0.6,
            label=f"{p} train")
    ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], marker="o",
            label=f"{p} validation")
ax.set(xlabel="step", ylabel="loss (nats per token)",
       title="configs/default.toml, tp=2 on 2 CPU ranks: fp32 and bf16")
ax.grid(alpha=0.3)
ax.legend()
fig.tight_layout()
fig.savefig(HERE / "compare.png", dpi=100)
print("| step | fp32 validation | bf16 validation | bf16 / fp32 - 1 |")
print("|---|---|---|---|")
for a, b in zip(runs["fp32"][1], runs["bf16"][1]):
    print(f"| {a['step']} | {a['val_loss']:.4f} | {b['val_loss']:.4f} | "
          f"{b['val_loss'] / a['val_loss'] - 1:+.1%} |")
for p, (train, _) in runs.items():
    print(f"{p}: median step {statistics.median(r['step_time_s'] for r in train[5:]):.3f} s, "
          f"peak {max(r['peak_mem_mb'] for r in train):.0f} MB")
