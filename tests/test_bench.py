"""``oases bench`` end to end on a tiny model (unshaped): the runner, the table, the report."""

import json
import subprocess
import sys

from distributed import REPO_ROOT


def test_bench_runs_schedules_side_by_side(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "oases",
            "bench",
            "configs/tiny.toml",
            "--link",
            "none",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--schedules",
            "megatron,oases,merak",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert set(result["schedules"]) == {"megatron", "oases", "merak"}
    for row in result["schedules"].values():
        assert row["median_step_s"] > 0 and row["predicted_step_s"] > 0
    assert (tmp_path / "report.md").is_file() and (tmp_path / "bench.png").is_file()
    assert "limit" in proc.stdout


def test_bench_rejects_an_unknown_schedule(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "oases",
            "bench",
            "configs/tiny.toml",
            "--link",
            "none",
            "--schedules",
            "megatron,nope",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert proc.returncode == 2 and "unknown schedule" in proc.stderr
