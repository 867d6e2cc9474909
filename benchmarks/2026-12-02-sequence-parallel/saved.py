"""Saved activations per block, the executor's own accounting (``Executor.track_memory``): the
bench model (configs/bench.toml, tp=2, 4 sequences, two sub-batches for the overlapped
schedules) under every schedule, without sequence parallelism and with each of its modes.
Writes saved.md. Run: .venv/bin/python benchmarks/2026-12-02-sequence-parallel/saved.py"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests"))

from distributed import run_ranks  # noqa: E402

SCHEDULES = ("megatron", "megatron-recompute", "commfree-recompute", "overlap",
             "overlap-recompute", "oases")


def rank(rank: int, world: int) -> dict:
    from oases.config import load_config
    from oases.model import build_model
    from oases.parallel.apply import parallelize
    from oases.parallel.context import init_distributed
    from oases.schedule import build_schedule

    cfg = load_config(str(HERE.parents[1] / "configs" / "bench.toml"), [])
    ctx = init_distributed(tp=world)
    torch.manual_seed(0)
    ref = build_model(cfg.model)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.model.vocab_size, (4, cfg.model.seq_len), generator=g)
    out = {}
    for name in (*SCHEDULES, "megatron-sp"):
        for sp in (None, "gathered", "shards"):
            if name == "megatron-sp" and sp != "gathered":
                continue
            model = parallelize(copy.deepcopy(ref), ctx)
            sched = build_schedule(name, n_sub=2, sp=sp)
            ex = sched.executor(model)
            ex.track_memory = True
            sched.step(model, tokens, tokens)
            blocks = [ex.saved_bytes.get(2 * b + 1, 0) + ex.saved_bytes.get(2 * b + 2, 0)
                      for b in range(cfg.model.n_layers)]
            out[name, sp] = blocks
    return out


if __name__ == "__main__":
    res = run_ranks(rank, 2, "/tmp/oases-saved")[0]
    act = 4 * 256 * 512 * 4  # the micro-batch's [B, S, H] fp32
    lines = ["| schedule | no sp (MiB) | sp=gathered (MiB) | sp=shards (MiB) | gathered / no sp "
             "| shards / no sp |", "|---|---|---|---|---|---|"]
    for name in (*SCHEDULES, "megatron-sp"):
        row = [res.get((name, sp)) for sp in (None, "gathered", "shards")]
        mib = [f"{b[-1] / 2**20:.2f}" if b else "-" for b in row]
        ratio = [f"{r[-1] / row[0][-1]:.2f}" if r and row[0] else "-" for r in row[1:]]
        lines.append(f"| {name} | " + " | ".join(mib + ratio) + " |")
    text = ("Saved activations of the last block (forward -> backward, both sub-batches), "
            f"[B, S, H] = {act / 2**20:.0f} MiB:\n\n" + "\n".join(lines) + "\n")
    (HERE / "saved.md").write_text(text)
    print(text)
