"""The fast plan search on two cores: a forked worker walks the chains the search will probably
walk next, and hands back what it computed; the search walks each chain as before, taking each
answer from what came back instead of computing it. Neither process waits on the other while
a chain is left to guess: each takes the next chain of the guessed order that neither has
claimed, and the search, reaching a chain the worker is still walking, walks the next free one
meanwhile (a speculative walk: its answers kept aside, not counted), as the worker does.

    main process (``planner.search``)          worker (forked at the walk's start)
    chain 1 (claimed here) walked               chain 2 claimed, walked: answers sent
    chain 2: its answers taken                  chain 3 claimed, walked ...
    chain 3: the worker's still: chain 4        |
             claimed and walked aside here      chain 5 claimed ...
    chain 3: <--------------- answers ----------'
    chain 4 walked from the answers kept aside

What comes back are values of pure functions, keyed by their whole input: plans simulated
(``_Search.simulate``'s key: layers, the plan, the micro-batch, memory walked or not; a batch
that does not split comes back with its error), chain bounds (``_Search.skip``'s key) and
chain solves (``ChainModel.fastest``'s key: the chain's arrays and the limit). The main
process still makes every decision itself, in the same order, on the same values: a plan
simulated is counted when the walk first asks for it, whether its answer came back, was
computed aside or is computed there; an answer never asked for is never counted. So the plan
chosen, every candidate and every count are those of the walk on one core
(``tests/test_search_exact.py`` compares the two).

Which chains come next depends on the chains being walked (does memory bind? the fastest plan
that fits so far): ``_guesses`` guesses them from the walk's order and what the walk knew at
its last chain (a ZeRO stage above 1, a smaller micro-batch: only while memory bound the chain
before). A wrong guess costs the guesser's time only. A chain walked ahead is told the fastest
step that fits so far, so it skips a chain by its bounds only where the walk will skip it too
(that step only falls). Who walks a chain is settled by a claim (a shared array under a lock):
the first to claim it walks it, the other never does. Of the next few free chains guessed,
each process takes one whose programs it has built (``Prefetch.pick``: a chain's programs do
not depend on the micro-batch, only their prices): each process builds its own, and a
program built in both is work done twice (the 96-layer case at 24 GB: 857 programs built by
the two processes for 641 distinct ones, before this; 16.1 s -> 14.9 s, round 12 of
``benchmarks/2026-12-04-search``).

``PROCESSES``: 1 (no worker: the walk computes everything, as before) unless
``use_spare_core`` is called (``oases plan`` does): then 2 where the machine gives this process
two cores or more and can fork. A library call stays on one process: e.g. every rank of a
training run that plans with ``parallel.plan = "auto"`` searches at once, and a fork beside a
rank's communication threads is not safe.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import pickle
import queue
import threading
from collections import ChainMap
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from oases.planner.space import sub_batch_counts

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from oases.planner.search import _Search

Chain = tuple  # (micro-batch shape, ZeRO stage, schedule, sub-batch count)
FREE, MAIN, WORKER = 0, 1, 2  # a chain's claim


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not on Linux)
        return os.cpu_count() or 1


PROCESSES = 1


@contextlib.contextmanager
def one_process() -> Iterator[None]:
    """Inside the block, this process's searches run on one process (``PROCESSES`` 1), as it
    was set again after: for searches too short to pay for a worker's fork."""
    global PROCESSES
    spare, PROCESSES = PROCESSES, 1
    try:
        yield
    finally:
        PROCESSES = spare


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
        self.order = list(_order(search))
        self.index = {chain: i for i, chain in enumerate(self.order)}
        self.lock = ctx.Lock()
        self.claims = ctx.RawArray("b", len(self.order))
        self.walked: set[tuple] = set()  # this process's chains' ``_programs`` (each its own)
        self.answers, answers_w = ctx.Pipe(duplex=False)  # worker -> main
        states_r, self.states = ctx.Pipe(duplex=False)  # main -> worker
        self.proc = ctx.Process(target=_serve, args=(search, self, states_r, answers_w))
        self.proc.daemon = True
        self.proc.start()
        states_r.close()
        answers_w.close()
        self.answered: set[Chain] = set()
        self.broken = False
        self.aside = 0  # chains walked aside here (speculatively)
        self.known: dict[int, bool] = {}  # the walk's chains so far: did memory bind?
        self.last: int | None = None

    @classmethod
    def start(cls, search: _Search) -> Prefetch | None:
        if PROCESSES < 2:
            return None
        import scipy.optimize  # noqa: F401 (the chain bounds' linprog: imported once, here)

        return cls(search)

    def pick(self, guesses: Iterator[Chain], who: int) -> Chain | None:
        """Claim one of the next few free ``guesses`` for ``who``: the first whose programs
        this process has built (a chain of the same schedule, sub-batch count and ZeRO stage
        at another micro-batch: ``walked``), else the first; where the other process claimed
        them all meanwhile, the next free one after them."""
        free = []
        for chain in guesses:
            if self.claims[self.index[chain]] == FREE:
                free.append(chain)
                if _programs(chain) in self.walked or len(free) >= LOOK:
                    break
        ranked = sorted(free, key=lambda c: _programs(c) not in self.walked)
        for chain in itertools.chain(ranked, guesses):
            if self.claim(chain, who):
                self.walked.add(_programs(chain))
                return chain
        return None

    def claim(self, chain: Chain, who: int) -> bool:
        """Claim ``chain`` for ``who`` unless the other has: True if it is ``who``'s."""
        i = self.index[chain]
        with self.lock:
            if self.claims[i] == FREE:
                self.claims[i] = who
            return self.claims[i] == who

    def before(self, search: _Search, chain: Chain, tight: bool, binds: bool, floors: dict) -> None:
        """Chain ``chain`` is next (``tight``: the last chain searched found memory binding;
        ``binds``: some chain of this micro-batch did; ``floors``: the walk's): tell the worker,
        and where the worker has claimed it, walk guessed chains aside until its answers
        came."""
        if self.last is not None:
            self.known[self.last] = tight
        self.last = self.index[chain]
        state = (chain, tight, binds, dict(floors), search.incumbent, dict(self.known))
        if not self.broken:
            try:
                self.states.send(state)
            except (OSError, EOFError):
                self.broken = True
        while not self.broken and self.answers.poll():
            self._take(search)
        if self.claim(chain, MAIN):
            self.walked.add(_programs(chain))
            return  # walked here (or aside here already: its answers kept in ``prefetched``)
        while chain not in self.answered and not self.broken:
            if self.answers.poll():
                self._take(search)
                continue
            ahead = self.pick(_guesses(self, *state), MAIN)
            if ahead is None:
                self._take(search)  # nothing left to guess: wait
            else:
                self.aside += 1
                for key, answer in walk_aside(search, ahead).items():
                    if key not in search.memo:
                        search.prefetched[key] = answer

    def _take(self, search: _Search) -> None:
        """Read one chain's answers, merged into ``search``'s."""
        try:
            got, sims, bounds, solves = self.answers.recv()
        except (OSError, EOFError):
            self.broken = True
            return
        self.answered.add(got)
        for key, answer in sims.items():
            if key not in search.memo:
                search.prefetched[key] = answer
        search.bounds.update(bounds)
        search.solves.update(solves)

    def close(self) -> None:
        with contextlib.suppress(OSError, EOFError):
            self.states.send(None)
        self.states.close()
        self.answers.close()
        self.proc.terminate()  # (what it walks now is not needed)
        self.proc.join(timeout=5)
        if self.proc.is_alive():
            self.proc.kill()


SWAPPED = (
    "memo",
    "prefetched",
    "candidates",
    "keys",
    "models",
    "split_errors",
    "incumbent",
    "skipped",
    "stats",
    "fresh",
)


def walk_aside(search: _Search, chain: Chain) -> dict:
    """``search.search(*chain)`` walked without touching the walk's state: what it computed
    (``_Search.simulate``'s keys: (result, error)), the walk's memo and answers unchanged
    (the bounds and solves, pure, are kept in the search's)."""
    from oases.planner.search import SearchStats

    saved = {name: getattr(search, name) for name in SWAPPED}
    search.memo = ChainMap({}, saved["memo"])
    search.prefetched = dict(saved["prefetched"])
    search.candidates, search.keys, search.models = [], set(), []
    search.split_errors, search.stats, search.fresh = list(saved["split_errors"]), SearchStats(), {}
    try:
        with contextlib.suppress(Exception):  # the walk meets it again and says so
            search.search(*chain)
        return search.fresh
    finally:
        for name, value in saved.items():
            setattr(search, name, value)


def _order(search: _Search) -> Iterator[Chain]:
    """Every chain of the walk's order (``_Search.walk``), before its breaks."""
    for shape in sorted(search.shapes, key=lambda b: -b.micro_rows):
        for schedule in search.schedules:
            for n_sub in sub_batch_counts(schedule, search.n_subs, search.schedules):
                for zero in sorted(search.zeros):
                    if zero == 2 and shape.n_micro() == 1 and 1 in search.zeros:
                        continue
                    yield shape, zero, schedule, n_sub


def _guesses(
    prefetch: Prefetch,
    chain: Chain,
    tight: bool,
    binds: bool,
    floors: dict,
    incumbent: float,
    known: dict[int, bool],
) -> Iterator[Chain]:
    """The chains the walk will probably search after ``chain``, in its order, from what it
    knew before ``chain`` (see the module docstring), less those claimed by the other. The walk
    goes on past a ZeRO stage of 1 or more (to the next stage of its schedule and sub-batch
    count) only where memory bound it: known for the chains the walk searched (``known``, by
    their position in the order), guessed from the last chain of that micro-batch and stage it
    searched (``tight`` where none)."""
    from oases.planner.search import BOUND_SLACK

    claims, order, at = prefetch.claims, prefetch.order, prefetch.index[chain]
    like = {order[i][:2]: bound for i, bound in known.items()}  # (the walk's order: last wins)

    def goes_on(i: int) -> bool:  # past chain i (its ZeRO stage 1 or more)
        return known.get(i, like.get(order[i][:2], tight))

    group, on = _group(chain), chain[1] == 0 or goes_on(at)
    for i in range(at + 1, len(order)):
        shape, zero, schedule, n_sub = order[i]
        if shape != chain[0] and not (binds or tight):
            return  # a smaller micro-batch only while memory binds
        if _group(order[i]) != group:
            group, on = _group(order[i]), True
        if not on:
            continue
        if zero != 1 and floors.get((schedule, n_sub), 0.0) * BOUND_SLACK >= incumbent:
            on = False  # the walk breaks here
            continue
        if claims[i] == FREE:
            yield order[i]
        on = zero == 0 or goes_on(i)


LOOK = 4  # free guesses looked through for one whose programs are built (see ``pick``)


def _programs(chain: Chain) -> tuple:
    """What a chain's programs depend on beside the micro-batch's shape (which only prices
    them): its ZeRO stage, schedule and sub-batch count."""
    return chain[1:]


def _group(chain: Chain) -> tuple:
    """A chain's micro-batch, schedule and sub-batch count (its ZeRO stages follow)."""
    return chain[0], chain[2], chain[3]


def _serve(search: _Search, prefetch: Prefetch, states: Connection, answers: Connection) -> None:
    """The worker: claim the first free chain guessed from the walk's latest state, walk it
    aside, send back what it computed; wait for the walk's next state where none is left.
    Two threads beside it read the walk's states (the latest kept) and send the answers, so
    neither process waits on a full pipe."""
    prefetch.states.close()  # (the walk's ends: the worker sees its end of states as EOF)
    prefetch.answers.close()
    outbox: queue.Queue[bytes | None] = queue.Queue()
    box = {"state": None, "seq": 0}  # the walk's latest state, and how many came
    changed = threading.Condition()

    def send() -> None:
        with contextlib.suppress(OSError, EOFError):
            while (data := outbox.get()) is not None:
                answers.send_bytes(data)

    def receive() -> None:
        state = ()
        while state is not None:
            try:
                state = states.recv()
            except (OSError, EOFError):
                state = None
            with changed:
                box["state"], box["seq"] = state, box["seq"] + 1
                changed.notify()

    threading.Thread(target=send, daemon=True).start()
    threading.Thread(target=receive, daemon=True).start()
    search.progress, search.prefetch = None, None
    used, idle = 0, True
    while True:
        with changed:
            if idle:  # wait for a state not used yet
                changed.wait_for(lambda seen=used: box["seq"] > seen)
            state, used = box["state"], box["seq"]
        if state is None:
            break
        chain = prefetch.pick(_guesses(prefetch, *state), WORKER)
        idle = chain is None
        if idle:
            continue
        n_bounds, n_solves = len(search.bounds), len(search.solves)
        search.incumbent = state[4]
        fresh = walk_aside(search, chain)
        for key, (res, _) in fresh.items():  # not computed again here
            search.memo.setdefault(key, res)
        bounds = dict(list(search.bounds.items())[n_bounds:])
        solves = dict(list(search.solves.items())[n_solves:])
        outbox.put(pickle.dumps((chain, fresh, bounds, solves), pickle.HIGHEST_PROTOCOL))
    outbox.put(None)


class Beside:
    """``fn()`` run in a forked process beside the caller's own work, where this process may
    use a second core (``PROCESSES`` 2; else ``fn()`` runs when its result is asked): e.g.
    ``oases plan --pp``'s pipeline search, which reads nothing of the flat search, beside it.
    ``result()`` is ``fn()``'s answer, or raises its exception; the same value either way (a
    pure function of what the fork copied). The forked process runs its own searches on one
    process (it is the spare core); on a machine of two cores, so do the caller's until
    ``result()`` (``PROCESSES`` 1 meanwhile: three busy processes on two cores would slow the
    one beside, measured on ``oases plan --pp auto``: 22.7 s against 25.6 s one after the
    other, and less with the caller's own search on one process)."""

    def __init__(self, fn: Callable[[], object]) -> None:
        global PROCESSES
        self.fn = fn
        self.proc: multiprocessing.process.BaseProcess | None = None
        self.spare = PROCESSES
        if PROCESSES > 1:
            ctx = multiprocessing.get_context("fork")
            self.answer, send = ctx.Pipe(duplex=False)
            self.proc = ctx.Process(target=_beside, args=(fn, send), daemon=True)
            self.proc.start()
            send.close()
            if _cores() < 3:
                PROCESSES = 1

    def result(self) -> object:
        global PROCESSES
        if self.proc is None:
            return self.fn()
        PROCESSES = self.spare
        try:
            ok, value = self.answer.recv()
        except EOFError:
            raise RuntimeError(
                f"the process computing {getattr(self.fn, '__name__', 'a search')} beside "
                f"this one died (exit code {self.proc.exitcode})"
            ) from None
        finally:
            self.proc.join()
            self.answer.close()
        if not ok:
            raise value
        return value


def _beside(fn: Callable[[], object], send: Connection) -> None:
    global PROCESSES
    PROCESSES = 1
    try:
        out = (True, fn())
    except Exception as exc:  # (handed to the caller, who raises it)
        out = (False, exc)
    try:
        send.send(out)
    except Exception as exc:  # (an answer or error that does not pickle)
        send.send((False, RuntimeError(f"{type(exc).__name__}: {exc}")))
    send.close()
