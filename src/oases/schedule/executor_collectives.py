"""The executor's collective instructions: ``Start`` issues an async collective, ``Wait``
completes it and puts its result where the next piece reads it.

A mixin of ``executor.Executor``. Per kind (``instructions``), what ``_start`` sends and where
``_wait`` leaves the result:

    fwd, bwd    p[i, j] / dh[i, j] all-reduced in place over region i's TP group; under sp a
                reduce-scatter along the sequence whose slice replaces them
    rsf, rsb    x[i, j] / gx[i, j] resharded between regions i-1 and i (batch rows, and under
                sp sequence slices): the result replaces them in the other layout
    gf, gr, gb  (sp) hs[i, j] -> hfull[i, j], dr[i, j] -> dr[i, j]: gathered along the sequence
    dp          the gradient mean of bucket i over each of its DP groups
    rs, ag      ZeRO: region i's gradient reduce-scatter, weight all-gather (``parallel/shard``)
    sg          (sp) the glue's and norms' gradients summed over their TP groups
    sf, rf, sb, rb, tie   pipeline stages: point-to-point and the tied embedding's gradient
                (``executor_p2p``)

Handles are kept in ``handles[kind, i, j]``; timelines get one "comm" event per collective that
moves data (CPU: on completion; CUDA: an event on the clock's side stream). ``skip_comm``
(benchmarks) gives results of the right shape and wrong numbers without a collective.
"""

from __future__ import annotations

import time

from torch import Tensor

from oases.parallel import comm
from oases.schedule.executor_p2p import P2P
from oases.schedule.instructions import Start, Wait, comm_name
from oases.schedule.timeline import Event
from oases.timing import DeviceClock

PIPELINE_KINDS = (*P2P, "tie")


class CollectiveInstructions:
    """``Start`` and ``Wait`` of ``Executor`` (see the module docstring)."""

    def _start(self, ins: Start, timelines: list, clock: DeviceClock | None) -> None:
        i, j = ins.index, ins.sub
        tag = f"{ins.kind}:{i}:{j}"
        issued = clock.now() if clock is not None else 0.0
        handles: list[tuple[comm.Handle, bool]] = []  # (handle, moves data between ranks)
        if ins.kind in PIPELINE_KINDS:
            handles.append(self._start_pipeline(ins, tag))
        elif ins.kind == "rs":  # ZeRO: this rank's shard of region i's gradient
            handles.append(
                (
                    self.zero.start_grad_reduce(i, tag, self.grad_reduce_dtype),
                    self.zero.units[i].group.size > 1,
                )
            )
        elif ins.kind == "ag":  # ZeRO stage 3: region i's weights, before a pass
            handles.append((self.zero.start_gather(i, tag), self.zero.units[i].group.size > 1))
        elif ins.kind == "dp":  # one mean per DP group among the bucket's regions
            for group, params in self.bucket_groups[i]:
                handles.append(
                    (
                        comm.Handle(None, None)
                        if self.skip_comm
                        else comm.gradient_mean_async(
                            params,
                            group,
                            divisor=self.dp_head,
                            dtype=self.grad_reduce_dtype,
                            tag=tag,
                        ),
                        group.size > 1,
                    )
                )
        elif ins.kind in ("rsf", "rsb"):
            a, b = self.chain[i - 1].tp, self.chain[i].tp
            group = self.ctx.merge_group(a, b)
            x, src, dst, direction = (
                (self.x.pop((i, j)), a, b, "forward")
                if ins.kind == "rsf"
                else (self.gx.pop((i, j)), b, a, "backward")
            )
            if self.sp is not None:  # rows and sequence slices both move
                big = self.chain[i if b > a else i - 1].tp_group
                if self.skip_comm:
                    out = (
                        x.repeat(dst // src, 1, 1)[:, : x.shape[1] * src // dst]
                        if dst > src
                        else x[: x.shape[0] * dst // src].repeat(1, src // dst, 1)
                    )
                    handles.append((comm.Handle(out.contiguous(), None), False))
                else:
                    handles.append(
                        (
                            comm.reshard_seq_async(x, src, dst, big, direction=direction, tag=tag),
                            True,
                        )
                    )
            elif self.skip_comm:  # the right shape, wrong numbers
                out = (
                    x.repeat(dst // src, *[1] * (x.dim() - 1))
                    if dst > src
                    else x[: x.shape[0] * dst // src]
                )
                handles.append((comm.Handle(out, None), False))
            else:
                handles.append(
                    (
                        comm.reshard_batch_async(x, src, dst, group, direction=direction, tag=tag),
                        dst > src,
                    )
                )
        elif ins.kind == "sg":  # sp: the glue's gradients, summed over their TP groups
            for group, params in self._sp_glue_groups:
                grads = self._glue_grads(params)
                if grads and group.size > 1 and not self.skip_comm:
                    handles.append((comm.flat_all_reduce_async(grads, group, tag=tag), True))
        elif ins.kind in ("gf", "gr", "gb"):  # sp: gather h_i (or dr_i) along the sequence
            group = self.chain[i].tp_group
            x, direction = (
                (self.dr[i, j], "backward")
                if ins.kind == "gb"
                else (self.hs.pop((i, j)), "forward")
            )
            handles.append(
                (
                    comm.Handle(x.repeat(1, group.size, 1), None)
                    if self.skip_comm
                    else comm.seq_gather_async(x, group, direction=direction, tag=tag),
                    group.size > 1,
                )
            )
        else:
            group = self.chain[i].tp_group
            store, direction = (self.p, "forward") if ins.kind == "fwd" else (self.dh, "backward")
            # (under sp the partial sums are given up: the scatter sends its rank-major copy
            # and gloo receives into them; a backward's are hl.grad, which nothing reads again)
            t = store.pop((i, j)) if self.sp is not None else store[i, j]
            if self.sp is not None:  # reduce-scatter along the sequence
                handles.append(
                    (
                        comm.Handle(comm.seq_slice(t, group), None)
                        if self.skip_comm
                        else comm.seq_reduce_scatter_async(
                            t, group, direction=direction, tag=tag, consume=True
                        ),
                        group.size > 1,
                    )
                )
            else:
                handles.append(
                    (
                        comm.Handle(t, None)
                        if self.skip_comm
                        else comm.all_reduce_async(t, group, direction=direction, tag=tag),
                        group.size > 1,
                    )
                )
        if clock is not None and not self.skip_comm:
            rank, name = self.ctx.rank, comm_name(ins.kind, i)
            if clock.cuda:  # an event on the clock's side stream, after the collective
                self._pending += [
                    ("comm", name, ins.kind, j, issued, clock.after(handle))
                    for handle, moves in handles
                    if moves
                ]
            else:

                def done(sub: int = j, phase: str = ins.kind) -> None:
                    ev = Event(rank, "comm", name, phase, sub, issued, time.perf_counter())
                    for tl in timelines:  # the timelines open at issue, even if one closed
                        tl.add(ev)

                for handle, moves in handles:
                    if moves:
                        handle.on_complete(done)
        self.handles[ins.kind, i, j] = [h for h, _ in handles]

    def _glue_grads(self, params: list) -> list[Tensor]:
        """The gradients of ``params`` as this rank holds them: ``.grad``, or for a ZeRO
        unit's parameter the part of it in this rank's gradient shard (the same offsets on
        every TP rank: their units have the same shapes)."""
        out = []
        for p in params:
            if self.zero is not None and self.zero.is_sharded(p):
                for u in self.zero.units.values():
                    if u.grad_shard is None:
                        continue
                    out += [
                        u.grad_shard[s.offset : s.offset + s.size]
                        for s in u.segments
                        if s.param is p
                    ]
            elif p.grad is not None:
                out.append(p.grad)
        return out

    def _wait(self, ins: Wait) -> None:
        i, j = ins.index, ins.sub
        results = [h.wait() for h in self.handles.pop((ins.kind, i, j))]
        if ins.kind in PIPELINE_KINDS:
            self._wait_pipeline(ins, results[0])
        elif ins.kind == "rs":
            self.zero.finish_grad_reduce(i, results[0], self.dp_head)
        elif ins.kind == "ag":  # the gathered weights live at a new address
            self._param_ptrs.add(self.zero.units[i].flat.untyped_storage().data_ptr())
        elif ins.kind == "rsf":  # body:i reads x_i in its own layout
            self.x[i, j] = results[0]
        elif ins.kind == "rsb":  # epi:i-1 reads dx_i in region i-1's layout
            self.gx[i, j] = results[0]
        elif ins.kind in ("gf", "gr"):
            self.hfull[i, j] = results[0]
        elif ins.kind == "gb":
            self.dr[i, j] = results[0]
        elif self.sp is not None and ins.kind == "fwd":  # the reduce-scattered slices
            self.p[i, j] = results[0]
        elif self.sp is not None and ins.kind == "bwd":
            self.dh[i, j] = results[0]
