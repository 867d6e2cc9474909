"""``oases train`` starts its ranks before importing torch: its parser, the config and the
launcher's modules import neither torch nor numpy (each rank imports torch once, itself)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PROBE = """
import contextlib, io, sys
from oases.cli import main
for line in (["--help"], ["train", "--help"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main(line)
from oases.config import load_config
load_config("configs/default.toml", ["--train.precision=fp64"])
import oases.train.launch, oases.train.supervise, oases.train.rank_group
print(sorted(m for m in ("torch", "numpy") if m in sys.modules))
"""


def test_the_launcher_imports_no_torch():
    env_path = str(REPO / "src")
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=REPO,
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
