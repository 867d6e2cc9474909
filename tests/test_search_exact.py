"""The fast plan search is exact: the same plan and step time as the exhaustive reference
search (``solve_plan(exhaustive=True)``) on small varied problems; the compiled walks it
simulates with give the reference walks' very floats (the bounds it skips chains by:
``test_search_bounds.py``)."""

from __future__ import annotations

import contextlib
import os
import random

import numpy as np
import pytest

from oases.config import ModelConfig
from oases.plan import ParallelPlan, RegionPlan, region_names
from oases.planner import load_costs, micro_batch_options
from oases.planner.batch import BatchShape, BatchSplitError
from oases.planner.candidate import with_zero
from oases.planner.profile import Profile
from oases.planner.search import SearchStats, candidate_degrees, solve_plan
from oases.planner.simulate import simulate_plan
from oases.schedule.program import SPECS

SCHEDULES = tuple(n for n, s in SPECS.items() if not s.sequence_parallel)


def _model(arch: str, layers: int, tied: bool) -> ModelConfig:
    return ModelConfig(
        arch=arch,
        n_layers=layers,
        dim=128,
        n_heads=8,
        n_kv_heads=8 if arch == "gpt2" else 4,
        ffn_dim=512,
        vocab_size=512,
        seq_len=32,
        dropout=0.1 if arch == "gpt2" else 0.0,
        tie_embeddings=tied,
    )


def _gloo_profile(cfg: ModelConfig) -> Profile:
    """A profile of CPU ranks on gloo, with contention both ways (the walks that stretch
    compute and collectives) and gloo's extra buffers (the memory walk's copies)."""
    pieces = [
        (p, k)
        for p in ("forward", "recompute")
        for k in (
            "body",
            "body-commfree",
            "epi",
            "sp-norm",
            "sp-core",
            "sp-core-commfree",
            "sp-epi",
        )
    ]
    pieces += [
        ("backward", k) for k in ("norm", "epi", "tp", "sp-norm", "sp-epi", "sp-dx", "sp-dw")
    ]
    compute = [
        {
            "region": region,
            "phase": phase,
            "piece": piece,
            "tp": t,
            "rows": r,
            "s": (1e-3 if piece in ("body", "tp", "sp-core", "sp-dx") else 2e-4) * r / t,
        }
        for region in ("embed", "attn", "mlp", "head")
        for phase, piece in pieces
        for t in (1, 2, 4)
        for r in (1, 2, 4, 8, 16)
    ]
    collectives = [
        {"op": op, "group_size": g, "nbytes": n, "s": 1e-4 + n / 1e8}
        for op in ("all_reduce", "all_gather", "reduce_scatter")
        for g in (2, 4, 8)
        for n in (2**12, 2**18, 2**24)
    ]
    model = {
        k: getattr(cfg, k)
        for k in (
            "arch",
            "dim",
            "n_heads",
            "n_kv_heads",
            "ffn_dim",
            "vocab_size",
            "seq_len",
            "tie_embeddings",
        )
    }
    return Profile(
        model,
        {"cpu": "synthetic", "backend": "gloo"},
        compute,
        collectives,
        [],
        [{"n_params": 1e4, "s": 1e-4}, {"n_params": 1e7, "s": 1e-2}],
        5e7,
        contention_factors={"all_reduce": 1.3, "all_gather": 1.2},
        comm_contention_factors={"all_reduce": 1.5},
    )


def _random_plan(
    rng: random.Random, cfg: ModelConfig, world: int, degrees: list[int]
) -> ParallelPlan:
    schedule = rng.choice(list(SPECS))
    sp = "" if SPECS[schedule].sequence_parallel else rng.choice(["", "gathered", "shards"])
    names = region_names(cfg)
    chosen = [rng.choice(degrees)]
    for _ in names[1:]:
        chosen.append(chosen[-1] if rng.random() < 0.6 else rng.choice(degrees))
    if cfg.tie_embeddings:
        chosen[-1] = chosen[0]
    plan = ParallelPlan(
        [RegionPlan(n, t, world // t) for n, t in zip(names, chosen)],
        n_sub=rng.choice([1, 2, 4]),
        schedule=schedule,
        sequence_parallel=sp,
    )
    return with_zero(plan, rng.choice([0, 1, 2, 3]))


def test_compiled_walks_give_the_reference_floats():
    """``simulate_plan`` without a timeline walks compiled programs (``planner.tape``); with
    ``tapes=False`` the instructions themselves: every float the same, mixed degrees, every
    schedule, ZeRO stage and sequence-parallel mode, micro-batches, presets and a profile."""
    rng = random.Random(29)
    checked = 0
    for arch, layers, tied, world, source in [
        ("gpt2", 3, True, 8, "hw"),
        ("llama", 2, False, 4, "hw"),
        ("gpt2", 2, False, 4, "profile"),
    ]:
        cfg = _model(arch, layers, tied)
        costs = (
            _gloo_profile(cfg)
            if source == "profile"
            else load_costs("hw:paper-3090-pcie-32", cfg, "bf16")
        )
        degrees = [t for t in candidate_degrees(cfg, world) if source == "hw" or t <= 4]
        for _ in range(40):
            plan = _random_plan(rng, cfg, world, degrees)
            micro = rng.choice([world, 2 * world, 4 * world])
            batch = BatchShape(micro * rng.choice([1, 2, 3]), micro)
            inflight = rng.choice([1, 2])
            try:
                plan.check(cfg, world)
                fast = simulate_plan(
                    cfg, plan, costs, world, batch, max_inflight=inflight, timeline=False
                )
            except (BatchSplitError, ValueError):
                continue
            ref = simulate_plan(
                cfg, plan, costs, world, batch, max_inflight=inflight, timeline=False, tapes=False
            )
            assert (fast.step_s, fast.peak_mem_bytes) == (ref.step_s, ref.peak_mem_bytes)
            # the parts: the two walks sum the exposed time in another order (to 1e-12)
            assert fast.breakdown == pytest.approx(ref.breakdown, rel=1e-12, abs=0)
            checked += 1
    assert checked >= 60


def _uniform_peaks(cfg: ModelConfig, costs: object, world: int, batch: BatchShape) -> list[float]:
    peaks = []
    for t in candidate_degrees(cfg, world):
        for schedule in ("megatron", "oases"):
            plan = ParallelPlan.uniform(cfg, world, t, schedule=schedule, n_sub=2)
            with contextlib.suppress(BatchSplitError):
                peaks.append(
                    simulate_plan(cfg, plan, costs, world, batch, timeline=False).peak_mem_bytes
                )
    return sorted(peaks)


# arch, layers, tied, world, preset, sequences per step, per micro-batch (x world), budgets:
# "loose" (none), "mid" (the median peak of the uniform plans), "tight" (2% over the least),
# "under" (3% under the least: the least-memory search), "none" (half of it: nothing fits)
CASES = [
    ("gpt2", 2, True, 4, "paper-3090-pcie-32", 16, 2, ("loose", "tight", "none")),
    ("gpt2", 4, False, 8, "paper-3090-pcie-32", 32, 2, ("mid", "tight", "under")),
    ("llama", 3, False, 16, "a100-ib-64", 64, 1, ("loose", "tight", "under")),
    ("gpt2", 8, True, 8, "a100-ib-64", 64, 4, ("tight",)),
    ("llama", 6, True, 4, "paper-3090-pcie-32", 32, 4, ("tight",)),
    ("llama", 5, False, 8, "a100-ib-64", 32, 2, ("loose", "mid", "tight")),
    ("gpt2", 7, False, 16, "paper-3090-pcie-32", 64, 2, ("mid", "tight")),
    ("gpt2", 3, True, 16, "paper-3090-pcie-32", 64, 1, ("loose", "under")),
    ("llama", 8, False, 4, "a100-ib-64", 16, 1, ("loose", "mid")),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-L{c[1]}-W{c[3]}" for c in CASES])
def test_fast_search_finds_the_exhaustive_plan(case):
    """Every lever on (every schedule and sub-batch count, ZeRO 0-3, both sequence-parallel
    modes, the micro-batch search, mixed degrees), budgets from loose to below every plan:
    the same plan and step time (1e-9 relative), or the same error. (The answers include
    mixed plans: e.g. tight, L3 on 16: embed tp=4, blocks at 1 and 2, head 4.)"""
    arch, layers, tied, world, preset, global_batch, micro, kinds = case
    cfg = _model(arch, layers, tied)
    costs = load_costs(f"hw:{preset}", cfg, "bf16")
    batch = BatchShape(global_batch, micro * world)
    peaks = _uniform_peaks(cfg, costs, world, batch)
    budgets = {
        "loose": float("inf"),
        "mid": peaks[len(peaks) // 2],
        "tight": peaks[0] * 1.02,
        "under": peaks[0] * 0.97,
        "none": peaks[0] * 0.5,
    }
    kw = dict(
        zeros=(0, 1, 2, 3), sps=("gathered", "shards"), micro_batches=micro_batch_options(batch)
    )
    for kind in kinds:
        outcomes = []
        for exhaustive in (True, False):
            try:
                best, _ = solve_plan(
                    cfg, costs, world, batch, budgets[kind], exhaustive=exhaustive, **kw
                )
                outcomes.append(
                    (
                        best.plan.regions,
                        best.plan.schedule,
                        best.plan.n_sub,
                        best.plan.sequence_parallel,
                        best.batch,
                        best.result.step_s,
                        best.result.peak_mem_bytes,
                    )
                )
            except ValueError as exc:
                outcomes.append(str(exc))
        ref, fast = outcomes
        if isinstance(ref, str):
            assert fast == ref
            continue
        assert fast[:5] == ref[:5], f"{kind} budget: {fast[:5]} != {ref[:5]}"
        assert fast[5] == pytest.approx(ref[5], rel=1e-9)
        assert fast[6] == pytest.approx(ref[6], rel=1e-9)


def test_progress_reports_the_search():
    cfg = _model("gpt2", 2, False)
    costs = load_costs("hw:paper-3090-pcie-32", cfg, "bf16")
    seen = []
    stats = SearchStats()
    best, cands = solve_plan(
        cfg,
        costs,
        4,
        BatchShape(16, 8),
        float("inf"),
        zeros=(0, 1),
        progress=lambda s, n: seen.append((s.chains, n)),
        stats=stats,
    )
    assert seen and seen[-1][1] == len(cands)
    assert stats.best is best and stats.simulated >= len(cands) and stats.wall_s > 0


def test_stretch_over_chained_queues_gives_the_reference_floats():
    """``tape_walk._stretched_queues`` (the next breakpoint read from each chained queue)
    gives ``event_walk._stretched``'s very float on random queues: flights back to back,
    with gaps, equal ends and begins, factors that differ, some done before the start; and so
    do the compiled kernel's two (``tape_kernel``, where numba is installed)."""
    from oases.planner import jit, tape_kernel
    from oases.planner.event_walk import _stretched
    from oases.planner.tape_walk import _stretched_queues

    compiled = tape_kernel if jit.load() else None
    rng = random.Random(11)
    for _ in range(2000):
        begins, ends, factors, queues, lo = [], [], [], [], []
        for _ in range(rng.randint(1, 3)):
            queue, t = [], rng.uniform(0.0, 1.0)
            for _ in range(rng.randint(0, 6)):
                t += rng.choice([0.0, 0.0, rng.uniform(0.0, 0.5)])  # (back to back, or a gap)
                cost = rng.choice([0.25, rng.uniform(1e-3, 1.0)])
                queue.append(len(begins))
                begins.append(t)
                ends.append(t + cost)
                factors.append(rng.choice([1.025, 1.3, rng.uniform(1.0001, 2.0)]))
                t += cost
            queues.append(queue)
        start = rng.choice([0.0, rng.uniform(0.0, 3.0), *ends]) if ends else 0.0
        for queue in queues:
            lo.append(sum(1 for g in queue if ends[g] <= start))
        work = rng.uniform(1e-3, 3.0)
        flights = [(begins[g], ends[g], factors[g]) for q in queues for g in q if ends[g] > start]
        if not flights:
            continue
        got = _stretched_queues(start, work, queues, lo, begins, ends, factors)
        assert got == _stretched(start, work, flights)
        if compiled is not None:  # the kernel's, on its arrays
            qlen = np.array([len(q) for q in queues], dtype=np.int64)
            table = np.zeros((len(queues), max(map(len, queues), default=0) + 1), np.int64)
            for s, queue in enumerate(queues):
                table[s, : len(queue)] = queue
            arrays = (np.array(begins), np.array(ends), np.array(factors))
            lo_array = np.array(lo, dtype=np.int64)
            assert compiled._stretched_queues(start, work, table, qlen, lo_array, *arrays) == got
            slowing = np.array([g for q in queues for g in q if ends[g] > start], np.int64)
            assert compiled._stretched(start, work, slowing, len(slowing), *arrays) == got


class _Slowed:
    """Costs whose compute is slowed by some kinds of collective only (``contention``)."""

    def __init__(self, costs, contention):
        self._costs, self.contention = costs, contention

    def __getattr__(self, name):
        return getattr(self._costs, name)


@pytest.mark.parametrize("contention", ["every collective", "some kinds"])
def test_kernel_and_python_loop_give_the_same_floats(contention, monkeypatch):
    """``walk_tape`` compiled (``tape_kernel``, loaded by ``jit.load()``: numba) and its Python loop
    (``walk_tape_py``) give the same floats on random plans: mixed degrees, every schedule,
    ZeRO stage and sequence-parallel mode, micro-batches; compute slowed by every collective
    (a preset's one factor: the chained-queue path) or by some kinds only (a profile's: the
    path that tracks the slowing flights)."""
    pytest.importorskip("numba")
    if os.environ.get("OASES_NO_JIT", "") not in ("", "0"):
        pytest.skip("OASES_NO_JIT: the compiled walk is off")
    from oases.planner import jit, tape_walk

    assert jit.load()  # numba is installed: it compiles
    rng = random.Random(13 if contention == "some kinds" else 31)
    walked = []
    real = tape_walk.walk_tape_py

    def both(*args):
        got = tape_walk.walk_tape(*args)  # compiled
        ref = real(*args)  # the Python loop
        assert (got.step_s, got.compute_busy_s, got.comm_busy_s) == (
            ref.step_s,
            ref.compute_busy_s,
            ref.comm_busy_s,
        )
        assert got.exposed_s == ref.exposed_s
        walked.append(got.step_s)
        return got

    monkeypatch.setattr("oases.planner.simulate.walk_tape", both)
    for arch, layers, tied, world in [("gpt2", 3, True, 8), ("llama", 4, False, 16)]:
        cfg = _model(arch, layers, tied)
        costs = load_costs("hw:paper-3090-pcie-32", cfg, "bf16")  # (one factor for all)
        if contention == "some kinds":  # all-reduces by 1.3, gathers by 1.1, the rest not
            factors = {"all_reduce": 1.3, "all_gather": 1.1}
            costs = _Slowed(costs, lambda op, factors=factors: factors.get(op, 1.0))
        degrees = candidate_degrees(cfg, world)
        for _ in range(100):
            plan = _random_plan(rng, cfg, world, degrees)
            micro = rng.choice([world, 2 * world])
            batch = BatchShape(micro * rng.choice([1, 2, 3]), micro)
            try:
                plan.check(cfg, world)
                simulate_plan(
                    cfg, plan, costs, world, batch, max_inflight=rng.choice([1, 2]), timeline=False
                )
            except (BatchSplitError, ValueError):
                continue
    assert len(walked) >= 150


def test_walk_tape_checks_what_the_kernel_does_not():
    """The compiled kernel reads no bounds: a stream id out of range or slowdowns that are not
    one per collective key are refused before either loop runs."""
    from oases.planner.tape import START, WAIT, Tape
    from oases.planner.tape_walk import walk_tape

    tape = Tape([(START, 0, 0), (WAIT, 0, 0)], [], [("fwd", 0)], 1, ())
    assert walk_tape(tape, [], [1.0], [0], 1).step_s == 1.0
    with pytest.raises(ValueError, match="stream is not one of 1"):
        walk_tape(tape, [], [1.0], [3], 1)
    with pytest.raises(ValueError, match="one compute slowdown per collective"):
        walk_tape(tape, [], [1.0], [0], 1, [1.5, 1.5])


class _FakeJit:
    """What a fake ``njit`` returns: calls the function; like numba's dispatchers, refused by
    ``njit`` again (numba raises TypeError on an already-jitted function)."""

    def __init__(self, fn):
        self.py_func = fn

    def __call__(self, *args):
        return self.py_func(*args)


def _fake_numba(fails):
    """A numba module whose ``njit`` "compiles" to ``_FakeJit`` and raises where
    ``fails(name, cache)`` says; its calls recorded."""
    import types

    calls = []

    def njit(**options):
        def compile_(fn):
            if isinstance(fn, _FakeJit):
                raise TypeError("A jit decorator was called on an already jitted function")
            calls.append((fn.__name__, options["cache"]))
            if fails(fn.__name__, options["cache"]):
                raise RuntimeError("cannot compile this here")
            return _FakeJit(fn)

        return compile_

    return types.SimpleNamespace(njit=njit), calls


@pytest.mark.parametrize("where", ["the solver's, cached only", "the solver's, always"])
def test_kernels_that_do_not_compile_leave_the_python_loops(where, monkeypatch):
    """Where numba imports but cannot compile (or cache) a kernel, ``jit.load`` tries once
    more without the cache, and else says so and leaves none half-loaded (every module's
    helpers as written): the walks run their Python and numpy code, to the same answers."""
    import sys

    from oases.planner import chain, chain_kernel, jit, tape_kernel

    for module, name in (
        (tape_kernel, "KERNEL"),
        (tape_kernel, "_stretched"),
        (tape_kernel, "_stretched_queues"),
        (chain_kernel, "VITERBI"),
        (chain_kernel, "AHEAD"),
        (chain_kernel, "PARETO"),
        (chain_kernel, "_sort"),
        (chain_kernel, "_before"),
        (jit, "_LOADED"),
        (jit, "LOADED_OK"),
    ):
        monkeypatch.setattr(module, name, getattr(module, name))  # (restored after)
    tape_kernel.reset()
    chain_kernel.reset()
    monkeypatch.setattr(jit, "_LOADED", False)
    monkeypatch.delenv("OASES_NO_JIT", raising=False)
    always = where.endswith("always")
    numba, calls = _fake_numba(lambda name, cache: name == "_pareto" and (cache or always))
    monkeypatch.setitem(sys.modules, "numba", numba)
    assert jit.load() is (not always) and jit.load() is (not always)  # (once: asks no more)
    assert [c for c in calls if c[0] == "_pareto"] == [("_pareto", True), ("_pareto", False)]
    if not always:  # the second try, uncached, loaded every kernel
        assert isinstance(tape_kernel.KERNEL, _FakeJit) and isinstance(
            chain_kernel.PARETO, _FakeJit
        )
        return
    assert tape_kernel.KERNEL is None
    assert chain_kernel.VITERBI is chain_kernel.AHEAD is chain_kernel.PARETO is None
    assert (tape_kernel._stretched_queues, tape_kernel._stretched) == tape_kernel._PYTHON
    assert (chain_kernel._before, chain_kernel._sort) == chain_kernel._PYTHON
    rng = np.random.default_rng(5)
    node_s, node_bytes = rng.uniform(1, 9, (12, 3)), rng.uniform(1, 9, (12, 3))
    edge_s = rng.uniform(0, 1, (11, 3, 3))
    budget = float(node_bytes.min(axis=1).sum() + 4)
    assert chain.solve_chain(node_s, node_bytes, edge_s, budget).memory_bytes <= budget


def test_a_tapes_deferred_regions_are_its_programs():
    """``Tape.deferring`` (read off the compute keys) is ``deferred_regions`` of the program
    it compiled, on random mixed plans of every schedule and mode (some defer, some not)."""
    from oases.planner.simulate import plan_program
    from oases.planner.tape import compile_tape
    from oases.schedule.program import deferred_regions

    rng = random.Random(17)
    cfg = _model("gpt2", 3, False)
    degrees = candidate_degrees(cfg, 8)
    seen = set()
    for _ in range(80):
        plan = _random_plan(rng, cfg, 8, degrees)
        try:
            program = plan_program(cfg, plan, 8, BatchShape(32, rng.choice([8, 16])))
        except (BatchSplitError, ValueError):
            continue
        tape = compile_tape(program)
        assert tape.deferring() == deferred_regions(program)
        seen.add(bool(tape.deferring()))
    assert seen == {True, False}
