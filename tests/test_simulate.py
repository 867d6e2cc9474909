"""The simulator runs the executor's programs on costs: checks against hand-computed bounds."""

import pytest

from oases.planner.simulate import StepCosts, simulate_program
from oases.schedule import SCHEDULES
from oases.schedule.program import Compute, Start, build_program

L = 3
R = 2 * L + 2


def _costs(compute_s: float, comm_s: float) -> StepCosts:
    return StepCosts(piece_s=lambda phase, kind, i: compute_s,
                     collective_s=lambda kind, i: comm_s)


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
    cheap = StepCosts(piece_s=lambda p, k, i: 0.01, collective_s=lambda k, i: 0.0,
                      recompute_body_s=lambda i: 0.004)
    n_recompute_bodies = sum(1 for c in program if isinstance(c, Compute)
                             and c.phase == "recompute" for k, _ in c.pieces if k == "body")
    a = simulate_program(program, full, commfree=True).step_s
    b = simulate_program(program, cheap, commfree=True).step_s
    assert a - b == pytest.approx(n_recompute_bodies * 0.006)


def test_timeline_has_both_lanes():
    result = simulate_program(build_program("oases", R, 2), _costs(0.01, 0.02))
    lanes = {e.lane for e in result.timeline.events}
    assert lanes == {"compute", "comm"}
    assert result.timeline.span_s() == pytest.approx(result.step_s)
