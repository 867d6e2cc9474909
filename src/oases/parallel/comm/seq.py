"""Sequence parallelism's collectives (no autograd: a schedule's instructions run them):
activations whose sequence (dim 1) is sliced over the TP group.

    seq_gather_async(x, g)             [b, s, ...] slices  -> [b, s * size, ...]  ("gf"/"gb"/"gr")
    seq_reduce_scatter_async(t, g)     [b, S, ...] partial sums -> the sum's slice [b, S / size]
    reshard_seq_async(x, a, b, g)      a slice at degree a -> its piece at degree b
    seq_slice(x, g)                    this rank's slice of a replicated [b, S, ...]
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from oases.parallel.comm.core import (
    Handle,
    _Keep,
    _local_chunk,
    _on_gloo,
    _ReduceScatter,
    _references,
)
from oases.parallel.comm.record import _issue
from oases.parallel.context import Group


class _SeqGather(_Keep):
    """A started gather of every rank's [b, s, ...] slice into [size * b, s, ...] (rank-major:
    each rank's slice is contiguous, gathered as it is); ``wait`` returns [b, s * size, ...]
    (one copy, none for one row)."""

    def __init__(
        self, out: Tensor, work: dist.Work | None, x: Tensor, size: int, held: tuple = ()
    ) -> None:
        super().__init__(out, work, x, held)
        self._size = size

    def wait(self) -> Tensor:
        out = super().wait()  # [size * b, s, ...]
        return out.view(self._size, -1, *out.shape[1:]).transpose(0, 1).flatten(1, 2)


def seq_gather_async(
    x: Tensor, group: Group, *, direction: str = "forward", tag: str = ""
) -> Handle:
    """Start gathering every rank's slice [b, s, ...] of the sequence (dim 1) into
    [b, s * size, ...], rank order (sequence parallelism's "gf"/"gb"/"gr"; no autograd)."""
    if group.size == 1:
        return Handle(x, None)
    x = x.contiguous()
    out = x.new_empty((group.size * x.shape[0], *x.shape[1:]))  # rank-major [size * b, ...]
    _issue("all_gather", group, x, direction, tag, True)
    held = _references(out, x) if _on_gloo(group) else ()
    work = dist.all_gather_single(out, x, group=group.pg, async_op=True)
    return _SeqGather(out, work, x, group.size, held)


def seq_reduce_scatter_async(
    t: Tensor, group: Group, *, direction: str = "forward", tag: str = "", consume: bool = False
) -> Handle:
    """Start the sum over the group of [b, S, ...] partial sums, keeping this rank's slice
    [b, S / size, ...] of the sequence (dim 1): sequence parallelism's "fwd"/"bwd", in place
    of the all-reduce (no autograd). NCCL: the partial sums are sent rank-major ([size, b,
    S / size, ...], chunk j for rank j: one copy, none for one row) and summed straight into
    the slice. gloo: ``_GlooSeqScatter`` (the other ranks' chunks only). ``consume``: the
    caller gives ``t`` up (nothing else reads it: the collective may keep it or let it go)."""
    if group.size == 1:
        return Handle(t, None)
    if t.shape[1] % group.size:
        raise ValueError(f"a sequence of {t.shape[1]} does not split over {group.size} ranks")
    _issue("reduce_scatter", group, t, direction, tag, True)
    if _on_gloo(group):
        return _GlooSeqScatter(t, group)
    n, b, s = group.size, t.shape[0], t.shape[1] // group.size
    tt = t.reshape(b, n, s, *t.shape[2:]).transpose(0, 1).contiguous()  # [n, b, s, ...]
    return _ReduceScatter(t.new_empty((b, s, *t.shape[2:])), tt, group)


class _GlooSeqScatter(Handle):
    """gloo's sequence reduce-scatter, holding no more than NCCL's: one ``all_to_all_single``
    with split sizes that sends each other rank its chunk and receives theirs of this rank's
    chunk, never this rank's own (gloo's own reduce-scatter moves an all-reduce's bytes; an
    all-to-all moves a ring's). Buffers, in units of t [b, S, ...] at n ranks::

        one row, 2 ranks   send the other chunk (a view of t); receive into the slice; the
                           wait adds this rank's chunk (a view of t)       t + 1/2
        otherwise          send the other chunks (one copy, (n-1)/n); this rank's chunk
                           copied into the slice and t let go; receive (n-1)/n, added
                           into the slice at the wait                    (2n - 1)/n

    NCCL's holds its rank-major copy of t and the slice, 1 + 1/n (one row: t itself + 1/n).
    So at 2 ranks the same bytes, at n ranks (n - 2)/n more (the receive buffer); the gloo
    path before this one (an all-to-all of the whole rank-major copy into a buffer of t's
    size) held 2 + 1/n."""

    def __init__(self, t: Tensor, group: Group) -> None:
        n, me, b, s = group.size, group.rank, t.shape[0], t.shape[1] // group.size
        chunks = t.reshape(b, n, s, *t.shape[2:]).unbind(1)  # n x [b, s, ...] views of t
        others = [chunks[j] for j in range(n) if j != me]
        splits = [0 if j == me else 1 for j in range(n)]  # along dim 0 of send and recv
        self._own: Tensor | None = None
        if n == 2 and others[0].is_contiguous():  # one row: no copy at all
            send = others[0].unsqueeze(0)
            out = t.new_empty(chunks[me].shape)
            recv, self._own = out.unsqueeze(0), chunks[me]  # (the view keeps t to the wait)
        else:
            send = torch.stack(others)  # [n - 1, b, s, ...]
            out = chunks[me].contiguous()
            recv = t.new_empty(send.shape)
        self._send, self._recv = send, recv
        held = _references(send, recv)
        work = dist.all_to_all_single(recv, send, splits, splits, group=group.pg, async_op=True)
        super().__init__(out, work, held)

    def wait(self) -> Tensor:
        out = super().wait()
        if self._own is not None:  # the other rank's partial sum is in the slice already
            out.add_(self._own)
        else:
            for part in self._recv.unbind(0):
                out.add_(part)
        self._own = self._recv = self._send = None
        return out


class _Relayout(Handle):
    """A started all-gather of every rank's [b, s, ...] piece over the larger degree's TP
    group; ``wait`` assembles the group's whole [R, S, ...] and keeps this rank's piece of the
    target layout (``reshard_seq_async``)."""

    def __init__(
        self,
        parts: list[Tensor],
        work: dist.Work | None,
        from_tp: int,
        to_tp: int,
        group: Group,
        keep: Tensor,
    ) -> None:
        super().__init__(parts[0], work)
        self._parts, self._keep = parts, keep
        self._from, self._to, self._group = from_tp, to_tp, group

    def wait(self) -> Tensor:
        super().wait()
        T, a, b = self._group.size, self._from, self._to
        # rank w of the group holds rows chunk w // a (of T / a) and sequence chunk w % a (of a)
        rows = [torch.cat(self._parts[g * a : (g + 1) * a], dim=1) for g in range(T // a)]
        whole = torch.cat(rows, dim=0)  # [R, S, ...], the group's rows in chunk order
        w = self._group.rank
        mine = whole.chunk(T // b, dim=0)[w // b].chunk(b, dim=1)[w % b]
        self._parts = self._keep = None
        return mine.contiguous()


def reshard_seq_async(
    x: Tensor, from_tp: int, to_tp: int, group: Group, *, direction: str = "forward", tag: str = ""
) -> Handle:
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
        raise ValueError(
            f"a sequence-parallel reshard between tp={from_tp} and tp={to_tp} "
            f"runs over the TP group of the larger degree, not one of {group.size}"
        )
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group.size)]
    _issue("all_gather", group, x, direction, tag, True)
    work = dist.all_gather(parts, x, group=group.pg, async_op=True)
    return _Relayout(parts, work, from_tp, to_tp, group, x)


def seq_slice(x: Tensor, group: Group) -> Tensor:
    """This rank's slice of the sequence (dim 1) of a replicated [b, S, ...] tensor."""
    return _local_chunk(x, group, 1)
