"""Saved bytes per block (measured vs analytic) and peak live tensor bytes per rank, every
schedule x sequence-parallel mode {off, gathered, shards} x {gpt2, llama} x S in {256, 2048},
at the TP degree given (2 or 4): small dims (H=64, 4 heads, 2 sequences, dropout 0.1, fp32)
so that it runs on a CPU. One warm-up step per case, then three measured steps
(``oases.bench.activation_memory.measure_step``): saved bytes from the first (they are the
same every step), the peak live bytes as the median of the three. ``overlap-recompute``
under shards also with its weight gradients inline (``dw=off``), to see what deferring them
holds.
Run: PYTHONPATH=src:tests python benchmarks/2026-12-04b-actmem/table.py TP [LAYERS] [SEQS]
(writes tpTP[-LLAYERS][-SSEQS].json; SEQS comma-separated, default 2048)"""

from __future__ import annotations

import copy
import json
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests"))

from distributed import run_ranks  # noqa: E402

ROWS, DIM, HEADS = 2, 64, 4
CASES = (  # (schedule, sp, defer weight grads)
    [("megatron", sp, True) for sp in (None, "gathered", "shards")]
    + [("megatron-recompute", sp, True) for sp in (None, "shards")]
    + [("commfree-recompute", sp, True) for sp in (None, "gathered", "shards")]
    + [("overlap", sp, True) for sp in (None, "gathered", "shards")]
    + [("overlap-recompute", sp, True) for sp in (None, "shards")]
    + [("overlap-recompute", "shards", False)]
    + [("oases", sp, True) for sp in (None, "gathered", "shards")]
    + [("megatron-sp", sp, True) for sp in ("gathered", "shards")]
)


def rank(rank: int, world: int, layers: int, seqs: tuple[int, ...]) -> list:
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
        for seq in seqs:
            cfg = ModelConfig(arch=arch, n_layers=layers, dim=DIM, n_heads=HEADS,
                              vocab_size=256, seq_len=seq, dropout=0.1)
            torch.manual_seed(0)
            ref = build_model(cfg)
            g = torch.Generator().manual_seed(1)
            tokens = torch.randint(0, 256, (ROWS, seq), generator=g)
            for name, sp, defer in CASES:
                model = parallelize(copy.deepcopy(ref), ctx)
                sched = build_schedule(name, n_sub=2, sp=sp, defer_weight_grads=defer)
                sched.step(model, tokens, tokens)  # warm-up (and the gradients' buffers)
                got = [measure_step(sched, model, tokens, tokens, ctx.device) for _ in range(3)]
                out.append({"arch": arch, "seq": seq, "schedule": name, "sp": sp,
                            "dw": defer, "recompute": sched.spec.recompute, "layers": layers,
                            "saved_per_block": got[0]["saved_per_block"],
                            "peak_live": statistics.median(g["peak_live"] for g in got),
                            "peak_live_all": [g["peak_live"] for g in got]})
    return out


if __name__ == "__main__":
    tp = int(sys.argv[1])
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    seqs = tuple(int(s) for s in sys.argv[3].split(",")) if len(sys.argv) > 3 else (2048,)
    res = run_ranks(rank, tp, f"/tmp/oases-actmem3-{tp}", layers, seqs, timeout_s=3000)[0]
    name = f"tp{tp}" + ("" if layers == 2 else f"-L{layers}")
    name += "" if seqs == (2048,) else "-S" + "_".join(str(s) for s in seqs)
    name += ".json"
    (HERE / name).write_text(json.dumps(res, indent=1))
    print(f"wrote {HERE / name}: {len(res)} cases")
