"""The parts of the CUDA/NCCL path that a CPU can check: local ranks against visible GPUs, the
high-priority TP streams knob (ignored by gloo), releasing a replaced context's groups, and an
NCCL watchdog timeout reported in one line (by a rank and by the supervisor)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from oases.parallel import comm
from oases.parallel.context import (
    _group_options,
    check_local_devices,
    init_distributed,
    release_groups,
)
from oases.train.launch import EXIT_RANK_FAILED, nccl_timeout_line
from oases.train.rank_ends import error_line

# The watchdog's lines as ProcessGroupNCCL prints them (the format of torch's message: "[Rank r]
# Watchdog caught collective operation timeout: <work> ran for <ms> milliseconds before timing
# out."), written here for a rank 1 whose all-reduce waited on a stopped peer.
WATCHDOG_STDERR = """\
[rank1]:[E1202 14:03:11.512345678 ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught \
collective operation timeout: WorkNCCL(SeqNum=41, OpType=ALLREDUCE, NumelIn=16384, \
NumelOut=16384, Timeout(ms)=60000) ran for 60013 milliseconds before timing out.
[rank1]:[E1202 14:03:11.512400000 ProcessGroupNCCL.cpp:2054] [PG ID 2 PG GUID 5 Rank 1] \
Timeout at NCCL work: 41, last enqueued NCCL work: 41, last completed NCCL work: 40.
[rank1]:[E1202 14:03:11.512410000 ProcessGroupNCCL.cpp:669] [Rank 1] To avoid data \
inconsistency, we are taking the entire process down.
terminate called after throwing an instance of 'c10::DistBackendError'
  what():  [PG ID 2 PG GUID 5 Rank 1] Process group watchdog thread terminated with exception: \
[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=41, OpType=ALLREDUCE, \
NumelIn=16384, NumelOut=16384, Timeout(ms)=60000) ran for 60013 milliseconds before timing out.
Exception raised from checkTimeout at /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp
"""
EXPECTED = (
    "NCCL collective timed out on rank 1: ALLREDUCE (sequence number 41, elements "
    "16384) ran 60.0 s, over the 60 s limit (parallel.timeout_s); a peer stopped, died "
    "or issued another collective"
)


def test_local_ranks_must_not_outnumber_gpus():
    check_local_devices(0, 1, 1)
    check_local_devices(3, 4, 8)
    with pytest.raises(
        ValueError,
        match=r"4 ranks on this machine \(LOCAL_WORLD_SIZE=4, "
        r"LOCAL_RANK=1\) but 2 visible GPU\(s\).*"
        r"--nproc-per-node=2",
    ):
        check_local_devices(1, 4, 2)
    with pytest.raises(ValueError, match="LOCAL_RANK=2"):
        check_local_devices(2, 1, 2)  # no LOCAL_WORLD_SIZE given: the rank itself
    with pytest.raises(ValueError, match="none is visible"):
        check_local_devices(0, 1, 0)


def test_high_priority_streams_only_on_nccl():
    assert _group_options("gloo", True) is None
    assert _group_options("nccl", False) is None


def test_nccl_timeout_in_one_line():
    assert nccl_timeout_line(WATCHDOG_STDERR) == EXPECTED
    assert nccl_timeout_line("RuntimeError: CUDA error: an illegal memory access") is None
    assert "NCCL collective timed out" in nccl_timeout_line(
        "[Rank 0] Watchdog caught collective operation timeout: in a new format"
    )


def test_supervisor_reads_the_timeout_from_an_error_file(tmp_path):
    path = tmp_path / "error.json"
    path.write_text(
        json.dumps(
            {"message": {"message": "DistBackendError: " + WATCHDOG_STDERR.split("what():  ")[1]}}
        )
    )
    assert error_line(str(path)) == EXPECTED


def test_a_rank_prints_the_timeout_in_one_line_and_exits_1(tmp_path):
    """run_rank with a training that fails as a blocking NCCL wait does."""
    code = f"""
import oases.train.loop as loop
from oases.config import Config
from oases.train.launch import run_rank
def train(cfg):
    raise RuntimeError({WATCHDOG_STDERR.split("what():  ")[1]!r})
loop.train = train
cfg = Config()
cfg.train.run_dir = {str(tmp_path)!r}
run_rank(cfg)
"""
    src = Path(__file__).resolve().parent.parent / "src"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == EXIT_RANK_FAILED, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: {EXPECTED}"]


def _rank_groups(rank, world_size):
    first = init_distributed(tp=1, high_priority_tp=True)  # gloo ignores the knob
    pgs = [g.pg for pair in first.groups.values() for g in pair if g.pg is not None]
    live = dist.distributed_c10d._world.pg_map
    assert pgs and all(pg in live for pg in pgs)
    release_groups(first)
    released = not any(pg in live for pg in pgs) and dist.group.WORLD in live
    ctx = init_distributed(tp=2, degrees=(1,), high_priority_tp=True)
    x = comm.all_reduce_(torch.ones(3), ctx.tp_group)
    return released, x.tolist()


def test_a_replaced_context_releases_its_groups(spawn_ranks):
    for released, x in spawn_ranks(_rank_groups, 2):
        assert released and x == [2.0, 2.0, 2.0]


def test_token_ids_are_read_on_the_host_only():
    from oases.config import ModelConfig
    from oases.model import check_batch

    cfg = ModelConfig(vocab_size=10, seq_len=4)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, model.vocab_size=10\), got"):
        check_batch(cfg, torch.tensor([[1, 2, 12]]))  # a host batch: checked, clear error
    # a device batch is not read (int(t.min()) would wait for the device every step; the
    # training loop checks the batch on the host before moving it): "meta" stands in here
    check_batch(cfg, torch.empty((1, 3), dtype=torch.long, device="meta"))
