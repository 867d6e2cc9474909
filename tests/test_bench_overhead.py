"""``oases bench --overhead``: the structure of its table and files on a tiny model (one
process, tp=1; no speed is asserted)."""

import json

import pytest
import torch

from oases.bench.overhead import format_overhead, parse_overhead_entry, run_overhead
from oases.cli import main
from oases.config import ModelConfig

TINY = {"tiny": ModelConfig(n_layers=2, dim=16, n_heads=2, seq_len=8, vocab_size=32)}


def test_overhead_rows_and_files(tmp_path):
    entries = ["megatron", "oases@k=2"]
    result = run_overhead(TINY, entries, steps=1, warmup=0, out=tmp_path)
    rows = result["models"]["tiny"]["entries"]
    assert [r["entry"] for r in rows] == entries
    for r in rows:
        assert r["plain_s"] > 0 and r["schedule_s"] > 0
        assert r["ratio"] == pytest.approx(r["schedule_s"] / r["plain_s"])
        assert r["pieces"] >= r["computes"] > 0 and r["host_per_piece_s"] >= 0
        assert r["executor_ops"] == pytest.approx(r["host_per_piece_s"] / result["host_op_s"])
        assert r["plain_k_s"] > 0
        assert r["ratio_k"] == pytest.approx(r["schedule_s"] / r["plain_k_s"])
    assert rows[0]["plain_k_s"] == rows[0]["plain_s"]  # k = 1: the plain step is the floor
    assert rows[1]["pieces"] > rows[0]["pieces"]  # two sub-batches: each piece twice, and more
    saved = json.loads((tmp_path / "overhead.json").read_text())
    assert saved["models"]["tiny"]["entries"][0]["entry"] == "megatron"
    assert "machine" in saved
    assert (tmp_path / "overhead.md").read_text().strip() == format_overhead(result)


def test_overhead_entries_are_checked():
    assert parse_overhead_entry("oases@k=4") == ("oases", 4)
    assert parse_overhead_entry("megatron") == ("megatron", 1)
    with pytest.raises(ValueError, match="NAME@k=K"):
        parse_overhead_entry("oases@n=2")
    with pytest.raises(ValueError, match="steps=0"):
        run_overhead(TINY, ["megatron"], steps=0, warmup=0)


def test_cli_overhead_flag_is_parsed(monkeypatch, tmp_path):
    seen = {}

    def fake(models, entries, steps, warmup, out, graphs):  # noqa: ANN001, ANN202
        seen.update(
            models=list(models), entries=entries, steps=steps, warmup=warmup, out=out, graphs=graphs
        )

    monkeypatch.setattr("oases.bench.overhead.run_overhead", fake)
    assert (
        main(["bench", "--overhead", "--schedules", "megatron,oases@k=4", "--out", str(tmp_path)])
        == 0
    )
    assert seen["models"] == ["gpt2-24x64", "gpt2-8x512"]
    assert seen["entries"] == ["megatron", "oases@k=4"] and seen["steps"] == 9
    assert seen["graphs"] is False


def test_cuda_graphs_flag_needs_overhead_and_a_gpu(tmp_path, capsys):
    assert main(["bench", "--cuda-graphs", "--out", str(tmp_path)]) != 0
    assert "--cuda-graphs goes with --overhead" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--cuda-graphs needs a CUDA device"):
            run_overhead(TINY, ["megatron"], steps=1, warmup=0, graphs=True)
