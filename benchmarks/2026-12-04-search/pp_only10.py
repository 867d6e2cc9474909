"""Round 10: only the pipeline search of `oases plan ... --pp auto` (as the CLI builds it), its
parts timed by wrappers (no profiler) and the cycle collector by gc.callbacks; prints a
fingerprint of every candidate (label, step, peak, fits, breakdown: equal before and after).
    python pp_only10.py RUNFILE WORLD MEMORY_GB HARDWARE [overrides] [--spare]"""

import hashlib
import sys
import time

import oases.planner.pipeline_search as ps
import oases.planner.pipeline_walk as pw
from oases.config import load_config
from oases.planner import costs_budget, load_costs
from oases.planner.pipeline_search import search_config_pipelines
from oases.planner.search_prefetch import use_spare_core

TIMERS = {}


def wrap(mod, name, label=None):
    f = getattr(mod, name)
    label = label or name

    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            d = TIMERS.setdefault(label, [0, 0.0])
            d[0] += 1
            d[1] += time.perf_counter() - t

    setattr(mod, name, g)


if "--spare" in sys.argv:
    use_spare_core()
    sys.argv.remove("--spare")
wrap(ps, "price_layout")
wrap(ps, "mixed_layouts")
wrap(ps, "simulate_plan", "walk(simulate_plan)")
import oases.schedule.pipeline_program as pprog

wrap(pprog, "build_stage_program")
wrap(pw, "walk_stages")
wrap(pw, "peak_memory")
toml, world, mem, hw = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
overrides = sys.argv[5:]
cfg = load_config(toml, overrides)
costs = load_costs(f"hw:{hw}", cfg.model, cfg.train.precision, cfg.parallel.grad_reduce_dtype)
budget = costs_budget(mem, costs)
import gc

GC = {"t": 0.0, "n": 0, "start": 0.0}


def cb(phase, info):
    if phase == "start":
        GC["start"] = time.perf_counter()
    else:
        GC["t"] += time.perf_counter() - GC["start"]
        GC["n"] += info["generation"] == 2


gc.callbacks.append(cb)
t = time.perf_counter()
found = search_config_pipelines(
    cfg, world, costs, budget.bytes, zeros=(0, 1, 2), sps=("gathered", "shards")
)
wall = time.perf_counter() - t
lines = [f"screened {found.screened} mixed {found.mixed} walked {found.walked}"]
for c in found.candidates:
    lines.append(
        f"{c.label()} {c.result.step_s!r} {c.result.peak_mem_bytes!r} {c.fits} {sorted(c.result.breakdown.items())!r}"
    )
lines.append(
    "best "
    + ("none" if found.best is None else found.best.label() + repr(found.best.result.step_s))
)
text = "\n".join(lines)
print(text[:3000] if "-v" in overrides else lines[0])
print("fingerprint", hashlib.sha256(text.encode()).hexdigest())
for k, (n, s) in sorted(TIMERS.items(), key=lambda kv: -kv[1][1]):
    print(f"  {k}: {n} calls, {s:.2f} s")
print(f"pipeline search {wall:.2f} s; gc {GC}")
