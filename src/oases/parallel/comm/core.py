"""The collectives themselves: ``Handle`` (an in-flight async collective) and the plain and
async all-reduce, reduce-scatter and all-gather of flat tensors, each over a ``Group``; the
blocking helpers of the training loop (a metric's mean, a barrier, an object gather).

    all_reduce_(t, g)                  blocking, in place          -> t (``op="max"`` too)
    reduce_scatter(t, g)               blocking, along dim 0       -> this rank's chunk
    all_reduce_async(t, g)             in place                    -> Handle; .wait() -> t
    reduce_scatter_async(flat, g)      1-D                         -> .wait(): its 1/size slice
    all_gather_into_async(out, s, g)   every rank's 1-D shard ``s`` -> .wait(): out

A group of size 1 issues nothing. On gloo a reduce-scatter runs as an all-to-all plus a local
sum (``_ReduceScatter``). Every collective is reported to ``record._issue`` first.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from oases.parallel.comm.record import _issue
from oases.parallel.context import Group

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def all_reduce_(
    t: Tensor, group: Group, *, op: str = "sum", direction: str = "forward", tag: str = ""
) -> Tensor:
    """In-place blocking all-reduce of a plain tensor (no autograd). Returns ``t``."""
    if group.size > 1:
        _issue("all_reduce", group, t, direction, tag, False)
        dist.all_reduce(t, op=_OPS[op], group=group.pg)
    return t


def reduce_scatter(t: Tensor, group: Group, *, direction: str = "forward", tag: str = "") -> Tensor:
    """Blocking sum reduce-scatter of a plain tensor along dim 0: this rank's 1/size chunk of
    the sum (sequence parallelism's collective; the profile measures it)."""
    if group.size == 1:
        return t
    if t.shape[0] % group.size:
        raise ValueError(f"dimension 0 of size {t.shape[0]} does not split over {group.size}")
    t = t.contiguous()
    out = torch.empty((t.shape[0] // group.size, *t.shape[1:]), dtype=t.dtype, device=t.device)
    _issue("reduce_scatter", group, t, direction, tag, False)
    _ReduceScatter(out, t, group).wait()
    return out


def _on_gloo(group: Group) -> bool:
    return group.pg is not None and dist.get_backend(group.pg) == "gloo"


class Handle:
    """An in-flight async collective. ``wait()`` blocks until done and returns the result."""

    def __init__(
        self, result: Tensor, work: dist.Work | None, held: tuple[tuple[Tensor, int], ...] = ()
    ) -> None:
        self.result = result
        self._work = work
        self._held = held  # gloo: the buffers it was given, with their references before it

    def on_complete(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` when the collective completes (gloo: on its communication thread).
        NCCL completes the future when the work is *enqueued*: there, timelines stamp the end
        with ``timing.DeviceClock.after`` instead.
        A collective without a future (none of ours on torch 2.13's gloo, whose
        reduce-scatter we run as an all-to-all; kept for other backends) is watched by a thread
        that polls ``is_completed()`` (instrumentation only: timelines are recorded for one
        step). It must never ``wait()`` itself: a second thread waiting on a gloo work corrupts
        the result of the owner's reduce-scatter (wrong ZeRO gradients in recorded steps, seen
        with torch 2.13; ``test_zero.py`` guards it)."""
        if self._work is None:
            fn()
            return
        try:
            future = self._work.get_future()
        except RuntimeError:  # "Work::getFuture not implemented"
            work = self._work

            def watch() -> None:
                with contextlib.suppress(Exception):  # the owner's wait() reports failures
                    while not work.is_completed():
                        time.sleep(1e-4)
                    fn()

            threading.Thread(target=watch, daemon=True, name="oases-comm-watch").start()
            return
        future.then(lambda _: fn())

    def wait_stream(self) -> None:
        """Make the current CUDA stream wait for the collective's end, without blocking the
        host, taking the result or touching the work (``timing.DeviceClock.after`` stamps the
        end on a side stream this way; the owner still calls ``wait``): through the work's
        CUDA-aware future, whose events NCCL records on its stream after the collective. Not
        ``work.wait()``: NCCL may let go of the tensors it holds for the collective at the
        first wait, and the side stream's would come before the compute stream's. NCCL only."""
        if self._work is not None:
            self._work.get_future().wait()

    def is_completed(self) -> bool:
        """Has the collective finished (without waiting for it)?"""
        return self._work is None or self._work.is_completed()

    def wait(self) -> Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
            _until_released(self._held)
        self._held = ()
        return self.result


def _references(*tensors: Tensor) -> tuple[tuple[Tensor, int], ...]:
    """Each tensor with its references now: taken before gloo is given them (``Handle``)."""
    return tuple((t, t._use_count()) for t in tensors)


def _until_released(held: tuple[tuple[Tensor, int], ...]) -> None:
    """After a gloo collective's wait, wait (at most 0.2 s) until gloo's worker thread has let
    go of the finished work and with it of the buffers it was given: their last references
    then die on the caller's thread, when it drops them, not on gloo's. The work completes
    its future a few microseconds before its thread drops it, but on busy cores that thread
    may wait long for one; and torch's CPU profiler records no free made on a thread it does
    not profile, so ``memory.peak_live_bytes`` would count such a buffer as live to the end
    of the step (seen: 20 MiB of a 6-layer step's reduce-scatter buffers)."""
    deadline = time.monotonic() + 0.2
    while any(t._use_count() > n for t, n in held) and time.monotonic() < deadline:
        time.sleep(0)


def all_reduce_async(
    t: Tensor, group: Group, *, direction: str = "forward", tag: str = ""
) -> Handle:
    """Start a sum all-reduce of ``t`` (in place, no autograd); ``.wait()`` returns it."""
    if group.size == 1:
        return Handle(t, None)
    _issue("all_reduce", group, t, direction, tag, True)
    held = _references(t) if _on_gloo(group) else ()
    return Handle(t, dist.all_reduce(t, group=group.pg, async_op=True), held)


def reduce_scatter_async(
    flat: Tensor, group: Group, *, direction: str = "backward", tag: str = ""
) -> Handle:
    """Start a sum reduce-scatter of the 1-D ``flat`` (its size a multiple of the group's):
    ``.wait()`` returns this rank's ``1/size`` slice of the sum (``flat`` itself for a group of
    one). ZeRO's gradient reduction (``parallel/shard.py``)."""
    if group.size == 1:
        return Handle(flat, None)
    out = flat.new_empty(flat.numel() // group.size)
    _issue("reduce_scatter", group, flat, direction, tag, True)
    return _ReduceScatter(out, flat, group)


def all_gather_into_async(
    out: Tensor, shard: Tensor, group: Group, *, direction: str = "forward", tag: str = ""
) -> Handle:
    """Start gathering every rank's 1-D ``shard`` into ``out`` (``size`` shards in rank order,
    in place); ``.wait()`` returns ``out``. ZeRO's weight gathers (``parallel/shard.py``)."""
    if group.size == 1:
        out.copy_(shard)
        return Handle(out, None)
    _issue("all_gather", group, shard, direction, tag, True)
    work = dist.all_gather_single(out, shard, group=group.pg, async_op=True)
    return _Keep(out, work, shard)


class _Keep(Handle):
    """A handle that keeps its collective's input alive until the wait (the input may be a
    temporary nobody else holds)."""

    def __init__(
        self, result: Tensor, work: dist.Work | None, keep: Tensor, held: tuple = ()
    ) -> None:
        super().__init__(result, work, held)
        self._keep: Tensor | None = keep

    def wait(self) -> Tensor:
        out = super().wait()
        self._keep = None
        return out


class _ReduceScatter(_Keep):
    """A started sum reduce-scatter of ``t`` along dim 0 into ``out`` (this rank's chunk); a
    handle whose ``wait`` returns ``out``.

    NCCL (and any backend but gloo) runs its own reduce-scatter. gloo's moves the bytes of an
    all-reduce, and over 4 ranks takes 3x one (measured with torch 2.13 on a loopback shaped to
    343 Mbit/s: 8 MiB over 2 ranks, all-reduce 396 ms, ``reduce_scatter_single`` 403 ms; an
    all-to-all 200 ms), so on gloo each rank sends chunk j to rank j with one
    ``all_to_all_single`` (each rank sends and receives (size-1)/size of the buffer: a ring's
    bytes) and sums the ``size`` chunks it received, in rank order, at ``wait``. The receive
    buffer is the same size as ``t`` (gloo's own reduce-scatter also held a full-size copy):
    ``recv``, a buffer of ``t``'s size the caller gives up, or a new one."""

    def __init__(self, out: Tensor, t: Tensor, group: Group, recv: Tensor | None = None) -> None:
        self._recv: Tensor | None = None
        if _on_gloo(group):
            self._recv = torch.empty_like(t) if recv is None else recv.view(t.shape)
            work = dist.all_to_all_single(self._recv, t, group=group.pg, async_op=True)
        else:
            work = dist.reduce_scatter_single(out, t, group=group.pg, async_op=True)
        super().__init__(out, work, t)

    def wait(self) -> Tensor:
        out = super().wait()
        if self._recv is not None:
            torch.sum(self._recv.view(-1, *out.shape), 0, out=out)
            self._recv = None
        return out


def _local_chunk(x: Tensor, group: Group, dim: int) -> Tensor:
    """This rank's chunk of ``x`` along ``dim`` (the group's ranks split it in rank order)."""
    if x.shape[dim] % group.size:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split over {group.size}")
    return x.chunk(group.size, dim=dim)[group.rank].contiguous()


# ----------------------------------------------------------- blocking helpers of the loop
def all_reduce_mean(t: Tensor, group: Group) -> Tensor:
    """Mean of a (detached) metric tensor over ``group``; returns a new tensor."""
    out = t.detach().clone()
    all_reduce_(out, group, tag="metric")
    return out.div_(group.size)


def barrier(group: Group) -> None:
    """Block until every rank of ``group`` arrives (a tiny all-reduce, so it obeys the timeout).
    On CUDA it also waits for this rank's queued kernels, so a timer around it is honest."""
    all_reduce_(torch.zeros(1, device=group.device), group, tag="barrier")
    if group.device.type == "cuda":
        torch.cuda.synchronize(group.device)


def all_gather_objects(obj: object, group: Group) -> list[object]:
    """Every rank's picklable ``obj``, in group order (for metrics and timelines, not tensors)."""
    if group.size == 1:
        return [obj]
    out: list[object] = [None] * group.size
    _issue("all_gather", group, torch.empty(0), "forward", "objects", False)
    dist.all_gather_object(out, obj, group=group.pg)
    return out
