"""Schedule programs as data: well-formed Start/Wait pairs, dependencies, overlap order, recompute.

Single process, no tensors: every check reads the instruction list that ``build_program`` makes.
Chain of R = 2L + 2 regions: 0 embedding, 2l+1 / 2l+2 block l's attention / MLP, R-1 the head.
"""

from __future__ import annotations

import itertools

import pytest

from oases.schedule import SCHEDULES, build_schedule
from oases.schedule.instructions import Compute, Start, Wait
from oases.schedule.program import build_program
from oases.schedule.specs import SPECS, sub_batches

N_SUBS = (1, 2, 3)
LAYERS = (1, 2, 3)
N_MICROS = (1, 2)
RECOMPUTE_NAMES = ("megatron-recompute", "commfree-recompute", "overlap-recompute", "oases")
COMMFREE_NAMES = ("commfree-recompute", "oases")
BLOCK_RECOMPUTE_NAMES = ("megatron-recompute", "overlap-recompute")


def _program(
    name: str, n_layers: int, n_sub: int, n_micro: int = 1, max_inflight: int = 1, dp: bool = True
) -> list:
    R = 2 * n_layers + 2
    dp_tasks = (0, 1, R - 2, R - 1) if dp else ()
    return build_program(
        name,
        R,
        n_sub,
        n_micro=n_micro,
        max_inflight=max_inflight,
        dp_tasks=tuple(sorted(set(dp_tasks))),
    )


CASES = list(itertools.product(SCHEDULES, N_SUBS, LAYERS, N_MICROS, (1, 2)))
CASE_IDS = [f"{n}-k{k}-L{nl}-m{m}-if{i}" for n, k, nl, m, i in CASES]
CASE_ARGS = ("name", "n_sub", "n_layers", "n_micro", "inflight")


def _key(ins) -> tuple:
    return (ins.kind, ins.index, ins.sub)


def _pairs(program: list) -> dict[int, int]:
    """Start position -> position of its Wait; asserts every Start is waited exactly once."""
    open_: dict[tuple, int] = {}
    pairs: dict[int, int] = {}
    for pos, ins in enumerate(program):
        if isinstance(ins, Start):
            assert _key(ins) not in open_, f"{ins} started again at {pos} before being waited"
            open_[_key(ins)] = pos
        elif isinstance(ins, Wait):
            assert _key(ins) in open_, f"{ins} at {pos} waits a collective that is not open"
            pairs[open_.pop(_key(ins))] = pos
    assert not open_, f"never waited: {sorted(open_)}"
    return pairs


def _latest_wait_before(program: list, pos: int, key: tuple, pairs: dict[int, int]) -> int | None:
    """Position of the Wait of the most recent Start of ``key`` before ``pos`` (None if none)."""
    starts = [p for p in range(pos) if isinstance(program[p], Start) and _key(program[p]) == key]
    return pairs[starts[-1]] if starts else None


# ------------------------------------------------------------------------------- well-formed


@pytest.mark.parametrize(CASE_ARGS, CASES, ids=CASE_IDS)
def test_every_start_has_exactly_one_later_wait(name, n_sub, n_layers, n_micro, inflight):
    program = _program(name, n_layers, n_sub, n_micro, inflight)
    pairs = _pairs(program)
    for s, w in pairs.items():
        assert s < w
    waits = [i for i in program if isinstance(i, Wait)]
    starts = [i for i in program if isinstance(i, Start)]
    assert len(waits) == len(starts)


@pytest.mark.parametrize(CASE_ARGS, CASES, ids=CASE_IDS)
def test_at_most_max_inflight_tp_collectives_open(name, n_sub, n_layers, n_micro, inflight):
    program = _program(name, n_layers, n_sub, n_micro, inflight)
    open_: set[tuple] = set()
    peak = 0
    for ins in program:
        if isinstance(ins, Start) and ins.kind in ("fwd", "bwd"):
            open_.add(_key(ins))
        elif isinstance(ins, Wait) and ins.kind in ("fwd", "bwd"):
            open_.discard(_key(ins))
        assert len(open_) <= inflight, f"{sorted(open_)} open at once (max_inflight={inflight})"
        peak = max(peak, len(open_))
    # the knob is used: with overlap and more than one sub-batch the limit is reached
    if SPECS[name].overlapped and n_sub > 1:
        assert peak == inflight


@pytest.mark.parametrize(CASE_ARGS, CASES, ids=CASE_IDS)
def test_computes_come_after_the_wait_of_their_reduced_input(
    name, n_sub, n_layers, n_micro, inflight
):
    """Forward/recompute ("epi", i) of sub j reads all-reduce(p_i): the Wait("fwd", i, j) of the
    latest Start("fwd", i, j) precedes it. Backward ("norm", i) of sub j reads the reduced dh_i:
    the Wait("bwd", i, j) of the latest Start("bwd", i, j) precedes it."""
    program = _program(name, n_layers, n_sub, n_micro, inflight)
    pairs = _pairs(program)
    checked = 0
    for pos, ins in enumerate(program):
        if not isinstance(ins, Compute):
            continue
        for kind, i in ins.pieces:
            if ins.phase in ("forward", "recompute") and kind == "epi":
                need = ("fwd", i, ins.sub)
            elif ins.phase == "backward" and kind == "norm":
                need = ("bwd", i, ins.sub)
            else:
                continue
            wait_pos = _latest_wait_before(program, pos, need, pairs)
            assert wait_pos is not None, f"{ins} at {pos}: no Start{need} before it"
            assert wait_pos < pos, f"{ins} at {pos} runs before Wait{need} at {wait_pos}"
            checked += 1
    assert checked > 0


@pytest.mark.parametrize(CASE_ARGS, CASES, ids=CASE_IDS)
def test_every_piece_runs_once_per_sub_batch_and_dp_reductions(
    name, n_sub, n_layers, n_micro, inflight
):
    R = 2 * n_layers + 2
    program = _program(name, n_layers, n_sub, n_micro, inflight)
    k = sub_batches(name, n_sub)
    subs = range(n_micro * k)
    expect_fwd = sorted([("body", i) for i in range(R)] + [("epi", i) for i in range(R - 1)])
    expect_bwd = sorted(
        [("tp", i) for i in range(R)]
        + [("epi", i) for i in range(R - 1)]
        + [("norm", i) for i in range(1, R)]
    )
    for j in subs:
        fwd = sorted(
            p
            for c in program
            if isinstance(c, Compute) and c.sub == j and c.phase == "forward"
            for p in c.pieces
        )
        bwd = sorted(
            p
            for c in program
            if isinstance(c, Compute) and c.sub == j and c.phase == "backward"
            for p in c.pieces
        )
        assert fwd == expect_fwd, f"sub {j}"
        assert bwd == expect_bwd, f"sub {j}"
        # backward of sub j only after its forward
        positions = [p for p, c in enumerate(program) if isinstance(c, Compute) and c.sub == j]
        phases = [program[p].phase for p in positions]
        last_fwd = max(p for p, ph in zip(positions, phases) if ph == "forward")
        first_bwd = min(p for p, ph in zip(positions, phases) if ph != "forward")
        assert last_fwd < first_bwd
    assert not any(isinstance(c, Compute) and c.sub >= n_micro * k for c in program)
    has_recompute = any(isinstance(c, Compute) and c.phase == "recompute" for c in program)
    assert has_recompute == (name in RECOMPUTE_NAMES)

    # data-parallel reductions: one Start per bucket after its last backward task, all waited
    # at the end, after every compute
    dp_tasks = sorted({0, 1, R - 2, R - 1})
    dp_starts = [(p, c) for p, c in enumerate(program) if isinstance(c, Start) and c.kind == "dp"]
    assert sorted(c.index for _, c in dp_starts) == dp_tasks
    last_compute = max(p for p, c in enumerate(program) if isinstance(c, Compute))
    for pos, start in dp_starts:
        closing = [
            p
            for p, c in enumerate(program)
            if isinstance(c, Compute) and c.phase == "backward" and ("tp", start.index) in c.pieces
        ]
        assert pos > max(closing), f"{start} before the last backward of its task"
    for p, c in enumerate(program):
        if isinstance(c, Wait) and c.kind == "dp":
            assert p > last_compute, f"{c} at {p} waited before the last compute"
    assert not any(
        isinstance(c, Start) and c.kind == "dp"
        for c in _program(name, n_layers, n_sub, n_micro, inflight, dp=False)
    )


# ------------------------------------------------------------------------------------ overlap


@pytest.mark.parametrize("inflight", (1, 2))
@pytest.mark.parametrize("n_layers", LAYERS)
def test_oases_issues_sub_a_collective_before_sub_b_compute_and_waits_after(n_layers, inflight):
    """n_sub=2: for every TP region i (0 < i < R-1), sub-batch 0's collective is in flight
    while sub-batch 1 computes that region: forward around the Compute holding ("body", i),
    backward around the Compute holding ("tp", i)."""
    R = 2 * n_layers + 2
    for n_micro in N_MICROS:
        program = _program("oases", n_layers, 2, n_micro, inflight)
        pos = {}
        for p, ins in enumerate(program):
            if isinstance(ins, (Start, Wait)):
                pos[type(ins).__name__, *_key(ins)] = p
        for m in range(n_micro):
            a, b = 2 * m, 2 * m + 1
            for i in range(1, R - 1):
                (fwd_b,) = [
                    p
                    for p, c in enumerate(program)
                    if isinstance(c, Compute)
                    and c.phase == "forward"
                    and c.sub == b
                    and ("body", i) in c.pieces
                ]
                assert pos["Start", "fwd", i, a] < fwd_b < pos["Wait", "fwd", i, a], (
                    f"forward region {i}: fwd AR of sub {a} does not span sub {b}'s compute"
                )
                (bwd_b,) = [
                    p
                    for p, c in enumerate(program)
                    if isinstance(c, Compute)
                    and c.phase == "backward"
                    and c.sub == b
                    and ("tp", i) in c.pieces
                ]
                assert pos["Start", "bwd", i, a] < bwd_b < pos["Wait", "bwd", i, a], (
                    f"backward region {i}: bwd AR of sub {a} does not span sub {b}'s compute"
                )


@pytest.mark.parametrize(
    "name",
    (
        "megatron",
        "megatron-recompute",
        "commfree-recompute",
    ),
)
def test_non_overlapped_schedules_are_synchronous(name):
    """One sub-batch whatever n_sub says, and every Start is waited before the next compute."""
    for n_sub in N_SUBS:
        assert sub_batches(name, n_sub) == 1
        program = _program(name, 2, n_sub)
        assert {c.sub for c in program if isinstance(c, Compute)} == {0}
        for p, ins in enumerate(program):
            if isinstance(ins, Start) and ins.kind != "dp":
                nxt = next(c for c in program[p + 1 :] if not isinstance(c, Start))
                assert nxt == Wait(ins.kind, ins.index, ins.sub), f"{ins} at {p} overlaps"


# ---------------------------------------------------------------------------------- recompute


def _fwd_starts_after_first_backward(program: list) -> dict[int, list[int]]:
    """Per sub-batch j: region indices of fwd Starts issued after sub j's first
    recompute/backward Compute (i.e. forward collectives repeated by the recompute)."""
    first: dict[int, int] = {}
    for p, c in enumerate(program):
        if isinstance(c, Compute) and c.phase != "forward":
            first.setdefault(c.sub, p)
    out: dict[int, list[int]] = {j: [] for j in first}
    for p, c in enumerate(program):
        if isinstance(c, Start) and c.kind == "fwd" and p > first[c.sub]:
            out[c.sub].append(c.index)
    return out


@pytest.mark.parametrize("n_micro", N_MICROS)
@pytest.mark.parametrize("n_sub", N_SUBS)
@pytest.mark.parametrize("n_layers", LAYERS)
@pytest.mark.parametrize("name", COMMFREE_NAMES)
def test_commfree_recompute_issues_no_forward_collective(name, n_layers, n_sub, n_micro):
    R = 2 * n_layers + 2
    program = _program(name, n_layers, n_sub, n_micro)
    repeated = _fwd_starts_after_first_backward(program)
    assert all(not v for v in repeated.values()), repeated
    # for a single micro-batch: nothing "fwd" is started once any backward compute has run
    program1 = _program(name, n_layers, n_sub, 1)
    first_bwd = min(
        p for p, c in enumerate(program1) if isinstance(c, Compute) and c.phase == "backward"
    )
    assert not any(isinstance(c, Start) and c.kind == "fwd" for c in program1[first_bwd:])
    # the recompute pieces: [epi i-1, body i] for every block region (not the embedding, and not
    # the head, whose recompute would repeat the cross-entropy's collectives), per sub-batch
    k = sub_batches(name, n_sub)
    for j in range(n_micro * k):
        pieces = sorted(
            c.pieces
            for c in program
            if isinstance(c, Compute) and c.phase == "recompute" and c.sub == j
        )
        assert pieces == sorted((("epi", i - 1), ("body", i)) for i in range(1, R - 1))


@pytest.mark.parametrize("n_micro", N_MICROS)
@pytest.mark.parametrize("n_sub", N_SUBS)
@pytest.mark.parametrize("n_layers", LAYERS)
@pytest.mark.parametrize("name", BLOCK_RECOMPUTE_NAMES)
def test_block_recompute_repeats_both_forward_collectives_per_block(name, n_layers, n_sub, n_micro):
    program = _program(name, n_layers, n_sub, n_micro)
    repeated = _fwd_starts_after_first_backward(program)
    k = sub_batches(name, n_sub)
    assert sorted(repeated) == list(range(n_micro * k))
    for j, regions in repeated.items():
        assert len(regions) == 2 * n_layers, (j, regions)  # 2 per block per sub-batch
        assert sorted(regions) == list(range(1, 2 * n_layers + 1)), (j, regions)


@pytest.mark.parametrize("name", ("megatron", "overlap"))
def test_no_recompute_schedules_repeat_nothing(name):
    program = _program(name, 2, 2)
    assert not any(isinstance(c, Compute) and c.phase == "recompute" for c in program)
    assert all(not v for v in _fwd_starts_after_first_backward(program).values())


# -------------------------------------------------------------------------------------- errors


def test_unknown_schedule_name_lists_the_valid_ones():
    with pytest.raises(ValueError) as err:
        build_program("zero-bubble", 6, 2)
    for name in SCHEDULES:
        assert name in str(err.value)
    with pytest.raises(ValueError) as err:
        build_schedule("zero-bubble")
    for name in SCHEDULES:
        assert name in str(err.value)


def test_schedules_are_the_six_named_ones():
    assert set(SCHEDULES) == {
        "megatron",
        "megatron-recompute",
        "commfree-recompute",
        "overlap",
        "overlap-recompute",
        "oases",
    }


@pytest.mark.parametrize("bad", [dict(n_sub=0), dict(max_inflight=0), dict(n_micro=0)])
def test_non_positive_knobs_raise(bad):
    kwargs = dict(n_sub=2, n_micro=1, max_inflight=1) | bad
    n_sub = kwargs.pop("n_sub")
    with pytest.raises(ValueError):
        build_program("oases", 6, n_sub, **kwargs)
