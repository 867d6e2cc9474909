"""ZeRO's collectives on gloo and what the memory walk counts of them (issue 14, 2026-12-02):

- the reduce-scatter runs as one all-to-all and a local sum (gloo's own moves an all-reduce's
  bytes); its result equals the all-reduce's slice in float64, in both the async (ZeRO) and the
  blocking (sequence-parallel, profile) forms, and its handle has a future, so timelines see
  it complete without a polling thread;
- the stages 1-2 gather of the updated weights happens at the next step's head: after
  ``ZeroAdamW.step`` the other ranks' parts are stale until the next step or
  ``materialized`` gathers them;
- the memory walk counts the profile's measured workspace and gloo's all-gather buffer.
"""

from __future__ import annotations

import copy

import pytest
import torch

from distributed import run_ranks
from oases.parallel import comm
from oases.parallel.context import init_distributed


def _rank_scatter(rank: int, world: int) -> dict:
    ctx = init_distributed(tp=world)
    g = ctx.tp_group
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(world * 6, 3, generator=gen, dtype=torch.float64)
    want = x.clone()
    comm.all_reduce_(want, g)
    mine = want.chunk(world)[rank]
    blocking = comm.reduce_scatter(x.clone(), g)
    flat = x.reshape(-1).clone()
    handle = comm.reduce_scatter_async(flat, g, tag="rs")
    fired = []
    handle.on_complete(lambda: fired.append(True))
    has_future = True
    try:
        handle._work.get_future()
    except RuntimeError:
        has_future = False
    got = handle.wait()
    return {
        "blocking": torch.equal(blocking, mine) or (blocking - mine).abs().max().item(),
        "async": (got - mine.reshape(-1)).abs().max().item(),
        "shape": tuple(got.shape),
        "future": has_future,
        "fired": bool(fired),
        "input_kept": torch.equal(flat, x.reshape(-1)),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_reduce_scatter_is_the_all_reduce_slice(tmp_path, world):
    for rank, r in enumerate(run_ranks(_rank_scatter, world, tmp_path)):
        # the sums of `world` float64 terms in rank order: equal up to the order of addition
        assert r["blocking"] is True or r["blocking"] < 1e-12, (rank, r)
        assert r["async"] < 1e-12, (rank, r)
        assert r["shape"] == (6 * 3,)
        assert r["future"] and r["fired"], r  # no polling thread needed for timelines
        assert r["input_kept"]  # the all-to-all reads its input; nothing writes it


def _rank_stale(rank: int, world: int) -> dict:
    import oases
    from oases.parallel.shard import materialized, shard_model
    from oases.schedule import build_schedule
    from oases.train.optim import build_optimizer
    from test_mixed_plans import layout_rows
    from test_zero import TRAIN, _batches, _cfg

    ctx = oases.init_distributed(tp=1)
    torch.manual_seed(0)
    base = oases.build_model(_cfg()).double()
    model = oases.parallelize(copy.deepcopy(base), ctx)
    shards = shard_model(model, 1)
    opt = build_optimizer(model, TRAIN)
    sched = build_schedule("oases", n_sub=2)
    tokens, targets = _batches()[0]
    x, y = layout_rows(tokens, rank, world, 1), layout_rows(targets, rank, world, 1)
    sched.step(model, x, y)
    opt.step()
    u = next(iter(shards.units.values()))
    other = (1 - rank) * u.shard_numel  # the other rank's part of the flat buffer
    stale = u.flat[other : other + u.shard_numel].clone()
    out = {"marked": not u.gathered}
    with materialized(model):
        fresh = u.flat[other : other + u.shard_numel].clone()
    out["changed"] = not torch.equal(stale, fresh)
    out["gathered_after"] = u.gathered
    return out


def test_stage1_weights_are_stale_between_steps_until_gathered(tmp_path):
    """The optimizer updates only this rank's shard; ``materialized`` (and the next step's
    program) gathers the others' updated shards."""
    for r in run_ranks(_rank_stale, 2, tmp_path):
        assert r == {"marked": True, "changed": True, "gathered_after": True}


def test_the_memory_walk_counts_the_workspace_and_gloo_gather_copies():
    """A profile's measured workspace adds to the peak as is; gloo's all-gather buffer adds to
    the peak of a stage-3 plan (an output-size copy from each gather's Start to its Wait)."""
    from oases.bench.memory_suite import _NoTime
    from oases.config import load_config
    from oases.plan import ParallelPlan
    from oases.planner.batch import BatchShape
    from oases.planner.search import with_zero
    from oases.planner.simulate import simulate_plan

    cfg = load_config("configs/bench.toml", ["--parallel.tp=1"]).model

    class Gloo:
        baseline_bytes = 0.0
        workspace_bytes = 0.0
        reduce_scatter_copies_input = True
        all_gather_copies_output = False

    def peak(zero: int, **attrs: object) -> float:
        costs = Gloo()
        for k, v in attrs.items():
            setattr(costs, k, v)
        plan = with_zero(ParallelPlan.uniform(cfg, 2, 1, schedule="oases", n_sub=2), zero)
        return simulate_plan(
            cfg, plan, _NoTime(costs), 2, BatchShape(8, 8), timeline=False
        ).peak_mem_bytes

    assert peak(0, workspace_bytes=13e6) - peak(0) == pytest.approx(13e6)
    assert peak(3, all_gather_copies_output=True) > peak(3)
    assert peak(0, all_gather_copies_output=True) == peak(0)  # stage 0 gathers nothing


def test_one_sub_batch_is_priced_with_the_synchronous_pieces():
    """An overlapped schedule cut into one sub-batch overlaps no TP collective: the simulator
    asks for pieces timed as the synchronous schedules run them (overlapped=False), and for
    overlapped ones from two sub-batches on."""
    from oases.config import load_config
    from oases.plan import ParallelPlan
    from oases.planner.batch import BatchShape
    from oases.planner.simulate import simulate_plan

    cfg = load_config("configs/bench.toml", ["--parallel.tp=1"]).model

    class Asked:
        measures_overlap = True

        def __init__(self) -> None:
            self.flags: set[bool] = set()

        def compute_s(self, kind, phase, piece, tp, rows, overlapped=False):  # noqa: ANN001
            self.flags.add(overlapped)
            return 1e-3

        def collective_s(self, *args: object) -> float:
            return 0.0

    for k, want in ((1, {False}), (2, {True})):
        costs = Asked()
        simulate_plan(
            cfg,
            ParallelPlan.uniform(cfg, 2, 1, schedule="oases", n_sub=k),
            costs,
            2,
            BatchShape(8, 8),
            timeline=False,
        )
        assert costs.flags == want, k
