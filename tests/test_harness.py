"""The multi-rank harness itself (tests/distributed.py): a failed rank is reported first, with its
exception and traceback, and its peers' lost-connection errors follow as one-line echoes; a
blocked peer does not hold the test until the collective timeout; a hang is killed."""

from __future__ import annotations

import math
import os
import time

import pytest
import torch
import torch.distributed as dist

from distributed import Failure, failure_report, run_ranks


def _rank_fail_one(rank: int, world_size: int) -> None:
    if rank == 1:
        assert rank == 0, "deliberate failure on rank 1"
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that is gone


def _rank_hang(rank: int, world_size: int) -> None:
    time.sleep(600)


def _rank_capability(rank: int, world_size: int) -> tuple[str, str | None]:
    return torch.backends.cpu.get_cpu_capability(), os.environ.get("ATEN_CPU_CAPABILITY")


@pytest.mark.exact
def test_ranks_run_the_parents_cpu_kernels(spawn_ranks):
    """ATEN_CPU_CAPABILITY (default, avx2, avx512: the kernels other machines would pick)
    reaches the spawned ranks, so ``pytest -m exact`` under it tests those kernels."""
    parent = torch.backends.cpu.get_cpu_capability()
    for capability, env in spawn_ranks(_rank_capability, 2):
        assert (capability, env) == (parent, os.environ.get("ATEN_CPU_CAPABILITY"))
    print(
        f"ranks' CPU capability: {parent} (ATEN_CPU_CAPABILITY="
        f"{os.environ.get('ATEN_CPU_CAPABILITY')})"
    )


def test_real_failure_leads_and_peers_are_echoes_and_hangs_are_killed(tmp_path):
    with pytest.raises(AssertionError) as err:
        run_ranks(_rank_fail_one, 2, tmp_path)
    message = str(err.value)
    assert message.startswith("rank 1 of 2 failed: AssertionError: deliberate failure on rank 1")
    assert "--- rank 1's traceback:" in message and "_rank_fail_one" in message
    echo = [ln for ln in message.splitlines() if ln.startswith("  rank 0")]
    assert len(echo) == 1 and echo[0].startswith("  rank 0 (echo): RuntimeError:"), message
    # rank 0 learned of the failure from the closed connection, not the collective timeout
    assert "Timed out" not in echo[0], message
    with pytest.raises(AssertionError, match=r"ranks \[0, 1\] of 2 did not finish"):
        run_ranks(_rank_hang, 2, tmp_path, timeout_s=3)


def test_report_order_without_processes():
    """The real failure leads even when an echo was recorded earlier (a rank that crashed
    without a result has no time); echoes and other failures take one line each."""
    lost = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1234. " + "x" * 300
    failures = [
        Failure(0, 10.0, lost, "Traceback: rank 0"),
        Failure(2, math.inf, "exited with code -11 without a result", ""),
        Failure(3, 11.0, "RuntimeError: [gloo] Timed out waiting 30000ms for recv", "tb 3"),
    ]
    text = failure_report(failures, 4, 1.5, hung=[1])
    lines = text.splitlines()
    assert lines[0] == "rank 2 of 4 failed: exited with code -11 without a result"
    assert lines[1] == "other ranks (3 of 4 failed after 1.5s):"
    assert lines[2].startswith("  rank 0 (echo): RuntimeError: [pair.cc:553] Connection closed")
    assert len(lines[2]) < 220 and lines[2].endswith("...")
    assert lines[3].startswith("  rank 3 (echo): RuntimeError: [gloo] Timed out")
    assert lines[4] == "  rank 1: still running after the failure, killed"
    # two real failures: the earlier leads with its traceback, the later is one line
    real = [
        Failure(1, 5.0, "AssertionError: b\nmore", "tb 1"),
        Failure(0, 4.0, "ValueError: a", "tb 0"),
        Failure(2, 3.0, lost, "tb 2"),
    ]
    text = failure_report(real, 3, 2.0, hung=[])
    assert text.startswith("rank 0 of 3 failed: ValueError: a\n--- rank 0's traceback:\ntb 0")
    assert "  rank 1: AssertionError: b more" in text and "  rank 2 (echo):" in text
