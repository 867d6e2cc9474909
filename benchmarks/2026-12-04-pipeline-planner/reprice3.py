"""The earlier runs' pipeline plans (out/CASE.pp.json for LLaMA, out-plans/ for the others)
re-simulated by this commit's simulator, beside round 3's: tells a plan the search now finds
from the same plan priced differently (the simulator changed on main between the runs).

    python reprice3.py CASE ...     -> one line per case: the pipeline plan before as
                                       recorded and re-priced, after; the plan without a
                                       pipeline as recorded and re-priced
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from oases.config import load_config
from oases.plan import ParallelPlan
from oases.planner.batch import BatchShape
from oases.planner.hardware import HardwareCosts
from oases.planner.precision import resolve_plan_precision
from oases.planner.sim_inputs import load_any_cluster
from oases.planner.simulate import simulate_plan

here = Path(__file__).parent


def main() -> None:
    for case in sys.argv[1:]:
        old_dir = "out" if case.startswith("llama") else "out-plans"
        before = json.loads((here / old_dir / f"{case}.json").read_text())
        after = json.loads((here / "out-round3" / f"{case}.json").read_text())
        if not before["pipeline"].get("step_s"):
            continue
        cfg = load_config(here / before["runfile"], [])
        gbps = before["inter_gbps"]
        cluster = load_any_cluster(before["cluster"], None if gbps == "-" else float(gbps))
        prec = resolve_plan_precision(cfg.train.precision, cfg.parallel.grad_reduce_dtype, gpu=True)
        costs = HardwareCosts(
            cluster, cfg.model, prec.compute, prec.grad_reduce, attention=before["attention"]
        )
        now = {}
        for kind in ("pp", "nopp"):
            plan = ParallelPlan.load(here / old_dir / f"{case}.{kind}.json")
            batch = BatchShape(plan.notes["global_batch"], plan.notes["micro_rows"])
            world = before["world_size"]
            now[kind] = simulate_plan(cfg.model, plan, costs, world, batch, timeline=False).step_s
        print(
            f"{case}: pipeline before {before['pipeline']['step_s']:.4g} s as recorded, "
            f"{now['pp']:.4g} s re-simulated now; after {after['pipeline']['step_s']:.4g} s; "
            f"without {before['no_pipeline']['step_s']:.4g} s as recorded, {now['nopp']:.4g} s "
            "re-simulated now",
            flush=True,
        )


if __name__ == "__main__":
    main()
