"""The named schedules' knobs (``SPECS``): sub-batches or not, what the recompute repeats, how far
a collective may overlap. ``program.py`` draws every schedule; the table there is this one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScheduleSpec:
    """The knobs that tell the named schedules apart."""

    name: str
    overlapped: bool  # k sub-batches (else 1)
    recompute: str  # "none" | "block" | "commfree"
    scope: str = "chain"  # "chain": collectives overlap anything; "block": within a block+pass
    sequence_parallel: bool = False  # always sequence-parallel (the megatron-sp baseline)


SPECS = {
    s.name: s
    for s in (
        ScheduleSpec("megatron", False, "none"),
        ScheduleSpec("megatron-recompute", False, "block"),
        ScheduleSpec("commfree-recompute", False, "commfree"),
        ScheduleSpec("overlap", True, "none"),
        ScheduleSpec("overlap-recompute", True, "block"),
        ScheduleSpec("oases", True, "commfree"),
        ScheduleSpec("merak", True, "block", scope="block"),
        ScheduleSpec("megatron-sp", False, "none", sequence_parallel=True),
    )
}
# other systems' schedules, rebuilt as programs (not the ablation set)
BASELINES = ("merak", "megatron-sp")
SP_MODES = ("gathered", "shards")  # what a communication-free recompute keeps under ``sp``


def sub_batches(name: str, n_sub: int) -> int:
    """How many sub-batches a micro-batch is cut into under this schedule."""
    return n_sub if SPECS[name].overlapped else 1
