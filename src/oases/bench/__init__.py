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


def run_rank_spec(run: Callable[[dict], None]) -> None:
    """Entry of a rank launched as ``python -m MODULE SPEC.json``: ``run(spec)``, then leave
    the process groups whatever happened."""
    from oases.parallel.context import close_distributed

    spec = json.loads(Path(sys.argv[1]).read_text())
    try:
        run(spec)
    finally:
        close_distributed()
