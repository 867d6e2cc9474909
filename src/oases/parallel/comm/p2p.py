"""Point-to-point between pipeline stages: async sends and receives of activations and their
gradients (no autograd: a schedule's "sf"/"rf"/"sb"/"rb" instructions run them).

    h = send_async(x, pair, peer, tag=p2p_tag(b, j, "forward"))     # stage s, after epi:b-1
    h = recv_async(shape, dtype, pair, peer, tag=...)                # stage s+1, posted early
    x = h.wait()                                                     # before body:b

``pair`` is the two-rank group of a boundary and direction (``ParallelContext.p2p_groups``);
``peer`` the other rank's global id. gloo matches a send with its receive by ``tag``, unique per
(boundary, sub-batch, direction). NCCL ignores tags and matches the operations between a pair
in the order each side posts them: the same code path relies on both sides posting the sends
and the receives of one boundary and direction in the same order (``pipeline_program`` does:
micro-batch, then sub-batch order), and on one group per direction (a receive posted early on
NCCL's stream of one group never holds back a send on the other's). Every send and receive is
reported to ``record._issue`` (op "send" / "recv", its bytes and ``peer``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from oases.parallel.comm.core import Handle, _Keep
from oases.parallel.comm.record import _issue
from oases.parallel.context import Group

_SUBS = 1 << 20  # sub-batch ids below this; boundaries below 2**9 (gloo tags are 32-bit)


def p2p_tag(index: int, sub: int, direction: str) -> int:
    """The gloo tag of the send and receive of x_index (``direction`` "forward") or of its
    gradient ("backward") for sub-batch ``sub``: unique per boundary, sub-batch, direction."""
    if not (0 <= sub < _SUBS and 0 <= index < 1 << 9):
        raise ValueError(f"point-to-point tag for region {index}, sub-batch {sub}: out of range")
    return (index * _SUBS + sub) * 2 + (direction == "backward")


def send_async(
    t: Tensor, pair: Group, peer: int, *, tag: int, direction: str = "forward", label: str = ""
) -> Handle:
    """Start sending ``t`` to global rank ``peer`` over ``pair``; ``.wait()`` (when the
    receiver has it, or at least has posted its receive) returns ``t``, kept alive until then."""
    t = t.contiguous()
    _issue("send", pair, t, direction, label, True, peer)
    work = dist.isend(t, dst=peer, group=pair.pg, tag=tag)
    return _Keep(t, work, t)


def recv_async(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    pair: Group,
    peer: int,
    *,
    tag: int,
    direction: str = "forward",
    label: str = "",
) -> Handle:
    """Post a receive of a ``shape`` tensor of ``dtype`` from global rank ``peer`` over
    ``pair``; ``.wait()`` returns it."""
    buf = torch.empty(shape, dtype=dtype, device=pair.device)
    _issue("recv", pair, buf, direction, label, True, peer)
    work = dist.irecv(buf, src=peer, group=pair.pg, tag=tag)
    return Handle(buf, work)
