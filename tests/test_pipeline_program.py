"""Pipeline programs without ranks: the pipeline orders, point-to-point per boundary and
sub-batch, the order both sides of a boundary post in, no stage waiting on a peer that waits on
it, the 1F1B steady state's pairing, stage bounds.

The walk (``_walk``) runs every stage's program together under the strictest point-to-point
semantics: a receive's Wait needs the peer's send started, and a send's Wait needs the peer's
receive posted (gloo's rendezvous; NCCL's in-order streams are covered by the order check).
"""

from __future__ import annotations

import itertools

import pytest

from oases.schedule.instructions import Compute, Start, Wait
from oases.schedule.pipeline_order import (
    PIPELINE_SCHEDULES,
    check_pipeline_schedule,
    in_flight,
    one_f_one_b_order,
    pipeline_order,
    warmup_forwards,
)
from oases.schedule.pipeline_program import build_stage_program
from oases.stages import StageLayout, check_stage_starts, default_stage_starts

PEER = {"rf": "sf", "rb": "sb", "sf": "rf", "sb": "rb"}


def _layout(n_layers: int, pp: int, chunks: int = 1) -> StageLayout:
    return StageLayout(2 * n_layers + 2, default_stage_starts(n_layers, pp * chunks), chunks)


def _programs(
    name: str, n_layers: int, pp: int, n_micro: int, n_sub: int = 1, chunks: int = 1, **kw
) -> list:
    layout = _layout(n_layers, pp, chunks)
    return [build_stage_program(name, n_sub, layout, s, n_micro=n_micro, **kw) for s in range(pp)]


def _unit_cost(ins: Compute, deferred: frozenset[int] = frozenset()) -> float:
    """A forward compute 1, a recompute or backward 2; with ``deferred`` regions (zb-h1's W
    passes) a backward holding [tp i] of such a region 1 and its [dw i] 1: the same work."""
    if ins.phase == "forward":
        return 1.0
    if any(kind == "dw" or (kind == "tp" and i in deferred) for kind, i in ins.pieces):
        return 1.0
    return 2.0


def _walk(programs: list[list], deferred: frozenset[int] = frozenset()) -> float:
    """Run every stage's program together; AssertionError naming each stage's blocking
    instruction if no stage can move. Returns the step's length on unit costs (``_unit_cost``,
    communication free): the order's own bubbles."""
    pos = [0] * len(programs)
    clock = [0.0] * len(programs)
    posted: dict[tuple, float] = {}  # (kind, index, sub) of started sends and receives
    tie_started: dict[int, float] = {}
    while any(p < len(prog) for p, prog in zip(pos, programs)):
        moved = False
        for s, prog in enumerate(programs):
            while pos[s] < len(prog):
                ins = prog[pos[s]]
                if isinstance(ins, Start) and ins.kind in PEER:
                    posted[ins.kind, ins.index, ins.sub] = clock[s]
                elif isinstance(ins, Start) and ins.kind == "tie":
                    tie_started[s] = clock[s]
                elif isinstance(ins, Wait) and ins.kind in PEER:
                    key = (PEER[ins.kind], ins.index, ins.sub)
                    if key not in posted:
                        break
                    clock[s] = max(clock[s], posted[key])
                elif isinstance(ins, Wait) and ins.kind == "tie":
                    if len(tie_started) < 2:
                        break
                    clock[s] = max(clock[s], *tie_started.values())
                elif isinstance(ins, Compute):
                    clock[s] += _unit_cost(ins, deferred)
                pos[s] += 1
                moved = True
        if not moved:
            stuck = {s: prog[pos[s]] for s, prog in enumerate(programs) if pos[s] < len(prog)}
            raise AssertionError(f"deadlock: {stuck}")
    return max(clock)


def _p2p(prog: list, cls: type, kind: str) -> list[tuple[int, int]]:
    return [(i.index, i.sub) for i in prog if isinstance(i, cls) and i.kind == kind]


def _check_p2p(programs: list, layout: StageLayout, n_subs: int) -> None:
    """Every boundary and sub-batch: one send and one receive each way, each started once and
    waited once after its start; the sender's sends and the receiver's posts in one order, per
    pair of stages (NCCL matches a pair's operations by order: a wrap-around pair is its own)."""
    n = layout.n_regions
    for s, prog in enumerate(programs):
        ranges = layout.chunk_bounds(s)
        want = {
            "sf": [hi for _, hi in ranges if hi < n],
            "rb": [hi for _, hi in ranges if hi < n],
            "rf": [lo for lo, _ in ranges if lo > 0],
            "sb": [lo for lo, _ in ranges if lo > 0],
        }
        for kind, bounds in want.items():
            starts, waits = _p2p(prog, Start, kind), _p2p(prog, Wait, kind)
            expect = sorted((b, j) for b in bounds for j in range(n_subs))
            assert sorted(starts) == expect, (s, kind, starts)
            assert sorted(waits) == expect, (s, kind, waits)
            for key in starts:
                start = prog.index(Start(kind, *key))
                assert start < prog.index(Wait(kind, *key)), (s, kind, key)

    def on_pair(prog: list, kind: str, wraps: bool) -> list:
        return [key for key in _p2p(prog, Start, kind) if layout.wraps(key[0]) == wraps]

    for b in layout.starts:
        s, t, wraps = layout.stage_of(b - 1), layout.stage_of(b), layout.wraps(b)
        assert on_pair(programs[s], "sf", wraps) == on_pair(programs[t], "rf", wraps), b
        assert on_pair(programs[t], "sb", wraps) == on_pair(programs[s], "rb", wraps), b


def _computes(prog: list) -> list[Compute]:
    return [i for i in prog if isinstance(i, Compute)]


# ------------------------------------------------------------------------------- orders


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
@pytest.mark.parametrize("n_micro", [1, 2, 3, 4, 6])
def test_1f1b_warm_up_and_in_flight(pp, n_micro):
    for s in range(pp):
        units = one_f_one_b_order(pp, s, n_micro)
        w = warmup_forwards(pp, s, n_micro)
        assert w == min(pp - s - 1, n_micro)
        first_b = next(u for u, unit in enumerate(units) if unit[0][0] == "B")
        # the warm-up forwards, then (if any is left) the steady state's first forward
        assert first_b == (w + 1 if w < n_micro else n_micro)
        assert all(unit == (("F", m),) for m, unit in enumerate(units[:w]))
        assert in_flight(units) == min(pp - s, n_micro)  # at most P - s in flight
        flat = [p for unit in units for p in unit]
        assert sorted(flat) == sorted(
            [("F", m) for m in range(n_micro)] + [("B", m) for m in range(n_micro)]
        )
        assert [m for k, m in flat if k == "F"] == list(range(n_micro))
        assert [m for k, m in flat if k == "B"] == list(range(n_micro))
        paired = one_f_one_b_order(pp, s, n_micro, pair=True)
        wp = warmup_forwards(pp, s, n_micro, pair=True)
        assert wp == min(2 * (pp - s) - 1, n_micro)
        assert paired[:wp] == [(("F", m),) for m in range(wp)]
        assert paired[wp:n_micro] == [(("F", m + wp), ("B", m)) for m in range(n_micro - wp)]
        assert in_flight(paired) == min(2 * (pp - s), n_micro)
        gpipe = pipeline_order("gpipe", pp, s, n_micro)
        assert in_flight(gpipe) == n_micro


def test_pipeline_schedule_names():
    assert PIPELINE_SCHEDULES == ("gpipe", "1f1b", "1f1b-pair", "zb-h1", "interleaved")
    with pytest.raises(ValueError, match="valid: gpipe, 1f1b, 1f1b-pair"):
        check_pipeline_schedule("pipedream")


def test_stage_starts():
    assert default_stage_starts(4, 2) == (5,)
    assert default_stage_starts(4, 4) == (3, 5, 7)
    assert default_stage_starts(5, 2) == (7,)  # the first stage takes the extra block
    assert default_stage_starts(3, 1) == ()
    layout = StageLayout(10, (5,))
    assert layout.bounds(0) == (0, 5) and layout.bounds(1) == (5, 10)
    assert [layout.stage_of(i) for i in range(10)] == [0] * 5 + [1] * 5
    with pytest.raises(ValueError, match="n_layers=2 blocks do not fill parallel.pp=3"):
        default_stage_starts(2, 3)
    with pytest.raises(ValueError, match="not the attention region"):
        check_stage_starts((4,), 4, 2)
    with pytest.raises(ValueError, match="must increase"):
        check_stage_starts((5, 3), 4, 3)
    with pytest.raises(ValueError, match="each of the 1 stages"):
        check_stage_starts((3, 5), 4, 2)


# --------------------------------------------------------------------------- programs

INNER = (
    "megatron",
    "megatron-recompute",
    "commfree-recompute",
    "overlap",
    "overlap-recompute",
    "oases",
    "merak",
)


@pytest.mark.parametrize("pp_schedule", PIPELINE_SCHEDULES)
@pytest.mark.parametrize("name", INNER)
def test_stage_programs_run_together(name, pp_schedule):
    """Every inner schedule x pipeline schedule, 2-4 stages, 1-5 micro-batches, 1-2
    sub-batches, with and without sequence parallelism: one send and receive per boundary,
    sub-batch and direction, matched in order, and no deadlock."""
    chunks = 2 if pp_schedule == "interleaved" else 1  # (its micro-batches: multiples of pp)
    for pp, n_micro, n_sub, sp in itertools.product((2, 3, 4), (1, 2, 5), (1, 2), (None, "shards")):
        n_layers = 4 * chunks
        n_micro = n_micro * pp if chunks > 1 else n_micro
        layout = _layout(n_layers, pp, chunks)
        programs = _programs(
            name,
            n_layers,
            pp,
            n_micro,
            n_sub,
            chunks,
            pp_schedule=pp_schedule,
            sp=sp,
            dp_tasks=tuple(range(2 * n_layers + 2)),
            tied=True,
        )
        k = n_sub if name not in ("megatron", "megatron-recompute", "commfree-recompute") else 1
        _check_p2p(programs, layout, n_micro * k)
        _walk(programs)
        for s, prog in enumerate(programs):
            held = {i for lo, hi in layout.chunk_bounds(s) for i in range(lo, hi)}
            regions = {i for c in _computes(prog) for _, i in c.pieces}
            assert regions == held, (s, regions)
            last_fwd, first_bwd = {}, {}
            for i, c in enumerate(_computes(prog)):  # a sub-batch's backward after its forward
                if c.phase == "forward":
                    last_fwd[c.sub] = i
                else:
                    first_bwd.setdefault(c.sub, i)
            assert all(last_fwd[j] < first_bwd[j] for j in first_bwd), s
            assert ({Start("tie", 0), Wait("tie", 0)} <= set(prog)) == (s in (0, pp - 1))


def test_gpipe_runs_every_forward_first():
    for prog in _programs("oases", 4, 2, 4, 2, pp_schedule="gpipe"):
        phases = [c.phase == "forward" for c in _computes(prog)]
        assert phases == sorted(phases, reverse=True)


def test_steady_state_pairs_a_forward_collective_with_a_backward_compute():
    """1f1b-pair with one sub-batch of one sequence: in each steady unit (F m+w, B m) a
    forward all-reduce of micro-batch m+w is in flight while a backward compute of micro-batch
    m runs, and it is started before that backward's first compute."""
    pp, n_micro = 2, 6
    for s, prog in enumerate(_programs("oases", 4, pp, n_micro, 1, pp_schedule="1f1b-pair")):
        w = warmup_forwards(pp, s, n_micro, pair=True)
        assert n_micro - w >= 2
        for m in range(n_micro - w):
            first_b = next(
                i
                for i, ins in enumerate(prog)
                if isinstance(ins, Compute) and ins.phase != "forward" and ins.sub == m
            )
            fwd = [
                i
                for i, ins in enumerate(prog)
                if isinstance(ins, Start) and ins.kind == "fwd" and ins.sub == m + w
            ]
            assert fwd and fwd[0] < first_b, (s, m)
            hidden = False
            for i in fwd:
                start = prog[i]
                end = prog.index(Wait("fwd", start.index, start.sub))
                hidden = hidden or any(
                    isinstance(ins, Compute) and ins.sub == m and ins.phase != "forward"
                    for ins in prog[i:end]
                )
            assert hidden, (s, m)
    # plain 1F1B: a forward collective never flies over a backward compute
    for prog in _programs("oases", 4, pp, n_micro, 1, pp_schedule="1f1b"):
        for i, ins in enumerate(prog):
            if isinstance(ins, Start) and ins.kind == "fwd":
                end = prog.index(Wait("fwd", ins.index, ins.sub))
                assert all(c.phase == "forward" for c in _computes(prog[i:end]))


@pytest.mark.parametrize("pp,n_micro", [(2, 8), (4, 8), (4, 12)])
def test_pairing_keeps_the_1f1b_period(pp, n_micro):
    """On unit costs (communication free, so pairing hides nothing) 1f1b-pair's step is as
    long as 1F1B's: its deeper warm-up keeps every pair independent of the neighbours' current
    units (pairing 1F1B's own F(m+w) and B(m) would not: ``pipeline_order``)."""
    one = _walk(_programs("oases", 8, pp, n_micro, 1, pp_schedule="1f1b"))
    paired = _walk(_programs("oases", 8, pp, n_micro, 1, pp_schedule="1f1b-pair"))
    assert paired <= one * 1.02, (paired, one)


@pytest.mark.parametrize("pp,n_micro,n_layers", [(2, 8, 8), (3, 6, 6), (4, 8, 8), (4, 8, 16)])
def test_zb_h1_runs_weight_gradients_where_1f1b_waits(pp, n_micro, n_layers):
    """zb-h1 on unit costs where a block's backward is half input and half weight gradients:
    the same work as 1F1B in a step at least 5% shorter, stage s holding back at most s W's,
    with 1F1B's forwards in flight; every block region's weight gradients deferred."""
    from oases.schedule.instructions import deferred_regions

    one = _walk(_programs("megatron", n_layers, pp, n_micro, 1, pp_schedule="1f1b"))
    programs = _programs("megatron", n_layers, pp, n_micro, 1, pp_schedule="zb-h1")
    deferred = frozenset().union(*map(deferred_regions, programs))
    assert deferred == set(range(1, 2 * n_layers + 1))  # not the embedding or the head
    zb = _walk(programs, deferred)
    assert zb < 0.95 * one, (zb, one)
    for s in range(pp):
        order = pipeline_order("zb-h1", pp, s, n_micro)
        assert in_flight(order) == in_flight(pipeline_order("1f1b", pp, s, n_micro))
        assert [u for u in order if u[0][0] != "W"] == pipeline_order("1f1b", pp, s, n_micro)
        done_b = done_w = 0
        for ((kind, _),) in order:
            done_b += kind == "B"
            done_w += kind == "W"
            assert done_w <= done_b and done_b - done_w <= s + 1, (s, order)
        assert done_w == n_micro


def test_commfree_recompute_repeats_no_collective_inside_stages():
    for prog in _programs("oases", 4, 2, 3, 2, pp_schedule="1f1b"):
        fwd = [(i.index, i.sub) for i in prog if isinstance(i, Start) and i.kind == "fwd"]
        assert len(fwd) == len(set(fwd))


def test_boundary_needs_one_degree():
    layout = _layout(2, 2)
    with pytest.raises(ValueError, match="either side of a stage boundary"):
        build_stage_program("megatron", 1, layout, 0, n_micro=1, degrees=(2, 2, 2, 1, 1, 1))


def test_tied_sum_comes_before_the_tied_weight_is_reduced():
    """The first and last stage sum the tied weight's full gradient ("tie") after their last
    compute, and only then reduce-scatter (ZeRO 1) or all-reduce (DP) the region holding it;
    ZeRO 2 for that region and ZeRO 3 anywhere are refused with a pipeline."""
    from oases.schedule.dp_insert import ZeroLayout

    layout, n, n_micro = _layout(4, 2), 10, 3
    uses = tuple((i,) for i in range(n))
    for zero, kind in ((ZeroLayout((1,) * n, uses), "rs"), (None, "dp")):
        for s, index in ((0, 0), (1, n - 1)):
            prog = build_stage_program(
                "oases",
                2,
                layout,
                s,
                n_micro=n_micro,
                zero=zero,
                dp_tasks=tuple(range(*layout.bounds(s))),
                tied=True,
            )
            sub = n_micro - 1 if kind == "rs" else 0
            tie = prog.index(Start("tie", 0))
            assert prog.index(Wait("tie", 0)) < prog.index(Start(kind, index, sub))
            last = max(i for i, ins in enumerate(prog) if isinstance(ins, Compute))
            assert last < tie < prog.index(Wait(kind, index, sub))
    with pytest.raises(ValueError, match="ZeRO stage 2 of region 9"):
        build_stage_program(
            "oases", 2, layout, 1, n_micro=2, zero=ZeroLayout((2,) * n, uses), tied=True
        )
    with pytest.raises(ValueError, match="ZeRO stage 3 inside pipeline stages"):
        build_stage_program("oases", 2, layout, 0, n_micro=2, zero=ZeroLayout((3,) * n, uses))


def test_pipeline_plan_checks_and_json_round_trip():
    from oases.config import ModelConfig
    from oases.plan import ParallelPlan, RegionPlan, region_names

    cfg = ModelConfig(arch="llama", n_layers=4, dim=32, n_heads=4, n_kv_heads=2)
    plan = ParallelPlan.uniform(cfg, 8, 2, pp=2, pp_schedule="1f1b-pair")
    plan.check(cfg, 8)
    assert [r.dp for r in plan.regions] == [2] * 10 and plan.stage_layout().starts == (5,)
    again = ParallelPlan.from_json(plan.to_json())
    assert again == plan and '"pp": 2' in plan.to_json()
    assert '"pp"' not in ParallelPlan.uniform(cfg, 8, 2).to_json()  # pp=1 plans read as before
    with pytest.raises(ValueError, match="model.n_kv_heads=2 is not divisible by tp=4"):
        ParallelPlan.uniform(cfg, 8, 4, pp=2).check(cfg, 8)
    with pytest.raises(ValueError, match="made for 16 ranks .* this run has 8"):
        ParallelPlan([RegionPlan(n, 2, 4) for n in region_names(cfg)], pp=2).check(cfg, 8)
    with pytest.raises(ValueError, match="do not fit world size 8 over pp=2 stages"):
        ParallelPlan(
            [RegionPlan(n, 2, 4 if i else 2) for i, n in enumerate(region_names(cfg))], pp=2
        ).check(cfg, 8)
    with pytest.raises(ValueError, match="not the attention region"):
        ParallelPlan.uniform(cfg, 8, 2, pp=2, stage_starts=[4]).check(cfg, 8)
    with pytest.raises(ValueError, match="needs parallel.pp_chunks >= 2 .*got 1"):
        ParallelPlan.uniform(cfg, 8, 2, pp=2, pp_schedule="interleaved").check(cfg, 8)
    with pytest.raises(ValueError, match='only with parallel.pp_schedule="interleaved"'):
        ParallelPlan.uniform(cfg, 8, 2, pp=2, pp_chunks=2).check(cfg, 8)
    with pytest.raises(ValueError, match="n_layers=4 blocks do not divide .* = 6 model chunks"):
        ParallelPlan.uniform(cfg, 8, 2, pp=2, pp_schedule="interleaved", pp_chunks=3).check(cfg, 8)
    chunked = ParallelPlan.uniform(cfg, 8, 2, pp=2, pp_schedule="interleaved", pp_chunks=2)
    chunked.check(cfg, 8)
    assert chunked.stage_layout().chunk_bounds(1) == [(3, 5), (7, 10)]
    assert ParallelPlan.from_json(chunked.to_json()) == chunked
    assert '"pp_chunks"' in chunked.to_json() and '"pp_chunks"' not in plan.to_json()
    mixed = ParallelPlan(
        [
            RegionPlan(n, 1 if i < 5 else 2, 4 if i < 5 else 2)
            for i, n in enumerate(region_names(cfg))
        ],
        pp=2,
    )
    with pytest.raises(ValueError, match="either side of a pipeline stage boundary"):
        mixed.check(cfg, 8)
    mixed.stage_starts = [3]  # the degree changes inside stage 1 (at block 1's MLP): fine
    mixed.regions = [
        RegionPlan(n, 1 if i < 4 else 2, 4 if i < 4 else 2) for i, n in enumerate(region_names(cfg))
    ]
    mixed.check(cfg, 8)


@pytest.mark.parametrize(
    "name,n_sub,order,sp,degrees",
    [
        ("megatron", 1, "1f1b", None, None),
        ("oases", 2, "zb-h1", None, None),
        ("overlap-recompute", 2, "interleaved", "gathered", None),
        ("overlap", 2, "1f1b-pair", "shards", None),
        ("commfree-recompute", 1, "gpipe", None, (2,) * 2 + (4,) * 16),
    ],
)
def test_micro_batch_passes_are_the_first_relabelled(name, n_sub, order, sp, degrees) -> None:
    """``_build`` builds micro-batch 0's passes once and relabels them for the others: built
    directly, micro-batch 3's passes equal micro-batch 0's with every sub-batch id shifted."""
    from oases.schedule.pipeline_program import _micro_passes, _shifted
    from oases.schedule.specs import SPECS
    from oases.schedule.tasks import degree_changes

    chunks = 2 if order == "interleaved" else 1
    layout = _layout(8, 2, chunks)
    spec = SPECS[name]
    k = n_sub if spec.overlapped else 1
    changes = degree_changes(layout.n_regions, degrees) | layout.boundaries
    for stage in range(2):
        args = (layout.chunk_bounds(stage), layout.n_regions)
        rest = (order, changes, sp, True, chunks)
        first = _micro_passes(spec, k, *args, 0, *rest)
        third = _micro_passes(spec, k, *args, 3, *rest)
        assert {(key[0], *key[2:]) for key in third} == {(key[0], *key[2:]) for key in first}
        for key, marked in first.items():
            direct = third[(key[0], 3, *key[2:])]
            assert direct, key
            assert [_shifted(x, 3 * k) for x in marked] == direct
            assert [_shifted(x, 2 * k) for x in marked] != direct
