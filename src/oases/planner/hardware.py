"""Named hardware and cluster presets for planning without the hardware: what things cost.

``HardwareCosts(cluster, model, dtype, grad_reduce)`` prices one sub-batch's piece of one
region and one collective, the interface the simulator calls (a profile measured on this
machine offers the same methods)::

    compute_s(region, phase, piece, tp, rows)     seconds on one GPU of the cluster
    collective_s(op, group_size, nbytes)          seconds of the collective as NCCL runs it

Compute is the kernels of the piece (``planner.kernels``): each GEMM by its shape (tiles and
waves over the SMs, at the measured best matmul efficiency), attention as the published fused
kernel series (or, "materialized", as the paper's prototype ran it: QK^T and AV as batched
GEMMs over the full S x S and the scores masked, softmaxed and dropped out in memory-bound
passes), every eager memory-bound op by the bytes it moves at the GPU's STREAM-like bandwidth,
and the launches by kernel count (``max(kernels + gaps, host dispatch)``). ``breakdown`` says
where a piece's time goes by kernel class; ``contention`` is compute's slowdown while a
collective's CTAs hold SMs beside it (the simulator applies it, ``planner.event_walk``).

Calibration, RTX 3090 compute (the profile table of the Oases paper, Li et al., IEEE TPDS
2025: GPT layer H=2048, 32 heads, S=1024, 4 sequences per TP group, t=4, fp32, dropout 0.1;
milliseconds, measured -> this model, see tests)::

    attention forward   3.24 -> 3.49      attention backward  5.18 -> 5.67
    MLP forward         2.69 -> 2.74      MLP backward        5.08 -> 5.32

with the 3090's fp32 matmul efficiency (0.90, solved from the two forward times under the
roofline model this replaced) anchored at that layer's fc1 GEMM, 4096 x 2048 x 2048, where
the tile and wave model caps it at 1 (no tile reaches 0.90 there on 82 SMs), and the
elementwise efficiency 0.82; the other compute rows of that table (H=1024, H=4096) come out
within 10% (they were within 17%).

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

import functools
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
from oases.planner.kernels import FLOP_CLASSES, Kernel, KernelPrices, PieceKernels
from oases.planner.kernels.pieces import memory
from oases.planner.precision import PlanPrecision

__all__ = [
    "CLUSTERS",
    "DTYPE_BYTES",
    "GPU",
    "GPUS",
    "LINKS",
    "PAPER_REFERENCE_MODEL",
    "Cluster",
    "HardwareCosts",
    "Link",
    "Server",
    "cluster_from_dict",
    "comm_to_compute",
    "get_cluster",
    "group_layout",
    "group_spans_servers",
    "load_cluster",
    "save_cluster",
]

REGIONS = ("embed", "attn", "mlp", "head")
# sequence parallelism's pieces (``schedule.program._sp_chain``): the norm and the glue on a
# 1/t slice of the sequence ("sp-norm", "sp-epi"), the TP matmuls on the gathered sequence
# ("sp-core": a body without its norm; "sp-core-commfree": without the last matmul too); a
# block's TP backward split into its input gradient ("sp-dx") and weight gradients ("sp-dw")
SP_FORWARD_PIECES = ("sp-norm", "sp-core", "sp-core-commfree", "sp-epi")
_FORWARD_PIECES = ("body", "body-commfree", "epi", *SP_FORWARD_PIECES)
PIECES = {
    "forward": _FORWARD_PIECES,
    "recompute": _FORWARD_PIECES,
    "backward": ("norm", "epi", "tp", "sp-norm", "sp-epi", "sp-dx", "sp-dw"),
}

# The Oases paper's reference GPT layer (its profile table): what the bench's link presets
# speak for.
PAPER_REFERENCE_MODEL = ModelConfig(
    arch="gpt2", n_layers=24, dim=2048, n_heads=32, vocab_size=50257, seq_len=1024, dropout=0.1
)


class HardwareCosts:
    """Seconds of compute and communication of ``model`` on ``cluster`` in ``dtype``
    ("fp32" | "tf32" | "bf16" | "fp16"; the dtype of matmuls and activations) with the DP
    gradient reduction in ``grad_reduce`` ("fp32" | "bf16"); ``precision`` says the bytes of
    each kind of tensor."""

    def __init__(
        self,
        cluster: Cluster,
        model: ModelConfig,
        dtype: str = "fp32",
        grad_reduce: str = "fp32",
        *,
        attention: str = "materialized",
        algorithms: Sequence[str] = NCCL_ALGORITHMS,
    ) -> None:
        gpu = cluster.server.gpu
        if dtype not in DTYPE_BYTES or dtype == "fp64":
            raise ValueError(
                f"dtype={dtype!r}; valid: {', '.join(d for d in DTYPE_BYTES if d != 'fp64')}"
            )
        if grad_reduce not in ("fp32", "bf16"):
            raise ValueError(f"grad_reduce={grad_reduce!r}; valid: fp32, bf16")
        if dtype not in gpu.peak_flops:
            raise ValueError(f"{gpu.name} has no {dtype} peak; it has {', '.join(gpu.peak_flops)}")
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
        self.prices = KernelPrices(gpu, dtype, self.elem_bytes)
        self._pieces = PieceKernels(model, self.elem_bytes, attention)

    @property
    def memory_bytes(self) -> float:
        """Memory of one GPU (the per-rank budget before any safety margin)."""
        return self.cluster.memory_bytes

    # -- compute ---------------------------------------------------------------------------

    def compute_s(self, region: str, phase: str, piece: str, tp: int, rows: int) -> float:
        """Seconds of one sub-batch of ``rows`` sequences through ``piece`` of a ``region``
        at TP degree ``tp``: its kernels, launched (``planner.kernels``). Pieces that do no
        work (the head's epi, the embedding's norm backward) cost 0."""
        return sum(self.breakdown(region, phase, piece, tp, rows).values())

    def breakdown(
        self, region: str, phase: str, piece: str, tp: int, rows: int
    ) -> dict[str, float]:
        """``compute_s`` by kernel class (``planner.kernels.CLASSES``; "launch" is what the
        launches add)."""
        self.kernels(region, phase, piece, tp, rows)  # checks the arguments
        return self._breakdown(region, phase, piece, tp, rows)

    @functools.cache  # noqa: B019 (a HardwareCosts lives as long as its planning)
    def _breakdown(
        self, region: str, phase: str, piece: str, tp: int, rows: int
    ) -> dict[str, float]:
        return self.prices.breakdown(self._kernels(region, phase, piece, tp, rows))

    def work(self, region: str, phase: str, piece: str, tp: int, rows: int) -> tuple[float, float]:
        """(GEMM and attention flops, bytes moved by memory-bound kernels) of one piece."""
        ks = self.kernels(region, phase, piece, tp, rows)
        return (
            sum(k.flops for k in ks if k.cls in FLOP_CLASSES),
            sum(k.nbytes for k in ks if k.cls not in FLOP_CLASSES),
        )

    def kernels(self, region: str, phase: str, piece: str, tp: int, rows: int) -> list[Kernel]:
        """The kernels of one piece (``planner.kernels.pieces``); a sequence-parallel piece
        is the plain one's: the norm and the glue on 1/tp of the tokens, the TP matmuls
        without the norm, the backward split into weight gradients ("sp-dw") and the rest."""
        if region not in REGIONS:
            raise ValueError(f"region={region!r}; valid: {', '.join(REGIONS)}")
        if phase not in PIECES or piece not in PIECES[phase]:
            valid = ", ".join(PIECES.get(phase, ())) or f"(phases: {', '.join(PIECES)})"
            raise ValueError(f"phase={phase!r} piece={piece!r}; valid pieces: {valid}")
        if tp < 1 or rows < 1:
            raise ValueError(f"tp={tp} and rows={rows} must be >= 1")
        return self._kernels(region, phase, piece, tp, rows)

    @functools.cache  # noqa: B019 (a HardwareCosts lives as long as its planning)
    def _kernels(self, region: str, phase: str, piece: str, tp: int, rows: int) -> list[Kernel]:
        pk, backward = self._pieces, phase == "backward"
        if not piece.startswith("sp-"):
            return (pk.backward if backward else pk.forward)(region, piece, tp, rows)
        tokens = rows * self.model.seq_len
        if piece == "sp-norm":
            if region == "embed":
                return []
            elements = tokens * self.model.dim / tp
            return memory(pk.norm, "norm", elements, self.elem_bytes, backward) + (
                memory("residual", "residual gradient sum", elements, self.elem_bytes, True)
                if backward
                else []
            )
        if piece == "sp-epi":
            return pk.epi(region, tokens / tp, backward)
        if piece in ("sp-dx", "sp-dw"):
            dw = piece == "sp-dw"
            return [k for k in pk.backward(region, "tp", tp, rows) if k.weight_grad == dw]
        body = pk.forward(region, piece.removeprefix("sp-").replace("core", "body"), tp, rows)
        return [k for k in body if k.label != "norm"]

    def optimizer_s(self, n_params: int) -> float:
        """torch's foreach AdamW over ``n_params`` local master (fp32) parameters and the
        gradient-norm clipping (memory-bound, ``planner.kernels.memory_bound``)."""
        if n_params <= 0:
            return 0.0
        return sum(self.prices.optimizer_breakdown(n_params).values())

    def contention(self, op: str) -> float:
        """Compute's slowdown while collective ``op`` runs beside it: its NCCL CTAs hold
        SMs (``KernelPrices.slowdown``); the same for every op."""
        return self.prices.slowdown()

    def saved_bytes(self, region: str, mode: str, tp: int, rows: int) -> None:
        """Presets measure no activations: None means 'use the analytic estimate'."""
        return None

    # -- collectives -----------------------------------------------------------------------

    def collective_s(
        self, op: str, group_size: int, nbytes: int, *, spans_servers: bool | None = None
    ) -> float:
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
            raise ValueError(
                f"a group of {group_size} does not fit in one server of {c.name} ({gps} GPUs)"
            )
        if spans_servers is True:
            if c.servers == 1:
                raise ValueError(f"{c.name} has one server: no group spans servers")
            if c.world_size % group_size == 0:
                ranks = list(range(0, c.world_size, c.world_size // group_size))
            else:
                per_server = math.ceil(group_size / c.servers)
                step = max(1, gps // per_server)
                ranks = [s * gps + j * step for s in range(c.servers) for j in range(per_server)][
                    :group_size
                ]
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
            raise ValueError(
                f"group_size={group_size} must be in 1..{self.cluster.world_size} "
                f"({self.cluster.name})"
            )
        if nbytes < 0:
            raise ValueError(f"nbytes={nbytes} must be >= 0")

    # -- summary ---------------------------------------------------------------------------

    def describe(self) -> str:
        """One paragraph of the assumptions behind these costs."""
        c, s, g = self.cluster, self.cluster.server, self.cluster.server.gpu
        link = s.link
        both = (
            f" one way, {link.duplex_bytes_per_s / 1e9:.1f} both ways"
            if link.duplex_bytes_per_s != link.effective_bytes_per_s
            else ""
        )
        pair = (
            f", pairs bridged by {s.pair_link.name} "
            f"({s.pair_link.effective_bytes_per_s / 1e9:.1f} GB/s)"
            if s.pair_link
            else ""
        )
        inter = (
            f"; servers joined by {c.inter_link.name} "
            f"({c.inter_link.effective_bytes_per_s / 1e9:.2f} GB/s bus bandwidth per port, "
            f"{c.nics_per_server} port(s) per server, shared by the server's GPUs' groups)"
            if c.inter_link is not None and c.servers > 1
            else ""
        )
        algos = "/".join(self.algorithms)
        pr = self.prices
        return (
            f"{c.name}: {c.servers} server(s) x {s.gpus_per_server} {g.name} "
            f"({g.memory_bytes / 1e9:.0f} GB); {self.dtype} matmuls by shape on {pr.sms} "
            f"SMs (tiles and waves; {self.matmul_efficiency:.0%} of "
            f"{g.peak_flops[self.dtype] / 1e12:.1f} TFLOP/s peak at the best shape), "
            f"{self.attention} attention"
            + (
                " (FlashAttention-2 series)"
                if self.attention == "fused" and pr.has_attention_series
                else ""
            )
            + f", memory-bound kernels at {self.memory_bytes_per_s / 1e9:.0f} GB/s "
            f"({g.elementwise_efficiency:.0%} of {g.memory_bandwidth_bytes_per_s / 1e9:.0f}),"
            f" {pr.value('kernel_gap_s') * 1e6:.0f} us per kernel launch, "
            f"{pr.value('host_op_s') * 1e6:.0f} us host per op, compute x"
            f"{pr.slowdown():.2f} beside a collective, "
            f"{self.precision.label()}; collectives as NCCL's tuner picks them ({algos} x "
            f"LL/LL128/Simple), inside a server over {link.name} "
            f"({link.effective_bytes_per_s / 1e9:.1f} GB/s bus bandwidth{both}){pair}{inter}. "
            f"Sources: {g.source}; {link.source}."
        )


def comm_to_compute(
    cluster: Cluster, model: ModelConfig, tp: int, rows: int, dtype: str = "fp32"
) -> float:
    """All-reduce of a TP region's output over its ``tp`` GPUs / that region's forward (body +
    epi), the mean of the attention and MLP regions: how slow the link is next to compute."""
    costs = HardwareCosts(cluster, model, dtype)
    forward_s = [
        costs.compute_s(r, "forward", "body", tp, rows)
        + costs.compute_s(r, "forward", "epi", tp, rows)
        for r in ("attn", "mlp")
    ]
    nbytes = rows * model.seq_len * model.dim * costs.elem_bytes  # [b, S, H]
    return costs.collective_s("all_reduce", tp, nbytes) / (sum(forward_s) / 2)
