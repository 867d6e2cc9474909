"""What every collective reports as it is issued: ``CollectiveRecord``, the issue hooks.

Every collective of ``oases.parallel.comm`` calls ``_issue`` just before it starts, so a test
(or the timeline) can see each one with ``record_collectives()``, and a tool can act on each
one with ``add_issue_hook(fn)`` (the fault injection of ``train/faults.py`` does)::

    with record_collectives() as log:      # a CollectiveRecord per collective issued inside
        ...
    remove = add_issue_hook(fn)            # fn(record) before each one, until remove()
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from torch import Tensor

from oases.parallel.context import Group


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as issued: what, over which group, how big (bytes of the tensor it
    reduces or gathers, in ``dtype``), in which pass; a point-to-point "send" or "recv" names
    its ``peer`` (a global rank; -1 for a collective)."""

    seq: int
    op: str  # "all_reduce" | "all_gather" | "reduce_scatter" | "send" | "recv"
    group: str  # the group's name: "tp", "dp", ...
    group_size: int
    nbytes: int
    direction: str  # "forward" | "backward"
    tag: str
    is_async: bool
    issued_ns: int
    dtype: str = ""  # e.g. "torch.bfloat16"
    peer: int = -1


# Instrumentation only (like a profiler): the callbacks called with every collective as it is
# issued. Not process state that changes results; empty unless a caller is inside
# ``record_collectives()`` or added a hook.
_HOOKS: list[Callable[[CollectiveRecord], None]] = []
_SEQ = itertools.count()


def add_issue_hook(fn: Callable[[CollectiveRecord], None]) -> Callable[[], None]:
    """Call ``fn(record)`` just before each collective is issued, until the returned function
    is called (it removes this very ``fn``: hooks are told apart by identity, not equality)."""
    _HOOKS.append(fn)

    def remove() -> None:
        for i, hook in enumerate(_HOOKS):
            if hook is fn:
                del _HOOKS[i]
                return

    return remove


@contextlib.contextmanager
def record_collectives() -> Iterator[list[CollectiveRecord]]:
    """Collect a ``CollectiveRecord`` for every collective issued inside the block."""
    log: list[CollectiveRecord] = []
    remove = add_issue_hook(log.append)
    try:
        yield log
    finally:
        remove()


def _issue(
    op: str, group: Group, t: Tensor, direction: str, tag: str, is_async: bool, peer: int = -1
) -> None:
    if _HOOKS:
        rec = CollectiveRecord(
            next(_SEQ),
            op,
            group.name,
            group.size,
            t.numel() * t.element_size(),
            direction,
            tag,
            is_async,
            time.perf_counter_ns(),
            str(t.dtype),
            peer,
        )
        for hook in tuple(_HOOKS):  # a hook may remove itself
            hook(rec)
