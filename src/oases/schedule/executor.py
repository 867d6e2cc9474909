"""The executor: runs a schedule program on the chain of regions with real tensors.

Every piece runs on *detached* inputs (leaves), so autograd graphs end at each collective and the
executor decides when each gradient is all-reduced. Per region i and sub-batch j::

    forward    body:i   x_i -(norm)-> h_i | h_leaf -(TP core)-> y_i ; p_i = row.partial(y_i)
               Start/Wait fwd: p_i is all-reduced in place into r_i
               epi:i    (x_i, r_i) -> x_{i+1}                      (dropout: RNG state kept)
    backward   epi:i    dx_{i+1} -> dr_i (= dp_i), residual part of dx_i
               tp:i     dp_i -> row.backward_partial (no forward matmul needed) -> dy -> dh_i
               Start/Wait bwd: dh_i all-reduced in place
               norm:i   dh_i -> norm backward -> dx_i (+ residual part)

Recompute modes (``ScheduleSpec.recompute``):
    none      every graph is kept from the forward.
    commfree  pieces run without graph in the forward; epi:i saves its inputs (x_i, r_i), both
              post-collective; the segment [epi:i-1, body:i] is recomputed before region i's
              backward: no collective, and no row-parallel matmul (its output is never needed).
    block     Megatron: a block's pieces run without graph; body:attn saves the block input; the
              recompute re-runs the block, repeating both forward all-reduces.

Shape legend: b sub-batch rows, S sequence, H hidden.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch import Tensor

from oases.model import Transformer
from oases.parallel import comm
from oases.parallel.layers import input_grads_unreduced
from oases.schedule.program import Compute, Instr, ScheduleSpec, Start, Wait, comm_name, label
from oases.schedule.regions import build_chain, dp_buckets
from oases.schedule.timeline import Event, active_timelines


class Executor:
    """Runs programs for one parallelized model. Build once, call ``run`` every step."""

    def __init__(self, model: Transformer, spec: ScheduleSpec) -> None:
        self.model, self.spec = model, spec
        self.ctx = model.parallel_ctx
        plan = model.parallel_plan
        if plan is not None and not plan.is_uniform():
            raise ValueError(f"schedules run uniform plans for now (this plan mixes tp "
                             f"{plan.degrees()}); a mixed plan trains through model(tokens, "
                             "targets).backward() and oases.parallel.apply.reduce_gradients")
        self.chain = build_chain(model)
        self.buckets = dp_buckets(self.chain) if self.ctx.dp > 1 else {}
        self.track_memory = False
        self.skip_comm = False  # benchmarks only: compute-only timing, numbers are then wrong
        self.saved_bytes: dict[int, int] = {}  # region -> bytes kept from forward to backward
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}

    # ----------------------------------------------------------------------------------- setup
    def _in_segment(self, kind: str, i: int) -> bool:
        """Does piece (kind, i) run without a graph in the forward (it is recomputed)?"""
        mode, last = self.spec.recompute, len(self.chain) - 1
        if mode == "commfree":  # segments [epi:i-1, body:i] for 0 < i < last (not the head,
            # whose recompute would repeat the cross-entropy's collectives)
            return (kind == "body" and 0 < i < last) or (kind == "epi" and i < last - 1)
        if mode == "block":
            return 0 < i < last
        return False

    def run(self, program: list[Instr], tokens: list[Tensor], targets: list[Tensor],
            loss_scale: float) -> list[Tensor]:
        """Run ``program`` on sub-batches ``tokens[j]``/``targets[j]``; returns per-sub losses."""
        self.tokens, self.targets, self.scale = tokens, targets, loss_scale
        self._reset()
        timelines = list(active_timelines())
        sync = bool(timelines) and self.ctx.device.type == "cuda"  # honest device times
        try:
            with input_grads_unreduced(self.model):
                for ins in program:
                    t = time.perf_counter()
                    if isinstance(ins, Compute):
                        self._compute(ins)
                        if timelines:
                            if sync:
                                torch.cuda.synchronize(self.ctx.device)
                            self._event(timelines, "compute", label(ins), ins.phase, ins.sub, t)
                    elif isinstance(ins, Start):
                        self._start(ins, timelines)
                    else:
                        self._wait(ins)
                        if sync:
                            torch.cuda.synchronize(self.ctx.device)
            state = {"graphs": self.bg, "epi": self.eg, "x": self.x, "p": self.p,
                     "handles": self.handles, "saved": self.saved, "rng": self.rng,
                     "grads": self.gx, "residual grads": self.gres, "dr": self.dr,
                     "dh": self.dh}
            leftovers = [k for k, d in state.items() if d]
            assert not leftovers, f"program left state behind: {leftovers}"
            return [self.losses[j] for j in sorted(self.losses)]
        finally:  # never keep a step's graphs alive past it (an OOM retry must find memory)
            self._reset()
            self.tokens = self.targets = None

    def _reset(self) -> None:
        self.x: dict = {}
        self.p: dict = {}
        self.bg: dict = {}
        self.eg: dict = {}
        self.saved: dict = {}
        self.rng: dict = {}
        self.gres: dict = {}
        self.gx: dict = {}
        self.dr: dict = {}
        self.dh: dict = {}
        self.handles: dict = {}
        self.losses: dict[int, Tensor] = {}
        self._seen: set[int] = set()

    def _event(self, timelines: list, lane: str, name: str, phase: str, sub: int,
               start: float) -> None:
        """Times are absolute ``perf_counter`` seconds (one clock for all processes of a
        machine); timelines are normalized when drawn or exported."""
        ev = Event(self.ctx.rank, lane, name, phase, sub, start, time.perf_counter())
        for tl in timelines:
            tl.add(ev)

    # --------------------------------------------------------------------------------- compute
    def _compute(self, ins: Compute) -> None:
        j = ins.sub
        for kind, i in ins.pieces:
            if ins.phase == "backward":
                {"norm": self._bwd_norm, "epi": self._bwd_epi, "tp": self._bwd_tp}[kind](i, j)
                continue
            recompute = ins.phase == "recompute"
            grad = recompute or not self._in_segment(kind, i)
            if kind == "epi":
                self._epi(i, j, grad, recompute)
            else:
                skip_last = recompute and self.spec.recompute == "commfree"
                self._body(i, j, grad, recompute, need_p=not skip_last)

    def _track(self, i: int, recompute: bool):  # noqa: ANN202
        """Count storages autograd keeps from the forward for region i (not parameters, not
        the transient graphs of a recompute)."""
        if not self.track_memory or recompute:
            return contextlib.nullcontext()

        def pack(t: Tensor) -> Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self._param_ptrs and ptr not in self._seen:
                self._seen.add(ptr)
                self.saved_bytes[i] = self.saved_bytes.get(i, 0) + t.untyped_storage().nbytes()
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def _count_saved(self, i: int, *tensors: Tensor | None) -> None:
        if self.track_memory:
            for t in tensors:
                if t is not None and t.untyped_storage().data_ptr() not in self._seen:
                    self._seen.add(t.untyped_storage().data_ptr())
                    self.saved_bytes[i] = self.saved_bytes.get(i, 0) + t.numel() * t.element_size()

    def _body(self, i: int, j: int, grad: bool, recompute: bool, need_p: bool) -> None:
        region, model = self.chain[i], self.model
        if region.kind == "embed":
            with torch.set_grad_enabled(grad), self._track(i, recompute):
                p = model.embed.partial(self.tokens[j])  # [b, S, H] partial sums
            self.p[i, j] = p.detach().clone() if grad else p  # all-reduced in place
            if grad:
                self.bg[i, j] = p
            return
        if recompute and self.spec.recompute == "block" and region.kind == "attn":
            self.x[i, j] = self.saved.pop((i, j))
        commfree_recompute = recompute and self.spec.recompute == "commfree"
        x = self.x.pop((i, j)) if commfree_recompute or region.kind == "head" else self.x[i, j]
        if not recompute and self.spec.recompute == "block" and region.kind == "attn":
            self.saved[i, j] = x
            self._count_saved(i, x)
        with torch.set_grad_enabled(grad), self._track(i, recompute):
            xl = x.detach().requires_grad_(grad)
            h = region.norm(xl)
            hl = h.detach().requires_grad_(grad)
            if region.kind == "head":
                out = model.loss_fn(model.head.local(hl), self.targets[j])
                self.losses[j] = out.detach()
            else:
                out = region.core(hl)  # y [b, S, I/t]
        if region.kind != "head" and need_p:
            with torch.no_grad():
                self.p[i, j] = region.row.partial(out)  # [b, S, H] partial sums
        if grad:
            self.bg[i, j] = (xl, h, hl, out)

    def _epi(self, i: int, j: int, grad: bool, recompute: bool) -> None:
        region = self.chain[i]
        if recompute and self.spec.recompute == "commfree":
            x, r = self.saved.pop((i, j))
        else:
            x, r = self.x.pop((i, j), None), self.p.pop((i, j))
        if not recompute and self.spec.recompute == "commfree" and self._in_segment("epi", i):
            self.saved[i, j] = (x, r)
            self._count_saved(i + 1, x, r)
        use_rng = region.dropout > 0 and self._in_segment("epi", i)
        with torch.random.fork_rng(devices=self._rng_devices(), enabled=recompute and use_rng):
            if use_rng:
                if recompute:
                    _set_rng(self.rng.pop((i, j)), self.ctx.device)
                else:
                    self.rng[i, j] = _get_rng(self.ctx.device)
            with torch.set_grad_enabled(grad), self._track(i + 1, recompute):
                xl = None if x is None else x.detach().requires_grad_(grad)
                rl = r.detach().requires_grad_(grad)
                out = region.epilogue(xl, rl)  # x_{i+1} [b, S, H]
        if not (recompute and self.spec.recompute == "block" and region.kind == "mlp"):
            # (a block's recompute ends at its MLP glue: the next block's input is not needed)
            self.x[i + 1, j] = out.detach()
        if grad:
            self.eg[i, j] = (xl, rl, out)

    def _rng_devices(self) -> list:
        return [self.ctx.device] if self.ctx.device.type == "cuda" else []

    # -------------------------------------------------------------------------------- backward
    def _bwd_norm(self, i: int, j: int) -> None:
        xl, h, _, _ = self.bg.pop((i, j))
        torch.autograd.backward(h, self.dh.pop((i, j)))
        res = self.gres.pop((i, j), None)
        self.gx[i, j] = xl.grad if res is None else xl.grad + res

    def _bwd_epi(self, i: int, j: int) -> None:
        xl, rl, out = self.eg.pop((i, j))
        torch.autograd.backward(out, self.gx.pop((i + 1, j)))
        self.dr[i, j] = rl.grad
        if xl is not None:
            self.gres[i, j] = xl.grad

    def _bwd_tp(self, i: int, j: int) -> None:
        region = self.chain[i]
        if region.kind == "embed":
            torch.autograd.backward(self.bg.pop((i, j)), self.dr.pop((i, j)))
            return
        xl, h, hl, out = self.bg[i, j]
        if region.kind == "head":
            torch.autograd.backward(out, torch.tensor(self.scale, device=out.device))
        else:
            dy = region.row.backward_partial(out, self.dr.pop((i, j)))  # [b, S, I/t]
            torch.autograd.backward(out, dy)
        self.bg[i, j] = (xl, h, hl, None)
        self.dh[i, j] = hl.grad  # partial sums of dL/dh over the TP group

    # ----------------------------------------------------------------------------- collectives
    def _start(self, ins: Start, timelines: list) -> None:
        key = (ins.kind, ins.index, ins.sub)
        tag = f"{ins.kind}:{ins.index}:{ins.sub}"
        issued = time.perf_counter()
        if ins.kind == "dp":
            group = self.ctx.dp_group
            handle = (comm.Handle(None, None) if self.skip_comm else
                      comm.gradient_mean_async(self.buckets[ins.index], group, tag=tag))
        else:
            group = self.ctx.tp_group
            t, direction = ((self.p[ins.index, ins.sub], "forward") if ins.kind == "fwd" else
                            (self.dh[ins.index, ins.sub], "backward"))
            handle = (comm.Handle(t, None) if self.skip_comm else
                      comm.all_reduce_async(t, group, direction=direction, tag=tag))
        if timelines and group.size > 1 and not self.skip_comm:
            rank, name = self.ctx.rank, comm_name(ins.kind, ins.index)

            def done(sub: int = ins.sub, phase: str = ins.kind) -> None:
                ev = Event(rank, "comm", name, phase, sub, issued, time.perf_counter())
                for tl in timelines:  # the timelines open at issue, even if one closed since
                    tl.add(ev)

            handle.on_complete(done)
        self.handles[key] = handle

    def _wait(self, ins: Wait) -> None:
        self.handles.pop((ins.kind, ins.index, ins.sub)).wait()


def _get_rng(device: torch.device) -> Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_rng(state: Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)
