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
    min_sub: int = 1  # the fewest sub-batches it is defined with (merak: 2)

    def check_n_sub(self, n_sub: int) -> None:
        """ValueError where ``n_sub`` is below what the schedule is defined with: Merak is
        sub-pipelined TMP, and with one sub-batch it is megatron-recompute's program."""
        if n_sub < self.min_sub:
            raise ValueError(
                f"{self.name} overlaps {self.min_sub} or more sub-batches inside "
                f"each block (schedule.n_sub={n_sub}); with one it is "
                "megatron-recompute's program: use that, or n_sub >= "
                f"{self.min_sub}"
            )


SPECS = {
    s.name: s
    for s in (
        ScheduleSpec("megatron", False, "none"),
        ScheduleSpec("megatron-recompute", False, "block"),
        ScheduleSpec("commfree-recompute", False, "commfree"),
        ScheduleSpec("overlap", True, "none"),
        ScheduleSpec("overlap-recompute", True, "block"),
        ScheduleSpec("oases", True, "commfree"),
        ScheduleSpec("merak", True, "block", scope="block", min_sub=2),
        ScheduleSpec("megatron-sp", False, "none", sequence_parallel=True),
    )
}
# other systems' schedules, rebuilt as programs (not the ablation set)
BASELINES = ("merak", "megatron-sp")
SP_MODES = ("gathered", "shards")  # what a TP region keeps of its gathered input under ``sp``


def shards_differ(recompute: str) -> bool:
    """Does ``sp="shards"`` change a program of this recompute mode? Without recompute ("gh"
    in the backward) and in the communication-free recompute ("gr"); block recompute keeps
    the block input's slice and gathers in its recompute either way."""
    return recompute in ("none", "commfree")


def sub_batches(name: str, n_sub: int) -> int:
    """How many sub-batches a micro-batch is cut into under this schedule."""
    return n_sub if SPECS[name].overlapped else 1
