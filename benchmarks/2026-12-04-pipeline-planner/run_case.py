"""Cases of the pipeline planner's report: the planner's best plan without a pipeline
(``planner.search_plans``) and with one (``planner.pipeline_search.search_config_pipelines``)
for a run file on a cluster preset (optionally at another rate between servers), each search
timed; writes out/CASE.json and the two plan files out/CASE.nopp.json and out/CASE.pp.json.
Several cases in one process (one wait for the machine's lock), each a "|"-joined argument:

    python run_case.py "CASE|RUNFILE|CLUSTER|GBPS or -|WORLD|fused or -" ...

Environment: OUT (the output folder, default out), MIXED=0 (the pipeline search without mixed
stage layouts, as before round 3), FLAT_FROM=DIR (the best plan without a pipeline read from
DIR/CASE.json of an earlier run instead of searched again: ``search_plans`` is not what round 3
changed; its search time is then the earlier run's).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from oases.config import load_config
from oases.planner import search_plans
from oases.planner.budget import costs_budget
from oases.planner.hardware import HardwareCosts
from oases.planner.pipeline_search import search_config_pipelines
from oases.planner.precision import resolve_plan_precision
from oases.planner.sim_inputs import load_any_cluster


def describe(c) -> dict:  # noqa: ANN001 - a Candidate
    if c is None:
        return {}
    r = c.result
    return {
        "label": c.label(),
        "pp": c.plan.pp,
        "pp_schedule": c.plan.pp_schedule if c.plan.pp > 1 else None,
        "stage_starts": c.plan.stage_starts,
        "tp": c.plan.degree_runs(),
        "zero": max(c.plan.zero_stages()),
        "sp": c.plan.sequence_parallel,
        "n_micro": c.batch.n_micro() if c.batch else None,
        "step_s": r.step_s,
        "peak_gib": r.peak_mem_bytes / 2**30,
        "parts": r.step_parts(),
        "bound": r.bound(),
    }


def main() -> None:
    for arg in sys.argv[1:]:
        try:
            run_case(*arg.split("|"))
        except ValueError as exc:  # a case that does not fit its cluster: say so, go on
            print(f"{arg.split('|')[0]}: {exc}", flush=True)


def run_case(case: str, runfile: str, cluster_name: str, gbps: str, world: str, fused: str) -> None:
    fused = fused == "fused"
    cfg = load_config(runfile, [])
    cluster = load_any_cluster(cluster_name, None if gbps == "-" else float(gbps))
    prec = resolve_plan_precision(cfg.train.precision, cfg.parallel.grad_reduce_dtype, gpu=True)
    costs = HardwareCosts(
        cluster,
        cfg.model,
        prec.compute,
        prec.grad_reduce,
        attention="fused" if fused else "materialized",
    )
    budget = costs_budget(0.0, costs)
    n = int(world)
    out = Path(__file__).parent / os.environ.get("OUT", "out")
    out.mkdir(exist_ok=True)
    flat_from = os.environ.get("FLAT_FROM")
    if flat_from:
        no_pipeline = json.loads((Path(flat_from) / f"{case}.json").read_text())["no_pipeline"]
        no_pipeline["from"] = flat_from
    else:
        start = time.perf_counter()
        flat = search_plans(cfg, n, costs, budget.bytes, search_micro_batch=False)
        flat_s = time.perf_counter() - start
        flat.best.plan.save(out / f"{case}.nopp.json")
        no_pipeline = describe(flat.best) | {"fits": flat.best.fits, "search_s": flat_s}
    mixed = os.environ.get("MIXED", "1") != "0"
    start = time.perf_counter()
    piped = search_config_pipelines(
        cfg, n, costs, budget.bytes, search_micro_batch=False, mixed=mixed
    )
    piped_s = time.perf_counter() - start
    if piped.best is not None:
        piped.best.plan.save(out / f"{case}.pp.json")
    result = {
        "case": case,
        "runfile": runfile,
        "cluster": cluster_name,
        "inter_gbps": gbps,
        "world_size": n,
        "attention": "fused" if fused else "materialized",
        "precision": prec.describe(),
        "budget_gib": budget.bytes / 2**30,
        "no_pipeline": no_pipeline,
        "pipeline": describe(piped.best)
        | {
            "search_s": piped_s,
            "mixed_search": mixed,
            "mixed_layouts": piped.mixed,
            "screened": piped.screened,
            "walked": piped.walked,
            "notes": piped.notes,
        },
    }
    (out / f"{case}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1), flush=True)


if __name__ == "__main__":
    main()
