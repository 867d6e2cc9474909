"""The plan search's chain bounds (``planner.search_bounds``) hold for every plan of a chain
that fits the budget, and their per-region pieces (``planner.region_prices``) are what each
region of a mixed plan runs at its own degree, whatever its neighbours'."""

from __future__ import annotations

import random

import numpy as np
import pytest

from oases.plan import ParallelPlan, RegionPlan, region_names
from oases.planner import load_costs
from oases.planner.batch import BatchShape, BatchSplitError
from oases.planner.candidate import with_zero
from oases.planner.region_prices import TP_KINDS, region_prices
from oases.planner.search import candidate_degrees
from oases.planner.search_bounds import chain_bounds, chain_prices, tp_serial
from oases.planner.simulate import plan_program, simulate_plan
from oases.planner.step_bound import MARGIN, joint_step_bound
from oases.schedule.program import SPECS, Start, Wait
from test_search_exact import _gloo_profile, _model, _random_plan


def _costs(name: str, cfg):
    return _gloo_profile(cfg) if name == "gloo" else load_costs(f"hw:{name}", cfg, "bf16")


CASES = [  # arch, layers, tied, world, costs, seed
    ("gpt2", 3, True, 8, "paper-3090-pcie-32", 7),
    ("llama", 4, False, 8, "a100-ib-64", 8),
    ("gpt2", 2, False, 16, "paper-3090-pcie-32", 9),
    ("llama", 3, True, 4, "gloo", 10),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-L{c[1]}-W{c[3]}-{c[4]}" for c in CASES])
def test_chain_bounds_hold_for_every_plan_that_fits(case):
    """No plan of a chain that fits a budget steps faster than ``chain_bounds`` says under
    that budget (nor, without one, than it says unbudgeted), none peaks lower, and none's
    compute stream is busy for less than its regions' least compute: budgets at the plan's own
    peak (the tightest it fits) and above it. The bound is the joint one (memory priced
    against the collectives), so under a budget below a plan's peak it may exceed that plan's
    step: the search uses it only for plans that fit."""
    arch, layers, tied, world, name, seed = case
    rng = random.Random(seed)
    cfg = _model(arch, layers, tied)
    costs = _costs(name, cfg)
    degrees = candidate_degrees(cfg, world)
    checked = stronger = rows_checked = 0
    for _ in range(150):
        plan = _random_plan(rng, cfg, world, degrees)
        zero = plan.zero_stages()[0]
        if zero and world in plan.degrees():
            continue  # (the search gives a ZeRO stage only to plans with data parallelism)
        batch = BatchShape(4 * world, rng.choice([world, 2 * world]))
        try:
            plan.check(cfg, world)
            res = simulate_plan(cfg, plan, costs, world, batch, timeline=False)
        except (BatchSplitError, ValueError):
            continue
        sp = plan.sequence_parallel if max(plan.degrees()) > 1 else ""
        args = (cfg, costs, world, batch, plan.schedule, plan.n_sub, zero, sp, degrees, 1)
        loose, memory_lb = chain_bounds(*args)
        assert res.step_s >= loose and res.peak_mem_bytes >= memory_lb
        # every serial sum and stream sum on its own (the joint bound weighs them)
        prices = chain_prices(*args)
        at = [prices.degrees.index(t) for t in plan.degrees()]
        regions = range(len(at))
        for j, row in enumerate(prices.serial()):
            total = sum(row[i, d] for i, d in zip(regions, at))
            assert res.step_s >= total * (1 - 1e-9), (plan.label(), batch, j, total)
        for d in set(at):
            stream = sum(prices.comm[i, d] for i, e in zip(regions, at) if e == d)
            assert res.step_s >= stream * (1 - 1e-9), (plan.label(), batch, d, stream)
        rows_checked += 1
        # the compute stream alone runs at least every region's least compute
        least = chain_prices(*args).compute.min(axis=1).sum() * batch.n_micro()
        assert res.breakdown["compute_s"] >= least * (1 - 1e-9)
        for budget in (res.peak_mem_bytes, res.peak_mem_bytes * rng.uniform(1.0, 1.5)):
            time_lb, _ = chain_bounds(*args, budget)
            assert res.step_s >= time_lb, (plan.label(), budget, res.step_s, time_lb)
            stronger += time_lb > loose * (1 + 1e-6)
        checked += 1
    assert checked >= 40 and rows_checked >= 40
    assert stronger >= 5  # (the budget does tighten it: the test reaches the joint bound)


def test_a_chain_over_the_budget_is_bounded_without_its_programs(monkeypatch):
    """``chain_bounds`` under a budget below the chain's peak bound answers from the bytes
    alone (the same peak bound as without a budget, and a step bound of 0) and prices no
    program; under one above it, it prices every degree's uniform plan (``region_prices``)."""
    import oases.planner.search_bounds as bounds

    cfg = _model("gpt2", 3, True)
    costs = _costs("paper-3090-pcie-32", cfg)
    degrees = candidate_degrees(cfg, 8)
    priced = []
    real = bounds.region_prices
    monkeypatch.setattr(bounds, "region_prices", lambda *a, **k: priced.append(a) or real(*a, **k))
    for schedule, zero, sp in [("megatron", 0, ""), ("oases", 1, "shards"), ("merak", 3, "")]:
        args = (cfg, costs, 8, BatchShape(32, 16), schedule, 2, zero, sp, degrees, 1)
        taken = len(chain_prices(*args).degrees)
        priced.clear()
        step, peak = chain_bounds(*args)
        assert step > 0 and peak > 0 and len(priced) == taken
        priced.clear()
        assert chain_bounds(*args, peak * 0.999) == (0.0, peak)
        assert not priced  # (no program built or priced)
        assert chain_bounds(*args, peak * 1.001)[1] == peak and len(priced) == taken
        priced.clear()


def test_a_bound_told_where_to_stop_skips_as_the_full_one(monkeypatch):
    """``chain_bounds(..., stop_at)``: where a cheaper bound (the compute alone, one serial
    sum alone) reaches ``stop_at`` it answers that one without the linear program, else the
    full bound, bit for bit. Either way the search's decision for every fastest step up to
    ``stop_at`` (it only falls) is the full bound's: skip iff the bound reaches it. Chains of
    every schedule, stage and mode, budgets loose and tight, stop_at below, at and above the
    full bound."""
    import oases.planner.step_bound as step_bound

    cfg = _model("gpt2", 3, True)
    costs = _costs("paper-3090-pcie-32", cfg)
    degrees = candidate_degrees(cfg, 8)
    solved = []
    real = step_bound._duals
    monkeypatch.setattr(step_bound, "_duals", lambda *a: solved.append(1) or real(*a))
    cheap = full_runs = 0
    for schedule, zero, sp in [("megatron", 0, ""), ("oases", 1, "shards"), ("merak", 3, "")]:
        args = (cfg, costs, 8, BatchShape(32, 16), schedule, 2, zero, sp, degrees, 1)
        _, peak = chain_bounds(*args)
        for budget in (peak * 1.05, peak * 3, float("inf")):
            full, _ = chain_bounds(*args, budget)
            for stop_at in (full * 0.3, full * 0.9, full, full * 1.1, float("inf")):
                solved.clear()
                got, got_peak = chain_bounds(*args, budget, stop_at)
                assert got_peak == peak
                assert got <= full  # (a weaker bound: the full one is at least it)
                if got < stop_at:  # (nothing cheaper reached it: the full bound)
                    assert got == full and solved
                    full_runs += 1
                else:  # (the full bound reaches it too)
                    assert full >= stop_at
                    cheap += not solved
                for incumbent in (stop_at, stop_at * 0.99, full * 0.5, full * 1.01, full):
                    if incumbent <= stop_at:
                        assert (got >= incumbent) == (full >= incumbent)
    assert cheap >= 3 and full_runs >= 3  # (both ways taken)


@pytest.mark.parametrize("case", CASES[:3], ids=[f"{c[0]}-L{c[1]}-W{c[3]}" for c in CASES[:3]])
def test_each_region_runs_its_own_collectives_at_its_degree(case):
    """A mixed plan's region i runs the TP collectives (seconds) the uniform plan of its
    degree runs there, waits at least as many of them at once, and computes at least as long:
    the per-region pieces the bound sums are the mixed plan's own."""
    arch, layers, tied, world, name, seed = case
    rng = random.Random(seed + 100)
    cfg = _model(arch, layers, tied)
    costs = _costs(name, cfg)
    degrees = candidate_degrees(cfg, world)
    checked = zero_checked = 0
    for _ in range(120):
        plan = _random_plan(rng, cfg, world, degrees)
        if len(set(plan.degrees())) == 1:
            continue
        zero = plan.zero_stages()[0]
        if zero and world in plan.degrees():
            continue
        batch = BatchShape(4 * world, rng.choice([world, 2 * world]))
        try:
            plan.check(cfg, world)
            mine = region_prices(cfg, plan, costs, world, batch)
        except (BatchSplitError, ValueError):
            continue
        if mine is None:
            continue
        mixed_z = (mine.gathers, mine.after, mine.scatters, mine.before)
        sp = plan.sequence_parallel if max(plan.degrees()) > 1 else ""
        prices = chain_prices(
            cfg, costs, world, batch, plan.schedule, plan.n_sub, zero, sp, degrees, 1
        )
        zero_prices = (prices.gathers, prices.after, prices.scatters, prices.before)
        for ours, chain in zip(mixed_z, zero_prices):  # (a pair the chain's bound uses holds)
            assert chain is None or ours is not None
        assert prices.zero_walks is None or mine.dp_walks is not None
        for i, r in enumerate(plan.regions):
            d = prices.degrees.index(r.tp)
            why = (plan.schedule, plan.n_sub, sp, plan.degrees(), zero, batch.n_micro(), i)
            assert mine.tp_comm[i] == pytest.approx(prices.comm[i, d], rel=1e-12, abs=0), why
            assert mine.tp_waited[i] >= prices.waited[i, d] * (1 - 1e-12), why
            assert mine.compute[i] >= prices.compute[i, d] * (1 - 1e-12), why
            # the DP stream's: the same collectives, at least the compute on their far side
            for pair in ((0, 1), (2, 3)):
                if zero_prices[pair[0]] is not None:
                    seconds, compute = (mixed_z[j][i] for j in pair)
                    chain_s, chain_c = (zero_prices[j][i, d] for j in pair)
                    assert seconds == pytest.approx(chain_s, rel=1e-12, abs=0), why
                    assert compute >= chain_c * (1 - 1e-12), why
                    zero_checked += 1
            if prices.zero_walks is not None:  # each walk's ZeRO collectives: the same
                for ours, chain in zip(mine.dp_walks, prices.zero_walks):
                    assert ours[i] == pytest.approx(chain[i, d], rel=1e-12, abs=0), why
        checked += 1
    assert checked >= 30 and zero_checked >= 50


def test_joint_bound_is_the_relaxation_s_optimum_on_a_small_chain():
    """Two identical regions, two degrees: degree 0 is quick on the compute stream but does
    not fit twice, degree 1 fits but carries collectives. Enumerating the four plans, the
    fastest that fits takes 6 (one region at each degree: max(1 + 5, 4)); the bound may be
    below it (a relaxation) but above the compute-only 2 and never above 6; with room for
    both at degree 0 it is 2."""
    serial = [np.array([[1.0, 5.0], [1.0, 5.0]])]
    streams = np.array([[0.0, 4.0], [0.0, 4.0]])
    a = np.array([[10.0, 1.0], [10.0, 1.0]])
    tight = joint_step_bound(serial, streams, a, a, room=11.0)
    assert 2.0 < tight <= 6.0
    assert joint_step_bound(serial, streams, a, a, room=20.0) == pytest.approx(2.0, rel=1e-6)
    assert joint_step_bound(serial, streams, a, a, room=float("inf")) <= 2.0
    assert joint_step_bound(serial, streams, a, a, room=20.0) <= 2.0 * (1 + MARGIN)


MODES = [
    (n, sp)
    for n, s in SPECS.items()
    for sp in ("", "gathered", "shards")[: 1 + 2 * (not s.sequence_parallel)]
]


INFLIGHT = [(n, sp, f) for n, sp in MODES for f in (1, 2)]


@pytest.mark.parametrize(
    "schedule, sp, max_inflight",
    INFLIGHT,
    ids=[f"{n}-{sp or 'no-sp'}-inflight{f}" for n, sp, f in INFLIGHT],
)
def test_tp_collectives_overlap_only_where_tp_serial_says_they_may(schedule, sp, max_inflight):
    """The serial sum of every TP collective (``search_bounds.tp_serial``): in every program
    of the chain (mixed degrees, every sub-batch count and ZeRO stage; the whole step of one
    micro-batch, and the first, a middle and the last of several), no two TP collectives that
    move bytes are between their starts and their waits at once in a synchronous schedule, or
    in an overlapped one without sequence parallelism and one collective in flight, so one
    begins only after the other's wait: they never run at the same time, whatever their
    groups' streams. Elsewhere they do somewhere (found here with two sub-batches or more:
    an overlapped schedule's gather opens before a neighbour's reduction is waited, and with
    two in flight overlap-recompute's recompute starts one while the backward's is open), so
    ``tp_serial`` must say no there."""
    rng = random.Random(len(schedule) + len(sp) + max_inflight)
    cfg = _model("gpt2", 3, False)
    world, names = 8, region_names(cfg)
    serial = tp_serial(schedule, sp, max_inflight)
    checked = overlapped = 0
    for _ in range(25):
        degrees = [rng.choice([1, 2, 4, 8]) for _ in names]
        if rng.random() < 0.3:  # (a degree change at every border, both ways)
            degrees = [(2, 4)[(i + rng.randrange(2)) % 2] for i in range(len(names))]
        spec = SPECS[schedule]
        subs = [n for n in (1, 2, 4) if n >= spec.min_sub and (n == 1 or spec.overlapped)]
        n_sub = rng.choice(subs[-2:] if sp else subs)
        plan = with_zero(
            ParallelPlan(
                [RegionPlan(n, t, world // t) for n, t in zip(names, degrees)],
                n_sub=n_sub,
                schedule=schedule,
                sequence_parallel=sp,
            ),
            rng.choice([0, 1, 2, 3]),
        )
        for micro, first, dp in (
            (1, True, True),
            (4, True, False),
            (4, False, False),
            (4, False, True),
        ):
            try:
                program = plan_program(
                    cfg,
                    plan,
                    world,
                    BatchShape(micro * world, world),
                    n_micro=1,
                    dp=dp,
                    first=first,
                    max_inflight=max_inflight,
                )
            except BatchSplitError:
                continue
            open_now: set[tuple] = set()
            for ins in program:
                key = (getattr(ins, "kind", None), getattr(ins, "index", None))
                if key[0] not in TP_KINDS or degrees[key[1]] == 1:
                    continue  # (at degree 1 a collective moves nothing: done at once)
                if isinstance(ins, Start):
                    overlapped += bool(open_now)
                    assert not (open_now and serial), (degrees, n_sub, ins, open_now)
                    open_now.add((*key, ins.sub))
                elif isinstance(ins, Wait):
                    open_now.discard((*key, ins.sub))
            checked += 1
    assert checked >= 50
    assert serial or overlapped or (max_inflight > 1 and schedule != "overlap-recompute" and not sp)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_each_walk_s_zero_collectives_are_the_dp_stream_s_busy_time(zero):
    """``ChainPrices.zero_walks``: at degree 1 (no TP collective, no reshard) every
    collective of a step is a ZeRO one, so the first walk's, the middle ones' and the last's
    summed over the regions are the step's communication as ``simulate_plan`` counts it (one,
    two and four micro-batches: the middle walks counted n - 2 times)."""
    cfg = _model("llama", 3, False)
    costs = _costs("paper-3090-pcie-32", cfg)
    world = 8
    for schedule, n_sub in (("megatron", 1), ("oases", 2), ("merak", 2)):
        plan = with_zero(ParallelPlan.uniform(cfg, world, 1, schedule=schedule, n_sub=n_sub), zero)
        for n_micro in (1, 2, 4):
            batch = BatchShape(world * n_micro * n_sub, world * n_sub)
            res = simulate_plan(cfg, plan, costs, world, batch, timeline=False)
            prices = chain_prices(cfg, costs, world, batch, schedule, n_sub, zero, "", [1], 1)
            first, middle, last = (z[:, 0].sum() for z in prices.zero_walks)
            walks = first if n_micro == 1 else first + (n_micro - 2) * middle + last
            assert walks == pytest.approx(res.breakdown["comm_s"], rel=1e-9), (schedule, n_micro)


def test_distinct_rows_are_numpys_unique_rows():
    """``step_bound._distinct_rows``: ``np.unique(axis=0, return_counts=True)``'s rows, order
    and counts, on tables of repeated rows (a model's blocks) at magnitudes far apart, with
    -0.0 beside 0.0 (equal rows, as numpy's record comparison has them)."""
    from oases.planner.step_bound import _distinct_rows

    rng = np.random.default_rng(3)
    for _ in range(200):
        n, width = int(rng.integers(1, 120)), int(rng.integers(1, 20))
        scale = rng.choice([1.0, 0.1, 1e9])
        base = rng.integers(0, 3, (int(rng.integers(1, 6)), width)).astype(float) * scale
        table = base[rng.integers(0, len(base), n)]
        table[rng.random(table.shape) < 0.1] *= -1.0  # (-0.0 among the zeros: equal to 0.0)
        rows, count = _distinct_rows(table)
        want_rows, want_count = np.unique(table, axis=0, return_counts=True)
        assert np.array_equal(rows, want_rows) and count.tolist() == want_count.tolist()
        if not (table == 0).any():
            assert rows.tobytes() == want_rows.tobytes()  # (no zero's sign to differ)
