"""Benchmarks: schedules side by side on an emulated commodity interconnect (see link.py), and
the rank sides of ``oases profile`` and ``oases plan --verify``."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

# The schedules of ``oases bench`` that are other libraries' training steps, not Oases programs
# (no compute-only, comm-only or predicted time): PyTorch tensor parallelism, PyTorch FSDP2.
PEERS = ("torch-tp", "fsdp2")


class Entry(NamedTuple):
    """One column of ``oases bench``: a schedule (or peer), its ZeRO stage, its precision
    ("" = the run's ``train.precision``), its sequence parallelism ("" = off, or what a TP
    region keeps of its gathered input: "gathered" | "shards"; megatron-sp always has it)."""

    name: str
    zero: int = 0
    precision: str = ""
    sp: str = ""
    dw: str = ""  # "off": sequence parallelism's weight gradients inline (not deferred)

    def stem(self) -> str:
        """A file-name stem: ``oases_zero3``, ``oases_bf16``, ``oases_sp-gathered``, ``fsdp2``,
        ``oases_sp-gathered_dw-off``."""
        return "_".join(
            [
                self.name,
                *([f"zero{self.zero}"] if self.zero else []),
                *([self.precision] if self.precision else []),
                *([f"sp-{self.sp}"] if self.sp else []),
                *([f"dw-{self.dw}"] if self.dw else []),
            ]
        )

    def sp_mode(self) -> str | None:
        """``build_schedule``'s ``sp``: None when off."""
        return self.sp or None


ENTRY_SYNTAX = (
    "SCHEDULE[@zero=0|1|2|3][,precision=fp32|bf16][,sp=gathered|shards][,dw=off] "
    "(peers: PEER[@precision=...])"
)


def split_entries(text: str) -> list[str]:
    """``--schedules``' comma-separated entries, where an entry's own options continue it:
    ``"megatron,oases@sp=gathered,dw=off,oases"`` -> ``["megatron", "oases@sp=gathered,dw=off",
    "oases"]`` (a piece with "=" and no "@" is an option of the entry before it)."""
    out: list[str] = []
    for piece in filter(None, text.split(",")):
        if "=" in piece and "@" not in piece and out and "@" in out[-1]:
            out[-1] += "," + piece
        else:
            out.append(piece)
    return out


def parse_entry(entry: str) -> Entry:
    """A bench entry: ``oases`` -> Entry("oases"), ``oases@zero=3`` (sharded data parallelism,
    ``oases.parallel.shard``), ``oases@precision=bf16`` (``oases.precision``),
    ``megatron@zero=1,precision=bf16``, ``oases@sp=gathered`` (sequence parallelism,
    ``schedule.sp_tasks.sp_chain``), ``oases@sp=gathered,dw=off`` (its weight gradients not
    deferred: the comparison for ``dw_tasks.defers_weight_grad``). ValueError naming the
    syntax otherwise."""
    name, at, opts = entry.partition("@")
    values: dict[str, str] = {}
    for opt in filter(None, opts.split(",")):
        key, _, value = opt.partition("=")
        if key in values or not (
            (key == "zero" and value in ("0", "1", "2", "3") and name not in PEERS)
            or (key == "precision" and value in ("fp32", "bf16"))
            or (key == "sp" and value in ("gathered", "shards") and name not in PEERS)
            or (key == "dw" and value == "off" and name not in PEERS)
        ):
            raise ValueError(f"bench entry {entry!r}: expected {ENTRY_SYNTAX}")
        values[key] = value
    if not name or (at and not values):
        raise ValueError(f"bench entry {entry!r}: expected {ENTRY_SYNTAX}")
    return Entry(
        name,
        int(values.get("zero", 0)),
        values.get("precision", ""),
        values.get("sp", ""),
        values.get("dw", ""),
    )


DRAWN = ("overlap", "overlap-recompute", "oases")  # schedules whose timelines a bench draws


def draws_timeline(entry: str) -> bool:
    """Does ``oases bench`` draw this entry's timeline (one more step, traced)? The overlapped
    schedules', where what hides under what is the point, and every sharded entry's."""
    parsed = parse_entry(entry)
    return parsed.name in DRAWN or bool(parsed.zero)


def run_rank_spec(run: Callable[[dict], None]) -> None:
    """Entry of a rank launched as ``python -m MODULE SPEC.json``: ``run(spec)``, then leave
    the process groups whatever happened."""
    from oases.parallel.context import close_distributed

    spec = json.loads(Path(sys.argv[1]).read_text())
    try:
        run(spec)
    finally:
        close_distributed()
