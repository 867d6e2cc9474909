"""Peak memory per device of a schedule program, by walking its instructions (the simulator's
memory model; ``simulate.simulate_plan`` calls it).

What a rank holds, by kind (n: a region's own parameters at its degree, d: its DP degree,
s = ceil(n / d) its ZeRO shard, in master-dtype bytes each, ``planner.precision``)::

    ZeRO stage        weights        Adam moments      gradients between micro-batches
    0                 n              2n                n (from its first backward on)
    1                 d*s (padded)   2s                n; after the last micro-batch's "rs": s
    2                 d*s            2s                s (each micro-batch's n lives from its
                                                          first backward to its "rs")
    3                 s (+ d*s       2s                s
                      from "ag" to
                      Release)

and, walked instruction by instruction: the activations each forward piece keeps until its
backward (``saved_bytes``), a recompute's transient graph, a gradient reduce-scatter's flat
copy (d*s, from its Start to its Wait, the full gradient freed at the Start; gloo reduces a
second copy: ``costs.reduce_scatter_copies_input``; in ``grad_reduce`` bytes, the fp32 copy it
is cast from counted at the Start), an all-gather's own output-size buffer on
gloo (``costs.all_gather_copies_output``), a DP bucket's
flat copy (stage 0, from its Start to its Wait, in ``grad_reduce`` bytes). Activations are in
the compute dtype's bytes (``saved_bytes``); a deferred weight gradient ("dw", sequence
parallelism) holds what it reads from its "tp" piece to its own. The optimizer step adds one
copy of the parameters it updates (foreach temporaries); stages 1-2 all-gather the updated
shards at the next step's head ("ag", a copy of each shard in flight to its Wait). A tied
head's backward makes the embedding's gradient.

The peak is ``baseline + workspace + allocated``: ``allocated`` is the tensors walked here (on a
GPU what ``torch.cuda.max_memory_allocated`` measures), ``baseline`` the profile's per-rank
memory before the model (CPU: the resident set; CUDA: context, NCCL buffers and workspaces
outside the allocator, ``memory.device_baseline_bytes``), ``workspace`` what warm steps leave
resident beyond the tensors (CPU only; 0 on a GPU).

The same walk compiled once per program for the search: ``peak_memory_tape``.
"""

from __future__ import annotations

from dataclasses import dataclass

from oases.config import ModelConfig
from oases.planner.costs import Costs, analytic_saved_bytes
from oases.planner.precision import FP32, PlanPrecision, precision_of
from oases.schedule.program import Compute, Instr, Release, Start, Wait, deferred_regions


@dataclass(frozen=True)
class ModelState:
    """Per region: its own parameter count ``numel``, DP degree ``dp`` and ZeRO ``stage``."""

    numel: tuple[int, ...]
    dp: tuple[int, ...]
    stages: tuple[int, ...]

    def shard(self, i: int) -> int:
        return -(-self.numel[i] // self.dp[i])

    def padded(self, i: int) -> int:
        return self.shard(i) * self.dp[i]

    def updated(self, i: int) -> int:
        """Parameters the optimizer updates on this rank (its shard under ZeRO)."""
        return self.numel[i] if self.stages[i] == 0 else self.shard(i)

    def bytes_by_kind(self, precision: PlanPrecision = FP32) -> dict[str, float]:
        """Model state between steps, by kind: weights, gradients (as the optimizer sees them),
        Adam moments (master-dtype bytes: fp32 under bf16 too)."""
        r = range(len(self.numel))
        w = precision.master_bytes
        return {
            "weights": w
            * sum(
                self.numel[i]
                if self.stages[i] == 0
                else self.padded(i)
                if self.stages[i] < 3
                else self.shard(i)
                for i in r
            ),
            "gradients": w * sum(self.updated(i) for i in r),
            "optimizer": precision.optimizer_bytes * sum(self.updated(i) for i in r),
        }


def _column_out(cfg: ModelConfig, kind: str) -> int:
    """Output features of a region's column-parallel layer, all ranks together."""
    if kind == "attn":
        return (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    if kind == "mlp":
        return (2 if cfg.arch == "llama" else 1) * cfg.ffn_dim
    return 0


def _row_in(cfg: ModelConfig, kind: str) -> int:
    """Input features of a region's row-parallel layer, all ranks together."""
    return {"attn": cfg.n_heads * cfg.head_dim, "mlp": cfg.ffn_dim}.get(kind, 0)


def saved_bytes(costs: Costs, cfg: ModelConfig, kind: str, mode: str, t: int, rows: int) -> float:
    """Activations a region keeps forward -> backward: the costs' measurement where they have
    one (a profile, measured in its own precision), else ``analytic_saved_bytes`` in the
    costs' compute dtype."""
    measured = getattr(costs, "saved_bytes", None)
    value = measured(kind, mode, t, rows) if measured is not None else None
    if value is None:
        return analytic_saved_bytes(cfg, kind, mode, t, rows, precision_of(costs))
    return value


@dataclass(frozen=True)
class _Bytes:
    """Per region i, the bytes the walks add and take away (see ``peak_memory``)."""

    kept: list[float]  # activations a forward piece keeps for its backward
    graph: list[float]  # a recompute's whole graph
    full: list[float]  # a whole gradient
    shard: list[float]  # a ZeRO shard
    padded: list[float]  # the padded flat buffer of the region's parameters
    scattering: list[float]  # a reduce-scatter in flight
    gather_copy: list[float]  # an all-gather's own output buffer (gloo)
    seq: tuple[list[float], list[float]]  # sequence parallelism's gather, reduce-scatter
    deferred: list[float]  # what a deferred weight gradient holds


def _region_bytes(
    cfg: ModelConfig,
    kinds: list[str],
    degrees: list[int],
    rows: list[int],
    mode: str,
    graph_mode: str,
    costs: Costs,
    state: ModelState,
) -> _Bytes:
    """Every region's ``_Bytes`` (computed once per distinct region: the blocks of a model
    repeat)."""
    n = len(kinds)
    prec = precision_of(costs)
    w, g = prec.master_bytes, prec.grad_reduce_bytes
    # a reduce-scatter in flight holds its flat input and its output (and, on gloo, a copy),
    # in the dtype it reduces in
    scatter_copy = bool(getattr(costs, "reduce_scatter_copies_input", False))
    # an all-gather in flight: gloo's own output-size buffer (and at stages 1-2 the shard's copy)
    gather_copies = bool(getattr(costs, "all_gather_copies_output", False))
    sp = mode.startswith("sp-")
    memo: dict[tuple, tuple[float, ...]] = {}
    out: list[tuple[float, ...]] = []
    for i in range(n):
        key = (kinds[i], degrees[i], rows[i], state.numel[i], state.dp[i])
        row = memo.get(key)
        if row is None:
            kind, t, r = key[:3]
            padded = state.padded(i) * w
            # sequence parallelism's collectives in flight (``comm.seq_*_async``): a gather
            # holds its slice and its rank-major [t, b, S/t, H] output; a reduce-scatter the
            # rank-major copy of the partial sums (for one row, the partial sums themselves)
            # and its slice; on gloo the other ranks' chunks sent and received and its slice,
            # (t - 2)/t more (``comm.seq``'s ``_GlooSeqScatter``)
            act = r * cfg.seq_len * cfg.dim * prec.activation_bytes if sp else 0.0
            row = memo[key] = (
                saved_bytes(costs, cfg, kind, mode, t, r),
                saved_bytes(costs, cfg, kind, graph_mode, t, r),
                state.numel[i] * w,
                state.shard(i) * w,
                padded,
                state.padded(i) * g * (2 if scatter_copy else 1) + state.shard(i) * g,
                padded if gather_copies else 0.0,
                act * (1 / t + 1) if sp else 0.0,
                act * (1 + 1 / t + (max(t - 2, 0) / t if scatter_copy else 0)) if sp else 0.0,
                # deferred weight gradients (sequence parallelism's "dw" pieces): from tp:i
                # to dw:i a block's region holds the gathered h_i and dr_i, the row-parallel
                # input y_i and the column-parallel output's gradient
                r
                * cfg.seq_len
                * prec.activation_bytes
                * (2 * cfg.dim + _column_out(cfg, kind) / t + _row_in(cfg, kind) / t),
            )
        out.append(row)
    cols = [list(c) for c in zip(*out)] if out else [[] for _ in range(10)]
    return _Bytes(*cols[:7], (cols[7], cols[8]), cols[9])


def peak_memory(
    cfg: ModelConfig,
    program: list[Instr],
    kinds: list[str],
    degrees: list[int],
    rows: list[int],
    mode: str,
    costs: Costs,
    state: ModelState,
    uses: tuple[tuple[int, ...], ...],
    bucket_bytes: dict[int, float],
    repeats: int = 1,
    graph_mode: str = "none",
) -> dict[str, float]:
    """Walk ``program`` (one micro-batch run ``repeats`` times back to back, or a whole step)
    and return the peak and its parts in bytes. ``uses[i]``: the regions whose parameters
    region i's TP backward makes gradients for; ``bucket_bytes[t]``: the flat copy of DP bucket
    t (stage 0, in ``grad_reduce`` bytes). With ``repeats > 1`` the walk is done twice: as the
    first micro-batch and as a later one, which finds every accumulated gradient (stages 0-1)
    or shard (2-3) there. ``mode``/``graph_mode``: the saved-activation modes of what a region
    keeps and of its full graph (under sequence parallelism "sp-..." modes, ``costs.sp_mode``;
    a region's TP matmuls are then its "core" piece). ``peak_memory_tape`` walks a compiled
    program to the same numbers."""
    n = len(kinds)
    prec = precision_of(costs)
    by_kind = state.bytes_by_kind(prec)
    static = by_kind["weights"] + by_kind["optimizer"]
    b = _region_bytes(cfg, kinds, degrees, rows, mode, graph_mode, costs, state)
    kept, graph, full, shard, padded = b.kept, b.graph, b.full, b.shard, b.padded
    scattering, gather_copy, seq, deferred = b.scattering, b.gather_copy, b.seq, b.deferred
    deferring = deferred_regions(program)

    def walk(later: bool) -> tuple[float, float, float]:
        whole: set[int] = set()  # regions whose full gradient is alive
        shards: set[int] = set()  # regions whose gradient shard exists (ZeRO)
        if later:
            whole = {i for i in range(n) if state.stages[i] <= 1}
            shards = {i for i in range(n) if state.stages[i] >= 2}
        alive: dict[tuple[int, int], float] = {}
        inflight: dict[tuple[str, int, int], float] = {}
        gathered: set[int] = set()
        # running totals of the sets above (the walk is linear in the program)
        grads = sum(full[u] for u in whole) + sum(shard[u] for u in shards)
        act = moving = held = peak = peak_act = 0.0
        for ins in program:
            if isinstance(ins, Compute):
                for piece, i in ins.pieces:
                    if ins.phase == "forward" and piece in ("body", "core"):
                        alive[i, ins.sub] = alive.get((i, ins.sub), 0.0) + kept[i]
                        act += kept[i]
                    elif ins.phase == "recompute" and piece in ("body", "core"):
                        alive[i, ins.sub] = alive.get((i, ins.sub), 0.0) + graph[i] - kept[i]
                        act += graph[i] - kept[i]
                    elif ins.phase == "backward" and piece == "tp":
                        act -= alive.pop((i, ins.sub), 0.0)
                        if i in deferring:  # what dw:i reads, until it runs
                            alive[i, ins.sub] = deferred[i]
                            act += deferred[i]
                        for u in uses[i]:
                            if u not in whole:
                                whole.add(u)
                                grads += full[u]
                    elif ins.phase == "backward" and piece == "dw":
                        act -= alive.pop((i, ins.sub), 0.0)
            elif isinstance(ins, Start) and ins.kind == "rs":
                u = ins.index  # the flat copy is made before the gradients are freed
                peak = max(peak, static + act + grads + moving + held + padded[u])
                if u in whole:
                    whole.discard(u)
                    grads -= full[u]
                inflight[ins.kind, u, ins.sub] = scattering[u]
                moving += scattering[u]
            elif isinstance(ins, Wait) and ins.kind == "rs":
                moving -= inflight.pop((ins.kind, ins.index, ins.sub), 0.0)
                if ins.index not in shards:  # accumulated into the one shard
                    shards.add(ins.index)
                    grads += shard[ins.index]
            elif isinstance(ins, Start) and ins.kind == "ag":
                u = ins.index
                if state.stages[u] < 3:  # into the weights it updates, from a shard's copy
                    inflight[ins.kind, u, ins.sub] = shard[u] + gather_copy[u]
                elif u not in gathered:  # into newly allocated weights
                    gathered.add(u)
                    held += padded[u]
                    inflight[ins.kind, u, ins.sub] = gather_copy[u]
                moving += inflight.get((ins.kind, u, ins.sub), 0.0)
            elif isinstance(ins, Wait) and ins.kind == "ag":
                moving -= inflight.pop((ins.kind, ins.index, ins.sub), 0.0)
            elif isinstance(ins, Release):
                if ins.index in gathered:
                    gathered.discard(ins.index)
                    held -= padded[ins.index]
            elif isinstance(ins, Start) and ins.kind in ("gf", "gb", "gr", "gh", "fwd", "bwd"):
                held_now = seq[ins.kind in ("fwd", "bwd")][ins.index]
                if held_now:
                    inflight[ins.kind, ins.index, ins.sub] = held_now
                    moving += held_now
            elif isinstance(ins, Wait) and ins.kind in ("gf", "gb", "gr", "gh", "fwd", "bwd"):
                moving -= inflight.pop((ins.kind, ins.index, ins.sub), 0.0)
            elif isinstance(ins, Start) and ins.kind == "dp":
                inflight[ins.kind, ins.index, ins.sub] = bucket_bytes.get(ins.index, 0.0)
                moving += bucket_bytes.get(ins.index, 0.0)
            elif isinstance(ins, Wait) and ins.kind == "dp":
                moving -= inflight.pop((ins.kind, ins.index, ins.sub), 0.0)
            peak = max(peak, static + act + grads + moving + held)
            peak_act = max(peak_act, act)
        return peak, peak_act, grads

    peak, peak_act, end = walk(later=False)
    if repeats > 1:
        later_peak, later_act, end = walk(later=True)
        peak, peak_act = max(peak, later_peak), max(peak_act, later_act)
    return _with_step(peak, peak_act, end, static, by_kind, shard, state, costs)


def _with_step(
    peak: float,
    peak_act: float,
    end: float,
    static: float,
    by_kind: dict[str, float],
    shard: list[float],
    state: ModelState,
    costs: Costs,
) -> dict[str, float]:
    """The peak of the walks with the optimizer step's, and its parts."""
    n = len(shard)
    w = precision_of(costs).master_bytes
    # the optimizer step: the gradients as they end, plus foreach temporaries of about one
    # copy of what it updates; stages 1-2 gather the updated shards at the next step's head
    # (a copy of each shard in flight: walked above when the program has the head; counted
    # here for a program of the step's last micro-batch alone)
    grads_end = end
    updated = sum(state.updated(i) for i in range(n)) * w
    opt_peak = static + grads_end + updated
    gather_peak = static + sum(shard[i] for i in range(n) if state.stages[i] in (1, 2))
    baseline = float(getattr(costs, "baseline_bytes", 0.0))
    workspace = float(getattr(costs, "workspace_bytes", 0.0))  # a profile's measurement
    allocated = max(peak, opt_peak, gather_peak)  # the tensors: a GPU's allocator peak
    return {
        "peak": baseline + workspace + allocated,
        "allocated": allocated,
        "baseline": baseline,
        "workspace": workspace,
        "params": by_kind["weights"],
        "grads": grads_end,
        "optimizer_state": by_kind["optimizer"],
        "activations_peak": peak_act,
    }
