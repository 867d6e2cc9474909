"""``oases profile``'s measurements of the link and of contention, on every rank together:
``measure_collectives`` times all-reduce, all-gather and reduce-scatter over groups of each size
at sizes around the activations; ``measure_contention`` how much a matmul and a collective in
flight at once slow each other. ``bench.profile_runner`` calls both per TP degree.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from oases.config import ModelConfig
from oases.parallel import comm
from oases.parallel.context import ParallelContext
from oases.planner.profile import check_collective_fit
from oases.precision import Precision
from oases.timing import DeviceClock


def measure_contention(
    ctx: ParallelContext,
    cfg: ModelConfig,
    rows: int,
    repeats: int = 4,
    dtype: torch.dtype = torch.float32,
) -> tuple[dict[str, float], dict[str, float]]:
    """How compute and each kind of collective slow each other down when they run at once,
    over the world: a matmul of the model's MLP shape (``rows`` sequences, in the run's compute
    ``dtype``, as are the collectives' buffers) runs in a loop while
    the collective runs (issued ``repeats`` times in a row, the same count on every rank).
    Returns ``(compute, comm)``: per op, the matmul's median time beside the collective over
    its median alone, and the collective's median time beside the matmuls (issue to completion,
    from its completion callback) over its median alone. On CPU ranks the communication threads
    share the cores with compute (measured on 2 cores with gloo: matmuls 1.35-1.49x slower
    beside an all-reduce, 1.17-1.23x beside an all-to-all or all-gather; the collectives 1.3x
    (reduce-scatter) to 1.9x (all-reduce) slower beside matmuls). On CUDA, where NCCL
    completes a future at enqueue, the collectives' factors are not measured (none)."""
    group = ctx.world_group
    if group.size <= 1:
        return {}, {}
    dev = ctx.device
    x = torch.randn(max(rows, 1) * cfg.seq_len, cfg.dim, device=dev, dtype=dtype)
    w = torch.randn(cfg.ffn_dim, cfg.dim, device=dev, dtype=dtype)

    clock = DeviceClock(dev)

    def matmul() -> float:
        return clock.time_s(lambda: torch.nn.functional.linear(x, w))

    for _ in range(3):
        matmul()
    comm.barrier(group)
    alone = statistics.median(matmul() for _ in range(8))
    n = group.size * max(1, -(-16 * x.numel() // group.size))  # ~16 activations, divisible
    buf = torch.randn(n, device=dev, dtype=dtype)
    starts = {
        "all_reduce": lambda: comm.all_reduce_async(buf, group, tag="contention"),
        "all_gather": lambda: comm.all_gather_into_async(
            torch.empty_like(buf), buf[: n // group.size], group, tag="contention"
        ),
        "reduce_scatter": lambda: comm.reduce_scatter_async(buf.clone(), group, tag="contention"),
    }
    compute, comm_factors = {}, {}
    for op, start in starts.items():
        comm.barrier(group)
        by_itself = []
        for _ in range(repeats):
            by_itself.append(clock.time_s(lambda start=start: start().wait()))
        comm.barrier(group)
        beside: list[float] = []
        spans: list[float] = []
        for _ in range(repeats):
            issued, finished = time.perf_counter(), []
            handle = start()
            handle.on_complete(lambda f=finished: f.append(time.perf_counter()))
            while not handle.is_completed():
                beside.append(matmul())
            handle.wait()
            spans.append((finished[0] if finished else time.perf_counter()) - issued)
        compute[op] = max(1.0, statistics.median(beside) / alone) if beside else 1.0
        if dev.type != "cuda":
            comm_factors[op] = max(1.0, statistics.median(spans) / statistics.median(by_itself))
    comm.barrier(group)
    return compute, comm_factors


def measure_collectives(
    ctx: ParallelContext,
    t: int,
    sizes: list[int],
    repeats: int,
    dp_only: bool = False,
    precision: Precision | None = None,
) -> list[dict]:
    """All-reduce and reduce-scatter over the TP group of degree t and all-gather (along the
    batch, as a reshard does) over the merge group of degrees 1 and t, at each byte size (the
    size of the full tensor: the all-reduce's buffer, the gather's output, the scatter's
    input), in the dtype the run moves activations in (``precision.compute_dtype``).
    ``dp_only``: the DP group of degree t instead (size world / t, a group size no TP degree
    has): its gradient all-reduce and ZeRO's reduce-scatter (``grad_reduce_dtype``) and weight
    all-gather (master weights, ``param_dtype``)."""
    tp_group, dp_group = ctx.groups_for(t)
    gather_group = None if dp_only else ctx.merge_group(1, t)
    act = torch.float32 if precision is None else precision.compute_dtype
    grad = torch.float32 if precision is None else precision.grad_reduce_dtype
    weight = torch.float32 if precision is None else precision.param_dtype

    def zeros(
        nbytes: int, dtype: torch.dtype, parts: int = 1, divisible: bool = False
    ) -> torch.Tensor:
        n = max(1, nbytes // dtype.itemsize)
        n = max(parts, n - n % parts) if divisible else max(1, n // parts)
        return torch.zeros(n, dtype=dtype, device=ctx.device)

    clock = DeviceClock(ctx.device)
    out = []
    for nbytes in sizes:
        if dp_only:
            d = dp_group.size
            ops = {
                "all_reduce": (lambda buf: comm.all_reduce_(buf, dp_group), zeros(nbytes, grad)),
                # ZeRO's collectives over the DP group: gradient scatters, weight gathers
                "reduce_scatter": (
                    lambda buf: comm.reduce_scatter(buf, dp_group),
                    zeros(nbytes, grad, d, divisible=True),
                ),
                "all_gather": (
                    lambda buf: comm.all_gather_into_async(
                        buf.new_empty(buf.numel() * dp_group.size), buf, dp_group
                    ).wait(),
                    zeros(nbytes, weight, d),
                ),
            }
        else:
            ops = {
                "all_reduce": (lambda buf: comm.all_reduce_(buf, tp_group), zeros(nbytes, act)),
                "all_gather": (
                    lambda buf: comm.reshard_batch(buf, 1, t, gather_group),
                    zeros(nbytes, act, t),
                ),
                "reduce_scatter": (
                    lambda buf: comm.reduce_scatter(buf, tp_group),
                    zeros(nbytes, act, t, divisible=True),
                ),
            }
        for op, (fn, buf) in ops.items():
            full = (
                buf.numel() * (dp_group.size if dp_only else t)
                if op == "all_gather"
                else (buf.numel())
            )
            samples = []
            for _ in range(repeats + 1):
                comm.barrier(ctx.world_group)  # (on CUDA it also empties the queue)
                with torch.no_grad():  # CUDA: events around it, read after a synchronize
                    samples.append(clock.time_s(lambda fn=fn, buf=buf: fn(buf)))
            size = ctx.world_size // t if dp_only else t
            out.append(
                {
                    "op": op,
                    "group_size": size,
                    "nbytes": full * buf.element_size(),
                    "s": statistics.median(samples[1:]),
                }
            )
    if len(sizes) > 1:  # a bandwidth of inf or <= 0 would price every byte at zero
        for op in sorted({e["op"] for e in out}):
            points = [(e["nbytes"], e["s"]) for e in out if e["op"] == op]
            try:
                check_collective_fit(op, out[0]["group_size"], points)
            except ValueError as exc:
                # CUDA (event-timed): a clock that did not wait, an error. CPU ranks sharing
                # loaded cores time small sizes within noise (measured on this 2-core machine:
                # 1-128 KiB all-reduces of 0.35-7.4 ms in no order): the fit then prices them
                # at their mean time (latency, no per-byte cost), with a warning
                if ctx.device.type == "cuda":
                    raise
                if ctx.rank == 0:
                    print(f"warning: {exc}", file=sys.stderr, flush=True)
    return out
