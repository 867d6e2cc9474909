"""What ``plan_model`` searches, narrowed step by step, with a line for every candidate a flag or
the costs kept out: so a search that simulated fewer plans than asked says why.

    SearchSpace.start(cfg, world)         every candidate degree, ZeRO stage, sequence-parallel
                                          mode and schedule asked for
      .narrow_degrees(keep, why)          a profile's measured degrees, --max-tp
      .narrow_zeros(...)                  costs that cannot price ZeRO's collectives
      .narrow_sps(...)                    costs that cannot price sequence parallelism
      .note_flag_effects(...)             what a fixed --zero or --sequence-parallel leaves out
                                          (no stage at dp=1; "shards" not under block
                                          recompute; degrees that do not divide the sequence)

ValueError when a flag leaves nothing to search, naming the flag and why.

``candidate_degrees`` and ``sub_batch_counts``: the TP degrees and sub-batch counts a search
walks (``planner.search`` imports them from here).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from oases.config import ModelConfig
from oases.schedule.program import SPECS
from oases.schedule.specs import shards_differ


@dataclass
class SearchSpace:
    """The degrees, ZeRO stages, sequence-parallel modes and schedules a search covers, and
    ``excluded``: one line per thing kept out and why."""

    world_size: int
    degrees: list[int]
    zeros: tuple[int, ...]
    sps: tuple[str, ...]
    schedules: tuple[str, ...]
    excluded: list[str] = field(default_factory=list)

    def narrow_degrees(self, keep: Callable[[int], bool], why: str, what: str) -> None:
        """Keep the degrees ``keep`` accepts; ``why`` says who asked (a flag), ``what`` the
        reason. ValueError if none is left."""
        out = [t for t in self.degrees if not keep(t)]
        if not out:
            return
        kept = [t for t in self.degrees if keep(t)]
        if not kept:
            raise ValueError(
                f"{why}: no candidate degree of this model is left ({what}; "
                f"candidates {self.degrees})"
            )
        self.degrees = kept
        self.excluded.append(f"{why}: tp={'/'.join(map(str, out))} not searched ({what})")

    def narrow_zeros(self, priced: bool) -> None:
        """Costs that cannot price ZeRO's collectives (a profile from before ``oases profile``
        timed reduce-scatters) plan at stage 0."""
        if priced or self.zeros == (0,):
            return
        dropped = [z for z in self.zeros if z]
        self.zeros = (0,)
        self.excluded.append(
            f"the profile cannot price ZeRO's reduce-scatters and gathers "
            f"(it predates them): stage(s) {'/'.join(map(str, dropped))} not "
            "searched; run oases profile again"
        )

    def narrow_sps(self, priced: bool) -> None:
        """Costs that cannot price sequence parallelism's pieces plan without it."""
        if priced or not self.sps:
            return
        self.excluded.append(
            f"the profile cannot price sequence parallelism's pieces (it "
            f"predates them): sequence parallelism ({'/'.join(self.sps)}) not "
            "searched; run oases profile again"
        )
        self.sps = ()

    def note_flag_effects(self, cfg: ModelConfig, zero_flag: str, sp_flag: str) -> None:
        """What the ZeRO stages and sequence-parallel modes asked for leave out, beyond the
        degrees: ``zero_flag`` / ``sp_flag`` name the flags (``--zero 2``)."""
        single = [t for t in self.degrees if self.world_size // t == 1]
        if 0 not in self.zeros and single:
            if len(single) == len(self.degrees):
                raise ValueError(
                    f"{zero_flag}: every candidate degree ({self.degrees}) leaves "
                    "dp=1, with no data-parallel group to shard over; plan with "
                    "--zero 0, or more ranks"
                )
            self.excluded.append(
                f"{zero_flag}: tp={'/'.join(map(str, single))} not searched "
                f"(dp=1 at {self.world_size} ranks: no data-parallel group to "
                "shard over; --zero 0 plans it)"
            )
        if not self.sps:
            return
        uneven = [t for t in self.degrees if t > 1 and cfg.seq_len % t]
        if uneven:
            self.excluded.append(
                f"{sp_flag}: tp={'/'.join(map(str, uneven))} searched without "
                f"sequence parallelism (model.seq_len={cfg.seq_len} is not "
                "divisible)"
            )
        if "gathered" not in self.sps:
            other = [s for s in self.schedules if not shards_differ(SPECS[s].recompute)]
            if other:
                self.excluded.append(
                    f"{sp_flag}: {', '.join(other)} searched without sequence "
                    "parallelism (shards changes a schedule without recompute or with the "
                    "communication-free one; block recompute is the same with gathered)"
                )


def candidate_degrees(cfg: ModelConfig, world_size: int, limit: int | None = None) -> list[int]:
    """Powers of two dividing the world size, heads, kv heads and ffn (up to ``limit``)."""
    out, t = [], 1
    while t <= min(world_size, limit or world_size):
        if not (world_size % t or cfg.n_heads % t or cfg.n_kv_heads % t or cfg.ffn_dim % t):
            out.append(t)
        t *= 2
    return out


def sub_batch_counts(
    schedule: str, n_subs: tuple[int, ...], schedules: tuple[str, ...] = ()
) -> tuple[int, ...]:
    """The sub-batch counts searched for ``schedule``: 1 for a non-overlapped one; for an
    overlapped one every count of ``n_subs``, 1 included unless ``schedules`` also has the
    non-overlapped schedule of the same recompute (with one sub-batch overlap runs megatron's
    program; oases at one sub-batch differs from commfree-recompute only in starting the next
    recompute before a backward all-reduce ends), and none below the schedule's least
    (``ScheduleSpec.min_sub``: merak, defined by its sub-batches, from 2)."""
    if not SPECS[schedule].overlapped:
        return (1,)
    twin = any(
        not SPECS[s].overlapped and SPECS[s].recompute == SPECS[schedule].recompute
        for s in schedules
    )
    return tuple(k for k in n_subs if (k > 1 or not twin) and k >= SPECS[schedule].min_sub)
