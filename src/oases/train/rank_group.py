"""One attempt's local ranks, started by a supervisor that never imports torch: each rank
imports torch (and the training loop) once, in its own process, while the others do the same.

The order of operations (``supervise.run_attempt`` drives the supervisor's side)::

    supervisor (no torch)                      rank r (a spawned process)
    listen on 127.0.0.1:0 (the system picks
      the port: no race with other programs)
    RankGroup(...): spawn ranks 0..n-1  ---->  its environment (RANK, MASTER_PORT=the port,
                                               TORCHELASTIC_USE_AGENT_STORE, ...)
                                               import torch and the training loop
                                               rank 0 with a ``check`` (the first attempt):
                                               the launcher's checks; a user error is one
                                               ``error:`` line and exit code 2, else
    group.report() <------------------------   its result (the resume point)
    group.go(cfg, threads)              ---->  rank 0: the attempt's rendezvous store (a
                                               TCPStore server on the inherited socket,
                                               held until it ends; every rank, rank 0
                                               too, joins it as a client, as torchrun's
                                               agent store)
                                               launch.run_rank(cfg, threads)
    group.exitcode(r) / pids: polls, as supervise says
    group.close(): SIGKILL every rank still running, reap all

An exception that ends a rank is written to its ``error.json`` (torch elastic's format:
``{"message": {"message": "Type: text", "extraInfo": {...}}}``) for the supervisor's failure
line (``rank_ends.error_line``). A rank whose supervisor closed the gate without a go (the
checks failed, or it was stopped) ends quietly.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from oases.config import Config


class RankGroup:
    """``nproc`` ranks of one attempt (spawned), each waiting for ``go`` after its imports.

    ``envs[r]``: rank r's environment on top of this one; ``listen``: the listening socket of
    the rendezvous store, handed to rank 0 (the caller closes its own copy); ``check``: run by
    rank 0 before the go, its result read by ``report`` (None: no check, go at once).
    """

    def __init__(
        self,
        envs: dict[int, dict[str, str]],
        error_dir: Path,
        listen: socket.socket,
        check: Callable[[], Any] | None = None,
    ) -> None:
        spawn = multiprocessing.get_context("spawn")
        error_dir.mkdir(parents=True, exist_ok=True)
        self.error_files = {r: str(error_dir / f"rank_{r}.json") for r in envs}
        self._gates: list[Connection] = []
        self._report: Connection | None = None
        self._procs: dict[int, multiprocessing.process.BaseProcess] = {}
        for r, env in envs.items():
            gate, self_gate = spawn.Pipe(duplex=False)
            report = None
            if r == 0 and check is not None:
                self._report, report = spawn.Pipe(duplex=False)
            proc = spawn.Process(
                target=_rank_main,
                args=(env, self.error_files[r], gate, report, listen if r == 0 else None, check),
                name=f"oases-rank-{r}",
            )
            proc.start()
            gate.close()
            if report is not None:
                report.close()
            self._gates.append(self_gate)
            self._procs[r] = proc
        self.pids = {r: int(p.pid or 0) for r, p in self._procs.items()}

    def report(self) -> tuple[bool, Any]:
        """(True, the check's result) once rank 0 has sent it, else (False, None); never
        blocks."""
        if self._report is None or not self._report.poll():
            return False, None
        try:
            return True, self._report.recv()
        except EOFError:  # rank 0 ended without a result: its exit code tells why
            self._report = None
            return False, None

    def go(self, cfg: Config, threads: int | None) -> None:
        """Let every rank run ``run_rank(cfg, threads)``."""
        for gate in self._gates:
            with contextlib.suppress(OSError):  # a rank already gone: the polls see it
                gate.send((cfg, threads))

    def exitcode(self, rank: int) -> int | None:
        """Rank ``rank``'s exit code (-N: ended by signal N), or None while it runs."""
        return self._procs[rank].exitcode

    def close(self) -> None:
        """SIGKILL every rank still running (a stopped one too: it cannot act on SIGTERM) and
        reap them all, so nothing of the attempt is left when the next one starts."""
        for gate in self._gates:
            gate.close()
        for proc in self._procs.values():
            if proc.exitcode is None and proc.pid is not None:  # not reaped: still our child
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
        for proc in self._procs.values():
            proc.join(10)
        if self._report is not None:
            self._report.close()


def _rank_main(
    env: dict[str, str],
    error_file: str,
    gate: Connection,
    report: Connection | None,
    listen: socket.socket | None,
    check: Callable[[], Any] | None,
) -> None:
    """One rank: imports, rank 0's check, the go, rank 0's store, ``run_rank``."""
    os.environ.update(env)
    from oases.train import loop  # noqa: F401  (what run_rank runs: imported before the go)
    from oases.train.launch import EXIT_USER_ERROR, run_rank

    if check is not None and report is not None:
        try:
            result = check()
        except ValueError as exc:  # user input: the one line of the whole run
            print(f"error: {exc}", file=sys.stderr, flush=True)
            os._exit(EXIT_USER_ERROR)
        report.send(result)
        report.close()
    try:
        cfg, threads = gate.recv()
    except EOFError:  # no go: the supervisor ended the attempt
        os._exit(0)
    store = None if listen is None else _host_store(listen, int(env["WORLD_SIZE"]), cfg)
    try:
        run_rank(cfg, threads)
    except Exception as exc:
        _write_error_file(error_file, exc)
        raise
    finally:
        del store  # the rendezvous server stops with its rank


def _host_store(listen: socket.socket, world_size: int, cfg: Config) -> Any:
    """The attempt's rendezvous store: a TCPStore server on the socket the supervisor bound."""
    import datetime

    from torch.distributed import TCPStore

    return TCPStore(
        "127.0.0.1",
        0,
        world_size=world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=cfg.parallel.timeout_s),
        master_listen_fd=listen.detach(),  # the store owns (and closes) the descriptor
    )


def _write_error_file(path: str, exc: BaseException) -> None:
    """The exception that ends a rank, in torch elastic's ``error.json`` format."""
    message = {
        "message": f"{type(exc).__name__}: {exc}",
        "extraInfo": {"py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))},
    }
    with contextlib.suppress(OSError):
        Path(path).write_text(json.dumps({"message": message}), encoding="utf-8")
