"""tp2.json, tp4.json (table.py) -> table.md: saved bytes per block (the last block), measured
and analytic (``planner.activation_terms``), and the peak live tensor bytes per rank (rank 0).
Run: PYTHONPATH=src python benchmarks/2026-12-03-actmem/render.py"""

from __future__ import annotations

import json
from pathlib import Path

from oases.config import ModelConfig
from oases.planner.activation_terms import korthikanti_block_bytes, schedule_block_bytes

HERE = Path(__file__).resolve().parent
ROWS, DIM, HEADS, LAYERS, ELT = 2, 64, 4, 2, 4
MIB = 2**20


def main() -> None:
    lines = []
    for tp in (2, 4):
        path = HERE / f"tp{tp}.json"
        if not path.exists():
            continue
        cases = json.loads(path.read_text())
        plain = {(c["arch"], c["seq"], c["schedule"]): c for c in cases if c["sp"] is None}
        lines += [f"### tp = {tp}", "",
                  "| arch | S | schedule | sp | saved/block MiB | analytic MiB | meas/anal "
                  "| Korthikanti MiB | saved vs sp off | analytic saving MiB "
                  "| peak live MiB | peak saving / analytic |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for c in cases:
            cfg = ModelConfig(arch=c["arch"], n_layers=LAYERS, dim=DIM, n_heads=HEADS,
                              vocab_size=256, seq_len=c["seq"], dropout=0.1)
            meas = c["saved_per_block"][-1]
            anal = schedule_block_bytes(cfg, c["recompute"], ROWS, tp, c["sp"], ELT)
            kort = (korthikanti_block_bytes(ROWS * c["seq"], DIM, tp, c["sp"] is not None, ELT)
                    if c["recompute"] == "none" and c["arch"] == "gpt2" else None)
            base = plain.get((c["arch"], c["seq"], c["schedule"]))
            if base is None and c["schedule"] == "megatron-sp":
                base = plain.get((c["arch"], c["seq"], "megatron"))
            cut = save_anal = ratio = "-"
            if c["sp"] is not None and base is not None:
                anal0 = schedule_block_bytes(cfg, c["recompute"], ROWS, tp, None, ELT)
                cut = f"{meas / base['saved_per_block'][-1] - 1:+.1%}"
                saving = (anal0 - anal) * LAYERS  # every block's
                save_anal = f"{saving / MIB:.2f}"
                got = base["peak_live"] - c["peak_live"]
                ratio = f"{got / saving:.2f}" if saving > 0 else f"{got / MIB:+.2f} MiB"
            lines.append(
                f"| {c['arch']} | {c['seq']} | {c['schedule']} | {c['sp'] or 'off'} "
                f"| {meas / MIB:.3f} | {anal / MIB:.3f} | {meas / anal:.3f} "
                f"| {'-' if kort is None else f'{kort / MIB:.3f}'} | {cut} | {save_anal} "
                f"| {c['peak_live'] / MIB:.2f} | {ratio} |")
        lines.append("")
    (HERE / "table.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
