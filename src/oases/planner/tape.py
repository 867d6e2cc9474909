"""A schedule program compiled once for the planner's fast walks: what ``tape_walk.walk_tape``
and ``peak_memory_tape.peak_memory_tape`` step through instead of the instruction objects.

A program (``schedule.program``) is a list of frozen ``Compute``/``Start``/``Wait``/``Release``
objects; the reference walks (``event_walk.simulate_program``, ``peak_memory.peak_memory``)
test each one's class and look its collective up by its (kind, index, sub) key. The search
walks the same few programs for hundreds of plans (every degree of a schedule shares one
program; only the prices differ), so ``compile_tape`` does that work once::

    program                              tape
    Compute(phase, pieces, sub)    ->    (COMPUTE, compute key id, 0)
    Start(kind, index, sub)        ->    (START, collective key id, slot)
    Wait(kind, index, sub)         ->    (WAIT, slot of the Start it waits, class id)
    Release(index)                 ->    (nothing: the event walk ignores it)

A compute key is a distinct (phase, pieces) (its price is the sum of its pieces, ``pieces``
lists them as (phase, piece, region) triples), a collective key a distinct (kind, index), a
slot one Start instruction (the Wait of a (kind, index, sub) waits the last Start of that key).
``classes`` names the class ids (``event_walk.COMM_CLASS``). A program that starts a key
again before waiting it, or waits one not started, is not compiled (``TapeError``): the
reference walks say what it means.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field

from oases.schedule.program import Compute, Instr, Piece, Start, Wait

COMPUTE, START, WAIT = 0, 1, 2
CLASSES = ("tp", "reshard", "dp")


_KEPT: dict | None = None  # inside ``tapes_kept``: every tape built, by its key
_THAWS = False  # the outermost ``tapes_kept`` unfreezes the collector's objects at its end


@contextlib.contextmanager
def tapes_kept() -> Iterator[None]:
    """Inside the block (a search), every tape ``kept_tape`` builds is kept until the
    outermost block ends; outside, only the callers' own caches keep them. A search asks for
    the same programs far apart (a chain's bounds up front, its walk later, its L-1 twin in
    between), more of them than a bounded cache holds: the 96-layer case at 24 GB built 1,596
    programs for 1,029 distinct ones with the last 256 kept (``benchmarks/2026-12-04-search``).

    What the search builds and keeps is frozen out of the cycle collector (``gc.freeze``
    after each tape built, ``gc.unfreeze`` when the outermost block ends, unless objects were
    frozen before it: then they stay so): each full collection walks every object still
    tracked, and a search's kept programs and memos are millions of them that live until it
    ends (the 96-layer case at 24 GB on one process: 7.0 s of 50 s in 17 full collections,
    0.08 s frozen; round 8 of the benchmark). Freezing changes no value (objects no longer
    referenced are freed by their counts as before; a cycle frozen waits until the thaw)."""
    global _KEPT, _THAWS
    outer = _KEPT
    if outer is None:
        _KEPT = {}
        _THAWS = gc.get_freeze_count() == 0  # (nobody else froze objects: ours to thaw)
    try:
        yield
    finally:
        _KEPT = outer
        if outer is None and _THAWS:
            gc.unfreeze()


def kept_tape(key: Hashable, build: Callable[[], Tape | None]) -> Tape | None:
    """``build()``, or the tape built for ``key`` inside the current ``tapes_kept``."""
    if _KEPT is None:
        return build()
    if key not in _KEPT:
        _KEPT[key] = build()
        gc.freeze()  # (kept until the search ends: see ``tapes_kept``)
    return _KEPT[key]


def kept_count() -> int:
    """How many tapes the current ``tapes_kept`` holds (0 outside one)."""
    return 0 if _KEPT is None else len(_KEPT)


class TapeError(ValueError):
    """The program is not one the tape walks (its reference walk handles it)."""


@dataclass
class Tape:
    """A compiled program (see the module docstring). ``program`` is the program itself, for
    the memory walk's own compilation (``peak_memory``), remembered per layout in ``memo``."""

    ops: list[tuple[int, int, int]]
    compute_keys: list[tuple[str, tuple[Piece, ...]]]
    coll_keys: list[tuple[str, int]]
    n_slots: int
    program: tuple[Instr, ...]
    memo: dict = field(default_factory=dict)

    def deferring(self) -> frozenset[int]:
        """``deferred_regions(program)``, remembered in ``memo``: read off the compute keys
        (every compute instruction's (phase, pieces) is one of them; far fewer)."""
        if "deferring" not in self.memo:
            self.memo["deferring"] = frozenset(
                i for _, pieces in self.compute_keys for kind, i in pieces if kind == "dw"
            )
        return self.memo["deferring"]

    def pieces(self) -> list[tuple[str, str, int]]:
        """Every distinct (phase, piece, region) of the compute keys, in first-use order."""
        if "pieces" not in self.memo:
            seen: dict[tuple[str, str, int], None] = {}
            for phase, pieces in self.compute_keys:
                for kind, region in pieces:
                    seen.setdefault((phase, kind, region), None)
            self.memo["pieces"] = list(seen)
        return self.memo["pieces"]


def compile_tape(program: list[Instr] | tuple[Instr, ...]) -> Tape:
    """``program`` as a ``Tape`` (TapeError where a key is started twice before its wait, or
    waited without a start)."""
    from oases.planner.event_walk import COMM_CLASS

    class_of = {
        kind: CLASSES.index(c) for kind, c in COMM_CLASS.items() if c in CLASSES
    }  # (a pipeline's point-to-point: walked by pipeline_walk)
    computes: dict[tuple[str, tuple[Piece, ...]], tuple[int, int, int]] = {}  # key -> its op
    coll_id: dict[tuple[str, int], int] = {}
    open_slots: dict[tuple[str, int, int], int] = {}
    ops: list[tuple[int, int, int]] = []
    append, slots = ops.append, 0
    for ins in program:
        kind = type(ins)
        if kind is Compute:
            key = (ins.phase, ins.pieces)
            op = computes.get(key)
            if op is None:
                op = computes[key] = (COMPUTE, len(computes), 0)
            append(op)
        elif kind is Start:
            name, index = ins.kind, ins.index
            if open_slots.setdefault((name, index, ins.sub), slots) != slots:
                raise TapeError(f"{(name, index, ins.sub)} started again before its wait")
            cid = coll_id.setdefault((name, index), len(coll_id))
            append((START, cid, slots))
            slots += 1
        elif kind is Wait:
            slot = open_slots.pop((ins.kind, ins.index, ins.sub), None)
            if slot is None:
                raise TapeError(f"{(ins.kind, ins.index, ins.sub)} waited without a start")
            append((WAIT, slot, class_of[ins.kind]))
    if open_slots:
        raise TapeError(f"program leaves collectives unwaited: {sorted(open_slots)}")
    return Tape(ops, list(computes), list(coll_id), slots, tuple(program))
