"""One GPU's kernel prices: every kernel of a piece in seconds, and where a piece's time goes.

``KernelPrices(gpu, dtype)`` reads the GPU preset (peaks, memory bandwidth, the STREAM
efficiency ``elementwise_efficiency``, the measured matmul efficiency) and its kernel table
(``GPU.kernels``: SMs, the GEMM anchor shape, launch and host costs, NCCL's SMs, the fused
attention series; ``planner.kernels.sources`` for the presets)::

    GEMM         planner.kernels.gemm: tiles and waves over the SMs, split-K, memory floor
    attention    planner.kernels.attention: the published fused-kernel series (or, when
                 materialized, its GEMMs and memory-bound passes)
    memory       planner.kernels.memory_bound: bytes at the STREAM bandwidth
    launch       planner.kernels.launch: max(kernels + gaps, host dispatch) per piece

``piece_s`` prices a list of kernels, ``breakdown`` splits it by class ("launch" included),
``slowdown`` is compute's while a collective runs beside it: the collective's CTAs hold
``nccl_ctas`` of the SMs, so full waves of compute take SMs / (SMs - CTAs) as long.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from oases.planner.clusters import GPU
from oases.planner.kernels import gemm as gemm_model
from oases.planner.kernels.attention import fused_attention_s
from oases.planner.kernels.launch import EXECUTOR_OPS, piece_s
from oases.planner.kernels.memory_bound import op_bytes, stream_s
from oases.planner.kernels.pieces import Kernel

DEFAULTS = {
    "kernel_gap_s": 2e-6,
    "host_op_s": 10e-6,
    "nccl_ctas": 0.0,
    "executor_ops": EXECUTOR_OPS,
}
CLASSES = (
    "gemm",
    "attention",
    "norm",
    "rotary",
    "activation",
    "elementwise",
    "cross-entropy",
    "cast",
    "embedding",
    "optimizer",
    "grad-norm",
    "launch",
)
FLOP_CLASSES = ("gemm", "attention")


class KernelPrices:
    """Seconds of kernels on ``gpu`` with ``dtype`` matmuls and ``elem_bytes`` activations."""

    def __init__(
        self, gpu: GPU, dtype: str, elem_bytes: float, table: Mapping[str, float] | None = None
    ) -> None:
        self.gpu, self.dtype, self.e = gpu, dtype, elem_bytes
        self.table = dict(gpu.kernels if table is None else table)
        self.peak = gpu.peak_flops[dtype]
        self.attn_peak = gpu.peak_flops.get("bf16", self.peak)  # the series' 16-bit peak
        self.bytes_per_s = gpu.memory_bandwidth_bytes_per_s * gpu.elementwise_efficiency
        self.sms = int(self.table.get("sms", 0)) or 100
        self.best_efficiency = gpu.matmul_efficiency_at(dtype)
        self.has_attention_series = any(key.startswith("attn_") for key in self.table)
        anchor = tuple(int(self.table.get(f"gemm_anchor_{d}", 0)) for d in "mnk")
        self.e_max = (
            gemm_model.peak_efficiency(
                anchor, self.best_efficiency, self.sms, self.peak, self.bytes_per_s
            )
            if all(anchor) and dtype not in gpu.dtype_efficiency
            else self.best_efficiency
        )  # the anchor is matmul_efficiency's shape

    def value(self, key: str) -> float:
        return float(self.table.get(key, DEFAULTS.get(key, 0.0)))

    # -- one kernel -----------------------------------------------------------------------
    def kernel_s(self, k: Kernel) -> float:
        """Seconds of kernel ``k`` on its own (no launch)."""
        if k.gemm is not None:
            m, n, kk, batch = k.gemm
            return gemm_model.gemm_s(
                m,
                n,
                kk,
                batch=batch,
                elem_bytes=self.e,
                sms=self.sms,
                peak_flops=self.peak,
                e_max=self.e_max,
                bytes_per_s=self.bytes_per_s,
            )
        if k.attn is not None:
            if not self.has_attention_series:  # a GPU without published series: at the
                return k.flops / (self.peak * self.best_efficiency)  # best matmul rate
            b, heads, s, d, causal, backward = k.attn
            return fused_attention_s(
                self.table,
                b=b,
                heads=heads,
                s=s,
                d=d,
                causal=causal,
                backward=backward,
                peak_flops=self.attn_peak,
                sms=self.sms,
            )
        return stream_s(k.nbytes, self.bytes_per_s)

    # -- a piece --------------------------------------------------------------------------
    def breakdown(self, kernels: Iterable[Kernel]) -> dict[str, float]:
        """Seconds of a piece by kernel class, "launch" being what the launches add."""
        out: dict[str, float] = {}
        own, count = 0.0, 0
        for k in kernels:
            s = self.kernel_s(k)
            out[k.cls] = out.get(k.cls, 0.0) + s
            own += s
            count += k.count
        if count:
            total = piece_s(
                own,
                count,
                self.value("kernel_gap_s"),
                self.value("host_op_s"),
                self.value("executor_ops"),
            )
            out["launch"] = total - own
        return out

    def piece_s(self, kernels: Iterable[Kernel]) -> float:
        """Seconds of a piece: its kernels, launched (``planner.kernels.launch``)."""
        return sum(self.breakdown(kernels).values())

    def optimizer_breakdown(self, n_params: int) -> dict[str, float]:
        """torch's foreach AdamW and the gradient-norm clipping over ``n_params`` fp32
        parameters, by class."""
        out = {}
        for op in ("adamw", "grad_norm"):
            nbytes, count = op_bytes(op, n_params, self.e, False)
            own = stream_s(nbytes, self.bytes_per_s)
            out[op.replace("_", "-").replace("adamw", "optimizer")] = own
            out["launch"] = (
                out.get("launch", 0.0)
                + piece_s(
                    own,
                    count,
                    self.value("kernel_gap_s"),
                    self.value("host_op_s"),
                    self.value("executor_ops"),
                )
                - own
            )
        return out

    # -- interference ---------------------------------------------------------------------
    def slowdown(self) -> float:
        """Compute's slowdown while a collective holds ``nccl_ctas`` SMs (>= 1)."""
        ctas = self.value("nccl_ctas")
        if ctas <= 0 or ctas >= self.sms:
            return 1.0
        return self.sms / (self.sms - ctas)

    def efficiency(self, kernels: Iterable[Kernel]) -> dict[str, float]:
        """Flops per second over the peak of each flop class of these kernels."""
        flops: dict[str, float] = {}
        secs: dict[str, float] = {}
        for k in kernels:
            if k.cls in FLOP_CLASSES:
                flops[k.cls] = flops.get(k.cls, 0.0) + k.flops
                secs[k.cls] = secs.get(k.cls, 0.0) + self.kernel_s(k)
        return {c: flops[c] / (secs[c] * self.peak) for c in flops if secs[c] > 0}
