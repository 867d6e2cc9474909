"""Where a step's peak of live tensor bytes falls, and what is alive there (CPU).

``peak_live_bytes`` (``oases.memory``) gives the height of the peak; this gives its anatomy.
The profiler's event tree records each allocation and free of torch's CPU allocator with its
address and the op that made it; each executor instruction is wrapped in a ``record_function``
named after it (``ins:<label>``, on the executor instance only, undone after), so::

    allocations, frees by address   -> the live set at every instant
    the instant of the maximum      -> the instruction running there (and its innermost op)
    each live block at the maximum  -> the instruction that allocated it (or "before": alive
                                       at the start) and the op that allocated it

``live_set_at_peak`` returns the peak's bytes above the start, the running instruction and
the live blocks grouped by (allocating instruction, op), largest first: enough to compare two
runs (sequence parallelism off and on) term by term. The profiler records no allocation or
free made on another thread (gloo's workers): a block whose address is allocated again
without a recorded free is reported as "unrecorded" (``comm.core._until_released`` keeps the
frees of our collectives' buffers on the caller's thread).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch import Tensor
from torch.profiler import ProfilerActivity, profile, record_function

from oases.schedule.instructions import Compute, Start, label

__all__ = ["live_set_at_peak"]


def _name(ins: object) -> str:
    if isinstance(ins, Compute):
        return f"ins:{ins.phase[0]}:{label(ins)}"
    kind = "start" if isinstance(ins, Start) else "wait"
    return f"ins:{kind}:{ins.kind}{ins.index}.{ins.sub}"


@contextlib.contextmanager
def _labelled(executor: object) -> Iterator[None]:
    """Wrap the executor's ``_compute``, ``_start`` and ``_wait`` in named profiler ranges."""
    originals = {n: getattr(executor, n) for n in ("_compute", "_start", "_wait")}

    def wrap(fn):  # noqa: ANN001, ANN202
        def run(ins, *args):  # noqa: ANN001, ANN002, ANN202
            with record_function(_name(ins)):
                return fn(ins, *args)

        return run

    for n, fn in originals.items():
        setattr(executor, n, wrap(fn))
    try:
        yield
    finally:
        for n in originals:
            delattr(executor, n)  # back to the class's methods


def _walk(events: list) -> Iterator[tuple[object, str, str]]:
    """(allocation event, enclosing instruction, innermost op) for every allocation."""
    stack = [(e, "before", "") for e in events]
    while stack:
        e, ins, op = stack.pop()
        if e.name.startswith("ins:"):
            ins = e.name[4:]
        elif e.name != "[memory]":
            op = e.name
        if e.name == "[memory]":
            yield e, ins, op
        stack.extend((c, ins, op) for c in e.children)


def live_set_at_peak(
    schedule: object, model: torch.nn.Module, tokens: Tensor, targets: Tensor
) -> dict:
    """One step of ``schedule`` under the profiler: {"peak": bytes above the start,
    "at": instruction running at the peak, "op": its op, "live": [(bytes, allocating
    instruction, op)] of the blocks alive there, largest group first, "before": bytes of
    blocks from before the step freed by the peak (negative), "unrecorded": [(bytes,
    instruction, op)] of blocks whose address was allocated again with no free recorded
    (freed on a thread the profiler does not see; counted as freed from that moment)}."""
    ex = schedule.executor(model)
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _labelled(ex), prof:
        schedule.step(model, tokens, targets)
    allocs = sorted(
        _walk(prof.profiler.kineto_results.experimental_event_tree()),
        key=lambda a: a[0].start_time_ns,
    )
    live: dict[int, tuple[int, str, str]] = {}
    total = peak = 0
    peak_set: dict[int, tuple[int, str, str]] = {}
    at = ("", "")
    unrecorded: dict[tuple[str, str], int] = defaultdict(int)
    freed_before = 0  # bytes of blocks from before the step, freed so far
    for e, ins, op in allocs:
        f = e.typed[1]
        size = f.alloc_size
        total += size
        if size > 0:
            old = live.get(f.ptr)
            if old is not None:  # freed unrecorded (another thread), its bytes still counted
                unrecorded[old[1], old[2]] += old[0]
                total -= old[0]
            live[f.ptr] = (size, ins, op)
        elif live.pop(f.ptr, None) is None:
            freed_before += size
        if total > peak:
            peak, at = total, (ins, op)
            peak_set = dict(live)
            peak_freed = freed_before
    groups: dict[tuple[str, str], int] = defaultdict(int)
    for size, ins, op in peak_set.values():
        groups[ins, op] += size
    rows = sorted(((b, i, o) for (i, o), b in groups.items()), reverse=True)
    return {
        "peak": peak,
        "at": at[0],
        "op": at[1],
        "live": rows,
        "before": peak_freed if peak_set else 0,
        "unrecorded": sorted(((b, i, o) for (i, o), b in unrecorded.items()), reverse=True),
    }
