"""The memory accounting's terms (``oases.memory``, ``planner.peak_memory``, ``planner.verify``):
the DP bucket's flat copy, walked from its Start to its Wait and sized as the executor's real
copy (none for a DP group of one rank); the peak split into baseline + workspace + allocated;
a GPU's allocator peak compared with the allocated part alone, a CPU's resident peak with the
whole."""

import pytest
import torch

import oases
from oases.memory import device_baseline_bytes, peak_memory_mb, peak_reserved_mb
from oases.parallel import comm
from oases.plan import ParallelPlan, RegionPlan, region_names
from oases.planner.costs import region_kind
from oases.planner.layout import dp_bucket_bytes, dp_buckets
from oases.planner.peak_memory import ModelState, peak_memory
from oases.planner.verify import predicted_peak_bytes
from oases.schedule import build_schedule
from oases.schedule.instructions import Compute, Start, Wait

CFG = oases.ModelConfig(arch="gpt2", dim=32, n_heads=2, n_layers=2, vocab_size=64, seq_len=8)


class _Costs:
    """Costs with fixed memory terms (a profile's baseline and workspace)."""

    baseline_bytes = 1000.0
    workspace_bytes = 24.0

    def saved_bytes(self, kind, mode, t, rows):
        return 100.0


def test_peak_walk_counts_the_dp_bucket_copy_from_start_to_wait():
    program = [
        Compute("forward", (("body", 0),), 0),
        Compute("backward", (("tp", 0),), 0),
        Start("dp", 0, 0),
        Wait("dp", 0, 0),
    ]
    state = ModelState(numel=(10,), dp=(2,), stages=(0,))
    args = (CFG, program, ["embed"], [1], [4], "none", _Costs(), state, ((0,),))
    without = peak_memory(*args, {})
    with_copy = peak_memory(*args, {0: 4000.0})
    # weights 40 + Adam 80, and then: the forward's 100 bytes of activations (freed by the
    # backward), or gradients 40 (from the backward on) + the 4000-byte copy to its Wait
    assert without["allocated"] == 40 + 80 + 100
    assert with_copy["allocated"] == 40 + 80 + 40 + 4000
    for mem in (without, with_copy):
        assert mem["peak"] == mem["baseline"] + mem["workspace"] + mem["allocated"]
        assert (mem["baseline"], mem["workspace"]) == (1000.0, 24.0)


def test_dp_bucket_bytes_skip_groups_of_one_rank():
    buckets = {0: [(2, 10), (1, 5)], 1: [(1, 7)]}
    assert dp_bucket_bytes(buckets) == {0: 10 * 4, 1: 0.0}
    assert dp_bucket_bytes(buckets, 2) == {0: 10 * 2, 1: 0.0}  # reduced in bf16


def test_gpu_peak_is_compared_in_allocator_terms():
    breakdown = {"baseline_bytes": 500.0, "workspace_bytes": 0.0, "allocated_bytes": 1500.0}
    assert predicted_peak_bytes(2000.0, breakdown, "cpu") == 2000.0
    assert predicted_peak_bytes(2000.0, breakdown, "cuda") == 1500.0
    # a breakdown without the allocated term (older): the peak less baseline and workspace
    assert predicted_peak_bytes(2000.0, {"baseline_bytes": 500.0}, "cuda") == 1500.0


def test_memory_helpers_on_cpu():
    cpu = torch.device("cpu")
    assert device_baseline_bytes(cpu) == 0.0  # the resident set holds it on a CPU
    assert peak_reserved_mb(cpu) == pytest.approx(peak_memory_mb(cpu), rel=0.1)


def _plans(world):
    names = region_names(CFG)
    mixed = [2 if n.startswith("blocks.0.") else 1 for n in names]
    return {
        "uniform": ParallelPlan.uniform(CFG, world, 1),
        "mixed": ParallelPlan([RegionPlan(n, t, world // t) for n, t in zip(names, mixed)]),
    }


def _rank_bucket_copies(rank, world_size):
    """The flat copy ``gradient_mean_async`` makes per backward task, in bytes."""
    out = {}
    for key, plan in _plans(world_size).items():
        ctx = oases.init_distributed(tp=plan.tp_of("embed"), degrees=plan.degrees())
        torch.manual_seed(0)
        model = oases.parallelize(oases.build_model(CFG), ctx, plan)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        ex = build_schedule("oases", n_sub=2).executor(model)
        copies = {}
        for task, groups in ex.bucket_groups.items():
            handles = [comm.gradient_mean_async(ps, g) for g, ps in groups]
            copies[task] = float(sum(h.wait().numel() * h.result.element_size() for h in handles))
        out[key] = copies
    return out


def test_simulated_bucket_copies_match_the_executors(spawn_ranks):
    world = 2
    measured = spawn_ranks(_rank_bucket_copies, world)[0]
    for key, plan in _plans(world).items():
        kinds = [region_kind(r.name) for r in plan.regions]
        degrees = [r.tp for r in plan.regions]
        simulated = dp_bucket_bytes(dp_buckets(CFG, kinds, degrees, world))
        real = {t: b for t, b in measured[key].items() if b}
        assert {t: b for t, b in simulated.items() if b} == real, key
    assert any(
        b == 0
        for b in dp_bucket_bytes(
            dp_buckets(
                CFG,
                [region_kind(r.name) for r in _plans(world)["mixed"].regions],
                [r.tp for r in _plans(world)["mixed"].regions],
                world,
            )
        ).values()
    )
