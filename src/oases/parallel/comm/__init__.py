"""All communication of Oases: the only package that calls ``torch.distributed`` collectives.

Every collective goes through ``record._issue`` first, so a test (or the timeline) can see each
one with ``record_collectives()``, and a tool can act on each one with ``add_issue_hook(fn)``
(the fault injection of ``train/faults.py`` does). Functions are named by what they do in the
*forward* pass; a group of size 1 issues nothing. Callers import the package::

    from oases.parallel import comm
    h = comm.all_reduce_async(t, ctx.tp_group)     # start
    ...                                            # compute something else
    t = h.wait()                                   # done

Modules, one concern each:

    record     CollectiveRecord, add_issue_hook, record_collectives (what each issue reports)
    core       Handle; plain and async all-reduce, reduce-scatter, all-gather of flat tensors;
               a metric's mean, barrier, all_gather_objects
    autograd   Megatron's conjugate pairs: copy_to_tp (f), reduce_from_tp (g), gather_from_tp,
               scatter_to_tp
    seq        sequence parallelism: gathers and reduce-scatters along the sequence, its reshard
    reshard    activations between TP degrees along the batch (autograd pair and async)
    dp         data-parallel gradient means: one flat all-reduce per bucket
    p2p        point-to-point between pipeline stages: async sends and receives
"""

from __future__ import annotations

from oases.parallel.comm.autograd import copy_to_tp, gather_from_tp, reduce_from_tp, scatter_to_tp
from oases.parallel.comm.core import (
    Handle,
    all_gather_into_async,
    all_gather_objects,
    all_reduce_,
    all_reduce_async,
    all_reduce_mean,
    barrier,
    reduce_scatter,
    reduce_scatter_async,
)
from oases.parallel.comm.dp import GradientMean, flat_all_reduce_async, gradient_mean_async
from oases.parallel.comm.p2p import p2p_tag, recv_async, send_async
from oases.parallel.comm.record import _HOOKS as _HOOKS
from oases.parallel.comm.record import _SEQ as _SEQ
from oases.parallel.comm.record import CollectiveRecord, add_issue_hook, record_collectives
from oases.parallel.comm.reshard import reshard_batch, reshard_batch_async
from oases.parallel.comm.seq import (
    reshard_seq_async,
    seq_gather_async,
    seq_reduce_scatter_async,
    seq_slice,
)

__all__ = [
    "CollectiveRecord",
    "GradientMean",
    "Handle",
    "add_issue_hook",
    "all_gather_into_async",
    "all_gather_objects",
    "all_reduce_",
    "all_reduce_async",
    "all_reduce_mean",
    "barrier",
    "copy_to_tp",
    "flat_all_reduce_async",
    "gather_from_tp",
    "gradient_mean_async",
    "p2p_tag",
    "recv_async",
    "record_collectives",
    "reduce_from_tp",
    "reduce_scatter",
    "reduce_scatter_async",
    "reshard_batch",
    "reshard_batch_async",
    "reshard_seq_async",
    "scatter_to_tp",
    "send_async",
    "seq_gather_async",
    "seq_reduce_scatter_async",
    "seq_slice",
]
