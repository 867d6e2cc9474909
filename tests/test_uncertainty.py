"""``oases simulate --uncertainty``: every prediction with its range over the uncertain inputs
(planner/uncertainty.py), in the table and in simulate.json."""

from __future__ import annotations

import dataclasses
import json

import pytest

from oases.plan import ParallelPlan
from oases.planner.batch import BatchShape
from oases.planner.clusters import get_cluster
from oases.planner.models import MODELS
from oases.planner.uncertainty import INPUTS, input_bounds, perturb, simulate_ranges

CFG = dataclasses.replace(MODELS["paper-h2048-l24"], n_layers=2)
NVLINK = get_cluster("paper-3090-nvlink-32")


def rows(cfg=CFG, world=32):
    batch = BatchShape(64, 32)
    return [
        (ParallelPlan.uniform(cfg, world, 4, schedule="megatron-recompute", n_sub=1), batch),
        (ParallelPlan.uniform(cfg, world, 4, schedule="oases", n_sub=2), batch),
        (ParallelPlan.uniform(cfg, world, 2, schedule="oases", n_sub=2), batch),
    ]


def test_every_input_states_its_bounds_and_why():
    for inp in INPUTS:
        assert inp.why and inp.low <= 1.0 <= inp.high
    bounds = input_bounds(NVLINK)
    assert set(bounds) == {i.name for i in INPUTS}
    assert bounds["server link efficiency"] == (0.5, 1.25)  # host-staged: wide
    assert input_bounds(get_cluster("a100-ib-64"))["server link efficiency"] == (0.9, 1.05)
    assert input_bounds(get_cluster("a100-ib-64"))["inter-server rate"] == (0.9, 1.02)
    one = input_bounds(get_cluster("rtx3090-pcie"))  # no bridges, no servers to join
    assert "pair link efficiency" not in one and "inter-server rate" not in one
    with pytest.raises(ValueError, match="enclose"):
        input_bounds(NVLINK, {"matmul efficiency": (1.1, 1.2)})
    with pytest.raises(ValueError, match="unknown input"):
        input_bounds(NVLINK, {"memory": (0.5, 1.0)})


def test_perturb_scales_one_input_and_caps_efficiencies():
    slow = perturb(NVLINK, "server link efficiency", 0.5)
    assert slow.server.link.effective_bytes_per_s == pytest.approx(
        NVLINK.server.link.effective_bytes_per_s / 2
    )
    assert slow.server.link.duplex_bytes_per_s == pytest.approx(
        NVLINK.server.link.duplex_bytes_per_s / 2
    )
    assert slow.server.pair_link == NVLINK.server.pair_link and slow.inter_link == NVLINK.inter_link
    fast = perturb(NVLINK, "matmul efficiency", 2.0)
    assert fast.server.gpu.matmul_efficiency == 1.0
    port = perturb(NVLINK, "inter-server rate", 0.5).inter_link
    assert port.effective_bytes_per_s == pytest.approx(NVLINK.inter_link.effective_bytes_per_s / 2)


def test_ranges_contain_the_point_estimate():
    from oases.planner.hardware import HardwareCosts
    from oases.planner.simulate import simulate_plan

    ranges = simulate_ranges(CFG, NVLINK, rows())
    costs = HardwareCosts(NVLINK, CFG)
    points = [
        simulate_plan(CFG, plan, costs, 32, batch, timeline=False).step_s for plan, batch in rows()
    ]
    for i, (r, step) in enumerate(zip(ranges, points)):
        lo, hi = r.step_s
        assert lo < step < hi, (i, r.step_s, step)  # every input moves a step
        tokens = 64 * CFG.seq_len / step
        assert r.tokens_per_s[0] < tokens < r.tokens_per_s[1]
        speed = points[0] / step
        assert r.speedup[0] <= speed <= r.speedup[1]
        assert r.most_sensitive in r.by_input
    assert ranges[0].speedup == (1.0, 1.0)
    # the overlapped schedule hides communication, so slower links widen the gap to megatron
    assert ranges[1].speedup[0] < ranges[1].speedup[1]


def test_a_wider_bound_gives_a_wider_range():
    narrow = simulate_ranges(CFG, NVLINK, rows())
    wide = simulate_ranges(
        CFG,
        NVLINK,
        rows(),
        bounds=input_bounds(
            NVLINK, {"matmul efficiency": (0.6, 1.1), "inter-server rate": (0.25, 1.3)}
        ),
    )
    for a, b in zip(narrow, wide):
        assert b.step_s[1] > a.step_s[1] and b.step_s[0] <= a.step_s[0] + 1e-12
        assert b.tokens_per_s[0] < a.tokens_per_s[0]
    assert wide[2].speedup[1] - wide[2].speedup[0] >= narrow[2].speedup[1] - narrow[2].speedup[0]


def test_simulate_prints_and_writes_the_ranges(capsys, tmp_path):
    from oases.cli import main

    code = main(
        [
            "simulate",
            "--model",
            "paper-h1024-l24",
            "--cluster",
            "paper-3090-nvlink-32",
            "--schedules",
            "megatron-recompute@tp=4,oases@tp=4",
            "--micro-batch",
            "4",
            "--micro-batch-tp",
            "4",
            "--global-batch",
            "64",
            "--uncertainty",
            "--out",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "tokens/s range" in out and "moves it most" in out and "x0.5-1.25" in out
    data = json.loads((tmp_path / "simulate.json").read_text())
    assert set(data["uncertain_inputs"]) == {i.name for i in INPUTS}
    for row in data["rows"]:
        u = row["uncertainty"]
        assert u["tokens_per_s"][0] <= row["tokens_per_s"] <= u["tokens_per_s"][1]
        assert u["speedup"][0] <= row["speedup"] <= u["speedup"][1]
        assert u["most_sensitive"] in data["uncertain_inputs"]
