"""A plan the search considered (``Candidate``), and the plans it builds: one ZeRO stage for
every region (``with_zero``), a degree per region from a chain solver's choice (``plan_of``),
and the bytes a region's state takes per master-weight byte at a ZeRO stage
(``state_factors``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from oases.config import ModelConfig
from oases.plan import ParallelPlan, RegionPlan, region_names
from oases.planner.batch import BatchShape
from oases.planner.precision import OPTIMIZER_STATES
from oases.planner.simulate import PlanResult


@dataclass
class Candidate:
    """One plan the planner considered, with its simulated step time and peak memory."""

    plan: ParallelPlan
    result: PlanResult
    fits: bool
    kind: str  # "uniform" | "searched" | "leanest" | "seeded" (see solve_plan)
    batch: BatchShape | None = None  # the micro-batch it was simulated with
    micro_label: bool = False  # name the micro-batch in the label (several were searched)

    def label(self) -> str:
        degrees = self.plan.degrees()
        layout = (
            f"uniform tp={degrees[0]}"
            if len(degrees) == 1
            else "mixed tp " + "/".join(str(d) for d in degrees)
        )
        zero = max(self.plan.zero_stages())
        extra = f", zero={zero}" if zero else ""
        if self.plan.sequence_parallel:
            extra += f", sp={self.plan.sequence_parallel}"
        if self.micro_label and self.batch is not None:
            extra += f", n_micro={self.batch.n_micro()}"  # micro-batches per step
        return f"{layout}, {self.plan.schedule}, n_sub={self.plan.n_sub}{extra}"


def state_factors(zero: int, dp: int) -> tuple[float, float, float]:
    """Bytes per master-weight byte of a region at ZeRO stage ``zero`` over ``dp`` ranks:
    (held through the passes, of which gradients, held at the optimizer step with its
    temporaries) — ``planner.peak_memory``'s table: weights 1 (stage 3: 1/dp), gradients 1
    (stages 2-3: 1/dp; stage 1 accumulates whole ones), Adam moments 2 (from stage 1: 2/dp), a
    copy of what the optimizer updates."""
    w = 1 / dp if zero == 3 else 1.0
    g = 1.0 if zero <= 1 else 1 / dp
    shard = 1.0 if zero == 0 else 1 / dp
    return w + g + OPTIMIZER_STATES * shard, g, w + shard * (2 + OPTIMIZER_STATES)


def with_zero(plan: ParallelPlan, zero: int) -> ParallelPlan:
    """``plan`` with every region at ZeRO stage ``zero`` (0: as unsharded, no stage given)."""
    return dataclasses.replace(
        plan, regions=[RegionPlan(r.name, r.tp, r.dp, zero or None) for r in plan.regions]
    )


def plan_of(
    cfg: ModelConfig,
    choice: tuple[int, ...],
    degrees: list[int],
    world_size: int,
    schedule: str,
    n_sub: int,
    sp: str = "",
) -> ParallelPlan:
    """The plan of a chain solver's ``choice`` (an index into ``degrees`` per region)."""
    if all(degrees[d] == 1 for d in choice):
        sp = ""  # nothing to slice: the plan without it
    return ParallelPlan(
        [
            RegionPlan(name, degrees[d], world_size // degrees[d])
            for name, d in zip(region_names(cfg), choice)
        ],
        n_sub=n_sub,
        schedule=schedule,
        sequence_parallel=sp,
    )
