"""``oases profile --kernels``: measure the kernel model's terms on this device and write them as
a cluster file the planner reads like a preset (``oases simulate --cluster FILE``).

One process, no ranks, on the local GPU (CUDA) or, without one, on this machine's CPU::

    GEMM          torch.mm over square and LLaMA-like shapes: the best rate sets the matmul
                  efficiency (of the datasheet's peak where the device is a preset GPU, else
                  of that best rate itself: efficiency 1)
    attention     SDPA (flash where CUDA has it) forward and backward, causal and not, by head
                  dim and sequence: the ``attn_*`` series (planner.kernels.sources' keys)
    memory        a STREAM-like triad (a = b + s c) over tensors far beyond the caches
    launch        back-to-back tiny kernels: the device time per kernel (``kernel_gap_s``)
                  and the host time to dispatch one op (``host_op_s``)
    executor      the executor's own host work per piece, in those ops (``executor_ops``):
                  ``oases bench --overhead``'s megatron and overlap k=2 steps against the
                  plain model on the same sub-batches (``measure_executor_ops``)

The link fields are a placeholder (one server of one device): the file prices compute; a
cluster file of your own joins its GPU table to your links. On CPU the per-piece profile of
``oases profile`` stays the planner's default; this file is for comparing the two models.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from oases.planner.clusters import GPU, Cluster, Server
from oases.planner.kernels.sources import ATTN_SEQ

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    def timed(fn: Callable[[], object], repeats: int) -> float:
        fn()  # warm-up
        best = float("inf")
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
        return best

    return timed


def measure_gemm(
    device: torch.device, dtype: torch.dtype, repeats: int, sizes: tuple[int, ...]
) -> dict[str, float]:
    """Best flop/s of torch.mm over square shapes of ``sizes``."""
    timed, best, at = _timer(device), 0.0, 0
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        rate = 2 * n**3 / timed(lambda a=a, b=b: torch.mm(a, b), repeats)
        if rate > best:
            best, at = rate, n
    return {"flops_per_s": best, "n": at}


def measure_stream(device: torch.device, nbytes: int, repeats: int) -> float:
    """Bytes/s of a triad a = b + s c (three tensors of ``nbytes`` / 3 bytes moved)."""
    n = nbytes // 12
    b = torch.rand(n, device=device)
    c = torch.rand(n, device=device)
    a = torch.empty_like(b)
    s = _timer(device)(lambda: torch.add(b, c, alpha=0.5, out=a), repeats)
    return 12 * n / s


def measure_launch(device: torch.device, kernels: int = 200) -> tuple[float, float]:
    """(device seconds per tiny back-to-back kernel, host seconds to dispatch one op)."""
    x = torch.zeros(16, device=device)
    timed = _timer(device)

    def burst() -> None:
        for _ in range(kernels):
            x.add_(1.0)

    per_kernel = timed(burst, 3) / kernels
    if device.type != "cuda":
        return per_kernel, per_kernel
    t0 = time.perf_counter()
    burst()  # the host returns before the device is done: the dispatch time alone
    host = (time.perf_counter() - t0) / kernels
    torch.cuda.synchronize(device)
    return per_kernel, host


def measure_attention(
    device: torch.device,
    dtype: torch.dtype,
    peak: float,
    repeats: int,
    seqs: tuple[int, ...],
    dims: tuple[int, ...],
    tokens: int,
) -> dict[str, float]:
    """``attn_*`` efficiencies: SDPA forward and backward at ``tokens`` tokens of 2048 / D
    heads, as the FlashAttention papers measure, over ``peak``."""
    timed, out = _timer(device), {}
    for d in dims:
        heads = max(1, 2048 // d)
        for s in seqs:
            b = max(1, tokens // s)
            q, k, v = (
                torch.randn(b, heads, s, d, device=device, dtype=dtype, requires_grad=True)
                for _ in range(3)
            )
            for causal in (False, True):
                mask = "causal" if causal else "full"
                fwd = timed(
                    lambda q=q, k=k, v=v, c=causal: F.scaled_dot_product_attention(
                        q, k, v, is_causal=c
                    ),
                    repeats,
                )
                o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                grad = torch.ones_like(o)
                both = timed(
                    lambda o=o, g=grad, x=(q, k, v): torch.autograd.grad(
                        o, x, g, retain_graph=True
                    ),
                    repeats,
                )
                flops = 4 * b * heads * s * s * d * (0.5 if causal else 1.0)
                out[f"attn_fwd_{mask}_d{d}_s{s}"] = flops / (fwd * peak)
                out[f"attn_bwd_{mask}_d{d}_s{s}"] = 2.5 * flops / (both * peak)
    return out


def measure_executor_ops(host_op_s: float, quick: bool = False) -> float:
    """The executor's own host work per piece in ``host_op_s`` units: (a schedule's step - the
    plain model's on the same k sub-batches) / the program's pieces, the mean of megatron's and
    overlap k=2's (schedules without recompute: their pieces run the plain model's kernels, so
    the difference is the executor's). On the device ``init_distributed`` picks (CUDA where
    there is one), on ``bench.overhead``'s 24 x 64 GPT-2 (``quick``: a 2-layer model)."""
    from oases.bench.overhead import OVERHEAD_MODELS, measure_model
    from oases.config import ModelConfig

    cfg = (
        ModelConfig(n_layers=2, dim=16, n_heads=2, seq_len=8, vocab_size=32)
        if quick
        else OVERHEAD_MODELS["gpt2-24x64"]
    )
    rows = measure_model(cfg, ["megatron", "overlap@k=2"], 3 if quick else 9, 1 if quick else 2)
    per_piece = [max(0.0, r["schedule_s"] - r["plain_k_s"]) / r["pieces"] for r in rows]
    return sum(per_piece) / len(per_piece) / host_op_s


def measure_kernels(
    device: torch.device, dtype: str = "bf16", repeats: int = 5, quick: bool = False
) -> Cluster:
    """Measure every kernel class on ``device`` and return a one-device cluster whose GPU
    carries the measurements (``quick``: smaller shapes, for tests and slow CPUs)."""
    from oases.planner.presets import GPUS

    cpu = device.type != "cuda"
    tdtype = DTYPES["fp32" if cpu and dtype == "bf16" else dtype]
    name = (
        torch.cuda.get_device_name(device)
        if not cpu
        else (platform.processor() or platform.machine())
    )
    preset = next(
        (g for key, g in GPUS.items() if key.replace("rtx", "") in name.lower().replace(" ", "")),
        None,
    )
    sizes = (256, 512) if quick else ((1024, 2048) if cpu else (2048, 4096, 8192, 16384))
    gemm = measure_gemm(device, tdtype, repeats, sizes)
    stream = measure_stream(device, (8 << 20) if quick else (1 << 30), repeats)
    gap, host = measure_launch(device, 50 if quick else 200)
    executor_ops = measure_executor_ops(host, quick)
    key = "fp32" if tdtype == torch.float32 else dtype
    peak = preset.peak_flops.get(key, gemm["flops_per_s"]) if preset else gemm["flops_per_s"]
    bandwidth = preset.memory_bandwidth_bytes_per_s if preset else stream
    seqs = (128, 256) if quick else ((512, 1024) if cpu else ATTN_SEQ)
    attn = measure_attention(
        device,
        tdtype,
        peak,
        repeats,
        seqs,
        (64,) if quick else (64, 128),
        512 if quick else (4096 if cpu else 16384),
    )
    sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if not cpu
        else os.cpu_count() or 1
    )
    memory = (
        torch.cuda.get_device_properties(device).total_memory
        if not cpu
        else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    )
    eff = min(1.0, gemm["flops_per_s"] / peak)
    gpu = GPU(
        f"{name} (measured)",
        {key: peak},
        float(memory),
        bandwidth,
        eff,
        min(1.0, stream / bandwidth),
        f"oases profile --kernels on {name}, torch {torch.__version__}: torch.mm best "
        f"{gemm['flops_per_s'] / 1e12:.2f} TFLOP/s at {gemm['n']}^3, triad "
        f"{stream / 1e9:.1f} GB/s, {gap * 1e6:.1f} us per kernel, {host * 1e6:.1f} us "
        f"per op dispatched, the executor {executor_ops:.2f} ops per piece, SDPA by head dim "
        "and sequence",
        kernels={
            "sms": float(sms),
            "kernel_gap_s": gap,
            "host_op_s": host,
            "executor_ops": executor_ops,
            **attn,
        },
        # (NCCL's tuning row: an H200's 9.0, not the field's default 8.0)
        compute_capability=(
            8.0 if cpu else float("{}.{}".format(*torch.cuda.get_device_capability(device)))
        ),
    )
    return Cluster(
        f"measured-{'cpu' if cpu else 'gpu'}",
        1,
        Server(1, gpu, _placeholder_link()),
        source=f"oases profile --kernels, {time.strftime('%Y-%m-%d')}",
    )


def _placeholder_link() -> object:
    from oases.planner.presets import LINKS

    return LINKS["pcie4-x16"]


def write_kernel_profile(cluster: Cluster, path: Path) -> None:
    """The cluster file (JSON), readable by ``oases simulate --cluster``."""
    path.write_text(json.dumps(dataclasses.asdict(cluster), indent=1), encoding="utf-8")
