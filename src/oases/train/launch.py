"""Starting ranks: one process per rank, supervised, or this process alone.

Outside ``torchrun``, ``launch(cfg, nproc, max_restarts)`` with ``nproc > 1`` (or any
``max_restarts``) hands the group to ``train.supervise``: each attempt spawns ``nproc`` local
ranks (``train.rank_group``) on a fresh rendezvous (a new store on 127.0.0.1) and each rank runs
``run_rank(cfg, num_threads)``; after a rank dies, hangs or fails, the whole group restarts from
the newest valid checkpoint, up to ``max_restarts`` times (see ``supervise.py``). Under
``torchrun`` (or with ``nproc == 1`` and no restarts) this process is the rank: it makes the
launcher's checks (``check_launch``) and calls ``run_rank``; torchrun's own ``--max-restarts``
then decides.

This module imports no torch (``run_rank`` imports it when it runs): ``oases train`` parses
its line and starts its ranks first, so the one torch import of each rank overlaps the others',
and the launcher's checks run in the first attempt's rank 0, after its imports.

    oases train ... -> load_config (no torch) -> launch
      one process:  check_launch -> run_rank
      supervised:   spawn the ranks -> each imports torch -> rank 0: check_launch (a user
                    error: its one line, exit 2, no other rank trains) -> every rank: run_rank

A user error found inside a rank (a ``ValueError``) prints one ``error: ...`` line on stderr and
ends the rank with exit code 2; the supervisor then stops the other ranks, restarts nothing and
returns 2.

An NCCL collective timeout is found by NCCL's watchdog thread, whose message ("[Rank r]
Watchdog caught collective operation timeout: WorkNCCL(SeqNum=.., OpType=.., ...) ran for ..
milliseconds before timing out.") comes wrapped in a ``DistBackendError`` and a C++ trace.
``nccl_timeout_line`` turns it into one line (which rank, which collective, how long, the
limit); a rank that catches such an error prints that line and ends with exit code 1 (not a
user error: the supervisor may restart the group), and the supervisor's failure line uses it
for a rank's ``error.json`` (``rank_ends.error_line``).
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

from oases.config import Config  # no torch here: the launcher starts the ranks without it

EXIT_USER_ERROR = 2
EXIT_RANK_FAILED = 1

_NCCL_TIMEOUT = re.compile(
    r"\[Rank (?P<rank>\d+)\] Watchdog caught collective operation timeout: "
    r"WorkNCCL\((?P<work>[^)]*(?:\([^)]*\)[^)]*)*)\) ran for (?P<ms>\d+) milliseconds"
)


def nccl_timeout_line(text: str) -> str | None:
    """One line for the first NCCL watchdog timeout in ``text`` (a rank's stderr or an
    exception's message), or None when there is none: the rank, the collective (its kind,
    sequence number and elements), how long it ran and the limit (``parallel.timeout_s``)."""
    m = _NCCL_TIMEOUT.search(text)
    if m is None:
        if "Watchdog caught collective operation timeout" in text:  # a format not known here
            return "NCCL collective timed out (ProcessGroupNCCL watchdog; see the rank's log)"
        return None
    fields = dict(kv.split("=", 1) for kv in m["work"].split(", ") if "=" in kv)
    op = fields.get("OpType", "a collective")
    what = ", ".join(
        f"{k} {fields[key]}"
        for k, key in (("sequence number", "SeqNum"), ("elements", "NumelIn"))
        if key in fields
    )
    limit = fields.get("Timeout(ms)")
    over = (
        f", over the {int(limit) / 1000:g} s limit (parallel.timeout_s)"
        if limit and limit.isdigit()
        else ""
    )
    return (
        f"NCCL collective timed out on rank {m['rank']}: {op}"
        + (f" ({what})" if what else "")
        + f" ran {int(m['ms']) / 1000:.1f} s{over}; "
        "a peer stopped, died or issued another collective"
    )


def under_torchrun() -> bool:
    """True when this process was started by torchrun / torch elastic as one rank of a job
    (read from the environment, without importing torch)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def run_rank(cfg: Config, num_threads: int | None = None) -> dict[str, Any] | None:
    """Entry point of one rank: train ``cfg``; returns the summary on rank 0."""
    import torch

    from oases.parallel.context import close_distributed
    from oases.train import faults
    from oases.train.agree import PeerError  # workers import only what they run
    from oases.train.loop import train

    if num_threads is not None:  # a CPU rank's share of the cores; a GPU rank needs one
        on_cpu = cfg.parallel.backend == "gloo" or not torch.cuda.is_available()
        torch.set_num_threads(num_threads if on_cpu else 1)
    failed = False
    try:
        faults.arm(cfg.train.run_dir)  # testing hook: a no-op unless OASES_FAULT is set
        summary = train(cfg)
    except PeerError:  # another rank printed the error
        failed = True
    except ValueError as exc:  # user input (config, data): one line, no traceback
        print(f"error: {exc}", file=sys.stderr, flush=True)
        failed = True
    except RuntimeError as exc:  # an NCCL timeout in one line; anything else as it is
        line = nccl_timeout_line(str(exc))
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_RANK_FAILED)  # not a user error: the supervisor may restart
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


def check_launch(cfg: Config, world_size: int | None) -> None:
    """The launcher's checks of user input before any rank trains: the config against
    ``world_size`` (None under torchrun: each rank checks against the real world size) on a
    copy (each rank resolves the config as given, and rank 0 names, once, the settings that
    have no effect), and ``data.source``. A ValueError names what is wrong."""
    import copy

    from oases.train.data import check_source
    from oases.train.setup import check_config

    if world_size is not None:
        check_config(copy.deepcopy(cfg), world_size)
    check_source(cfg.data.source)


def launch(cfg: Config, nproc: int, max_restarts: int = 0) -> int:
    """Run ``cfg`` on ``nproc`` local ranks (or in this process when ``nproc == 1`` and no
    restart is asked for), restarting the whole group up to ``max_restarts`` times after a
    failure (``train.supervise``).

    Returns the process exit code: 0 on success, ``EXIT_USER_ERROR`` when a rank reported a
    user error, ``EXIT_RANK_FAILED`` when the ranks failed and no restart was left.
    """
    if max_restarts < 0:
        raise ValueError(f"--max-restarts={max_restarts} must be >= 0")
    if under_torchrun() or (nproc == 1 and max_restarts == 0):
        check_launch(cfg, None if under_torchrun() else nproc)
        run_rank(cfg)
        return 0
    from oases.train.supervise import supervise  # the first attempt's rank 0 checks

    # each rank's share of the cores, unless it runs on a GPU (nccl; with "auto" the rank
    # itself sees whether it has one: run_rank)
    threads = max(1, (os.cpu_count() or 1) // nproc) if cfg.parallel.backend != "nccl" else None
    os.environ.setdefault("OMP_NUM_THREADS", str(threads or 1))  # inherited by the workers
    return supervise(cfg, nproc, max_restarts, threads)
