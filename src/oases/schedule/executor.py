"""The executor: runs a schedule program on the chain of regions with real tensors.

Every piece runs on *detached* inputs (leaves), so autograd graphs end at each collective and the
executor decides when each gradient is all-reduced. Per region i and sub-batch j::

    forward    body:i   x_i -(norm)-> h_i | h_leaf -(TP core)-> y_i ; p_i = row.partial(y_i)
               Start/Wait fwd: p_i is all-reduced in place into r_i (region i's TP group)
               epi:i    (x_i, r_i) -> x_{i+1}                      (dropout: RNG state kept)
               Start/Wait rsf (degree change at i+1): x_{i+1} [b_i, S, H] -> [b_{i+1}, S, H]
    backward   epi:i    dx_{i+1} -> dr_i (= dp_i), residual part of dx_i
               tp:i     dp_i -> row.backward_partial (no forward matmul needed) -> dy -> dh_i
               dw:i     (sp) the weight gradients tp:i left: it computed dh_i alone
               Start/Wait bwd: dh_i all-reduced in place (region i's TP group)
               norm:i   dh_i -> norm backward -> dx_i (+ residual part)
               Start/Wait rsb (degree change at i): dx_i [b_i, S, H] -> [b_{i-1}, S, H]

Each region computes at its own TP degree t_i on b_i = b_0 * t_i / t_0 rows (b_0: the sub-batch
in the embedding's layout); a reshard gathers the batch over the ranks whose TP groups merge
(degree grows) or keeps this rank's chunk (degree shrinks), and its backward does the conjugate.
The targets are resharded from the embedding's layout to the head's once, at the start of a run.

Recompute modes (``ScheduleSpec.recompute``):
    none      every graph is kept from the forward.
    commfree  pieces run without graph in the forward; epi:i saves its inputs (x_i, r_i), both
              post-collective; the segment [epi:i-1, body:i] is recomputed before region i's
              backward: no collective, and no row-parallel matmul (its output is never needed).
              At a degree change at i the segment is [body:i] from its saved post-reshard input
              (epi:i-1 keeps its graph), so the reshard is not repeated either.
    block     Megatron: a block's pieces run without graph; body:attn saves the block input
              (post-reshard); the recompute re-runs the block, repeating both forward
              all-reduces and a reshard inside the block.

Sequence parallelism (``sp``, ``program._sp_chain``): x_i, r_i and the glue live on this rank's
slice [b, S/t, H] of the sequence; body:i splits into norm:i (on the slice) and core:i (on the
gathered h_i [b, S, H]); "fwd"/"bwd" reduce-scatter along the sequence, "gf"/"gr" gather h_i
and "gb" gathers dr_i before tp:i. The embedding adds the positions of its slice (their
gradient comes from the gathered dr_0, whole on every rank: no sum); its dropout
and every glue's draw from this rank's own stream (a slice is not replicated), kept across
steps and restored for a recompute. A communication-free recompute keeps the gathered h_i
(``sp="gathered"``: no collective) or gathers it again (``"shards"``, "gr").

Data-parallel gradients: each region's are summed over its own DP group and divided by the
head's DP degree (the number of distinct loss terms), one mean per (bucket, DP group). Regions
sharded by ZeRO (``model.zero_shards``, ``parallel/shard.py``) reduce-scatter their gradients
instead ("rs": each rank keeps its shard of the mean) and, at stage 3, gather their weights
before each pass ("ag") and free them after it (``Release``); ``program._insert_zero`` places
these instructions.

Shape legend: b sub-batch rows, S sequence, H hidden.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch import Tensor

from oases.model import Transformer
from oases.parallel import comm
from oases.parallel.layers import (
    ColumnParallelLinear,
    deferred_weight_grads,
    input_grads_unreduced,
)
from oases.parallel.shard import zero_shards
from oases.schedule.program import (
    Compute,
    Instr,
    Release,
    ScheduleSpec,
    Start,
    Wait,
    ZeroLayout,
    comm_name,
    deferred_regions,
    degree_changes,
    label,
)
from oases.schedule.regions import build_chain, dp_bucket_groups, dp_buckets
from oases.schedule.timeline import Event, active_timelines
from oases.timing import DeviceClock, Stamp


class Executor:
    """Runs programs for one parallelized model. Build once, call ``run`` every step."""

    def __init__(self, model: Transformer, spec: ScheduleSpec,
                 grad_reduce_dtype: torch.dtype | None = None, sp: str | None = None) -> None:
        self.model, self.spec = model, spec
        self.sp = sp
        self.grad_reduce_dtype = grad_reduce_dtype  # of the "dp" and "rs" collectives
        self.ctx = model.parallel_ctx
        self.chain = build_chain(model)
        self.degrees = tuple(r.tp for r in self.chain)
        self.changes = degree_changes(len(self.chain), self.degrees)
        reduce = any(r.dp_group.size > 1 for r in self.chain)
        self.zero = zero_shards(model)
        skip = frozenset() if self.zero is None else frozenset(
            id(p) for u in self.zero.units.values() for p in u.params)
        self.buckets = dp_buckets(self.chain, skip) if reduce else {}
        self.bucket_groups = dp_bucket_groups(self.chain, skip) if reduce else {}
        self.zero_layout = None if self.zero is None else _zero_layout(self.chain, self.zero)
        self.dp_head = self.ctx.world_size // self.chain[-1].tp  # distinct loss terms
        self.track_memory = False
        self._deferring = frozenset()  # regions whose "dw" the running program has
        self.skip_comm = False  # benchmarks only: compute-only timing, numbers are then wrong
        self.saved_bytes: dict[int, int] = {}  # region -> bytes kept from forward to backward
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        if sp is not None:
            # this rank's own dropout stream for the glue on its slice of the sequence
            gen = torch.Generator(self.ctx.device)
            gen.manual_seed(torch.initial_seed() + 1_000_003 * (1 + self.chain[0].tp_group.rank))
            self._sp_rng = gen.get_state()
            # what runs on slices (norms, biases after the TP matmuls, positions), by the TP
            # group of the region that uses it
            # (not GPT-2's positions: each rank computes their whole gradient, _position_grad)
            positions = (set() if model.pos_embed is None
                         else {id(p) for p in model.pos_embed.parameters()})
            seen: dict[int, tuple[int, torch.nn.Parameter]] = {}
            for r in self.chain:
                for p in (*r.norm_params, *r.epi_params):
                    if id(p) not in positions:
                        seen.setdefault(id(p), (r.index, p))
            self._sp_glue_params = [p for _, p in seen.values()]
            self._sp_glue_groups: list[tuple[object, list[torch.nn.Parameter]]] = []
            for t in sorted(set(self.degrees)):
                params = [p for i, p in seen.values() if self.chain[i].tp == t]
                group = next(r.tp_group for r in self.chain if r.tp == t)
                if params:
                    self._sp_glue_groups.append((group, params))

    # ----------------------------------------------------------------------------------- setup
    def _in_segment(self, kind: str, i: int) -> bool:
        """Does piece (kind, i) run without a graph in the forward (it is recomputed)?"""
        mode, last = self.spec.recompute, len(self.chain) - 1
        if mode == "commfree":  # segments [epi:i-1, body:i] for 0 < i < last (not the head,
            # whose recompute would repeat the cross-entropy's collectives); [body:i] alone
            # after a reshard; under sp body:i is norm:i and core:i
            return (kind in ("body", "norm", "core") and 0 < i < last) or (
                kind == "epi" and i < last - 1 and i + 1 not in self.changes)
        if mode == "block":
            return 0 < i < last
        return False

    def _saves_input(self, i: int) -> bool:
        """Does body:i keep its input x_i for its recompute (a block's input; in commfree mode,
        an input that arrived through a reshard)?"""
        mode = self.spec.recompute
        if mode == "block":
            return self.chain[i].kind == "attn"
        return mode == "commfree" and i in self.changes and self._in_segment("body", i)

    def run(self, program: list[Instr], tokens: list[Tensor], targets: list[Tensor],
            loss_scale: float) -> list[Tensor]:
        """Run ``program`` on sub-batches ``tokens[j]``/``targets[j]`` (the embedding's layout);
        returns the per-sub losses (of this rank's rows in the head's layout)."""
        with torch.no_grad():  # a collective when embed and head differ in degree
            targets = [self.model.target_reshard(y) for y in targets]
        self.tokens, self.targets, self.scale = tokens, targets, loss_scale
        self._deferring = deferred_regions(program)
        self._reset()
        timelines = list(active_timelines())
        # honest device times without a synchronize inside the step (``oases.timing``)
        clock = DeviceClock(self.ctx.device) if timelines else None
        self._pending: list[tuple] = []  # CUDA: events whose stamps resolve after the step
        try:
            with input_grads_unreduced(self.model), self._armed_for_deferral():
                for ins in program:
                    if isinstance(ins, Compute):
                        start = clock.now() if clock is not None else None
                        self._compute(ins)
                        if clock is not None:
                            self._event(timelines, clock, "compute", label(ins), ins.phase,
                                        ins.sub, start, clock.now())
                    elif isinstance(ins, Start):
                        self._start(ins, timelines, clock)
                    elif isinstance(ins, Release):
                        self.zero.release(ins.index)
                    else:
                        self._wait(ins)
            state = {"graphs": self.bg, "epi": self.eg, "x": self.x, "p": self.p,
                     "handles": self.handles, "saved": self.saved, "inputs": self.inputs,
                     "rng": self.rng, "h slices": self.hs, "gathered h": self.hfull,
                     "kept h": self.hkeep,
                     "grads": self.gx, "residual grads": self.gres, "dr": self.dr,
                     "dh": self.dh, "deferred weight grads": self.wg}
            leftovers = [k for k, d in state.items() if d]
            assert not leftovers, f"program left state behind: {leftovers}"
            if clock is not None and self._pending:  # CUDA: one synchronize, after the step
                clock.resolve()
                for lane, name, phase, sub, start, end in self._pending:
                    ev = Event(self.ctx.rank, lane, name, phase, sub, clock.seconds(start),
                               clock.seconds(end))
                    for tl in timelines:
                        tl.add(ev)
            return [self.losses[j] for j in sorted(self.losses)]
        finally:  # never keep a step's graphs alive past it (an OOM retry must find memory)
            self._reset()
            self._pending = []
            self.tokens = self.targets = None

    def _reset(self) -> None:
        self.x: dict = {}
        self.p: dict = {}
        self.bg: dict = {}
        self.eg: dict = {}
        self.saved: dict = {}  # (i, j) -> (x_i, r_i) kept by epi:i (commfree)
        self.inputs: dict = {}  # (i, j) -> x_i kept by body:i (_saves_input)
        self.rng: dict = {}
        self.hs: dict = {}  # (i, j) -> norm:i's output slice, to gather (sp)
        self.hfull: dict = {}  # (i, j) -> the gathered h_i, for core:i (sp)
        self.hkeep: dict = {}  # (i, j) -> a gathered h_i kept for a recompute (sp="gathered")
        self.gres: dict = {}
        self.gx: dict = {}
        self.dr: dict = {}
        self.dh: dict = {}
        self.wg: dict = {}  # (i, j) -> what dw:i needs: (y_i, dr_i, [(layer, h_i, dY)]) (sp)
        self.handles: dict = {}
        self.losses: dict[int, Tensor] = {}
        self._seen: set[int] = set()
        self._scale_grads: dict[tuple, Tensor] = {}  # (dtype, device) -> the loss scale

    def _event(self, timelines: list, clock: DeviceClock, lane: str, name: str, phase: str,
               sub: int, start: Stamp, end: Stamp) -> None:
        """Times are absolute ``perf_counter`` seconds (one clock for all processes of a
        machine); timelines are normalized when drawn or exported. CPU: added now; CUDA: kept
        until ``run`` resolves the step's events after its last instruction."""
        if clock.cuda:
            self._pending.append((lane, name, phase, sub, start, end))
            return
        ev = Event(self.ctx.rank, lane, name, phase, sub, start, end)
        for tl in timelines:
            tl.add(ev)

    def _defers(self, i: int) -> bool:
        """Does region i's backward leave its weight gradients to a "dw" piece (the program
        running has one: ``program.defers_weight_grad``)?"""
        return i in self._deferring

    @contextlib.contextmanager
    def _armed_for_deferral(self):  # noqa: ANN202
        """Under sequence parallelism, a block's column-parallel layers record what their
        weight gradients need instead of computing them, inside ``_bwd_tp``; disarmed after."""
        layers = [m for r in self.chain if self._defers(r.index) and r.module is not None
                  for m in r.module.modules() if isinstance(m, ColumnParallelLinear)]
        for m in layers:
            m.defers_weight_grad = True
        try:
            yield
        finally:
            for m in layers:
                m.defers_weight_grad = False

    # --------------------------------------------------------------------------------- compute
    def _compute(self, ins: Compute) -> None:
        j = ins.sub
        for kind, i in ins.pieces:
            if ins.phase == "backward":
                {"norm": self._bwd_norm, "epi": self._bwd_epi, "tp": self._bwd_tp,
                 "dw": self._bwd_dw}[kind](i, j)
                continue
            recompute = ins.phase == "recompute"
            grad = recompute or not self._in_segment(kind, i)
            skip_last = recompute and self.spec.recompute == "commfree"
            if kind == "epi":
                self._epi(i, j, grad, recompute)
            elif kind == "norm":
                self._norm(i, j, grad, recompute)
            elif kind == "core" and i > 0:
                self._core(i, j, grad, recompute, need_p=not skip_last)
            else:  # body, or the embedding's core (its lookup: it has no norm)
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
                if not recompute:  # kept as the graph's root until the backward
                    self._count_saved(i, p)
            return
        x = self._norm_input(i, j, recompute)
        with torch.set_grad_enabled(grad), self._track(i, recompute):
            xl = x.detach().requires_grad_(grad)
            h = region.norm(xl)
            hl = h.detach().requires_grad_(grad)
            out = self._tp_core(i, j, hl)
        self._after_core(i, j, grad, recompute, need_p, (xl, h, hl, out))

    def _norm_input(self, i: int, j: int, recompute: bool) -> Tensor:
        """x_i for norm:i (in body:i, or sequence parallelism's norm:i): a block's saved input
        (kept here in the forward, taken back in the recompute), else the glue's output,
        taken where nothing else reads it after (a recompute segment, the head)."""
        commfree_recompute = recompute and self.spec.recompute == "commfree"
        if recompute and self._saves_input(i):
            x = self.inputs.pop((i, j))
            if not commfree_recompute:  # the block's recompute re-runs epi:i too
                self.x[i, j] = x
        elif commfree_recompute or self.chain[i].kind == "head":
            x = self.x.pop((i, j))
        else:
            x = self.x[i, j]
        if not recompute and self._saves_input(i):
            self.inputs[i, j] = x
            self._count_saved(i, x)
        return x

    def _tp_core(self, i: int, j: int, hl: Tensor) -> Tensor:
        """Region i's TP matmuls on its (gathered) norm output: y [b, S, I/t], or the head's
        loss (kept in ``losses``)."""
        region = self.chain[i]
        if region.kind == "head":
            out = self.model.loss_fn(self.model.head.local(hl), self.targets[j])
            self.losses[j] = out.detach()
            return out
        return region.core(hl)

    def _after_core(self, i: int, j: int, grad: bool, recompute: bool, need_p: bool,
                    graph: tuple) -> None:
        """p_i from y (unless a communication-free recompute skips it), and the graph (xl, h,
        hl, out) kept for the backward, y counted as kept."""
        out = graph[-1]
        if self.chain[i].kind != "head" and need_p:
            with torch.no_grad():
                self.p[i, j] = self.chain[i].row.partial(out)  # [b, S, H] partial sums
        if grad:
            self.bg[i, j] = graph
            if not recompute and self.chain[i].kind != "head":  # y, for the row-parallel bwd
                self._count_saved(i, out)

    def _norm(self, i: int, j: int, grad: bool, recompute: bool) -> None:
        """Sequence parallelism's norm:i on this rank's slice x_i -> h_i (gathered next)."""
        x = self._norm_input(i, j, recompute)
        with torch.set_grad_enabled(grad), self._track(i, recompute):
            xl = x.detach().requires_grad_(grad)
            h = self.chain[i].norm(xl)
        commfree_recompute = recompute and self.spec.recompute == "commfree"
        if not (commfree_recompute and self.sp == "gathered"):  # core:i reads the kept h
            self.hs[i, j] = h.detach()
        if grad:
            self.bg[i, j] = (xl, h, None, None)

    def _core(self, i: int, j: int, grad: bool, recompute: bool, need_p: bool) -> None:
        """Sequence parallelism's core:i on the gathered h_i [b, S, H] -> p_i (or the loss)."""
        commfree_recompute = recompute and self.spec.recompute == "commfree"
        if commfree_recompute and self.sp == "gathered":
            h = self.hkeep.pop((i, j))
        else:
            h = self.hfull.pop((i, j))
        if (not recompute and self.sp == "gathered" and self.spec.recompute == "commfree"
                and self._in_segment("core", i)):
            self.hkeep[i, j] = h
            self._count_saved(i, h)
        with torch.set_grad_enabled(grad), self._track(i, recompute):
            hl = h.detach().requires_grad_(grad)
            out = self._tp_core(i, j, hl)
        xl, h_slice = self.bg[i, j][:2] if grad else (None, None)
        self._after_core(i, j, grad, recompute, need_p, (xl, h_slice, hl, out))

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
        own = self.sp is not None and region.dropout > 0  # this rank's own stream (a slice)
        with torch.random.fork_rng(devices=self._rng_devices(),
                                   enabled=(recompute and use_rng) or own):
            if own and not recompute:
                _set_rng(self._sp_rng, self.ctx.device)
            if use_rng:
                if recompute:
                    _set_rng(self.rng.pop((i, j)), self.ctx.device)
                else:
                    self.rng[i, j] = _get_rng(self.ctx.device)
            with torch.set_grad_enabled(grad), self._track(i + 1, recompute):
                xl = None if x is None else x.detach().requires_grad_(grad)
                rl = r.detach().requires_grad_(grad)
                if region.kind == "embed" and self.sp is not None:  # its slice's positions
                    out = region.epilogue(xl, rl, start=region.tp_group.rank * rl.shape[1],
                                          pos_grad=False)  # (their gradient: _bwd_tp)
                else:
                    out = region.epilogue(xl, rl)  # x_{i+1} [b, S, H] (a slice under sp)
            if own and not recompute:
                self._sp_rng = _get_rng(self.ctx.device)
        if not (recompute and self.spec.recompute == "block" and region.kind == "mlp"):
            # (a block's recompute ends at its MLP glue: the next block's input is not needed)
            self.x[i + 1, j] = out.detach()
        if grad:
            self.eg[i, j] = (xl, rl, out)
            ptr = rl.untyped_storage().data_ptr()
            if (not recompute and (i, j) not in self.saved
                    and out.untyped_storage().data_ptr() != ptr):  # (an identity glue: r is x')
                # r_i = the reduced p_i: the glue's backward reads none of its values (bias add
                # and residual add keep nothing, dropout keeps its mask), only rl.grad is
                # wanted, yet the leaf rl would keep its [b, S, H] alive until the backward
                # (one activation per region that plain autograd frees at once)
                rl.untyped_storage().resize_(0)

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
            dr = self.dr.pop((i, j))
            torch.autograd.backward(self.bg.pop((i, j)), dr)
            if self.sp is not None and self.model.pos_embed is not None:
                self._position_grad(dr)
            return
        xl, h, hl, out = self.bg[i, j]
        if region.kind == "head":
            # the loss scale in the loss's dtype (a float64 run's 1/3 is not rounded to fp32),
            # filled on the device (a fill kernel: no host-to-device copy, no sync), once a run
            key = (out.dtype, out.device)
            if key not in self._scale_grads:
                self._scale_grads[key] = torch.full((), self.scale, dtype=out.dtype,
                                                    device=out.device)
            torch.autograd.backward(out, self._scale_grads[key])
        elif self._defers(i):  # dh_i now, the weight gradients in dw:i
            dr = self.dr.pop((i, j))
            dy = region.row.backward_partial(out, dr, weight_grad=False)  # [b, S, I/t]
            with deferred_weight_grads() as stash:
                torch.autograd.backward(out, dy)
            self.wg[i, j] = (out, dr, stash)
        else:
            dy = region.row.backward_partial(out, self.dr.pop((i, j)))  # [b, S, I/t]
            torch.autograd.backward(out, dy)
        self.bg[i, j] = (xl, h, hl, None)
        self.dh[i, j] = hl.grad  # partial sums of dL/dh over the TP group

    def _bwd_dw(self, i: int, j: int) -> None:
        """Region i's weight gradients, which ``_bwd_tp`` left: the row-parallel layer's from
        (y_i, dr_i), the column-parallel layers' from their inputs and output gradients."""
        out, dr, stash = self.wg.pop((i, j))
        self.chain[i].row.accumulate_weight_grad(out, dr)
        for layer, x, grad in stash:
            layer.accumulate_weight_grad(x, grad)

    def _position_grad(self, dr: Tensor) -> None:
        """Sequence parallelism: GPT-2's position table's gradient from the gathered dr_0
        [b, S, H] (gb(0), which the lookup's backward needs anyway): every rank of the TP group
        holds the same whole, so each computes the whole table's gradient, equal on all of
        them, and the table is not in the glue's sum ("sg"), which would otherwise move S x H
        (most of its bytes) to add up the zeros of the other ranks' positions. Accumulated in
        the weight's dtype, as autograd's cast back would."""
        w = self.model.pos_embed.weight
        g = dr.sum(0).to(w.dtype)  # [S, H]
        if w.grad is None:
            w.grad = torch.zeros_like(w)
        w.grad[: g.shape[0]].add_(g)

    # ----------------------------------------------------------------------------- collectives
    def _start(self, ins: Start, timelines: list, clock: DeviceClock | None) -> None:
        i, j = ins.index, ins.sub
        tag = f"{ins.kind}:{i}:{j}"
        issued = clock.now() if clock is not None else 0.0
        handles: list[tuple[comm.Handle, bool]] = []  # (handle, moves data between ranks)
        if ins.kind == "rs":  # ZeRO: this rank's shard of region i's gradient
            handles.append((self.zero.start_grad_reduce(i, tag, self.grad_reduce_dtype),
                            self.zero.units[i].group.size > 1))
        elif ins.kind == "ag":  # ZeRO stage 3: region i's weights, before a pass
            handles.append((self.zero.start_gather(i, tag), self.zero.units[i].group.size > 1))
        elif ins.kind == "dp":  # one mean per DP group among the bucket's regions
            for group, params in self.bucket_groups[i]:
                handles.append((comm.Handle(None, None) if self.skip_comm else
                                comm.gradient_mean_async(params, group, divisor=self.dp_head,
                                                         dtype=self.grad_reduce_dtype,
                                                         tag=tag), group.size > 1))
        elif ins.kind in ("rsf", "rsb"):
            a, b = self.chain[i - 1].tp, self.chain[i].tp
            group = self.ctx.merge_group(a, b)
            x, src, dst, direction = ((self.x.pop((i, j)), a, b, "forward") if ins.kind == "rsf"
                                      else (self.gx.pop((i, j)), b, a, "backward"))
            if self.sp is not None:  # rows and sequence slices both move
                big = self.chain[i if b > a else i - 1].tp_group
                if self.skip_comm:
                    out = x.repeat(dst // src, 1, 1)[:, : x.shape[1] * src // dst] if dst > src \
                        else x[: x.shape[0] * dst // src].repeat(1, src // dst, 1)
                    handles.append((comm.Handle(out.contiguous(), None), False))
                else:
                    handles.append((comm.reshard_seq_async(x, src, dst, big,
                                                           direction=direction, tag=tag), True))
            elif self.skip_comm:  # the right shape, wrong numbers
                out = x.repeat(dst // src, *[1] * (x.dim() - 1)) if dst > src else x[
                    : x.shape[0] * dst // src]
                handles.append((comm.Handle(out, None), False))
            else:
                handles.append((comm.reshard_batch_async(x, src, dst, group, direction=direction,
                                                         tag=tag), dst > src))
        elif ins.kind == "sg":  # sp: the glue's gradients, summed over their TP groups
            for group, params in self._sp_glue_groups:
                grads = self._glue_grads(params)
                if grads and group.size > 1 and not self.skip_comm:
                    handles.append((comm.flat_all_reduce_async(grads, group, tag=tag), True))
        elif ins.kind in ("gf", "gr", "gb"):  # sp: gather h_i (or dr_i) along the sequence
            group = self.chain[i].tp_group
            x, direction = ((self.dr[i, j], "backward") if ins.kind == "gb" else
                            (self.hs.pop((i, j)), "forward"))
            handles.append((comm.Handle(x.repeat(1, group.size, 1), None) if self.skip_comm
                            else comm.seq_gather_async(x, group, direction=direction, tag=tag),
                            group.size > 1))
        else:
            group = self.chain[i].tp_group
            store, direction = ((self.p, "forward") if ins.kind == "fwd" else
                                (self.dh, "backward"))
            # (under sp the partial sums are given up: the scatter sends its rank-major copy
            # and gloo receives into them; a backward's are hl.grad, which nothing reads again)
            t = store.pop((i, j)) if self.sp is not None else store[i, j]
            if self.sp is not None:  # reduce-scatter along the sequence
                handles.append((comm.Handle(comm.seq_slice(t, group), None) if self.skip_comm
                                else comm.seq_reduce_scatter_async(t, group, direction=direction,
                                                                   tag=tag, consume=True),
                                group.size > 1))
            else:
                handles.append((comm.Handle(t, None) if self.skip_comm else
                                comm.all_reduce_async(t, group, direction=direction, tag=tag),
                                group.size > 1))
        if clock is not None and not self.skip_comm:
            rank, name = self.ctx.rank, comm_name(ins.kind, i)
            if clock.cuda:  # an event on the clock's side stream, after the collective
                self._pending += [("comm", name, ins.kind, j, issued, clock.after(handle))
                                  for handle, moves in handles if moves]
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
                    out += [u.grad_shard[s.offset:s.offset + s.size] for s in u.segments
                            if s.param is p]
            elif p.grad is not None:
                out.append(p.grad)
        return out

    def _wait(self, ins: Wait) -> None:
        i, j = ins.index, ins.sub
        results = [h.wait() for h in self.handles.pop((ins.kind, i, j))]
        if ins.kind == "rs":
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


def _zero_layout(chain: list, shards) -> ZeroLayout:  # noqa: ANN001 (ZeroShards)
    """The program's view of the sharded regions: each region's stage, and which regions'
    weights its TP pieces read (the owner of each of its norm and TP parameters)."""
    owner = {id(p): u.index for u in shards.units.values() for p in u.params}
    uses = []
    for region in chain:
        read = {owner.get(id(p), region.index) for p in (*region.norm_params,
                                                         *region.tp_params)}
        uses.append(tuple(sorted(read | {region.index})))
    return ZeroLayout(shards.stages, tuple(uses), shards.reshard_after_forward)


def _get_rng(device: torch.device) -> Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_rng(state: Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)
