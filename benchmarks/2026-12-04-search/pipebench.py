"""Round 14 (run from the repository root: PYTHONPATH=src python benchmarks/2026-12-04-search/pipebench.py).
Record build_program's arguments and _compile_memory's of a one-process 24 GB search (once,
/tmp/pipe_args.pkl), then time the per-program pipeline on them: build_program (caches
cleared), compile_tape, _compile_memory; --check compares outputs with /tmp/pipe_ref.pkl."""
import sys, time, pickle, os
import numpy as np
PATH, REF = "/tmp/pipe_args.pkl", "/tmp/pipe_ref.pkl"
if not os.path.exists(PATH):
    import oases.planner.search_prefetch as sp
    sp.use_spare_core = lambda: None
    import oases.schedule.program as PR
    import oases.planner.peak_memory_tape as PM
    builds, mems, index = [], [], {}
    orig_build, orig_mem = PR.build_program, PM._compile_memory
    def rec_build(*a, **k):
        out = orig_build(*a, **k)
        index[id(out)] = len(builds); builds.append((a, k))
        return out
    def rec_mem(program, *a):
        mems.append((index.get(id(program)), a)); return orig_mem(program, *a)
    PR.build_program = rec_build
    import oases.planner.simulate as SIM
    PM._compile_memory = rec_mem
    # the tape keeps tuple(program): map ids through compile_tape
    import oases.planner.tape as T
    orig_ct = T.compile_tape
    def rec_ct(program):
        tape = orig_ct(program); index[id(tape.program)] = index.get(id(program)); return tape
    SIM.compile_tape = rec_ct
    from oases.cli import main
    main("plan benchmarks/2026-12-04-search/gpt-96.toml --world-size 32 --memory-gb 24 --hardware paper-3090-pcie-32 --train.global_batch=128 --out /tmp/pb.json".split())
    pickle.dump((builds, mems), open(PATH, "wb"))
    print(len(builds), "builds", len(mems), "memory compiles recorded"); sys.exit()
builds, mems = pickle.load(open(PATH, "rb"))
from oases.schedule.program import build_program, clear_program_caches
from oases.planner.tape import compile_tape
from oases.planner.peak_memory_tape import _compile_memory
import gc; gc.disable()
best = None
for rep in range(int(os.environ.get("REPS", "2"))):
    clear_program_caches()
    t0 = time.perf_counter(); progs = [build_program(*a, **k) for a, k in builds]; t1 = time.perf_counter()
    tapes = [compile_tape(p) for p in progs]; t2 = time.perf_counter()
    evs = [_compile_memory(tapes[i].program, *a) for i, a in mems if i is not None]; t3 = time.perf_counter()
    times = (t1 - t0, t2 - t1, t3 - t2)
    best = times if best is None else tuple(map(min, best, times))
print("build %.2f compile_tape %.2f compile_memory %.2f (best of reps)" % best)
def sig(e): return tuple(x.tobytes() if isinstance(x, np.ndarray) else x for x in (e.var, e.value, e.sign, e.checkpoints, e.rs_before, e.rs_value, e.patterns, tuple(sorted(e.whole)), tuple(sorted(e.shards))))
def isig(i):
    return (type(i).__name__,) + tuple(getattr(i, f) for f in i.__dataclass_fields__)
out = ([tuple(map(isig, p)) for p in progs], [(t.ops, t.compute_keys, t.coll_keys, t.n_slots) for t in tapes], [sig(e) for e in evs])
if not os.path.exists(REF):
    pickle.dump(out, open(REF, "wb")); print("reference saved")
else:
    ref = pickle.load(open(REF, "rb"))
    print("programs equal", ref[0] == out[0], "tapes equal", ref[1] == out[1], "events equal", ref[2] == out[2])
