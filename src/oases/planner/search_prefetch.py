"""The fast plan search on two cores: while the search walks one chain, a forked copy of it
walks the chain it will probably walk next, and hands back what it computed; the search then
walks that chain as before, taking each answer from what came back instead of computing it.

    main process (``planner.search``)           worker (forked at the walk's start)
    chain 1: ask for chain 2 ------------------> chain 2 walked (its own caches)
             chain 1 walked                       |
    chain 2: <------------- answers of chain 2 ---'
             chain 2 walked from the answers
    chain 3: ask for chain 4 ------------------> chain 4 walked ...

What comes back are values of pure functions, keyed by their whole input: plans simulated
(``_Search.simulate``'s key: layers, the plan, the micro-batch, memory walked or not; a batch
that does not split comes back with its error), chain bounds (``_Search.skip``'s key) and
chain solves (``ChainModel.fastest``'s key: the chain's arrays and the limit). The main
process still makes every decision itself, in the same order, on the same values: a plan
simulated is counted when the walk first asks for it, whether its answer came back or was
computed there; an answer never asked for is never counted. So the plan chosen, every
candidate and every count are those of the walk on one core (``tests/test_search_exact.py``
compares the two).

Which chain comes next depends on the chain being walked (does memory bind? the fastest plan
that fits so far): ``_next`` guesses it from the walk's order and what the walk knew when
asking (a ZeRO stage above 1, a smaller micro-batch: only while memory bound the chain
before). A wrong guess costs the worker's time only. The worker is told the fastest step
that fits so far, so it skips a chain by its bounds only where the walk will skip it too
(that step only falls).

``PROCESSES``: 1 (no worker: the walk computes everything, as before) unless
``use_spare_core`` is called (``oases plan`` does): then 2 where the machine gives this process
two cores or more and can fork. A library call stays on one process: e.g. every rank of a
training run that plans with ``parallel.plan = "auto"`` searches at once, and a fork beside a
rank's communication threads is not safe.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from oases.planner.space import sub_batch_counts

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from oases.planner.search import _Search

Chain = tuple  # (micro-batch shape, ZeRO stage, schedule, sub-batch count)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not on Linux)
        return os.cpu_count() or 1


PROCESSES = 1


def use_spare_core() -> None:
    """Let the searches of this process use a second one (``PROCESSES`` 2), where it can."""
    global PROCESSES
    if _cores() >= 2 and "fork" in multiprocessing.get_all_start_methods():
        PROCESSES = 2


class Prefetch:
    """The worker of one walk (``start``: None where ``PROCESSES`` is 1): ``before`` is called
    before each chain the walk searches; ``close`` at the walk's end."""

    def __init__(self, search: _Search) -> None:
        ctx = multiprocessing.get_context("fork")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(search, theirs), daemon=True)
        self.proc.start()
        theirs.close()
        self.order = list(_order(search))
        self.waiting: list[Chain] = []  # asked, answers not read yet
        self.asked: set[Chain] = set()
        self.done: set[Chain] = set()
        self.broken = False

    @classmethod
    def start(cls, search: _Search) -> Prefetch | None:
        return cls(search) if PROCESSES > 1 else None

    def before(self, search: _Search, chain: Chain, tight: bool, binds: bool, floors: dict) -> None:
        """Chain ``chain`` is next: take its answers if asked for (waiting for them), else ask
        for the chain after it (``tight``: the last chain searched found memory binding;
        ``binds``: some chain of this micro-batch did; ``floors``: the walk's)."""
        self.done.add(chain)
        if chain in self.asked:
            self._take(search, chain)
            return
        following = self._next(search, chain, tight, binds, floors)
        if following is not None and not self.broken:
            try:
                self.conn.send((following, search.incumbent))
            except (OSError, EOFError):
                self.broken = True
                return
            self.asked.add(following)
            self.waiting.append(following)

    def _next(
        self, search: _Search, chain: Chain, tight: bool, binds: bool, floors: dict
    ) -> Chain | None:
        """The walk's next chain after ``chain``, guessed (see the module docstring)."""
        from oases.planner.search import BOUND_SLACK

        at = self.order.index(chain)
        for shape, zero, schedule, n_sub in self.order[at + 1 :]:
            if shape != chain[0] and not (binds or tight):
                return None  # a smaller micro-batch only while memory binds
            if zero != 1 and floors.get((schedule, n_sub), 0.0) * BOUND_SLACK >= search.incumbent:
                continue
            if zero >= 2 and not tight:
                continue
            nxt = (shape, zero, schedule, n_sub)
            if nxt not in self.asked and nxt not in self.done:
                return nxt
        return None

    def _take(self, search: _Search, chain: Chain) -> None:
        """Read answers until ``chain``'s has come, each merged into ``search``'s."""
        while chain in self.waiting and not self.broken:
            try:
                got, sims, bounds, solves = self.conn.recv()
            except (OSError, EOFError):
                self.broken = True
                return
            self.waiting.remove(got)
            for key, answer in sims.items():
                if key not in search.memo:
                    search.prefetched[key] = answer
            search.bounds.update(bounds)
            search.solves.update(solves)

    def close(self) -> None:
        with contextlib.suppress(OSError, EOFError):
            self.conn.send(None)
        self.conn.close()
        self.proc.join(timeout=5)
        if self.proc.is_alive():
            self.proc.kill()


def _order(search: _Search) -> Iterator[Chain]:
    """Every chain of the walk's order (``_Search.walk``), before its breaks."""
    for shape in sorted(search.shapes, key=lambda b: -b.micro_rows):
        for schedule in search.schedules:
            for n_sub in sub_batch_counts(schedule, search.n_subs, search.schedules):
                for zero in sorted(search.zeros):
                    if zero == 2 and shape.n_micro() == 1 and 1 in search.zeros:
                        continue
                    yield shape, zero, schedule, n_sub


def _serve(search: _Search, conn: Connection) -> None:
    """The worker: walk each chain asked for, told the fastest step that fits so far, and
    send back what it computed (in the order computed: the dicts' entries added since)."""
    from oases.planner.search import SearchStats

    search.progress, search.stats, search.prefetch = None, SearchStats(), None
    while True:
        try:
            msg = conn.recv()
        except (OSError, EOFError):
            return
        if msg is None:
            return
        chain, incumbent = msg
        search.fresh = {}
        n_bounds, n_solves = len(search.bounds), len(search.solves)
        search.incumbent = incumbent
        search.candidates, search.keys, search.models = [], set(), []
        with contextlib.suppress(Exception):  # the main process meets it again and says so
            search.search(*chain)
        bounds = dict(list(search.bounds.items())[n_bounds:])
        solves = dict(list(search.solves.items())[n_solves:])
        conn.send((chain, search.fresh, bounds, solves))
