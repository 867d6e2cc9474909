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

Where no collective separates them, pieces share one graph instead (``links``): norm:i reads
epi:i-1's output itself (an x-link), and without recompute epi:i reads p_i itself, reduced in
place (a p-link), so a backward Compute [norm:i+1, epi:i, tp:i] is one autograd call; where only
Computes lie between tp:i and norm:i (a region at tp=1), body:i's core reads h_i itself and
the call goes on into the next Compute (an h-link): a Megatron step at tp=1 is one call.

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

Sequence parallelism (``sp``, ``sp_tasks.sp_chain``): x_i, r_i and the glue live on this rank's
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
before each pass ("ag") and free them after it (``Release``); ``dp_insert.insert_zero`` places
these instructions.

Pipeline stages (``plan.pp`` > 1): the executor runs a stage's program on the regions it holds
(indices stay global); a stage boundary b splits tasks like a degree change (``changes``
holds both), and x_b / dx_b arrive by point-to-point instead of a reshard. Only the first
stage reads the tokens and only the last the targets (every stage is given both: they size
the buffers), and only the last returns losses.

This module builds the executor, runs a program's instructions in order, dispatches each
compute's pieces and records timeline events; the pieces and collectives live in four mixins:
``executor_forward`` (forward and recompute pieces, what they keep, their RNG),
``executor_backward`` (backward pieces, deferred weight gradients),
``executor_collectives`` (``Start``/``Wait`` of every collective kind) and ``executor_p2p``
(the pipeline's point-to-point and tied-embedding instructions).

Shape legend: b sub-batch rows, S sequence, H hidden.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from oases.model import Transformer
from oases.parallel.layers import ColumnParallelLinear
from oases.parallel.shard import zero_shards
from oases.schedule.dp_insert import ZeroLayout
from oases.schedule.executor_backward import BackwardPieces
from oases.schedule.executor_collectives import CollectiveInstructions
from oases.schedule.executor_forward import ForwardPieces
from oases.schedule.executor_p2p import PointToPointInstructions
from oases.schedule.instructions import (
    Compute,
    Instr,
    Release,
    Start,
    Wait,
    deferred_regions,
    label,
)
from oases.schedule.links import Links, handed_on, program_links
from oases.schedule.regather import regathered_regions
from oases.schedule.regions import build_chain, dp_bucket_groups, dp_buckets
from oases.schedule.specs import ScheduleSpec
from oases.schedule.tasks import degree_changes
from oases.schedule.timeline import Event, active_timelines
from oases.timing import DeviceClock, Stamp


class Executor(ForwardPieces, BackwardPieces, CollectiveInstructions, PointToPointInstructions):
    """Runs programs for one parallelized model. Build once, call ``run`` every step.

    Construction, ``run`` (the loop over instructions), the dispatch of a compute's pieces,
    the per-step state and the timeline events live here; the pieces and collectives in the
    mixins ``ForwardPieces`` (``executor_forward``), ``BackwardPieces``
    (``executor_backward``) and ``CollectiveInstructions`` (``executor_collectives``)."""

    def __init__(
        self,
        model: Transformer,
        spec: ScheduleSpec,
        grad_reduce_dtype: torch.dtype | None = None,
        sp: str | None = None,
    ) -> None:
        self.model, self.spec = model, spec
        self.sp = sp
        self.grad_reduce_dtype = grad_reduce_dtype  # of the "dp" and "rs" collectives
        self.ctx = model.parallel_ctx
        self.chain = build_chain(model)
        self.degrees = tuple(r.tp for r in self.chain)
        self.layout = model.parallel_plan.stage_layout()  # pipeline stages (one: pp = 1)
        self.stage = self.ctx.pp_rank
        self.changes = degree_changes(len(self.chain), self.degrees) | self.layout.boundaries
        self._segments = frozenset(  # the pieces a recompute segment holds (``_in_segment``)
            (kind, i)
            for i in range(len(self.chain))
            for kind in ("body", "norm", "core", "epi")
            if self._segment_rule(kind, i)
        )
        reduce = any(r.dp_group.size > 1 for r in self.chain)
        self.zero = zero_shards(model)
        skip = (
            frozenset()
            if self.zero is None
            else frozenset(id(p) for u in self.zero.units.values() for p in u.params)
        )
        self.buckets = dp_buckets(self.chain, skip) if reduce else {}
        self.bucket_groups = dp_bucket_groups(self.chain, skip) if reduce else {}
        self.zero_layout = None if self.zero is None else _zero_layout(self.chain, self.zero)
        self.dp_head = self.ctx.stage_size // self.chain[-1].tp  # distinct loss terms
        self.track_memory = False
        self._deferring = frozenset()  # regions whose "dw" the running program has
        self._regathering = frozenset()  # regions whose h_i it gathers again ("gh")
        self._links = Links(frozenset(), frozenset())  # where its pieces share a graph
        self._fuse_bias = False  # may an h-linked row-parallel matmul add its bias (``run``)
        # id(program) -> (program, its deferring and regathering regions, its links, the
        # instructions run)
        self._compiled: dict[int, tuple] = {}
        # (found once: no module walk per step) the layers whose input gradients the executor
        # all-reduces itself (``layers.input_grads_unreduced``)
        self._column_layers = [m for m in model.modules() if isinstance(m, ColumnParallelLinear)]
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
            positions = (
                set() if model.pos_embed is None else {id(p) for p in model.pos_embed.parameters()}
            )
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

    def run(
        self, program: list[Instr], tokens: list[Tensor], targets: list[Tensor], loss_scale: float
    ) -> list[Tensor]:
        """Run ``program`` on sub-batches ``tokens[j]``/``targets[j]`` (the embedding's layout);
        returns the per-sub losses (of this rank's rows in the head's layout)."""
        if self.layout.holds(self.stage, len(self.chain) - 1):
            with torch.no_grad():  # a collective when embed and head differ in degree
                targets = [self.model.target_reshard(y) for y in targets]
        self.tokens, self.targets, self.scale = tokens, targets, loss_scale
        self._deferring, self._regathering, self._links, steps = self._compile(program)
        self._fuse_bias = not torch.is_autocast_enabled(self.ctx.device.type)
        self._reset()
        timelines = list(active_timelines())
        # honest device times without a synchronize inside the step (``oases.timing``)
        clock = DeviceClock(self.ctx.device) if timelines else None
        self._pending: list[tuple] = []  # CUDA: events whose stamps resolve after the step
        try:
            with self._input_grads_unreduced(), self._armed_for_deferral():
                for ins in steps:
                    if isinstance(ins, Compute):
                        start = clock.now() if clock is not None else None
                        self._compute(ins)
                        if clock is not None:
                            self._event(
                                timelines,
                                clock,
                                "compute",
                                label(ins),
                                ins.phase,
                                ins.sub,
                                start,
                                clock.now(),
                            )
                    elif isinstance(ins, Start):
                        self._start(ins, timelines, clock)
                    elif isinstance(ins, Release):
                        self.zero.release(ins.index)
                    else:
                        self._wait(ins)
            state = {
                "graphs": self.bg,
                "epi": self.eg,
                "x": self.x,
                "p": self.p,
                "handles": self.handles,
                "saved": self.saved,
                "inputs": self.inputs,
                "rng": self.rng,
                "h slices": self.hs,
                "gathered h": self.hfull,
                "kept h": self.hkeep,
                "re-gathered h": self.hagain,
                "grads": self.gx,
                "residual grads": self.gres,
                "dr": self.dr,
                "dh": self.dh,
                "deferred weight grads": self.wg,
                "linked partials": self.pg,
                "pending roots": self._roots,
                "handed-on roots": self._carried,
                "linked glue outputs": self.xg,
                "linked glue inputs": self._epi_leaf,
            }
            leftovers = [k for k, d in state.items() if d]
            assert not leftovers, f"program left state behind: {leftovers}"
            if clock is not None and self._pending:  # CUDA: one synchronize, after the step
                clock.resolve()
                for lane, name, phase, sub, start, end in self._pending:
                    ev = Event(
                        self.ctx.rank,
                        lane,
                        name,
                        phase,
                        sub,
                        clock.seconds(start),
                        clock.seconds(end),
                    )
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
        self.hagain: dict = {}  # (i, j) -> h_i gathered again in the backward ("gh", sp)
        self.gres: dict = {}
        self.gx: dict = {}
        self.dr: dict = {}
        self.dh: dict = {}
        self.wg: dict = {}  # (i, j) -> what dw:i needs: (y_i, dr_i, [(layer, h_i, dY)]) (sp)
        self.handles: dict = {}
        self.pg: dict = {}  # (i, j) -> p_i with its graph, reduced in place (a p-link)
        self._roots: list = []  # (tensor, grad) of linked backward pieces, not yet run
        self._carried: dict = {}  # sub-batch -> its roots an h-linked tp:i handed on
        self.xg: dict = {}  # (i, j) -> x_i with its graph, for an h-linked epi:i's residual
        self._epi_leaf: dict = {}  # (i, j) -> epi:i's x leaf, read when tp:i runs the call
        self.losses: dict[int, Tensor] = {}
        self._seen: set[int] = set()
        self._scale_grads: dict[tuple, Tensor] = {}  # (dtype, device) -> the loss scale

    def _event(
        self,
        timelines: list,
        clock: DeviceClock,
        lane: str,
        name: str,
        phase: str,
        sub: int,
        start: Stamp,
        end: Stamp,
    ) -> None:
        """Times are absolute ``perf_counter`` seconds (one clock for all processes of a
        machine); timelines are normalized when drawn or exported. CPU: added now; CUDA: kept
        until ``run`` resolves the step's events after its last instruction."""
        if clock.cuda:
            self._pending.append((lane, name, phase, sub, start, end))
            return
        ev = Event(self.ctx.rank, lane, name, phase, sub, start, end)
        for tl in timelines:
            tl.add(ev)

    # --------------------------------------------------------------------------------- compute
    def _compile(self, program: list[Instr]) -> tuple[frozenset, frozenset, Links, list[Instr]]:
        """What ``run`` reads off ``program`` before its first instruction, once per program
        object (a schedule keeps its programs): the regions whose weight gradients it defers,
        those whose h_i it gathers again, where its pieces share a graph (``links``), and the
        instructions it runs: the program less its TP all-reduces over a group of one (``fwd``
        and ``bwd`` of a region at tp=1 without sp: in place, nothing to move or wait for)."""
        cached = self._compiled.get(id(program))
        if cached is None or cached[0] is not program:
            links = program_links(program, self.spec.recompute, self.sp, self.zero is not None)
            steps = [ins for ins in program if not self._trivial(ins)]
            head = len(self.chain) - 1
            leaves = frozenset(  # norm:i on a saved block input, or after a glue run without
                i  # a graph (the head under a block recompute)
                for i in range(head + 1)
                if self._saves_input(i)
                or (self._in_segment("epi", i - 1) and not self._in_segment("body", i))
            )
            deferring = deferred_regions(program)  # (their tp:i leaves dW to a "dw" piece)
            links = handed_on(steps, links, self.spec.recompute, head, leaves | deferring)
            cached = (program, deferring, regathered_regions(program), links, steps)
            self._compiled[id(program)] = cached
        return cached[1:]

    def _trivial(self, ins: Instr) -> bool:
        """Is ``ins`` a Start/Wait of a TP all-reduce in place over a group of one?"""
        return (
            isinstance(ins, (Start, Wait))
            and ins.kind in ("fwd", "bwd")
            and self.sp is None
            and self.chain[ins.index].tp_group.size == 1
        )

    @contextlib.contextmanager
    def _input_grads_unreduced(self):  # noqa: ANN202
        """``layers.input_grads_unreduced`` on the layers found at construction."""
        for m in self._column_layers:
            m.reduce_input_grad = False
        try:
            yield
        finally:
            for m in self._column_layers:
                m.reduce_input_grad = True

    def _compute(self, ins: Compute) -> None:
        j = ins.sub
        if ins.phase == "backward":
            if self._links.h:  # (roots an h-linked tp:i handed on to this Compute)
                self._roots = self._carried.pop(j, [])
            for kind, i in ins.pieces:
                getattr(self, _BACKWARD_PIECES[kind])(i, j)
            if self._roots:  # handed on by an h-linked tp (or the head)
                self._carried[j], self._roots = self._roots, []
            return
        linked = None  # epi:i-1's output, with its graph, for an x-linked body:i
        for kind, i in ins.pieces:
            recompute = ins.phase == "recompute"
            grad = recompute or not self._in_segment(kind, i)
            skip_last = recompute and self.spec.recompute == "commfree"
            if kind == "epi":
                out = self._epi(i, j, grad, recompute)
                x_link = i + 1 in self._links.x and out is not None and out.grad_fn is not None
                linked = out if x_link else None
                if x_link and i + 1 in self._links.h and i + 1 in self._links.p:
                    # epi:i+1 (not the head: it has none) reads it for its residual
                    self.xg[i + 1, j] = out
                continue
            if kind == "norm":
                self._norm(i, j, grad, recompute)
            elif kind == "core" and i > 0:
                self._core(i, j, grad, recompute, need_p=not skip_last)
            else:  # body, or the embedding's core (its lookup: it has no norm)
                link = linked if kind == "body" and grad else None
                self._body(i, j, grad, recompute, need_p=not skip_last, linked=link)
            linked = None


# backward piece kind -> the method that runs it (looked up on the executor, so a method
# replaced on one executor is the one that runs; no table built per piece)
_BACKWARD_PIECES = {"norm": "_bwd_norm", "epi": "_bwd_epi", "tp": "_bwd_tp", "dw": "_bwd_dw"}


def _zero_layout(chain: list, shards) -> ZeroLayout:  # noqa: ANN001 (ZeroShards)
    """The program's view of the sharded regions: each region's stage, and which regions'
    weights its TP pieces read (the owner of each of its norm and TP parameters)."""
    owner = {id(p): u.index for u in shards.units.values() for p in u.params}
    uses = []
    for region in chain:
        read = {owner.get(id(p), region.index) for p in (*region.norm_params, *region.tp_params)}
        uses.append(tuple(sorted(read | {region.index})))
    return ZeroLayout(shards.stages, tuple(uses), shards.reshard_after_forward)
