"""All communication of Oases: Megatron's conjugate autograd pairs, async variants, recording.

Every collective goes through ``_issue`` here, so a test (or the timeline) can see each one with
``record_collectives()``, and a tool can act on each one with ``add_issue_hook(fn)`` (the fault
injection of ``train/faults.py`` does). Functions are named by what they do in the *forward* pass:

=================  ============================  ==============================
function           forward                       backward (its conjugate)
=================  ============================  ==============================
copy_to_tp   (f)   identity                      all-reduce of the input grad
reduce_from_tp (g) all-reduce of partial sums    identity
gather_from_tp     all-gather along ``dim``      keep the local chunk
scatter_to_tp      keep the local chunk          all-gather along ``dim``
=================  ============================  ==============================

A group of size 1 makes all of them the identity and issues nothing.

Between regions of different TP degrees, ``reshard_batch`` (autograd) and
``reshard_batch_async`` (a schedule's reshard instructions, no autograd) move activations along
the batch: an all-gather when the degree grows, a local slice when it shrinks.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from oases.parallel.context import Group


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as issued: what, over which group, how big (bytes of the tensor it
    reduces or gathers, in ``dtype``), in which pass."""

    seq: int
    op: str  # "all_reduce" | "all_gather" | "reduce_scatter"
    group: str  # the group's name: "tp", "dp", ...
    group_size: int
    nbytes: int
    direction: str  # "forward" | "backward"
    tag: str
    is_async: bool
    issued_ns: int
    dtype: str = ""  # e.g. "torch.bfloat16"


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


def _issue(op: str, group: Group, t: Tensor, direction: str, tag: str, is_async: bool) -> None:
    if _HOOKS:
        rec = CollectiveRecord(
            next(_SEQ), op, group.name, group.size, t.numel() * t.element_size(),
            direction, tag, is_async, time.perf_counter_ns(), str(t.dtype),
        )
        for hook in tuple(_HOOKS):  # a hook may remove itself
            hook(rec)


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def all_reduce_(
    t: Tensor, group: Group, *, op: str = "sum", direction: str = "forward", tag: str = ""
) -> Tensor:
    """In-place blocking all-reduce of a plain tensor (no autograd). Returns ``t``."""
    if group.size > 1:
        _issue("all_reduce", group, t, direction, tag, False)
        dist.all_reduce(t, op=_OPS[op], group=group.pg)
    return t


def reduce_scatter(t: Tensor, group: Group, *, direction: str = "forward",
                   tag: str = "") -> Tensor:
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

    def __init__(self, result: Tensor, work: dist.Work | None) -> None:
        self.result = result
        self._work = work

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
        return self.result


def all_reduce_async(
    t: Tensor, group: Group, *, direction: str = "forward", tag: str = ""
) -> Handle:
    """Start a sum all-reduce of ``t`` (in place, no autograd); ``.wait()`` returns it."""
    if group.size == 1:
        return Handle(t, None)
    _issue("all_reduce", group, t, direction, tag, True)
    return Handle(t, dist.all_reduce(t, group=group.pg, async_op=True))


def reduce_scatter_async(flat: Tensor, group: Group, *, direction: str = "backward",
                         tag: str = "") -> Handle:
    """Start a sum reduce-scatter of the 1-D ``flat`` (its size a multiple of the group's):
    ``.wait()`` returns this rank's ``1/size`` slice of the sum (``flat`` itself for a group of
    one). ZeRO's gradient reduction (``parallel/shard.py``)."""
    if group.size == 1:
        return Handle(flat, None)
    out = flat.new_empty(flat.numel() // group.size)
    _issue("reduce_scatter", group, flat, direction, tag, True)
    return _ReduceScatter(out, flat, group)


def all_gather_into_async(out: Tensor, shard: Tensor, group: Group, *,
                          direction: str = "forward", tag: str = "") -> Handle:
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

    def __init__(self, result: Tensor, work: dist.Work | None, keep: Tensor) -> None:
        super().__init__(result, work)
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

    def __init__(self, out: Tensor, t: Tensor, group: Group, recv: Tensor | None = None
                 ) -> None:
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


class _SeqGather(_Keep):
    """A started gather of every rank's [b, s, ...] slice into [size * b, s, ...] (rank-major:
    each rank's slice is contiguous, gathered as it is); ``wait`` returns [b, s * size, ...]
    (one copy, none for one row)."""

    def __init__(self, out: Tensor, work: dist.Work | None, x: Tensor, size: int) -> None:
        super().__init__(out, work, x)
        self._size = size

    def wait(self) -> Tensor:
        out = super().wait()  # [size * b, s, ...]
        return out.view(self._size, -1, *out.shape[1:]).transpose(0, 1).flatten(1, 2)


def seq_gather_async(x: Tensor, group: Group, *, direction: str = "forward",
                     tag: str = "") -> Handle:
    """Start gathering every rank's slice [b, s, ...] of the sequence (dim 1) into
    [b, s * size, ...], rank order (sequence parallelism's "gf"/"gb"/"gr"; no autograd)."""
    if group.size == 1:
        return Handle(x, None)
    x = x.contiguous()
    out = x.new_empty((group.size * x.shape[0], *x.shape[1:]))  # rank-major [size * b, ...]
    _issue("all_gather", group, x, direction, tag, True)
    work = dist.all_gather_single(out, x, group=group.pg, async_op=True)
    return _SeqGather(out, work, x, group.size)


def seq_reduce_scatter_async(t: Tensor, group: Group, *, direction: str = "forward",
                             tag: str = "", consume: bool = False) -> Handle:
    """Start the sum over the group of [b, S, ...] partial sums, keeping this rank's slice
    [b, S / size, ...] of the sequence (dim 1): sequence parallelism's "fwd"/"bwd", in place
    of the all-reduce (no autograd). The partial sums are sent rank-major ([size, b, S / size,
    ...], chunk j for rank j: one copy, none for one row) and summed straight into the slice.
    ``consume``: the caller gives ``t`` up, and gloo's all-to-all receives into its storage
    (no second buffer of its size)."""
    if group.size == 1:
        return Handle(t, None)
    if t.shape[1] % group.size:
        raise ValueError(f"a sequence of {t.shape[1]} does not split over {group.size} ranks")
    n, b, s = group.size, t.shape[0], t.shape[1] // group.size
    tt = t.reshape(b, n, s, *t.shape[2:]).transpose(0, 1).contiguous()  # [n, b, s, ...]
    out = t.new_empty((b, s, *t.shape[2:]))
    recv = None
    if (consume and t.is_contiguous()
            and t.untyped_storage().data_ptr() != tt.untyped_storage().data_ptr()):
        recv = t  # (one row: tt is t itself, the buffer being sent)
    _issue("reduce_scatter", group, tt, direction, tag, True)
    return _ReduceScatter(out, tt, group, recv)


class _Relayout(Handle):
    """A started all-gather of every rank's [b, s, ...] piece over the larger degree's TP
    group; ``wait`` assembles the group's whole [R, S, ...] and keeps this rank's piece of the
    target layout (``reshard_seq_async``)."""

    def __init__(self, parts: list[Tensor], work: dist.Work | None, from_tp: int, to_tp: int,
                 group: Group, keep: Tensor) -> None:
        super().__init__(parts[0], work)
        self._parts, self._keep = parts, keep
        self._from, self._to, self._group = from_tp, to_tp, group

    def wait(self) -> Tensor:
        super().wait()
        T, a, b = self._group.size, self._from, self._to
        # rank w of the group holds rows chunk w // a (of T / a) and sequence chunk w % a (of a)
        rows = [torch.cat(self._parts[g * a:(g + 1) * a], dim=1) for g in range(T // a)]
        whole = torch.cat(rows, dim=0)  # [R, S, ...], the group's rows in chunk order
        w = self._group.rank
        mine = whole.chunk(T // b, dim=0)[w // b].chunk(b, dim=1)[w % b]
        self._parts = self._keep = None
        return mine.contiguous()


def reshard_seq_async(x: Tensor, from_tp: int, to_tp: int, group: Group, *,
                      direction: str = "forward", tag: str = "") -> Handle:
    """Move sequence-parallel activations between TP degrees (no autograd): at degree d a TP
    group holds a chunk of the rows, each of its ranks a 1/d slice of their sequence. Over
    ``group``, the TP group of the larger degree T (contiguous ranks, its groups at the
    smaller degree nested in it), every rank's piece is all-gathered, the group's whole
    [R, S, ...] assembled and this rank's piece at ``to_tp`` kept: [R d / T, S / d, ...] at
    degree d. Both directions move data (a slice of the sequence comes from other ranks), so
    the backward reshard of a gradient is this same call with the degrees swapped."""
    if from_tp == to_tp:
        return Handle(x, None)
    if group.size != max(from_tp, to_tp):
        raise ValueError(f"a sequence-parallel reshard between tp={from_tp} and tp={to_tp} "
                         f"runs over the TP group of the larger degree, not one of {group.size}")
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group.size)]
    _issue("all_gather", group, x, direction, tag, True)
    work = dist.all_gather(parts, x, group=group.pg, async_op=True)
    return _Relayout(parts, work, from_tp, to_tp, group, x)


def seq_slice(x: Tensor, group: Group) -> Tensor:
    """This rank's slice of the sequence (dim 1) of a replicated [b, S, ...] tensor."""
    return _local_chunk(x, group, 1)


def _all_gather(x: Tensor, group: Group, dim: int, direction: str) -> Tensor:
    """Every rank's ``x`` concatenated along ``dim``, in rank order: gathered into one tensor
    (``all_gather_single``, NCCL's all-gather into a flat buffer, on gloo too), so that along
    dim 0 the result is the buffer itself; along another dim one copy moves the chunks."""
    x = x.contiguous()
    _issue("all_gather", group, x, direction, "", False)
    dim = dim % x.dim()
    out = x.new_empty((group.size * x.shape[0], *x.shape[1:]))  # [g * b, ...]
    dist.all_gather_single(out, x, group=group.pg)
    if dim == 0:
        return out
    return torch.cat(out.chunk(group.size), dim=dim)


def _local_chunk(x: Tensor, group: Group, dim: int) -> Tensor:
    if x.shape[dim] % group.size:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split over {group.size}")
    return x.chunk(group.size, dim=dim)[group.rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:  # noqa: ANN001
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # noqa: ANN001
        return all_reduce_(grad.contiguous().clone(), ctx.group, direction="backward"), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:  # noqa: ANN001
        return all_reduce_(x.contiguous().clone(), group, direction="forward")

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # noqa: ANN001
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group, dim: int) -> Tensor:  # noqa: ANN001
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim, "forward")

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # noqa: ANN001
        return _local_chunk(grad, ctx.group, ctx.dim), None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group, dim: int) -> Tensor:  # noqa: ANN001
        ctx.group, ctx.dim = group, dim
        return _local_chunk(x, group, dim)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # noqa: ANN001
        return _all_gather(grad, ctx.group, ctx.dim, "backward"), None, None


def copy_to_tp(x: Tensor, group: Group) -> Tensor:
    """f: identity forward; backward all-reduces the input gradient over the TP group."""
    return x if group.size == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: Tensor, group: Group) -> Tensor:
    """g: forward all-reduces the partial sums over the TP group; backward is the identity."""
    return x if group.size == 1 else _ReduceFromTP.apply(x, group)


def gather_from_tp(x: Tensor, group: Group, dim: int = -1) -> Tensor:
    """Forward all-gathers the TP shards along ``dim``; backward keeps this rank's chunk."""
    return x if group.size == 1 else _GatherFromTP.apply(x, group, dim)


def scatter_to_tp(x: Tensor, group: Group, dim: int = -1) -> Tensor:
    """Forward keeps this rank's chunk along ``dim``; backward all-gathers the gradient."""
    return x if group.size == 1 else _ScatterToTP.apply(x, group, dim)


class GradientMean(Handle):
    """In-flight average of several parameters' gradients over a (data-parallel) group, as one
    flat all-reduce; ``wait()`` divides by ``divisor`` and copies back into every ``.grad``."""

    def __init__(self, grads: list[Tensor], flat: Tensor, work: dist.Work | None,
                 divisor: float) -> None:
        super().__init__(flat, work)
        self.grads, self.divisor = grads, divisor

    def wait(self) -> Tensor:
        flat = super().wait()
        if self.grads:
            if self.divisor != 1.0:
                flat.div_(self.divisor)
            offset = 0
            for g in self.grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            self.grads = []
        return flat


def gradient_mean_async(params: Iterable[torch.nn.Parameter], group: Group, *,
                        divisor: float | None = None, tag: str = "dp-grads",
                        dtype: torch.dtype | None = None) -> GradientMean:
    """Start averaging the gradients of ``params`` (those that require grad) over ``group``.
    A parameter without a gradient contributes zeros, so every rank sends the same layout.
    ``dtype``: reduce in this dtype (e.g. bf16: half the bytes; the mean is copied back into
    the gradients' own dtype); None: in the gradients' dtype."""
    params = [p for p in params if p.requires_grad]
    divisor = float(group.size if divisor is None else divisor)
    if group.size == 1 or not params:  # nothing to exchange; still scale (mixed-degree plans)
        if divisor != 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.div_(divisor)
        return GradientMean([], torch.empty(0), None, 1.0)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return flat_all_reduce_async([p.grad for p in params], group, divisor=divisor, tag=tag,
                                 dtype=dtype)


def flat_all_reduce_async(tensors: list[Tensor], group: Group, *, divisor: float = 1.0,
                          tag: str = "", dtype: torch.dtype | None = None) -> GradientMean:
    """Start one flat sum all-reduce of several tensors over ``group`` (in ``dtype``; None:
    theirs); ``wait()`` divides by ``divisor`` and copies the result back into each tensor
    (a gradient, or a view of a ZeRO gradient shard)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    if dtype is not None and dtype != flat.dtype:
        flat = flat.to(dtype)
    _issue("all_reduce", group, flat, "backward", tag, True)
    work = dist.all_reduce(flat, group=group.pg, async_op=True)
    return GradientMean(tensors, flat, work, divisor)


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


def reshard_batch(x: Tensor, from_tp: int, to_tp: int, group: Group) -> Tensor:
    """Move activations [b, ...] between TP degrees along the batch (dim 0), over the merge
    group of the two degrees (``ParallelContext.merge_group``).

    Growing the degree (a < b): the merging groups' batches are all-gathered, in rank order;
    backward keeps this rank's chunk (the gradient is replicated over the larger TP group).
    Shrinking it: this rank keeps its chunk; backward all-gathers the gradient.
    """
    if from_tp == to_tp:
        return x
    if to_tp > from_tp:
        return gather_from_tp(x, group, dim=0)
    return scatter_to_tp(x, group, dim=0)


def reshard_batch_async(x: Tensor, from_tp: int, to_tp: int, group: Group, *,
                        direction: str = "forward", tag: str = "") -> Handle:
    """Start moving ``x`` [b, ...] from degree ``from_tp``'s batch layout to ``to_tp``'s, over
    their merge group (no autograd); ``.wait()`` returns [b * to_tp / from_tp, ...].

    Growing the degree: an async all-gather along the batch, in rank order. Shrinking it: this
    rank's chunk, at once (the handle is complete). The two directions of one reshard point
    are each other's conjugates, so the backward reshard of a gradient is this same call with
    the degrees swapped (``direction="backward"`` only labels the record), exactly as
    ``reshard_batch``'s autograd pair does it.
    """
    if from_tp == to_tp:
        return Handle(x, None)
    if to_tp < from_tp:
        return Handle(_local_chunk(x, group, 0), None)
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * group.size, *x.shape[1:]))  # [g * b, ...]
    _issue("all_gather", group, x, direction, tag, True)
    # into one tensor (no list of views: NCCL gathers straight into ``out``; gloo supports it
    # too, torch 2.13); the input is kept to the wait (the caller may hold it no longer)
    work = dist.all_gather_single(out, x, group=group.pg, async_op=True)
    return _Keep(out, work, x)
