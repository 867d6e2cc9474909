"""A stage program's units list-scheduled once per shape and relabelled
(``pipeline_program._build``): the same instructions as every unit built from its own
micro-batches' passes and list-scheduled apart."""

from __future__ import annotations

import itertools

import pytest

from oases.schedule.pipeline_order import PIPELINE_SCHEDULES, pipeline_order
from oases.schedule.pipeline_program import (
    _backward_chunk,
    _build,
    _micro_passes,
    _place_p2p,
    _unit_body,
    _unit_tasks,
)
from oases.schedule.regather import insert_regathers, regathers
from oases.schedule.specs import SPECS
from oases.schedule.tasks import degree_changes
from oases.stages import StageLayout, default_stage_starts


def _each_unit_apart(spec, k, layout, stage, n_micro, order, max_inflight, degrees, sp):
    """The reference: every micro-batch's passes built directly, every unit list-scheduled
    from its own passes."""
    n = layout.n_regions
    changes = degree_changes(n, degrees) | layout.boundaries
    ranges = layout.chunk_bounds(stage)
    if sp is not None:
        max_inflight = max(max_inflight, 2)
    passes: dict = {}
    for m in range(n_micro):
        passes.update(_micro_passes(spec, k, ranges, n, m, order, changes, sp, True, layout.chunks))
    bodies, recvs = [], []
    for unit in pipeline_order(order, layout.pp, stage, n_micro, layout.chunks):
        body = _unit_body(_unit_tasks(unit, passes), spec, max_inflight)
        if regathers(spec.recompute, spec.scope, sp):
            body = insert_regathers(body, n, not spec.overlapped, *ranges[_backward_chunk(unit)])
        bodies.append(body)
        recvs.append(
            sorted(
                (m.recv for p in unit for m in passes[p] if m.recv is not None),
                key=lambda key: (key[2], key[1]),
            )
        )
    return tuple(_place_p2p(bodies, recvs))


CASES = list(
    itertools.product(
        list(SPECS),
        (1, 2, 3),
        PIPELINE_SCHEDULES,
        (None, "gathered", "shards"),
    )
)


@pytest.mark.parametrize("name,n_sub,order,sp", CASES)
def test_units_by_shape_equal_each_unit_built_apart(name, n_sub, order, sp) -> None:
    spec = SPECS[name]
    k = n_sub if spec.overlapped else 1
    chunks = 2 if order == "interleaved" else 1
    for pp, n_micro, mixed in ((2, 6, False), (3, 9, True)):
        n_layers = 6
        n = 2 * n_layers + 2
        layout = StageLayout(n, default_stage_starts(n_layers, pp * chunks), chunks)
        degrees = None
        if mixed:  # a degree change inside a stage, none at a boundary
            degrees = tuple(4 if i in (3, 4) and 4 not in layout.starts else 2 for i in range(n))
        for stage in range(pp):
            args = (spec, k, layout, stage, n_micro, order, 1)
            built = _build(*args, (), degrees, sp, True)
            assert built == _each_unit_apart(*args, degrees, sp), (stage, pp)
