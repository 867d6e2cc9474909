"""Saved bytes per block (measured vs analytic) and peak live tensor bytes per rank, every
schedule x {sp off, on} x {gpt2, llama} x S in {256, 2048}, at the TP degree given (2 or 4):
small dims (H=64, 4 heads, 2 layers, 2 sequences, dropout 0.1, fp32) so that it runs on a CPU.
One warm-up step per case, then one measured step (``oases.bench.activation_memory``).
Run: PYTHONPATH=src:tests python benchmarks/2026-12-03-actmem/table.py TP  (writes tpTP.json)"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests"))

from distributed import run_ranks  # noqa: E402

SCHEDULES = ("megatron", "megatron-recompute", "commfree-recompute", "overlap",
             "overlap-recompute", "oases", "megatron-sp")
ROWS, DIM, HEADS, LAYERS = 2, 64, 4, 2


def modes(name: str) -> tuple:
    if name == "megatron-sp":
        return ("gathered",)
    if name in ("commfree-recompute", "oases"):
        return (None, "gathered", "shards")
    return (None, "shards")


def rank(rank: int, world: int) -> dict:
    from oases.bench.activation_memory import measure_step
    from oases.config import ModelConfig
    from oases.model import build_model
    from oases.parallel.apply import parallelize
    from oases.parallel.context import init_distributed
    from oases.schedule import build_schedule

    ctx = init_distributed(tp=world, timeout_s=600.0)
    torch.set_num_threads(1)
    out = []
    for arch in ("gpt2", "llama"):
        for seq in (256, 2048):
            cfg = ModelConfig(arch=arch, n_layers=LAYERS, dim=DIM, n_heads=HEADS,
                              vocab_size=256, seq_len=seq, dropout=0.1)
            torch.manual_seed(0)
            ref = build_model(cfg)
            g = torch.Generator().manual_seed(1)
            tokens = torch.randint(0, 256, (ROWS, seq), generator=g)
            for name in SCHEDULES:
                for sp in modes(name):
                    model = parallelize(copy.deepcopy(ref), ctx)
                    sched = build_schedule(name, n_sub=2, sp=sp)
                    sched.step(model, tokens, tokens)  # warm-up (and the gradients' buffers)
                    got = measure_step(sched, model, tokens, tokens, ctx.device)
                    out.append({"arch": arch, "seq": seq, "schedule": name, "sp": sp,
                                "recompute": sched.spec.recompute, **got})
    return out


if __name__ == "__main__":
    tp = int(sys.argv[1])
    res = run_ranks(rank, tp, "/tmp/oases-actmem", timeout_s=3000)[0]
    (HERE / f"tp{tp}.json").write_text(json.dumps(res, indent=1))
    print(f"wrote {HERE / f'tp{tp}.json'}: {len(res)} cases")
