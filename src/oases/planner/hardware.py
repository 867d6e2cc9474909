"""Named hardware and cluster presets for planning without the hardware: what things cost.

``HardwareCosts(cluster, model, dtype, grad_reduce)`` prices one sub-batch's piece of one
region and one collective, the interface the simulator calls (a profile measured on this
machine offers the same methods)::

    compute_s(region, phase, piece, tp, rows)     seconds on one GPU of the cluster
    collective_s(op, group_size, nbytes)          seconds of the collective as NCCL runs it

Compute is a roofline sum over a piece's kernels: matmul flops / (peak[dtype] x
matmul efficiency at dtype) + bytes that elementwise and norm kernels move / (memory bandwidth x
elementwise_efficiency) + one launch overhead per piece. Matmul flops are divided by the TP
degree; elementwise work on the replicated [b, S, H] activations is not. Bytes are counted in
*passes* over a tensor (one read or one write of every element); a dropout costs 2 passes plus a
one-byte mask per element.

Attention is priced as the paper's prototype ran it ("materialized"): QK^T and AV over the full
S x S, and the [b, A/t, S, S] scores written by QK^T, masked and softmaxed in place (2 + 2
passes), dropped out, and read by AV; ``attention="fused"`` prices a flash-style kernel instead
(causal: half the flops, no score traffic).

Calibration, RTX 3090 compute (the profile table of the Oases paper, Li et al., IEEE TPDS
2025: GPT layer H=2048, 32 heads, S=1024, 4 sequences per TP group, t=4, fp32, dropout 0.1;
milliseconds, measured -> this model, see tests)::

    attention forward   3.24 -> 3.23      attention backward  5.18 -> 4.98
    MLP forward         2.69 -> 2.68      MLP backward        5.08 -> 4.93

with matmul_efficiency 0.90 and elementwise_efficiency 0.82 (32.0 TFLOP/s, 768 GB/s), solved
from the two forward times; the backward times are predictions. The other compute rows of that
table (H=1024, H=4096 at t=4 and 16) come out within 17%.

Collectives are no longer calibrated on that table (until 2026-12-02 its all-reduce column set
the PCIe efficiency to 0.44, a 6.9 GB/s bus bandwidth for a 4-GPU ring): the paper's prototype
times its all-reduces over the whole world, not the TP group (the t=16 row, 18.09 ms, is the
t=4 row's 17.95 ms again), so those are 32-GPU all-reduces across the 8 servers. They are now
a check (``benchmarks/2026-12-02-collectives``): NCCL's ring over 32 GPUs, bound by the
100 GbE port (9.4 GB/s), predicts 4.1 / 7.6 / 14.5 ms for 3.49 / 7.29 / 17.95. Collective
costs come from ``planner.collectives`` with public microbenchmarks per path
(``planner.presets``); a 4-GPU all-reduce of the H=2048 block output (32 MiB) went from 7.29
to 4.63 ms (PCIe 4.0 host-staged ring, 11.0 GB/s), 2.34 ms with bridged pairs.

Shape legend: b rows (sequences of the sub-batch), S sequence, T = b*S tokens, H hidden, F ffn,
A heads, K kv heads, D head dim, V vocabulary (padded to a multiple of t), t TP degree, e bytes
per element of the dtype.

Precision (``planner.precision``): ``dtype`` is the compute dtype (matmuls at its peak and
efficiency, ``GPU.matmul_efficiency_at``; activations, elementwise traffic and TP collectives
in its bytes); ``grad_reduce`` the dtype of the DP gradient reduction; master weights, their
gradients and AdamW's moments stay fp32 (``precision``, which the simulator prices bytes by).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from oases.config import ModelConfig
from oases.planner.clusters import (
    CLUSTERS,
    DTYPE_BYTES,
    GPU,
    GPUS,
    LINKS,
    Cluster,
    Link,
    Server,
    cluster_from_dict,
    get_cluster,
    group_layout,
    group_spans_servers,
    load_cluster,
    save_cluster,
)
from oases.planner.collectives import ALGORITHMS, NCCL_ALGORITHMS, OPS, Choice, collective
from oases.planner.precision import PlanPrecision

__all__ = ["CLUSTERS", "DTYPE_BYTES", "GPU", "GPUS", "LINKS", "PAPER_REFERENCE_MODEL", "Cluster",
           "HardwareCosts", "Link", "Server", "cluster_from_dict", "comm_to_compute",
           "get_cluster", "group_layout", "group_spans_servers", "load_cluster", "save_cluster"]

REGIONS = ("embed", "attn", "mlp", "head")
# sequence parallelism's pieces (``schedule.program._sp_chain``): the norm and the glue on a
# 1/t slice of the sequence ("sp-norm", "sp-epi"), the TP matmuls on the gathered sequence
# ("sp-core": a body without its norm; "sp-core-commfree": without the last matmul too); a
# block's TP backward split into its input gradient ("sp-dx") and weight gradients ("sp-dw")
SP_FORWARD_PIECES = ("sp-norm", "sp-core", "sp-core-commfree", "sp-epi")
_FORWARD_PIECES = ("body", "body-commfree", "epi", *SP_FORWARD_PIECES)
PIECES = {"forward": _FORWARD_PIECES, "recompute": _FORWARD_PIECES,
          "backward": ("norm", "epi", "tp", "sp-norm", "sp-epi", "sp-dx", "sp-dw")}

# Passes over a tensor (one read or one write of each element) of the kernels of each piece.
NORM_FWD_PASSES = 2  # read x, write y
NORM_BWD_PASSES = 7  # read x and dy, write dx, a pass for the weight gradients; + residual add (3)
SCORE_FWD_PASSES = 6  # QK^T writes, mask (2), softmax (2), AV reads; + dropout
SCORE_BWD_PASSES = 8  # dP written, softmax backward (3), mask backward (2), two reads by matmuls
RESIDUAL_PASSES = 3  # x + r: two reads, one write
OPTIMIZER_PASSES = 7  # AdamW over fp32 states: read param, grad, m, v; write param, m, v

# The Oases paper's reference GPT layer (its profile table): what the bench's link presets
# speak for.
PAPER_REFERENCE_MODEL = ModelConfig(arch="gpt2", n_layers=24, dim=2048, n_heads=32,
                                    vocab_size=50257, seq_len=1024, dropout=0.1)


class HardwareCosts:
    """Seconds of compute and communication of ``model`` on ``cluster`` in ``dtype``
    ("fp32" | "tf32" | "bf16" | "fp16"; the dtype of matmuls and activations) with the DP
    gradient reduction in ``grad_reduce`` ("fp32" | "bf16"); ``precision`` says the bytes of
    each kind of tensor."""

    def __init__(self, cluster: Cluster, model: ModelConfig, dtype: str = "fp32",
                 grad_reduce: str = "fp32", *, attention: str = "materialized",
                 algorithms: Sequence[str] = NCCL_ALGORITHMS) -> None:
        gpu = cluster.server.gpu
        if dtype not in DTYPE_BYTES or dtype == "fp64":
            raise ValueError(f"dtype={dtype!r}; valid: "
                             f"{', '.join(d for d in DTYPE_BYTES if d != 'fp64')}")
        if grad_reduce not in ("fp32", "bf16"):
            raise ValueError(f"grad_reduce={grad_reduce!r}; valid: fp32, bf16")
        if dtype not in gpu.peak_flops:
            raise ValueError(f"{gpu.name} has no {dtype} peak; it has "
                             f"{', '.join(gpu.peak_flops)}")
        if attention not in ("materialized", "fused"):
            raise ValueError(f"attention={attention!r}; valid: materialized, fused")
        unknown = [a for a in algorithms if a not in ALGORITHMS]
        if unknown or not algorithms:
            raise ValueError(f"algorithms={list(algorithms)}; valid: {', '.join(ALGORITHMS)}")
        self.cluster, self.model, self.dtype, self.attention = cluster, model, dtype, attention
        self.algorithms = tuple(algorithms)
        # tf32 is a matmul mode: activations, weights and collectives are fp32
        self.precision = PlanPrecision("fp32" if dtype == "tf32" else dtype, grad_reduce)
        self.elem_bytes = self.precision.activation_bytes
        self.matmul_efficiency = gpu.matmul_efficiency_at(dtype)
        self.matmul_flops_per_s = gpu.peak_flops[dtype] * self.matmul_efficiency
        self.memory_bytes_per_s = gpu.memory_bandwidth_bytes_per_s * gpu.elementwise_efficiency

    @property
    def memory_bytes(self) -> float:
        """Memory of one GPU (the per-rank budget before any safety margin)."""
        return self.cluster.memory_bytes

    # -- compute ---------------------------------------------------------------------------

    def compute_s(self, region: str, phase: str, piece: str, tp: int, rows: int) -> float:
        """Seconds of one sub-batch of ``rows`` sequences through ``piece`` of a ``region``
        at TP degree ``tp``. Pieces that do no work (the head's epi, the embedding's norm
        backward) cost 0."""
        flops, nbytes = self.work(region, phase, piece, tp, rows)
        if flops == 0 and nbytes == 0:
            return 0.0
        return (flops / self.matmul_flops_per_s + nbytes / self.memory_bytes_per_s
                + self.cluster.server.gpu.launch_overhead_s)

    def work(self, region: str, phase: str, piece: str, tp: int,
             rows: int) -> tuple[float, float]:
        """(matmul flops, bytes moved by elementwise and norm kernels) of one piece."""
        if region not in REGIONS:
            raise ValueError(f"region={region!r}; valid: {', '.join(REGIONS)}")
        if phase not in PIECES or piece not in PIECES[phase]:
            valid = ", ".join(PIECES.get(phase, ())) or f"(phases: {', '.join(PIECES)})"
            raise ValueError(f"phase={phase!r} piece={piece!r}; valid pieces: {valid}")
        if tp < 1 or rows < 1:
            raise ValueError(f"tp={tp} and rows={rows} must be >= 1")
        if piece.startswith("sp-"):
            return self._sequence_parallel(region, phase, piece, tp, rows)
        if phase == "backward":
            return self._backward(region, piece, tp, rows)
        return self._forward(region, piece, tp, rows)

    def _sequence_parallel(self, region: str, phase: str, piece: str, tp: int,
                           rows: int) -> tuple[float, float]:
        """A sequence-parallel piece: the non-sequence-parallel one's work, the norm's and the
        glue's on 1/tp of the tokens, the matmuls' without the norm's passes."""
        norm_passes = NORM_BWD_PASSES if phase == "backward" else NORM_FWD_PASSES
        norm = 0.0 if region == "embed" else norm_passes * self._shapes(tp, rows)["THe"]
        if piece == "sp-norm":
            return 0.0, norm / tp
        if piece == "sp-epi":
            flops, nbytes = (self._backward if phase == "backward" else self._forward)(
                region, "epi", tp, rows)
            return flops / tp, nbytes / tp
        if piece in ("sp-dx", "sp-dw"):  # the TP matmuls' backward without / with only
            flops, nbytes = self._backward(region, "tp", tp, rows)  # its weight gradients
            matmuls, _ = self._matmuls(region, tp, rows)
            dw = matmuls - (self._shapes(tp, rows)["score_flops"] if region == "attn" else 0)
            return (flops - dw, nbytes) if piece == "sp-dx" else (dw, 0.0)
        flops, nbytes = self._forward(region, piece.removeprefix("sp-").replace("core", "body"),
                                      tp, rows)
        return flops, max(0.0, nbytes - norm)

    def _shapes(self, tp: int, rows: int) -> dict[str, float]:
        m, e = self.model, self.elem_bytes
        drop = 2 + 1 / e if m.dropout > 0 else 0.0  # read, write, a one-byte mask
        T = rows * m.seq_len
        score_elems = rows * m.n_heads / tp * m.seq_len * m.seq_len  # [b, A/t, S, S]
        score_flops = 2 * 2 * rows * m.n_heads / tp * m.seq_len ** 2 * m.head_dim  # QK^T, AV
        if self.attention == "fused":
            score_flops /= 2  # causal blocks skipped
        return {"T": T, "e": e, "drop": drop, "THe": T * m.dim * e, "score_elems": score_elems,
                "score_flops": score_flops, "Vt": math.ceil(m.vocab_size / tp),
                "bias": 1.0 if m.arch == "gpt2" else 0.0}

    def _matmuls(self, region: str, tp: int, rows: int) -> tuple[float, float]:
        """(all forward matmul flops, flops of the last row-parallel matmul) of a region."""
        m, x = self.model, self._shapes(tp, rows)
        T, H, D = x["T"], m.dim, m.head_dim
        if region == "attn":
            proj = 2 * T * m.n_heads * D * H / tp
            qkv = 2 * T * H * (m.n_heads + 2 * m.n_kv_heads) * D / tp
            return qkv + x["score_flops"] + proj, proj
        if region == "mlp":
            fc1_out = 2 * m.ffn_dim if m.arch == "llama" else m.ffn_dim
            fc2 = 2 * T * m.ffn_dim * H / tp
            return 2 * T * H * fc1_out / tp + fc2, fc2
        if region == "head":
            return 2 * T * H * x["Vt"], 0.0
        return 0.0, 0.0

    def _forward(self, region: str, piece: str, tp: int, rows: int) -> tuple[float, float]:
        m, x = self.model, self._shapes(tp, rows)
        T, e, THe = x["T"], x["e"], x["THe"]
        if piece == "epi":
            if region == "head":
                return 0.0, 0.0
            if region == "embed":  # + positions (GPT-2), dropout
                return 0.0, THe * (RESIDUAL_PASSES * x["bias"] + x["drop"])
            return 0.0, THe * (2 * x["bias"] + RESIDUAL_PASSES + x["drop"])  # bias, res, drop
        if region == "embed":  # vocab-parallel lookup: gather rows, mask foreign ids, write
            return 0.0, 4 * THe
        flops, last = self._matmuls(region, tp, rows)
        if piece == "body-commfree":
            flops -= last
        nbytes = NORM_FWD_PASSES * THe
        if region == "attn":
            if self.attention == "materialized":
                nbytes += x["score_elems"] * e * (SCORE_FWD_PASSES + x["drop"])
            if m.arch == "llama":  # rotary on q and k
                nbytes += 4 * T * (m.n_heads + m.n_kv_heads) * m.head_dim / tp * e
        elif region == "mlp":  # GELU (2 passes) or silu(gate) * up (5)
            nbytes += (5 if m.arch == "llama" else 2) * T * m.ffn_dim / tp * e
        else:  # head: vocab-parallel cross-entropy over [T, V/t]
            nbytes += 6 * T * x["Vt"] * e
        return flops, nbytes

    def _backward(self, region: str, piece: str, tp: int, rows: int) -> tuple[float, float]:
        m, x = self.model, self._shapes(tp, rows)
        T, e, THe = x["T"], x["e"], x["THe"]
        if piece == "norm":
            return 0.0, (0.0 if region == "embed" else NORM_BWD_PASSES * THe)
        if piece == "epi":
            if region == "head":
                return 0.0, 0.0
            return 0.0, THe * (x["bias"] + x["drop"])  # bias (or position) grad, dropout
        flops, _ = self._matmuls(region, tp, rows)
        if region == "embed":  # zero the [V/t, H] gradient, scatter-add the rows into it
            return 0.0, 2 * THe + x["Vt"] * m.dim * e
        if region == "head":  # logits dX and dW; cross-entropy backward over [T, V/t]
            return 2 * flops, 3 * T * x["Vt"] * e
        if region == "mlp":
            return 2 * flops, (8 if m.arch == "llama" else 3) * T * m.ffn_dim / tp * e
        nbytes = 0.0
        if self.attention == "materialized":
            nbytes += x["score_elems"] * e * (SCORE_BWD_PASSES + x["drop"])
        else:  # flash backward recomputes the scores: 2.5x the forward attention flops
            flops += 1.5 * x["score_flops"]
        if m.arch == "llama":
            nbytes += 4 * T * (m.n_heads + m.n_kv_heads) * m.head_dim / tp * e
        return 2 * flops, nbytes

    def optimizer_s(self, n_params: int) -> float:
        """One fused AdamW step over ``n_params`` local master (fp32) parameters
        (memory-bound)."""
        if n_params <= 0:
            return 0.0
        return (OPTIMIZER_PASSES * self.precision.master_bytes * n_params
                / self.memory_bytes_per_s
                + self.cluster.server.gpu.launch_overhead_s)

    def saved_bytes(self, region: str, mode: str, tp: int, rows: int) -> None:
        """Presets measure no activations: None means 'use the analytic estimate'."""
        return None

    # -- collectives -----------------------------------------------------------------------

    def collective_s(self, op: str, group_size: int, nbytes: int, *,
                     spans_servers: bool | None = None) -> float:
        """Seconds of ``op`` over ``group_size`` ranks as NCCL runs it (``planner.collectives``);
        ``nbytes`` is the full (output) tensor. The group is taken to be contiguous ranks from
        rank 0 (a TP group: inside one server when it fits, a bridged pair at 2, else whole
        servers); ``spans_servers=True``: strided over the servers (a DP group, one rank per
        server while servers last); ``False``: inside one server. ``collective_ranks_s``
        prices a group from its actual ranks."""
        c, gps = self.cluster, self.cluster.server.gpus_per_server
        self._check_collective(op, group_size, nbytes)
        if group_size == 1:
            return 0.0
        if spans_servers is False and group_size > gps:
            raise ValueError(f"a group of {group_size} does not fit in one server of "
                             f"{c.name} ({gps} GPUs)")
        if spans_servers is True:
            if c.servers == 1:
                raise ValueError(f"{c.name} has one server: no group spans servers")
            if c.world_size % group_size == 0:
                ranks = list(range(0, c.world_size, c.world_size // group_size))
            else:
                per_server = math.ceil(group_size / c.servers)
                step = max(1, gps // per_server)
                ranks = [s * gps + j * step for s in range(c.servers)
                         for j in range(per_server)][:group_size]
        else:
            ranks = list(range(group_size))
        return self.collective_ranks_s(op, ranks, nbytes)

    def collective_ranks_s(self, op: str, ranks: Iterable[int], nbytes: int) -> float:
        """``collective_s`` for the group of these global ranks (rank r on server r // gpus
        per server; a bridge joins ranks 2i and 2i+1)."""
        return self.collective_choice(op, ranks, nbytes).seconds

    def collective_choice(self, op: str, ranks: Iterable[int], nbytes: int) -> Choice:
        """The algorithm, protocol and seconds NCCL's tuner picks for ``op`` over ``ranks``."""
        ranks = sorted(set(ranks))
        self._check_collective(op, len(ranks), nbytes)
        return collective(self.cluster, op, ranks, nbytes, self.algorithms)

    def _check_collective(self, op: str, group_size: int, nbytes: int) -> None:
        if op not in OPS:
            raise ValueError(f"op={op!r}; valid: {', '.join(OPS)}")
        if not 1 <= group_size <= self.cluster.world_size:
            raise ValueError(f"group_size={group_size} must be in 1..{self.cluster.world_size} "
                             f"({self.cluster.name})")
        if nbytes < 0:
            raise ValueError(f"nbytes={nbytes} must be >= 0")

    # -- summary ---------------------------------------------------------------------------

    def describe(self) -> str:
        """One paragraph of the assumptions behind these costs."""
        c, s, g = self.cluster, self.cluster.server, self.cluster.server.gpu
        link = s.link
        both = (f" one way, {link.duplex_bytes_per_s / 1e9:.1f} both ways"
                if link.duplex_bytes_per_s != link.effective_bytes_per_s else "")
        pair = (f", pairs bridged by {s.pair_link.name} "
                f"({s.pair_link.effective_bytes_per_s / 1e9:.1f} GB/s)" if s.pair_link else "")
        inter = (f"; servers joined by {c.inter_link.name} "
                 f"({c.inter_link.effective_bytes_per_s / 1e9:.2f} GB/s bus bandwidth per port, "
                 f"{c.nics_per_server} port(s) per server, shared by the server's GPUs' groups)"
                 if c.inter_link is not None and c.servers > 1 else "")
        algos = "/".join(self.algorithms)
        return (f"{c.name}: {c.servers} server(s) x {s.gpus_per_server} {g.name} "
                f"({g.memory_bytes / 1e9:.0f} GB); {self.dtype} matmuls at "
                f"{self.matmul_flops_per_s / 1e12:.1f} TFLOP/s ({self.matmul_efficiency:.0%} of "
                f"{g.peak_flops[self.dtype] / 1e12:.1f} peak), elementwise and norm kernels at "
                f"{self.memory_bytes_per_s / 1e9:.0f} GB/s ({g.elementwise_efficiency:.0%} of "
                f"{g.memory_bandwidth_bytes_per_s / 1e9:.0f}), "
                f"{g.launch_overhead_s * 1e6:.0f} us launch overhead per piece, "
                f"{self.precision.label()}, "
                f"{self.attention} attention; collectives as NCCL's tuner picks them ({algos} x "
                f"LL/LL128/Simple), inside a server over {link.name} "
                f"({link.effective_bytes_per_s / 1e9:.1f} GB/s bus bandwidth{both}){pair}{inter}. "
                f"Sources: {g.source}; {link.source}.")


def comm_to_compute(cluster: Cluster, model: ModelConfig, tp: int, rows: int,
                    dtype: str = "fp32") -> float:
    """All-reduce of a TP region's output over its ``tp`` GPUs / that region's forward (body +
    epi), the mean of the attention and MLP regions: how slow the link is next to compute."""
    costs = HardwareCosts(cluster, model, dtype)
    forward_s = [costs.compute_s(r, "forward", "body", tp, rows)
                 + costs.compute_s(r, "forward", "epi", tp, rows) for r in ("attn", "mlp")]
    nbytes = rows * model.seq_len * model.dim * costs.elem_bytes  # [b, S, H]
    return costs.collective_s("all_reduce", tp, nbytes) / (sum(forward_s) / 2)
