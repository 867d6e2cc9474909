"""The house rules that keep the design legible (DESIGN.md, "style"), checked on every run:
no module of ``src/`` is 500 lines or more (split by concern before adding to one near the
limit), and the tree is as ``ruff format`` writes it (``make lint``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 500


def test_no_module_reaches_500_lines():
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text().splitlines())
        for p in sorted((ROOT / "src").rglob("*.py"))
    }
    assert sizes, "no modules found under src/"
    over = {name: n for name, n in sizes.items() if n >= LIMIT}
    assert not over, f"modules at or over {LIMIT} lines (split them by concern): {over}"


def _ruff() -> str | None:
    here = Path(sys.executable).parent / "ruff"
    return str(here) if here.exists() else shutil.which("ruff")


def test_the_tree_is_ruff_formatted():
    ruff = _ruff()
    if ruff is None:
        pytest.skip("ruff is not installed beside this python (make setup installs it)")
    done = subprocess.run(
        [ruff, "format", "--check", "src", "tests"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, f"ruff format would change files:\n{done.stdout}{done.stderr}"
