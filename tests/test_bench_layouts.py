"""``oases bench --layouts``: layout entries parsed and fitted before any rank starts, and one
tiny run laying the model out as TP, DP with ZeRO, our pipeline and PyTorch's pipelining."""

import json
import subprocess
import sys

import pytest

from distributed import REPO_ROOT
from oases.bench.layouts import Layout, check_layouts, parse_layout
from oases.config import load_config


def test_parse_layout():
    assert parse_layout("megatron@tp=1,zero=1") == Layout("megatron", 1, 1, 1, "1f1b")
    assert parse_layout("oases@pp=2,pps=1f1b-pair") == Layout("oases", 1, 2, 0, "1f1b-pair")
    assert parse_layout("torch-pp@pp=2") == Layout("torch-pp", 1, 2, 0, "1f1b")
    assert parse_layout("torch-pp@pp=2,pps=zb") == Layout("torch-pp", 1, 2, 0, "zb", 2)
    assert parse_layout("torch-pp@pp=2,pps=interleaved,v=3").v == 3
    for bad, want in (
        ("megatron@tp=x", "expected"),
        ("megatron@dp=2", "expected"),
        ("nope@tp=1", "unknown schedule"),
        ("megatron@pp=2,pps=zz", "zz"),
        ("torch-pp@pp=2,zero=1", "torch-pp runs"),
        ("torch-pp@pp=2,pps=1f1b-pair", "torch-pp runs"),
        ("torch-pp@pp=2,pps=interleaved,v=1", "v >= 2 exactly under"),
        ("torch-pp@pp=2,pps=1f1b,v=2", "v >= 2 exactly under"),
    ):
        with pytest.raises(ValueError, match=want):
            parse_layout(bad)


def test_check_layouts_fits_ranks_and_batch():
    cfg = load_config(str(REPO_ROOT / "configs" / "tiny.toml"), [])  # 4 sequences, 2 a micro
    assert len(check_layouts(["megatron@tp=2", "megatron@pp=2"], 2, cfg)) == 2
    with pytest.raises(ValueError, match="does not divide 2 ranks"):
        check_layouts(["megatron@tp=4"], 2, cfg)
    with pytest.raises(ValueError, match="torch-pp's pp must be the world"):
        check_layouts(["torch-pp@pp=2"], 4, cfg)
    with pytest.raises(ValueError, match="does not split into micro-batches of 2 over dp=4"):
        check_layouts(["megatron@tp=1"], 4, cfg)


@pytest.mark.slow
def test_bench_layouts_side_by_side(tmp_path):
    entries = ["megatron@tp=2", "megatron@tp=1,zero=1", "megatron@pp=2,pps=zb-h1", "torch-pp@pp=2"]
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
            "1",
            "--nproc-per-node",
            "2",
            "--out",
            str(tmp_path),
            "--model.n_layers=4",
            "--layouts",
            *entries,
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "layouts.json").read_text())
    assert list(result["layouts"]) == entries
    for row in result["layouts"].values():
        assert row["median_step_s"] > 0 and row["tokens_per_s"] > 0
    assert result["layouts"]["megatron@tp=2"]["vs_first"] == 1.0
    assert "| `torch-pp@pp=2` |" in (tmp_path / "layouts.md").read_text()
