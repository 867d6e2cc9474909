"""Schedules: the order of a training step's computation and collectives, as data.

``build_schedule(name, n_sub)`` returns a ``Schedule`` whose ``step(model, tokens, targets)``
runs forward and backward of this rank's share of the batch through the executor, leaves
gradients averaged over data parallelism in ``.grad`` and returns the mean loss of this rank's
rows. Names: megatron, megatron-recompute, commfree-recompute, overlap, overlap-recompute, oases
(``SCHEDULES``, the paper's ablation set), and the baselines merak and megatron-sp
(``specs.BASELINES``).

Under a mixed-degree plan (``parallelize(model, ctx, plan)``) the batch is in the embedding's
layout (``world_size / tp_of("embed")`` data-parallel shares), every region runs at its own
degree with reshard instructions between them, and the returned loss is that of this rank's
rows in the head's layout (its mean over all ranks is the global loss).

Under pipeline stages (``parallel.pp`` > 1: ``model.parallel_plan.pp``) each rank runs its
stage's program (``pipeline_program.build_stage_program``, in the plan's ``pp_schedule``
order), and the loss, computed on the last stage, is sent to every stage (a sum over the
``pp`` group), so every rank returns it.

The package itself imports nothing heavy: ``Schedule`` and ``build_schedule`` (``step``, which
needs torch and the executor) are loaded when first asked for, so the planner, which reads only
the programs and specs, starts without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from oases.schedule.specs import BASELINES, SPECS
from oases.schedule.timeline import Timeline, record_timeline

if TYPE_CHECKING:
    from oases.schedule.step import Schedule, build_schedule

SCHEDULES = tuple(name for name in SPECS if name not in BASELINES)

__all__ = ["SCHEDULES", "Schedule", "Timeline", "build_schedule", "record_timeline"]


def __getattr__(name: str) -> object:
    if name in ("Schedule", "build_schedule"):
        from oases.schedule import step

        return getattr(step, name)
    raise AttributeError(f"module 'oases.schedule' has no attribute {name!r}")
