"""The collective model (planner/collectives.py) against the public figures it rests on
(tests/data/collective_figures.json: nccl-tests bus bandwidths and the Oases paper's profile,
each with its source). Error = predicted time / the figure's time - 1.

benchmarks/2026-12-02-collectives/collectives.py prints the same comparison as a table. Where
a preset misses 15% the bound below is its measured error, a guard against getting worse, and
the report says why it misses."""

from __future__ import annotations

import json
import statistics

import pytest

from distributed import REPO_ROOT
from oases.planner.clusters import cluster_from_dict, get_cluster
from oases.planner.collectives import OPS, bus_factor, collective

FIGURES = json.loads((REPO_ROOT / "tests" / "data" / "collective_figures.json").read_text())


def errors(preset: str, held_out_only: bool = False, op: str | None = None) -> list[float]:
    out = []
    for s in FIGURES["sets"]:
        if s["preset"] != preset or op not in (None, s["op"]):
            continue
        cluster = (
            get_cluster(s["cluster"])
            if isinstance(s["cluster"], str)
            else cluster_from_dict(s["cluster"])
        )
        for size, busbw in s["busbw_GBps"].items():
            if held_out_only and size in s["sets_preset"]:
                continue
            nbytes = int(size)
            figure_s = bus_factor(s["op"], len(s["ranks"])) * nbytes / (busbw * 1e9)
            out.append(collective(cluster, s["op"], s["ranks"], nbytes).seconds / figure_s - 1)
    return out


def test_every_figure_names_its_source_and_fits_the_grid():
    assert FIGURES["sets"]
    for s in FIGURES["sets"]:
        assert s["source"] and s["op"] in OPS and s["busbw_GBps"]
        assert set(s["sets_preset"]) <= set(s["busbw_GBps"])
        latency = s.get("latency_sizes", [])
        assert all(int(size) < (1 << 20) for size in latency)
        for size in s["busbw_GBps"]:
            in_grid = (1 << 20) <= int(size) <= (1 << 30)
            assert size in s["sets_preset"] or size in latency or in_grid


def test_host_staged_pcie_within_15_percent():
    """PCIe 3.0 GeForce pair without peer-to-peer: the all-reduce at 1 GiB sets the both-ways
    rate; the other ten all-reduce sizes and the all-gather curve are held out."""
    assert statistics.median(abs(e) for e in errors("pcie3-x16-geforce")) <= 0.15
    assert statistics.median(abs(e) for e in errors("pcie3-x16-geforce", True)) <= 0.15


@pytest.mark.parametrize("preset", ["h100-nvlink", "a100-ib-64"])
def test_presets_reproduce_the_figures_they_are_taken_from(preset):
    assert max(abs(e) for e in errors(preset)) <= 0.01


def test_the_papers_world_all_reduces():
    """The paper's profile all-reduces (32 GPUs, 16-64 MiB), held out: 4-19%."""
    assert statistics.median(abs(e) for e in errors("paper-3090-pcie-32")) <= 0.20


def test_nvswitch_a100_misses_15_percent_below_64_mib():
    """8x A100 in one process, one thread driving all 8 GPUs (nccl-tests -g 8, NCCL 2.8-2.10:
    34 us at 0 bytes): NCCL's tuner model is optimistic below 64 MiB, all-gather and
    reduce-scatter most (medians 41% and 35%, all-reduce 18%), within 15% from 256 MiB.
    Median 25.8%: a known miss (benchmarks/2026-12-02-collectives says why), guarded here."""
    errs = errors("a100-nvlink")
    assert statistics.median(abs(e) for e in errs) <= 0.26
    assert max(abs(e) for e in errs) <= 0.71
    assert all(e < 0 for e in errs)  # optimistic everywhere, never slower than measured
    assert statistics.median(abs(e) for e in errors("a100-nvlink", op="all_reduce")) <= 0.19


def test_nvswitch_a100_miss_repeats_over_729_nodes_in_the_same_mode():
    """The same all-reduce, same single-process mode, averaged over 729 Azure NDm A100 v4 nodes
    (SuperBench v0.4 golden data): the same miss, so it is the mode, not one machine."""
    errs = errors("a100-nvlink-azure-729")
    assert statistics.median(abs(e) for e in errs) <= 0.19
    assert all(e < 0 for e in errs)


def test_nvswitch_a100_one_process_per_gpu_within_15_percent():
    """8x A100-80GB, one process per GPU (as torch.distributed runs), NCCL 2.17.1: all-gather and
    all-reduce at 1 KiB (latency) and 1 GiB (bandwidth), held out, every one within 15%."""
    errs = errors("a100-nvlink-nccl2.17")
    assert len(errs) == 4 and max(abs(e) for e in errs) <= 0.15
