"""The CPU path is untouched: every candidate `oases plan` simulates from a profile measured on
this machine (the sequence-parallel report's verify profile, its command) is predicted to the
bit the same by the tree on PYTHONPATH; run with both trees and diff the outputs (run.sh).

    python cpu_identical.py OUT.txt
"""

import math
import sys

from oases.config import load_config
from oases.planner.batch import config_batch
from oases.planner.profile import Profile
from oases.planner.search import solve_plan

PROFILE = "benchmarks/2026-12-02-sequence-parallel/verify/profile.json"
cfg = load_config("configs/bench.toml", ["--train.global_batch=8", "--train.micro_batch=8",
                                         "--train.precision=fp32"])
batch = config_batch(cfg).shape(2, cfg.train.global_batch, cfg.parallel.tp)
best, candidates = solve_plan(cfg.model, Profile.load(PROFILE), 2, batch, math.inf,
                              schedules=("oases", "megatron"), degrees=[1, 2], zeros=(0,),
                              sps=("gathered", "shards"))
with open(sys.argv[1], "w") as out:
    for c in sorted(candidates, key=lambda c: (c.label(), c.result.step_s)):
        out.write(f"{c.label()}: step {c.result.step_s!r} s, peak {c.result.peak_mem_bytes!r} B,"
                  f" parts {c.result.step_parts()!r}\n")
    out.write(f"chosen: {best.label()} {best.result.step_s!r}\n")
print(f"{len(candidates)} candidates -> {sys.argv[1]}")
