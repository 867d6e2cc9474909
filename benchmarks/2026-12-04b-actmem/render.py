"""tp2.json, tp4.json (table.py; and tpN-LL.json for other layer counts) -> table.md: saved
bytes per block (the last block), measured and analytic (``planner.activation_terms``), and
the peak live tensor bytes per rank (rank 0, the median of three steps).
Run: PYTHONPATH=src python benchmarks/2026-12-04b-actmem/render.py"""

from __future__ import annotations

import json
from pathlib import Path

from oases.config import ModelConfig
from oases.planner.activation_terms import korthikanti_block_bytes, schedule_block_bytes

HERE = Path(__file__).resolve().parent
ROWS, DIM, HEADS, ELT = 2, 64, 4, 4
MIB = 2**20


def _row(c: dict, tp: int, plain: dict) -> str:
    layers = c["layers"]
    cfg = ModelConfig(arch=c["arch"], n_layers=layers, dim=DIM, n_heads=HEADS,
                      vocab_size=256, seq_len=c["seq"], dropout=0.1)
    meas = c["saved_per_block"][-1]
    anal = schedule_block_bytes(cfg, c["recompute"], ROWS, tp, c["sp"], ELT)
    kort = (korthikanti_block_bytes(ROWS * c["seq"], DIM, tp, c["sp"] == "shards", ELT)
            if c["recompute"] == "none" and c["arch"] == "gpt2" and c["sp"] != "gathered"
            else None)
    base = plain.get((c["arch"], c["seq"], c["schedule"]))
    if base is None and c["schedule"] == "megatron-sp":
        base = plain.get((c["arch"], c["seq"], "megatron"))
    cut = save_anal = ratio = "-"
    if c["sp"] is not None and base is not None:
        anal0 = schedule_block_bytes(cfg, c["recompute"], ROWS, tp, None, ELT)
        cut = f"{meas / base['saved_per_block'][-1] - 1:+.1%}"
        saving = (anal0 - anal) * layers  # every block's
        save_anal = f"{saving / MIB:.2f}"
        got = base["peak_live"] - c["peak_live"]
        ratio = f"{got / saving:.2f}" if saving > 0 else f"{got / MIB:+.2f} MiB"
    spread = (max(c["peak_live_all"]) - min(c["peak_live_all"])) / MIB
    name = c["schedule"] + ("" if c["dw"] else " dw=off")
    return (
        f"| {c['arch']} | {c['seq']} | {name} | {c['sp'] or 'off'} "
        f"| {meas / MIB:.3f} | {anal / MIB:.3f} | {meas / anal:.3f} "
        f"| {'-' if kort is None else f'{kort / MIB:.3f}'} | {cut} | {save_anal} "
        f"| {c['peak_live'] / MIB:.2f} | {spread:.2f} | {ratio} |"
    )


def main() -> None:
    lines = []
    for path in sorted(HERE.glob("tp*.json")):
        tp = int(path.stem[2:].split("-")[0])
        cases = json.loads(path.read_text())
        plain = {(c["arch"], c["seq"], c["schedule"]): c for c in cases if c["sp"] is None}
        lines += [f"### tp = {tp}, {cases[0]['layers']} layers ({path.name})", "",
                  "| arch | S | schedule | sp | saved/block MiB | analytic MiB | meas/anal "
                  "| Korthikanti MiB | saved vs sp off | analytic saving MiB "
                  "| peak live MiB | spread MiB | peak saving / analytic |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [_row(c, tp, plain) for c in cases]
        lines.append("")
    (HERE / "table.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
