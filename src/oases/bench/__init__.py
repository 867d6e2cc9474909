"""Benchmarks: schedules side by side on an emulated commodity interconnect (see link.py), and
the rank sides of ``oases profile`` and ``oases plan --verify``."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

# The schedules of ``oases bench`` that are other libraries' training steps, not Oases programs
# (no compute-only, comm-only or predicted time): PyTorch tensor parallelism, PyTorch FSDP2.
PEERS = ("torch-tp", "fsdp2")


def parse_entry(entry: str) -> tuple[str, int]:
    """A bench entry -> (schedule, ZeRO stage): ``oases`` -> ("oases", 0), ``oases@zero=3`` ->
    ("oases", 3) (sharded data parallelism, ``oases.parallel.shard``). ValueError otherwise."""
    name, _, opts = entry.partition("@")
    if not opts:
        return name, 0
    key, _, value = opts.partition("=")
    if key != "zero" or value not in ("0", "1", "2", "3") or name in PEERS:
        raise ValueError(f"bench entry {entry!r}: expected SCHEDULE or SCHEDULE@zero=0|1|2|3")
    return name, int(value)


def run_rank_spec(run: Callable[[dict], None]) -> None:
    """Entry of a rank launched as ``python -m MODULE SPEC.json``: ``run(spec)``, then leave
    the process groups whatever happened."""
    from oases.parallel.context import close_distributed

    spec = json.loads(Path(sys.argv[1]).read_text())
    try:
        run(spec)
    finally:
        close_distributed()
