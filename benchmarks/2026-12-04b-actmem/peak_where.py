"""Where the peak of live tensor bytes falls, sequence parallelism off and on, and what is
alive there by origin (``oases.bench.peak_live_set``): per case one warm-up step, gradients
set to None (as ``oases bench --memory``'s counted step), then one profiled step.
Run: PYTHONPATH=src:tests python benchmarks/2026-12-04b-actmem/peak_where.py CASE
CASE: issue (6-layer GPT-2 dim 128, 4 heads, ffn 256, S=2048, 8 seqs, tp=2, no dropout) or
small (2-layer GPT-2, H=64, 4 heads, S=2048, 2 seqs, dropout 0.1, tp=2). Writes where-CASE.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests"))

from distributed import run_ranks  # noqa: E402

SHAPES = {
    "issue": dict(
        arch="gpt2",
        n_layers=6,
        dim=128,
        n_heads=4,
        ffn_dim=256,
        vocab_size=256,
        seq_len=2048,
        dropout=0.0,
        rows=8,
    ),
    "small": dict(
        arch="gpt2",
        n_layers=2,
        dim=64,
        n_heads=4,
        vocab_size=256,
        seq_len=2048,
        dropout=0.1,
        rows=2,
    ),
}
CASES = [
    (s, sp, dw) for s in ("megatron", "overlap") for sp, dw in ((None, True), ("shards", True))
] + [
    ("overlap-recompute", None, True),
    ("overlap-recompute", "shards", True),
    ("overlap-recompute", "shards", False),
]


def rank(rank: int, world: int, case: str, only: str | None) -> list:
    from oases.bench.peak_live_set import live_set_at_peak
    from oases.config import ModelConfig
    from oases.model import build_model
    from oases.parallel.apply import parallelize
    from oases.parallel.context import init_distributed
    from oases.schedule import build_schedule

    ctx = init_distributed(tp=world, timeout_s=600.0)
    torch.set_num_threads(1)
    shape = dict(SHAPES[case])
    rows = shape.pop("rows")
    cfg = ModelConfig(**shape)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (rows, cfg.seq_len), generator=g)
    out = []
    for name, sp, dw in CASES:
        if only and name != only:
            continue
        torch.manual_seed(0)
        model = parallelize(build_model(cfg), ctx)
        sched = build_schedule(name, n_sub=2, sp=sp, defer_weight_grads=dw)
        sched.step(model, tokens, tokens)
        for p in model.parameters():
            p.grad = None
        got = live_set_at_peak(sched, model, tokens, tokens)
        out.append({"schedule": name, "sp": sp, "dw": dw, **got})
    return out


if __name__ == "__main__":
    case = sys.argv[1]
    only = sys.argv[2] if len(sys.argv) > 2 else None
    res = run_ranks(rank, 2, f"/tmp/oases-actmem3-{case}", case, only, timeout_s=3000)[0]
    (HERE / f"where-{case}{'-' + only if only else ''}.json").write_text(json.dumps(res, indent=1))
    mib = 2**20
    from oases.config import ModelConfig
    from oases.planner.activation_terms import schedule_block_bytes
    from oases.schedule.specs import SPECS

    shape = dict(SHAPES[case])
    rows = shape.pop("rows")
    cfg = ModelConfig(**shape)
    off = {r["schedule"]: r["peak"] for r in res if r["sp"] is None}
    for r in res:
        rec = SPECS[r["schedule"]].recompute
        if r["sp"] is not None and r["schedule"] in off:
            saving = cfg.n_layers * (
                schedule_block_bytes(cfg, rec, rows, 2, None, 4)
                - schedule_block_bytes(cfg, rec, rows, 2, r["sp"], 4)
            )
            got = off[r["schedule"]] - r["peak"]
            print(
                f"{r['schedule']} sp={r['sp']} dw={r['dw']}: live saving {got / mib:.2f} MiB, "
                f"analytic {saving / mib:.2f} MiB, ratio {got / saving:.2f}"
            )
    for r in res:
        print(
            f"== {r['schedule']} sp={r['sp']} dw={r['dw']}: peak {r['peak'] / mib:.2f} MiB at "
            f"{r['at']} ({r['op']}); before-step freed {r['before'] / mib:.2f}"
        )
        for b, i, o in r["unrecorded"]:
            print(f"   unrecorded free {b / mib:8.2f}  {i:32s} {o}")
        for b, i, o in r["live"][:14]:
            print(f"   {b / mib:8.2f}  {i:32s} {o}")
