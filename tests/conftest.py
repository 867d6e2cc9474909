"""Shared pytest fixtures.

``spawn_ranks(fn, world_size, *args, timeout_s=120)`` runs ``fn(rank, world_size, *args)`` on
``world_size`` spawned gloo ranks with a rendezvous inside the test's ``tmp_path`` and returns
the per-rank return values (see ``tests/distributed.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

_SRC = Path(__file__).resolve().parent.parent / "src"
try:  # the Makefile installs the package editable; fall back to the source tree
    import oases  # noqa: F401
except ImportError:
    sys.path.insert(0, str(_SRC))

from distributed import run_ranks  # noqa: E402


@pytest.fixture
def spawn_ranks(tmp_path: Path) -> Callable[..., list[Any]]:
    """Return ``launch(fn, world_size, *args, timeout_s=120.0) -> list`` bound to tmp_path."""

    def launch(
        fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0
    ) -> list[Any]:
        return run_ranks(fn, world_size, tmp_path, *args, timeout_s=timeout_s)

    return launch
