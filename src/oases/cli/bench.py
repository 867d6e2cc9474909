"""``oases bench`` (schedules side by side on a shaped loopback, or their memory) and
``oases profile`` (this model's regions and this machine's collectives, for the planner)."""

from __future__ import annotations

import argparse
from pathlib import Path

from oases.cli.command import BENCH_CONFIG, SubCommand
from oases.config import load_config


def _bench_arguments(bench: argparse.ArgumentParser) -> None:
    from oases.bench.link import LINK_PRESETS
    from oases.bench.suite import DEFAULT_SCHEDULES

    bench.add_argument(
        "config",
        nargs="?",
        default=str(BENCH_CONFIG),
        help=f"TOML run file (default: {BENCH_CONFIG})",
    )
    bench.add_argument(
        "--schedules",
        default=",".join(DEFAULT_SCHEDULES),
        help="comma-separated schedules, each NAME[@OPTION=VALUE,...] with "
        "options zero=0|1|2|3, precision=fp32|bf16, sp=gathered|shards (sequence "
        "parallelism), dw=off (its weight gradients inline, for comparison); "
        "e.g. oases,overlap@sp=gathered,dw=off (default: %(default)s)",
    )
    bench.add_argument(
        "--link",
        default=f"auto:{next(iter(LINK_PRESETS))}",
        help="none, a tbf rate (200mbit, 25MB) or auto:PRESET with PRESET in "
        f"{{{', '.join(LINK_PRESETS)}}} (default: %(default)s)",
    )
    bench.add_argument(
        "--steps",
        type=int,
        default=None,
        help="measured steps per schedule (default: 5; 9 with --overhead)",
    )
    bench.add_argument("--warmup", type=int, default=2, help="warm-up steps per schedule")
    bench.add_argument("--out", default="runs/bench", help="output folder")
    bench.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="N",
        help="local ranks (default: parallel.tp)",
    )
    bench.add_argument(
        "--with-optimizer",
        action="store_true",
        help="time whole training steps: also clipping and the AdamW step "
        "(default: forward, backward and the gradient sync)",
    )
    bench.add_argument(
        "--layouts",
        nargs="+",
        default=None,
        metavar="LAYOUT",
        help="instead of --schedules: the model laid out several ways on the same ranks, "
        "each SCHEDULE@tp=T[,pp=P][,zero=Z][,pps=ORDER][,v=V] or "
        "torch-pp@pp=P[,pps=gpipe|1f1b|interleaved|zb][,v=V] "
        "(PyTorch's pipelining), e.g. megatron@tp=2 megatron@tp=1,zero=1 megatron@pp=2 "
        "torch-pp@pp=2 (--link none or a rate)",
    )
    bench.add_argument(
        "--memory",
        action="store_true",
        help="instead of timing: each entry in a launch of its own, unshaped; "
        "model state by kind, measured peak and the simulator's prediction "
        "(memory.md)",
    )
    bench.add_argument(
        "--overhead",
        action="store_true",
        help="instead of a launch: the executor's host cost, in this process at tp=1, "
        "each schedule's step against a plain forward + backward of the same model on the "
        "issue's two GPT-2 shapes (the config is not used; --out gets overhead.json/.md)",
    )
    bench.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="with --overhead on a GPU: also each schedule's step captured as a CUDA graph "
        "and replayed (a NAME+graph row per entry)",
    )
    bench.add_argument(
        "--memory-profile",
        metavar="FILE",
        default=None,
        help="with --memory: predict from this `oases profile` file (its measured "
        "activations; default: the analytic sizes)",
    )


def _default_schedules() -> tuple[str, ...]:
    from oases.bench.suite import DEFAULT_SCHEDULES

    return DEFAULT_SCHEDULES


def _bench(ns: argparse.Namespace, overrides: list[str]) -> int:
    from oases.bench import split_entries
    from oases.bench.suite import run_bench

    if ns.overhead:
        from oases.bench.overhead import OVERHEAD_ENTRIES, OVERHEAD_MODELS, run_overhead

        schedules = ns.schedules if ns.schedules != ",".join(_default_schedules()) else None
        run_overhead(
            OVERHEAD_MODELS,
            split_entries(schedules) if schedules else list(OVERHEAD_ENTRIES),
            9 if ns.steps is None else ns.steps,
            ns.warmup,
            Path(ns.out),
            graphs=ns.cuda_graphs,
        )
        return 0
    if ns.cuda_graphs:
        raise ValueError("--cuda-graphs goes with --overhead (training: schedule.cuda_graphs)")
    ns.steps = 5 if ns.steps is None else ns.steps
    if ns.steps < 1 or ns.warmup < 0:
        raise ValueError(f"--steps={ns.steps} must be >= 1 and --warmup={ns.warmup} >= 0")
    nproc = ns.nproc_per_node or load_config(ns.config, overrides).parallel.tp
    if ns.layouts:
        from oases.bench.layouts import run_layouts

        run_layouts(
            ns.config,
            overrides,
            ns.layouts,
            ns.link,
            ns.steps,
            Path(ns.out),
            nproc=nproc,
            warmup=ns.warmup,
        )
        return 0
    if ns.memory:
        from oases.bench.memory_suite import run_memory

        run_memory(
            ns.config,
            overrides,
            split_entries(ns.schedules),
            ns.steps,
            Path(ns.out),
            nproc=nproc,
            warmup=max(1, ns.warmup),
            profile=ns.memory_profile,
        )
        return 0
    run_bench(
        ns.config,
        overrides,
        split_entries(ns.schedules),
        ns.link,
        ns.steps,
        Path(ns.out),
        nproc=nproc,
        warmup=ns.warmup,
        with_optimizer=ns.with_optimizer,
    )
    return 0


def _profile_arguments(profile: argparse.ArgumentParser) -> None:
    profile.add_argument(
        "config",
        nargs="?",
        default=str(BENCH_CONFIG),
        help=f"TOML run file (default: {BENCH_CONFIG})",
    )
    profile.add_argument("--out", default="profile.json", help="profile file to write")
    profile.add_argument(
        "--link", default="none", help="none, a tbf rate (200mbit) or auto:PRESET, as for bench"
    )
    profile.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="N",
        help="local ranks = the world size profiled (default: parallel.tp)",
    )
    profile.add_argument("--repeats", type=int, default=3, help="timed repeats per point")
    profile.add_argument(
        "--kernels",
        action="store_true",
        help="measure the kernel model's terms (GEMM, attention, STREAM-like bandwidth, "
        "launch, host and executor cost) on this device, the local GPU or else this CPU, in one "
        "process, and write them as a cluster file for `oases simulate --cluster` (--out; the "
        "config and --nproc-per-node are not used)",
    )
    profile.add_argument(
        "--dtype",
        default="bf16",
        choices=("fp32", "bf16", "fp16"),
        help="--kernels: the matmul and attention dtype measured (CPU: fp32) (default: bf16)",
    )


def _profile(ns: argparse.Namespace, overrides: list[str]) -> int:
    import tempfile

    from oases.bench.suite import launch_ranks, resolve_link

    if ns.kernels:
        return _profile_kernels(ns)
    cfg = load_config(ns.config, overrides)
    nproc = ns.nproc_per_node or cfg.parallel.tp
    if nproc < 1 or ns.repeats < 1:
        raise ValueError(f"--nproc-per-node={nproc} and --repeats={ns.repeats} must be >= 1")
    cfg.validate(nproc)
    out = Path(ns.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    rate, label, _ = resolve_link(ns.link, ns.config, overrides, nproc, cfg.parallel.tp)
    with tempfile.TemporaryDirectory() as tmp:
        launch_ranks(
            "oases.bench.profile_runner",
            {
                "config": ns.config,
                "overrides": overrides,
                "out": str(out),
                "repeats": ns.repeats,
                "link_label": label,
            },
            nproc,
            rate,
            Path(tmp),
        )
    print(f"wrote {out}")
    return 0


def _profile_kernels(ns: argparse.Namespace) -> int:
    import torch

    from oases.bench.kernel_profile import measure_kernels, write_kernel_profile

    if ns.repeats < 1:
        raise ValueError(f"--repeats={ns.repeats} must be >= 1")
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    cluster = measure_kernels(device, ns.dtype, ns.repeats)
    out = Path(ns.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    write_kernel_profile(cluster, out)
    print(f"{cluster.server.gpu.source}\nwrote {out} (oases simulate --cluster {out})")
    return 0


BENCH = SubCommand(
    name="bench",
    help="compare schedules side by side on an emulated interconnect",
    description="Run every schedule in one launch, interleaved, on a loopback shaped like a "
    "commodity interconnect (root + tc), and report medians, speedups and the limit.",
    add_arguments=_bench_arguments,
    run=_bench,
    takes_overrides=True,
    launches_ranks=True,
)
PROFILE = SubCommand(
    name="profile",
    help="measure this model's regions and this machine's collectives for the planner",
    description="Measure forward, backward and recompute time of every region kind at "
    "every candidate TP degree and sub-batch size, collectives per group size (fitted to "
    "latency + bytes/bandwidth), saved activations and the optimizer; write a profile.",
    add_arguments=_profile_arguments,
    run=_profile,
    takes_overrides=True,
    launches_ranks=True,
)
