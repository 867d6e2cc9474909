"""A mixed-degree plan on the same machine and link: predicted beside measured.

On 2 ranks over this link tp=2 wins everywhere, so the planner never mixes here; this measures
a mixed plan anyway (blocks 0-1 at tp=1 x dp=2, blocks 2-3 and the head at tp=2, the oases
schedule): reshards between the degrees, DP gradient all-reduces for the tp=1 half, both priced
by the simulator. Run from the repository root (root, for the shaped link):

    .venv/bin/python benchmarks/2026-11-30-planner/mixed.py
"""

import json
from pathlib import Path

from oases.bench.suite import parse_rate
from oases.config import load_config
from oases.plan import ParallelPlan, RegionPlan, region_names
from oases.planner import batch_shape
from oases.planner.profile import Profile
from oases.planner.search import Candidate
from oases.planner.simulate import simulate_plan
from oases.planner.verify import format_rows, measure_candidates

out = Path("benchmarks/2026-11-30-planner/mixed")
cfg = load_config("configs/bench.toml", [])
profile = Profile.load("benchmarks/2026-11-30-planner/profile.json")
names = region_names(cfg.model)
candidates = []
for schedule, n_sub in (("oases", 2), ("megatron", 1)):
    degrees = [1 if n == "embed" or n.startswith(("blocks.0.", "blocks.1.")) else 2
               for n in names]
    plan = ParallelPlan([RegionPlan(n, t, 2 // t) for n, t in zip(names, degrees)],
                        n_sub=n_sub, schedule=schedule)
    result = simulate_plan(cfg.model, plan, profile, 2, batch_shape(cfg, 2))
    candidates.append(Candidate(plan, result, True, "mixed"))
rows = measure_candidates("configs/bench.toml", [], candidates, 2, parse_rate("343mbit"),
                          steps=3, warmup=2, out=out, rounds=2)
(out / "verify.json").write_text(json.dumps(rows, indent=1))
text = format_rows(rows, rows[0]["plan"])
(out / "table.txt").write_text(text + "\n")
print(text)
