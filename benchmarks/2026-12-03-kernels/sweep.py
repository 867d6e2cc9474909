"""Predicted MFU of dense LLaMA-shaped decoders (1B-70B) on 64 A100s and 64 H100s, bf16, fused
attention, for the oases tree on PYTHONPATH: run once with the tree before the kernel model and
once with this one (run.sh), then summarize.py puts them side by side.

    python sweep.py OUT.json
"""

from __future__ import annotations

import json
import math
import sys
import time

from oases.config import ModelConfig
from oases.planner.batch import BatchSpec
from oases.planner.hardware import CLUSTERS
from oases.planner.whatif import parse_entries, simulate_cluster

MODELS = {  # LLaMA-3.2-1B, LLaMA-3-8B, LLaMA-2-13B, LLaMA-3-70B shapes
    "1B": dict(n_layers=16, dim=2048, n_heads=32, n_kv_heads=8, ffn_dim=8192,
               vocab_size=128256),
    "8B": dict(n_layers=32, dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336,
               vocab_size=128256),
    "13B": dict(n_layers=40, dim=5120, n_heads=40, n_kv_heads=40, ffn_dim=13824,
                vocab_size=32000),
    "70B": dict(n_layers=80, dim=8192, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                vocab_size=128256),
}
CONFIGS = {  # name: (schedule entry)
    "FSDP": "megatron@tp=1,zero=3",
    "FSDP+recompute": "megatron-recompute@tp=1,zero=3",
    "TP8": "megatron@tp=8,zero=1",
    "TP8+recompute": "megatron-recompute@tp=8,zero=1",
}
SEQS = (2048, 4096, 8192)
TOKENS_PER_STEP = 1 << 21  # 2M tokens, one sequence per model replica per micro-batch
# the two examples: (model, S, sequences per GPU, global batch)
EXAMPLES = (("8B", 8192, 1, 64), ("13B", 4096, 2, 128))


def run(model: str, seq: int, cluster: str, config: str, micro: int, global_batch: int
        ) -> dict:
    cfg = ModelConfig(arch="llama", seq_len=seq, **MODELS[model])
    entries = parse_entries(CONFIGS[config], "auto")
    rep = simulate_cluster(cfg, CLUSTERS[cluster], entries, BatchSpec(global_batch, micro, 1),
                           math.inf, dtype="bf16", attention="fused")
    row = rep.rows[0]
    budget = 0.95 * CLUSTERS[cluster].memory_bytes
    out = {"model": model, "seq": seq, "cluster": cluster, "config": config,
           "micro": micro, "global_batch": global_batch, "step_s": row.result.step_s,
           "mfu": row.mfu, "tokens_per_s_per_gpu": row.tokens_per_s_per_gpu,
           "peak_gib": row.result.peak_mem_bytes / 2**30,
           "fits": row.result.peak_mem_bytes <= budget, "parts": row.result.step_parts()}
    kernels = getattr(row, "kernels", None)
    if kernels is not None:
        out["kernels"] = {"shares": kernels.shares(), "efficiency": kernels.efficiency,
                          "bound": kernels.bound, "sane": kernels.sane()}
    return out


def main(path: str) -> None:
    start, rows = time.perf_counter(), []
    for cluster in ("a100-ib-64", "h100-ib-64"):
        for model in MODELS:
            for seq in SEQS:
                for config in CONFIGS:
                    rows.append(run(model, seq, cluster, config, 1, TOKENS_PER_STEP // seq))
        for model, seq, micro, global_batch in EXAMPLES:
            rows.append(run(model, seq, cluster, "FSDP", micro, global_batch) | {"example": 1})
    with open(path, "w") as f:
        json.dump({"rows": rows, "seconds": time.perf_counter() - start}, f, indent=1)
    print(f"{len(rows)} rows in {time.perf_counter() - start:.1f} s -> {path}")


if __name__ == "__main__":
    main(sys.argv[1])
