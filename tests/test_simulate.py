"""The simulator runs the executor's programs on costs: checks against hand-computed bounds."""

import pytest

from oases.planner.event_walk import StepCosts, simulate_program
from oases.schedule import SCHEDULES
from oases.schedule.instructions import Compute, Start
from oases.schedule.program import build_program

L = 3
R = 2 * L + 2


def _costs(compute_s: float, comm_s: float) -> StepCosts:
    return StepCosts(piece_s=lambda phase, kind, i: compute_s, collective_s=lambda kind, i: comm_s)


def _sums(program, compute_s, comm_s):
    n_pieces = sum(len(c.pieces) for c in program if isinstance(c, Compute))
    n_coll = sum(1 for c in program if isinstance(c, Start))
    return n_pieces * compute_s, n_coll * comm_s


@pytest.mark.parametrize("name", ["megatron", "megatron-recompute", "commfree-recompute"])
def test_synchronous_schedules_add_compute_and_comm(name):
    program = build_program(name, R, 2)
    result = simulate_program(program, _costs(0.01, 0.03))
    compute, comm = _sums(program, 0.01, 0.03)
    assert result.step_s == pytest.approx(compute + comm)
    assert result.compute_busy_s == pytest.approx(compute)
    assert result.comm_busy_s == pytest.approx(comm)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("n_sub", [1, 2, 4])
def test_step_lies_between_the_limit_and_the_sum(name, n_sub):
    program = build_program(name, R, n_sub, dp_tasks=(0, 3))
    result = simulate_program(program, _costs(0.01, 0.025))
    compute, comm = _sums(program, 0.01, 0.025)
    assert max(compute, comm) - 1e-12 <= result.step_s <= compute + comm + 1e-12


@pytest.mark.parametrize("name", SCHEDULES)
def test_free_communication_leaves_only_compute(name):
    program = build_program(name, R, 2)
    result = simulate_program(program, _costs(0.01, 0.0))
    compute, _ = _sums(program, 0.01, 0.0)
    assert result.step_s == pytest.approx(compute)


def test_overlap_hides_most_communication():
    """Two sub-batches, comm a bit longer than compute: the forward is comm-bound, so the step
    is close to all communication plus the exposed first compute, far below the sum."""
    program = build_program("overlap", R, 2)
    result = simulate_program(program, _costs(0.01, 0.012))
    compute, comm = _sums(program, 0.01, 0.012)
    assert result.step_s < 0.8 * (compute + comm)


def test_commfree_recompute_uses_the_cheaper_body():
    program = build_program("oases", R, 2)
    full = StepCosts(piece_s=lambda p, k, i: 0.01, collective_s=lambda k, i: 0.0)
    cheap = StepCosts(
        piece_s=lambda p, k, i: 0.01,
        collective_s=lambda k, i: 0.0,
        recompute_body_s=lambda i: 0.004,
    )
    n_recompute_bodies = sum(
        1
        for c in program
        if isinstance(c, Compute) and c.phase == "recompute"
        for k, _ in c.pieces
        if k == "body"
    )
    a = simulate_program(program, full, commfree=True).step_s
    b = simulate_program(program, cheap, commfree=True).step_s
    assert a - b == pytest.approx(n_recompute_bodies * 0.006)


def test_timeline_has_both_lanes():
    result = simulate_program(build_program("oases", R, 2), _costs(0.01, 0.02))
    lanes = {e.lane for e in result.timeline.events}
    assert lanes == {"compute", "comm"}
    assert result.timeline.span_s() == pytest.approx(result.step_s)


def test_compute_beside_a_collective_is_slowed_by_its_contention():
    """Contention (a profile's measured slowdown of compute while a collective is in flight):
    a compute that starts with a collective in flight advances at 1/f of its rate until the
    collective ends. Hand-computed: compute pieces of 1 s, an all-reduce of 0.5 s started
    before the second piece, f = 2: the second piece takes 0.5 s (0.25 s of work at half rate)
    + 0.75 s = 1.25 s. No slowdown (f = 1, or none given) leaves the step as it was."""
    from oases.planner.event_walk import _stretched
    from oases.schedule.instructions import Wait

    program = [
        Compute("forward", (("body", 0),), 0),
        Start("fwd", 0),
        Compute("forward", (("body", 1),), 0),
        Wait("fwd", 0),
    ]
    base = StepCosts(piece_s=lambda p, k, i: 1.0, collective_s=lambda k, i: 0.5)
    slowed = StepCosts(
        piece_s=lambda p, k, i: 1.0, collective_s=lambda k, i: 0.5, slowdown=lambda kind: 2.0
    )
    even = StepCosts(
        piece_s=lambda p, k, i: 1.0, collective_s=lambda k, i: 0.5, slowdown=lambda kind: 1.0
    )
    assert simulate_program(program, base).step_s == pytest.approx(2.0)
    assert simulate_program(program, even).step_s == pytest.approx(2.0)
    assert simulate_program(program, slowed).step_s == pytest.approx(2.25)
    # the largest factor in flight sets the rate; work left after every flight runs at full rate
    assert _stretched(0.0, 1.0, [(0.0, 1.0, 2.0), (0.5, 1.0, 4.0)]) == pytest.approx(
        0.5 + 0.5 + 0.625
    )
    assert _stretched(2.0, 1.0, [(0.0, 1.0, 3.0)]) == pytest.approx(1.0)  # already over
    for name in SCHEDULES:  # never faster than without contention, never slower than f times
        prog = build_program(name, R, 2, dp_tasks=(0, 3))
        plain = simulate_program(prog, _costs(0.01, 0.02)).step_s
        s = StepCosts(
            piece_s=lambda p, k, i: 0.01, collective_s=lambda k, i: 0.02, slowdown=lambda kind: 1.5
        )
        slow = simulate_program(prog, s).step_s
        assert plain - 1e-12 <= slow <= 1.5 * plain + 1e-12, name


def test_a_collective_under_compute_is_slowed_until_the_compute_stream_waits_for_it():
    """comm_slowdown g (a profile's measured slowdown of a collective while compute runs): a
    collective runs at 1/g of its rate while the compute stream computes and at its full rate
    once the compute stream waits for it. Hand-computed with a collective of 1 s and g = 2:
    issued and waited at once, 1 s; under a compute of 0.5 s, 0.25 s of it is done by then and
    0.75 s is left at full rate (step 1.25 s); under a compute of 3 s it is done at 2 s, hidden
    (step 3 s). A second collective queued behind it on the same stream starts when it ends
    and runs beside the compute that follows the wait."""
    from oases.schedule.instructions import Wait

    def costs(comm_s, g):
        return StepCosts(
            piece_s=lambda p, k, i: 0.5 if i == 0 else 3.0,
            collective_s=lambda k, i: comm_s,
            comm_slowdown=lambda kind: g,
        )

    at_once = [Start("fwd", 0), Wait("fwd", 0)]
    assert simulate_program(at_once, costs(1.0, 2.0)).step_s == pytest.approx(1.0)
    short = [Start("fwd", 0), Compute("forward", (("body", 0),), 0), Wait("fwd", 0)]
    res = simulate_program(short, costs(1.0, 2.0))
    assert res.step_s == pytest.approx(1.25)
    assert res.exposed_s["tp"] == pytest.approx(0.75)
    (comm,) = [e for e in res.timeline.events if e.lane == "comm"]
    assert (comm.start_s, comm.end_s) == (pytest.approx(0.0), pytest.approx(1.25))
    long = [Start("fwd", 0), Compute("forward", (("body", 1),), 0), Wait("fwd", 0)]
    assert simulate_program(long, costs(1.0, 2.0)).step_s == pytest.approx(3.0)
    assert simulate_program(short, costs(1.0, 1.0)).step_s == pytest.approx(1.0)
    queued = [
        Start("fwd", 0),
        Start("fwd", 1),
        Compute("forward", (("body", 0),), 0),
        Wait("fwd", 0),
        Compute("forward", (("body", 1),), 0),
        Wait("fwd", 1),
    ]
    # fwd 0 ends at 1.25; fwd 1 then runs 1 s x 2 beside the 3 s compute: ends at 3.25 < 4.25
    res = simulate_program(queued, costs(1.0, 2.0))
    assert res.step_s == pytest.approx(4.25)
    second = next(e for e in res.timeline.events if e.name == "fwd AR 1")
    assert (second.start_s, second.end_s) == (pytest.approx(1.25), pytest.approx(3.25))
    for name in SCHEDULES:  # never faster than without, never slower than g times the comm
        prog = build_program(name, R, 2, dp_tasks=(0, 3))
        plain = simulate_program(prog, _costs(0.01, 0.02))
        s = StepCosts(
            piece_s=lambda p, k, i: 0.01,
            collective_s=lambda k, i: 0.02,
            comm_slowdown=lambda kind: 3.0,
        )
        slow = simulate_program(prog, s).step_s
        assert plain.step_s - 1e-12 <= slow <= plain.step_s + 2 * plain.comm_busy_s + 1e-12, name


def test_a_profile_keeps_its_contention_and_an_older_one_has_none(tmp_path):
    import json

    from oases.planner.profile import Profile

    p = Profile(
        {"arch": "gpt2"},
        {"backend": "gloo"},
        contention_factors={"all_reduce": 1.4},
        comm_contention_factors={"all_gather": 1.7},
    )
    p.save(tmp_path / "p.json")
    q = Profile.load(tmp_path / "p.json")
    assert q.contention("all_reduce") == 1.4 and q.contention("all_gather") == 1.0
    assert q.comm_contention("all_gather") == 1.7 and q.comm_contention("all_reduce") == 1.0
    raw = json.loads((tmp_path / "p.json").read_text())
    del raw["contention"], raw["comm_contention"]
    (tmp_path / "old.json").write_text(json.dumps(raw))
    assert Profile.load(tmp_path / "old.json").contention("all_reduce") == 1.0
    assert Profile.load(tmp_path / "old.json").comm_contention("all_gather") == 1.0
    raw["contention"] = ["all_reduce", 1.4]  # not a mapping: one clear error
    (tmp_path / "bad.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="malformed profile"):
        Profile.load(tmp_path / "bad.json")
