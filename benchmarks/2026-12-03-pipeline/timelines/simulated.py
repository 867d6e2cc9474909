"""Simulated timelines of every pipeline schedule, with the pipeline p2p lane: issue 28's
two-server case on paper (``paper-3090-pcie-32``: a stage per server, tp=4 inside it, the
boundary over the servers' 100 GbE ports), a GPT-2-shaped model of 8 blocks (dim 2048,
S = 1024, embedding untied), bf16, 8 micro-batches of one sequence. Writes
``sim-<schedule>-<G>gbe.png`` beside this file and prints each step's time and bubble, at
100 GbE (the preset's) or the rate given::

    PYTHONPATH=src python benchmarks/2026-12-03-pipeline/timelines/simulated.py [GBPS]
"""

from __future__ import annotations

import sys
from pathlib import Path

from oases.config import ModelConfig
from oases.plan import ParallelPlan
from oases.planner.batch import BatchShape
from oases.planner.hardware import HardwareCosts
from oases.planner.pipeline_walk import simulate_pipeline
from oases.planner.sim_inputs import load_any_cluster

HERE = Path(__file__).parent
CFG = ModelConfig(  # (untied: a tied embedding's gradient sum between the servers is its own wait)
    arch="gpt2",
    n_layers=8,
    dim=2048,
    n_heads=16,
    vocab_size=50304,
    seq_len=1024,
    tie_embeddings=False,
)
WORLD, TP, PP, N_MICRO = 8, 4, 2, 8
ENTRIES = [  # (inner schedule, pipeline schedule, chunks)
    ("megatron", "gpipe", 1),
    ("megatron", "1f1b", 1),
    ("oases", "1f1b-pair", 1),
    ("megatron", "zb-h1", 1),
    ("megatron", "interleaved", 2),
]


def main(gbps: float | None = None) -> None:
    costs = HardwareCosts(load_any_cluster("paper-3090-pcie-32", gbps), CFG, "bf16", "bf16")
    for inner, order, chunks in ENTRIES:
        plan = ParallelPlan.uniform(
            CFG, WORLD, TP, pp=PP, pp_schedule=order, pp_chunks=chunks, schedule=inner, n_sub=1
        )
        plan.check(CFG, WORLD)
        res = simulate_pipeline(CFG, plan, costs, WORLD, BatchShape(N_MICRO, 1))
        name = f"sim-{order}-{gbps or 100:g}gbe"
        title = (
            f"simulated: {inner}@tp={TP},pp={PP},pps={order}"
            + (f",v={chunks}" if chunks > 1 else "")
            + f" on paper-3090-pcie-32 ({gbps or 100:g} GbE), {N_MICRO} micro-batches of 1 seq"
        )
        res.timeline.plot(HERE / f"{name}.png", title=title, n_sub=1)
        parts = res.step_parts()
        print(
            f"{order:12s} {inner:9s} step {res.step_s * 1e3:8.1f} ms  bubble "
            f"{parts['bubble'] * 1e3:7.1f} ms  peak {res.peak_mem_bytes / 2**30:5.2f} GiB"
        )


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else None)
