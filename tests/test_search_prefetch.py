"""The fast search on two processes (``planner.search_prefetch``: a forked worker walks the
next chain beside the walk) gives the one-process search's every candidate, float for float,
and its every count; the worker's answers are really taken."""

from __future__ import annotations

import pytest

from oases.planner import load_costs, micro_batch_options
from oases.planner import search_prefetch as prefetch
from oases.planner.batch import BatchShape
from oases.planner.search import SearchStats, solve_plan
from test_search_exact import CASES, _model, _uniform_peaks

pytestmark = pytest.mark.skipif(
    "fork" not in prefetch.multiprocessing.get_all_start_methods(), reason="no fork here"
)


def _search(case: tuple, budget_kind: str, processes: int, monkeypatch) -> tuple:
    arch, layers, tied, world, preset, global_batch, micro, _ = case
    cfg = _model(arch, layers, tied)
    costs = load_costs(f"hw:{preset}", cfg, "bf16")
    batch = BatchShape(global_batch, micro * world)
    peaks = _uniform_peaks(cfg, costs, world, batch)
    budget = {"loose": float("inf"), "tight": peaks[0] * 1.02, "under": peaks[0] * 0.97}
    monkeypatch.setattr(prefetch, "PROCESSES", processes)
    stats = SearchStats()
    best, cands = solve_plan(
        cfg,
        costs,
        world,
        batch,
        budget[budget_kind],
        zeros=(0, 1, 2, 3),
        sps=("gathered", "shards"),
        micro_batches=micro_batch_options(batch),
        stats=stats,
    )
    seen = [
        (
            [(r.name, r.tp, r.zero) for r in c.plan.regions],
            c.plan.schedule,
            c.plan.n_sub,
            c.plan.sequence_parallel,
            c.batch,
            c.kind,
            c.fits,
            c.result.step_s,
            c.result.peak_mem_bytes,
        )
        for c in cands
    ]
    return seen, cands.index(best), stats.simulated, stats.chains, stats.skipped_chains


@pytest.mark.parametrize("index,budget_kind", [(1, "tight"), (2, "loose"), (5, "tight")])
def test_two_processes_give_the_one_process_search(index, budget_kind, monkeypatch):
    taken = []
    take = prefetch.Prefetch._take

    def counting(self, search):
        before = len(search.prefetched)
        take(self, search)
        taken.append(len(search.prefetched) - before)

    monkeypatch.setattr(prefetch.Prefetch, "_take", counting)
    one = _search(CASES[index], budget_kind, 1, monkeypatch)
    assert not taken
    two = _search(CASES[index], budget_kind, 2, monkeypatch)
    assert two == one  # every candidate (floats equal), the best, every count
    assert sum(taken) > 0  # the worker's answers were used


def test_the_walk_walks_chains_aside_while_the_worker_is_slow(monkeypatch):
    """A slow worker (each chain it walks delayed): the walk, reaching a chain the worker has
    claimed and not answered, walks the next free ones aside; the same search still."""
    import os
    import time

    main, walked = os.getpid(), []
    walk_aside = prefetch.walk_aside

    def slow(search, chain):
        if os.getpid() != main:
            time.sleep(0.2)
        else:
            walked.append(chain)
        return walk_aside(search, chain)

    monkeypatch.setattr(prefetch, "walk_aside", slow)
    one = _search(CASES[2], "tight", 1, monkeypatch)
    assert not walked
    two = _search(CASES[2], "tight", 2, monkeypatch)
    assert two == one
    assert walked  # chains walked aside by the walk's process


def test_a_process_picks_a_chain_whose_programs_it_built():
    """``Prefetch.pick``: of the next ``LOOK`` free chains guessed, the first of a ZeRO stage,
    schedule and sub-batch count this process walked (its programs built here), else the
    first; a chain the other process claimed is never taken; the one taken is claimed."""
    fetch = prefetch.Prefetch.__new__(prefetch.Prefetch)
    shape2, shape4 = BatchShape(64, 32), BatchShape(64, 16)
    order = [
        (shape2, 0, "oases", 2),
        (shape2, 1, "oases", 2),
        (shape2, 0, "merak", 2),
        (shape4, 0, "oases", 2),
        (shape4, 1, "oases", 2),
        (shape4, 0, "merak", 2),
    ]
    fetch.order, fetch.index = order, {c: i for i, c in enumerate(order)}
    fetch.claims = [prefetch.FREE] * len(order)

    def claim(chain, who):
        i = fetch.index[chain]
        if fetch.claims[i] == prefetch.FREE:
            fetch.claims[i] = who
        return fetch.claims[i] == who

    fetch.claim = claim
    fetch.walked = set()
    assert fetch.pick(iter(order), prefetch.WORKER) == order[0]  # nothing built: the first
    assert fetch.walked == {(0, "oases", 2)} and fetch.claims[0] == prefetch.WORKER
    fetch.walked = {(0, "merak", 2)}
    assert fetch.pick(iter(order), prefetch.WORKER) == order[2]  # (order[0]: claimed above)
    assert fetch.claims[2] == prefetch.WORKER
    fetch.claims[5] = prefetch.MAIN  # (the other process's: never taken)
    assert fetch.pick(iter(order), prefetch.WORKER) == order[1]
    fetch.claims = [prefetch.FREE] * len(order)
    far = [order[1], order[3], order[4], order[0], order[5]]  # beyond LOOK: the first
    assert prefetch.LOOK == 4 and fetch.pick(iter(far), prefetch.WORKER) == order[1]
    # the other process claims the free ones it looked at meanwhile: the scan goes on
    fetch.claims = [prefetch.FREE] * len(order)
    racing = iter(order)
    fetch.claim = lambda chain, who: fetch.index[chain] >= 4 and claim(chain, who)
    assert fetch.pick(racing, prefetch.WORKER) == order[4]
