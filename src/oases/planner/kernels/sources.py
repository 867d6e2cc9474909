"""The public figures the kernel model prices from, each with where it comes from.

Every number here is a kernel microbenchmark or a specification; none is an end-to-end training
throughput. A GPU preset carries its kernel table as ``GPU.kernels`` (a flat table of numbers,
so a cluster file and ``oases profile --kernels`` write the same keys); ``KERNEL_KEYS`` says
what each key means, ``GPU_KERNELS`` holds the presets' tables, ``SOURCES`` names the source of
each kernel class.

Attention efficiencies are fractions of the GPU's dense 16-bit peak, keyed
``attn_{fwd|bwd}_{full|causal}_d{D}_s{S}``, in the FlashAttention papers' convention: forward
flops 4 x batch x heads x S^2 x D, halved when causal; backward 2.5x the forward's.
"""

from __future__ import annotations

# -- sources, one per kernel class -------------------------------------------------------------
FA3_PAPER = (
    "Shah et al., 'FlashAttention-3: Fast and Accurate Attention with Asynchrony and "
    "Low-precision' (arXiv 2407.08608), the H100 SXM5 BF16/FP16 speed figures, "
    "FlashAttention-2 series: forward without causal mask D=64 282-324, D=128 309-370, "
    "D=256 275-326 TFLOP/s; with causal mask D=128 191-335, D=256 208-298; backward "
    "D=64 198-291, D=128 214-322 (S = 512 ... 16k, batch x S = 16k, H = 2048)"
)
FA2_PAPER = (
    "Dao, 'FlashAttention-2: Faster Attention with Better Parallelism and Work "
    "Partitioning' (arXiv 2307.08691), abstract: 50-73% of the A100's theoretical "
    "maximum FLOP/s; the A100 curve is the FlashAttention-2 series of the H100 figure "
    "above scaled so its best point (forward, no mask, D=128, 16k: 370 TFLOP/s) is 73%"
)
AZURE = (
    "Azure/AI-benchmarking-guide, Azure_Results/ND_A100_v4_results.md and "
    "ND_H100_v5_results.md, ND_H200_v5_results.md (cuBLASLt GEMM sweep, FP16, A100: 1024^3 "
    "119.4, 2048^3 221.8, 4096^3 228.0, 8192^3 253.7, 16384^3 256.5 TFLOP/s; HBM triad A100 "
    "1.70, H100 2.97, H200 4.15 TB/s; FlashAttention-2 A100 D=64 S=8192 179.5, H100 D=128 "
    "S=8192 327.9 TFLOP/s; PyTorch standard attention A100 46.0, H100 145.1)"
)
MAMF = (
    "stas00/ml-engineering compute/accelerator/README.md, 'Maximum Achievable Matmul FLOPS "
    "comparison table' (BF16 torch.mm, best shape: A100 SXM 271.2 of 312 at "
    "1024x10240x5120, H100 SXM 794.5 of 989 at 2048x2048x13312)"
)
MATMUL_GUIDE = (
    "NVIDIA Deep Learning Performance, 'Matrix Multiplication Background User's "
    "Guide' (DU-09799-001): cuBLAS tiles 256x128 ... 64x64, larger tiles reuse more "
    "data; tile quantization and wave quantization over the SMs (108 on A100)"
)
BABELSTREAM = (
    "BabelStream 5.0 CUDA on NVIDIA A100-SXM4-80GB (Tursa), as printed in the "
    "NERSC-10-based BabelStream benchmark README: copy 1709.4, triad 1724.8 GB/s; "
    "Azure (above): H100 triad 2.97 TB/s, H200 4.15 TB/s"
)
LAUNCH = (
    "jiahuanglin.xyz 'From PyTorch op to kernel launch' (GPU kernel serving lesson 18): "
    "cudaLaunchKernel ~1-3 us, ~5-25 us of CPU-side dispatch per eager op (Python, "
    "autograd, ATen dispatcher, cuBLAS heuristics); the mid-range is taken"
)
NCCL_SMS = (
    "NVIDIA NCCL user guide NCCL_MIN_CTAS/NCCL_MAX_CTAS (one CTA per channel, on the "
    "SMs compute would use), as stas00/ml-engineering network/benchmarks explains; "
    "NVIDIA developer forum 'Compute-Communication Overlap Causes Severe GEMM "
    "Performance Degradation because of Tail Effect': on an H100 an all-gather beside a "
    "132-block GEMM took 24 SMs and the GEMM ran ~2x slower (80% -> 47% MFU)"
)
SOURCES = {
    "gemm": f"{MATMUL_GUIDE}; anchored at {MAMF}; checked against {AZURE}",
    "attention": f"{FA3_PAPER}; {FA2_PAPER}; checked against {AZURE}",
    "memory": (
        f"bytes each eager kernel moves (oases/model.py, parallel/layers.py) at {BABELSTREAM}"
    ),
    "launch": LAUNCH,
    "interference": NCCL_SMS,
}

# -- what the keys of a kernel table mean ------------------------------------------------------
KERNEL_KEYS = {
    "sms": "streaming multiprocessors (the waves of a GEMM and of an attention kernel)",
    "gemm_anchor_m": "M of the one shape the GPU's matmul_efficiency was measured at (absent,"
    " and for every dtype_efficiency: the best over a search of shapes, "
    "reached by full waves)",
    "gemm_anchor_n": "N of that shape",
    "gemm_anchor_k": "K of that shape",
    "kernel_gap_s": "device time between two back-to-back kernels (launch latency)",
    "host_op_s": "CPU time to dispatch one eager op (Python, autograd, dispatcher, launch)",
    "executor_ops": "the executor's own host work per piece, in host_op_s units (oases bench "
    "--overhead; default: launch.EXECUTOR_OPS, measured in benchmarks/2026-12-04-overhead)",
    "nccl_ctas": "SMs a collective occupies while it runs (one CTA per NCCL channel)",
    "attn_*": "fused attention efficiency, fraction of the 16-bit dense peak (see above)",
}

# FlashAttention-2 on H100 SXM5 (FA3_PAPER), TFLOP/s at S = 512, 1k, 2k, 4k, 8k, 16k
ATTN_SEQ = (512, 1024, 2048, 4096, 8192, 16384)
_FA2_H100 = {
    ("fwd", "full", 64): (282, 306, 318, 321, 322, 324),
    ("fwd", "full", 128): (309, 350, 362, 368, 370, 370),
    ("fwd", "full", 256): (275, 313, 321, 323, 324, 326),
    ("fwd", "causal", 128): (191, 260, 298, 319, 333, 335),
    ("fwd", "causal", 256): (208, 251, 278, 293, 297, 298),
    ("bwd", "full", 64): (198, 238, 264, 279, 287, 291),
    ("bwd", "full", 128): (214, 260, 291, 310, 318, 322),
}
H100_DENSE_16BIT = 989.4e12
FA2_A100_BEST = 0.73  # FA2_PAPER: up to 73% of the A100's peak
FA2_H100_BEST = 370.0  # the best point of the FA2 series on H100 (forward, no mask, D=128)


def _fa2_series() -> dict[tuple[str, str, int], tuple[float, ...]]:
    """The H100 FlashAttention-2 series completed where the figure has none: a causal series
    is the no-mask series times the causal / no-mask ratio at the same S of the nearest head
    dimension that has both (the causal backward: the forward's ratio)."""
    series = dict(_FA2_H100)
    for d in (64, 128, 256):
        ratio_d = 128 if d == 64 else d
        ratio = [
            c / f
            for c, f in zip(
                _FA2_H100[("fwd", "causal", ratio_d)],
                _FA2_H100[("fwd", "full", ratio_d)],
                strict=True,
            )
        ]
        if ("fwd", "causal", d) not in series:
            series[("fwd", "causal", d)] = tuple(
                v * r for v, r in zip(series[("fwd", "full", d)], ratio, strict=True)
            )
        if ("bwd", "full", d) not in series:
            series[("bwd", "full", d)] = series[("bwd", "full", 128)]
        series[("bwd", "causal", d)] = tuple(
            v * r for v, r in zip(series[("bwd", "full", d)], ratio, strict=True)
        )
    return series


def attention_table(scale: float) -> dict[str, float]:
    """``attn_*`` keys: the FlashAttention-2 series (TFLOP/s on H100) times ``scale`` (1 /
    the dense peak it is a fraction of)."""
    return {
        f"attn_{direction}_{mask}_d{d}_s{s}": tflops * 1e12 * scale
        for (direction, mask, d), values in _fa2_series().items()
        for s, tflops in zip(ATTN_SEQ, values, strict=True)
    }


_H100_ATTN = attention_table(1 / H100_DENSE_16BIT)
_A100_ATTN = attention_table(FA2_A100_BEST / (FA2_H100_BEST * 1e12))
_LAUNCH = {"kernel_gap_s": 2e-6, "host_op_s": 10e-6}
GPU_KERNELS: dict[str, dict[str, float]] = {
    # the RTX 3090 has no public FA2 figure: the A100's (same Ampere tensor cores) is assumed;
    # its fp32 matmul efficiency (0.90) was solved from the Oases paper's layer profile (H=2048,
    # t=4, 4 sequences): anchored at that layer's fc1 GEMM, 4096 x 2048 x 2048 (where the tile
    # and wave model caps it at 1: no tile reaches 0.90 there on 82 SMs)
    "rtx3090": {
        "sms": 82,
        "gemm_anchor_m": 4096,
        "gemm_anchor_n": 2048,
        "gemm_anchor_k": 2048,
        **_LAUNCH,
        "nccl_ctas": 2,
        **_A100_ATTN,
    },
    # the MAMF figure is the best over a search of shapes: no anchor, full waves of the
    # largest tiles reach it (gemm.py)
    "a100": {"sms": 108, **_LAUNCH, "nccl_ctas": 12, **_A100_ATTN},
    "h100": {"sms": 132, **_LAUNCH, "nccl_ctas": 18, **_H100_ATTN},
}
GPU_KERNELS["h200"] = dict(GPU_KERNELS["h100"])  # H100's SMs and kernels (MAMF: "the same")

# STREAM-like bandwidth as a fraction of the datasheet's (BABELSTREAM, triad)
STREAM_EFFICIENCY = {"a100": 1724.8 / 2039, "h100": 2.97 / 3.35, "h200": 4.15 / 4.8}
