"""Where a simulated step's time goes, by kernel class, and the sanity bound on its MFU.

The simulator's compute stream runs a plan's Compute instructions; each is pieces, each piece
kernels (``planner.kernels.pieces``). ``step_kernels`` prices the very pieces the simulator
prices (``planner.plan_costs``: the same names, degrees and rows), once per kernel class, over
one micro-batch's program times the micro-batches (every micro-batch computes the same)::

    step = sum over classes (gemm, attention, norm, rotary, ..., launch)   the kernels alone
         + interference      compute stretched while collectives ran beside it (the walk's)
         + optimizer, grad-norm, their launches                            the AdamW step
         + exposed communication                                           (the walk's)

Each flop class (GEMM, attention) has its own efficiency, its flops over its seconds and the
peak; the memory-bound classes and the launches do no matmul flops. The MFU cannot exceed
what the step's kernels deliver::

    bound = sum over flop classes (share of the step) x (efficiency)
          = flops the MFU formula counts for the work executed / (step x peak)

with causal fused attention's flops counted over the full S x S as the MFU formula counts
them; executed work includes the recompute, so ``mfu <= bound`` always, and how far below
says how much of the step is not matmul work.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from oases.config import ModelConfig
from oases.plan import ParallelPlan
from oases.planner.batch import BatchShape, region_rows
from oases.planner.costs import region_kind
from oases.planner.kernels.prices import FLOP_CLASSES
from oases.planner.layout import dp_buckets, model_state
from oases.planner.simulate import PlanResult, plan_program


@dataclass(frozen=True)
class StepKernels:
    """A step's compute by kernel class (seconds), each flop class's efficiency, the MFU and
    its bound (see the module docstring)."""

    seconds: dict[str, float]
    efficiency: dict[str, float]
    step_s: float
    mfu: float
    bound: float
    flops: dict[str, float] = field(default_factory=dict)

    def shares(self) -> dict[str, float]:
        return {c: s / self.step_s for c, s in self.seconds.items()}

    def sane(self) -> bool:
        return self.mfu <= self.bound + 1e-9


class _ClassCosts:
    """``costs`` whose ``compute_s`` is one kernel class's seconds (or flops) of a piece."""

    def __init__(self, costs: object, cls: str, what: str) -> None:
        self._costs, self._cls, self._what = costs, cls, what

    def compute_s(self, region: str, phase: str, piece: str, tp: int, rows: int) -> float:
        if self._what == "seconds":
            return self._costs.breakdown(region, phase, piece, tp, rows).get(self._cls, 0.0)
        ks = self._costs.kernels(region, phase, piece, tp, rows)
        scale = 2.0 if self._cls == "attention" and self._costs.attention == "fused" else 1.0
        return scale * sum(k.flops for k in ks if k.cls == self._cls)

    def __getattr__(self, name: str) -> object:
        return getattr(self._costs, name)


def step_kernels(
    cfg: ModelConfig,
    plan: ParallelPlan,
    costs: object,
    world_size: int,
    batch: BatchShape,
    result: PlanResult,
    mfu: float,
    peak_flops: float,
) -> StepKernels:
    """The step of ``plan`` (simulated as ``result``, at ``mfu``) by kernel class, on hardware
    ``costs`` (``planner.hardware.HardwareCosts``)."""
    from oases.planner.kernels.prices import CLASSES
    from oases.planner.plan_costs import plan_step_costs
    from oases.schedule.program import SPECS, Compute, deferred_regions

    spec = SPECS[plan.schedule]
    k = plan.n_sub if spec.overlapped else 1
    rows = region_rows(plan, world_size, batch, k)
    kinds = [region_kind(r.name) for r in plan.regions]
    degrees = [r.tp for r in plan.regions]
    state = model_state(cfg, plan, world_size)
    buckets = dp_buckets(cfg, kinds, degrees, world_size, plan.zero_stages())
    program = plan_program(cfg, plan, world_size, batch, n_micro=1, dp=False, first=False)
    deferring = deferred_regions(program)
    pieces = [(ins.phase, p) for ins in program if isinstance(ins, Compute) for p in ins.pieces]

    def total(cls: str, what: str) -> float:
        step = plan_step_costs(
            cfg,
            plan,
            _ClassCosts(costs, cls, what),
            world_size,
            rows,
            state=state,
            buckets=buckets,
            deferring=deferring,
        )
        return batch.n_micro() * sum(step.piece_s(phase, kind, i) for phase, (kind, i) in pieces)

    seconds = {c: total(c, "seconds") for c in CLASSES if c not in ("optimizer", "grad-norm")}
    counted = {c: total(c, "flops") for c in FLOP_CLASSES}  # as the MFU formula counts them
    kernels_s = sum(seconds.values())
    seconds["interference"] = max(0.0, result.breakdown.get("compute_s", 0.0) - kernels_s)
    n_params = sum(state.updated(i) for i in range(len(degrees)))
    for c, s in costs.prices.optimizer_breakdown(n_params).items():
        seconds[c] = seconds.get(c, 0.0) + s
    seconds = {c: s for c, s in seconds.items() if s > 0}
    own = {
        c: f / (2.0 if c == "attention" and costs.attention == "fused" else 1.0)
        for c, f in counted.items()
    }  # the kernels' own flops (causal: half the square)
    efficiency = {
        c: own[c] / (seconds[c] * peak_flops) for c in FLOP_CLASSES if seconds.get(c, 0) > 0
    }
    bound = sum(counted.values()) / (result.step_s * peak_flops)
    return StepKernels(seconds, efficiency, result.step_s, mfu, bound, own)
