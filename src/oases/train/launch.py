"""Starting ranks: one process per rank through torch's elastic launcher, or this process alone.

Outside ``torchrun``, ``launch(cfg, nproc)`` with ``nproc > 1`` starts ``nproc`` local ranks the
way ``torchrun --standalone`` does (a c10d rendezvous on 127.0.0.1 at a free port, spawned
workers) and each runs ``run_rank(cfg, num_threads)``. With ``max_restarts > 0`` the launcher
restarts every rank after a failure, up to that many times; with ``checkpoint.resume = "auto"``
the restarted ranks continue from the newest complete checkpoint (torchrun's ``--max-restarts``
does the same for a job it starts). Under ``torchrun`` (or with
``nproc == 1``) this process is the rank and calls ``run_rank`` directly.

A user error found inside a rank (a ``ValueError``) prints one ``error: ...`` line on stderr and
ends the rank with exit code 2; the launcher then stops the other ranks and returns non-zero.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import uuid
from typing import Any

import torch

from oases.config import Config
from oases.parallel.context import close_distributed, launched_by_torchrun

EXIT_USER_ERROR = 2
EXIT_RANK_FAILED = 1


def under_torchrun() -> bool:
    """True when this process was started by torchrun / torch elastic as one rank of a job."""
    return launched_by_torchrun()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_rank(cfg: Config, num_threads: int | None = None) -> dict[str, Any] | None:
    """Entry point of one rank: train ``cfg``; returns the summary on rank 0."""
    from oases.train.loop import PeerError, train  # workers import only what they run

    if num_threads is not None and not torch.cuda.is_available():
        torch.set_num_threads(num_threads)
    failed = False
    try:
        summary = train(cfg)
    except PeerError:  # another rank printed the error
        failed = True
    except ValueError as exc:  # user input (config, data): one line, no traceback
        print(f"error: {exc}", file=sys.stderr, flush=True)
        failed = True
    finally:
        close_distributed()
    if failed:
        # End here, not in interpreter teardown: after a failed setup, gloo's threads sometimes
        # abort it ("terminate called without an active exception"), adding a crash report
        # to the one-line error.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_USER_ERROR)
    return summary


def _quiet_elastic_logs() -> None:
    for name in (
        "torch.distributed.elastic",
        "torch.distributed.launcher",
        "torch.multiprocessing",
    ):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def launch(cfg: Config, nproc: int, max_restarts: int = 0) -> int:
    """Run ``cfg`` on ``nproc`` local ranks (or in this process when ``nproc == 1``), restarting
    the ranks up to ``max_restarts`` times after a failure (only through the elastic launcher).

    Returns the process exit code: 0 on success, non-zero when a rank failed.
    """
    if max_restarts < 0:
        raise ValueError(f"--max-restarts={max_restarts} must be >= 0")
    if under_torchrun() or (nproc == 1 and max_restarts == 0):
        run_rank(cfg)
        return 0
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _quiet_elastic_logs()
    on_cpu = cfg.parallel.backend == "gloo" or not torch.cuda.is_available()
    threads = max(1, (os.cpu_count() or 1) // nproc) if on_cpu else None
    os.environ.setdefault("OMP_NUM_THREADS", str(threads or 1))  # inherited by the workers
    port = free_port()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"oases-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{port}",
        rdzv_configs={"timeout": int(max(30, cfg.parallel.timeout_s))},
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        local_addr="127.0.0.1",
    )
    try:
        elastic_launch(config, run_rank)(cfg, threads)
    except ChildFailedError as exc:
        codes = {f.local_rank: f.exitcode for f in exc.failures.values()}
        if any(code != EXIT_USER_ERROR for code in codes.values()):
            ranks = ", ".join(f"rank {r} (exit code {c})" for r, c in sorted(codes.items()))
            print(f"error: training failed on {ranks}; see the output above", file=sys.stderr)
        return EXIT_USER_ERROR if set(codes.values()) == {EXIT_USER_ERROR} else EXIT_RANK_FAILED
    return 0
