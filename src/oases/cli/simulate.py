"""``oases simulate``: schedules and plans of a model on a cluster preset or file, predicted
without the hardware."""

from __future__ import annotations

import argparse
from pathlib import Path

from oases.cli.command import SubCommand


def _simulate_arguments(sim: argparse.ArgumentParser) -> None:
    from oases.planner.budget import DEFAULT_BUDGET_HELP

    sim.add_argument(
        "--model",
        required=True,
        metavar="PRESET|CONFIG",
        help="a model preset (paper-h1024-l24, ...) or a TOML run file (its "
        "[model]; its train.global_batch, train.micro_batch and parallel.tp "
        "where it sets them and no flag does)",
    )
    sim.add_argument(
        "--cluster",
        required=True,
        metavar="PRESET|FILE",
        help="a cluster preset or a cluster TOML/JSON file (see below)",
    )
    sim.add_argument(
        "--schedules",
        default="megatron-recompute,merak,oases",
        help="comma-separated schedules, each optionally @PLAN; the first is the "
        "baseline of the speedups (default: %(default)s)",
    )
    sim.add_argument(
        "--plan",
        default="auto",
        help="plan of schedules without @PLAN: auto, tp=N or tp=N+, each "
        "optionally with ,zero=Z (ZeRO stage Z for every region; auto without it "
        "searches stages 0-3), ,sp=MODE; tp=N also with ,pp=P (P pipeline stages, "
        "simulated together) and ,pps=gpipe|1f1b|1f1b-pair|zb-h1 (default: auto)",
    )
    sim.add_argument(
        "--global-batch",
        type=int,
        default=None,
        metavar="B",
        help="sequences per optimizer step (default: the run file's "
        "train.global_batch, else one micro-batch: the largest of the rows)",
    )
    sim.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        metavar="M",
        help="sequences per model replica (per DP rank) per forward/backward, as "
        "train.micro_batch and Megatron-LM count them: a plan at tp=t runs "
        "M*GPUs/t across the cluster per micro-batch (default: the run file's "
        "train.micro_batch, else one sequence per GPU)",
    )
    sim.add_argument(
        "--micro-batch-tp",
        type=int,
        default=None,
        metavar="T",
        help="the TP degree at which --micro-batch counts (a divisor of the GPUs; "
        "needs a micro-batch): auto plans mix degrees, so they keep the cluster "
        "micro-batch of tp=T, M*GPUs/T (default: the run file's parallel.tp with "
        "its micro_batch, else one server's GPUs)",
    )
    sim.add_argument("--memory-gb", type=float, default=0.0, metavar="G", help=DEFAULT_BUDGET_HELP)
    sim.add_argument(
        "--n-sub",
        type=int,
        default=2,
        help="sub-batches of overlapped schedules at a fixed plan (tp=N); auto "
        "plans search 1, 2, 4 and this (default: %(default)s)",
    )
    sim.add_argument(
        "--max-tp",
        type=int,
        default=None,
        metavar="N",
        help="auto: largest TP degree (default: GPUs per server, more only if nothing fits)",
    )
    sim.add_argument(
        "--inter-gbps",
        type=float,
        default=None,
        metavar="GBPS",
        help="replace the nominal rate of the link between servers (Gb/s)",
    )
    sim.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "fp32", "tf32", "bf16", "fp16"),
        help="compute dtype: matmuls at the GPU's peak in it; activations, saved "
        "tensors, TP all-reduces and reshards in its bytes (tf32: fp32 bytes); "
        "master weights, gradients and AdamW stay fp32. auto: a run file's "
        "train.precision as training resolves it on GPUs (auto: bf16), as oases plan "
        "prices it; a model preset: the paper's fp32 (default: %(default)s)",
    )
    sim.add_argument(
        "--grad-reduce-dtype",
        default="auto",
        choices=("auto", "fp32", "bf16"),
        help="dtype of the DP gradient all-reduce and ZeRO's reduce-scatter, as "
        "parallel.grad_reduce_dtype (auto: a run file's, else fp32) (default: %(default)s)",
    )
    sim.add_argument(
        "--attention",
        default="materialized",
        choices=("materialized", "fused"),
        help="attention as the paper's prototype ran it (scores materialized) or "
        "a flash-style fused kernel (causal, no score traffic), as PyTorch's SDPA "
        "runs it on GPUs (default: %(default)s)",
    )
    sim.add_argument(
        "--uncertainty",
        action="store_true",
        help="each row's tokens/s and speedup range over the uncertain inputs "
        "(link efficiencies, the rate between servers, matmul efficiency, at their "
        "stated bounds), and which input moves it most; in the table and "
        "simulate.json",
    )
    sim.add_argument("--out", default="runs/simulate", help="output folder")


def _simulate(ns: argparse.Namespace, overrides: list[str]) -> int:
    from oases.planner.batch import simulate_batch
    from oases.planner.budget import memory_budget
    from oases.planner.models import load_model
    from oases.planner.report import format_report
    from oases.planner.sim_inputs import load_any_cluster, parse_entries, simulate_precision
    from oases.planner.whatif import simulate_cluster, write_report

    cfg = load_model(ns.model)
    dtype, grad_reduce, priced = simulate_precision(ns.model, ns.dtype, ns.grad_reduce_dtype)
    cluster = load_any_cluster(ns.cluster, ns.inter_gbps)
    batch = simulate_batch(ns.model, cluster, ns.global_batch, ns.micro_batch, ns.micro_batch_tp)
    budget = memory_budget(ns.memory_gb, cluster.memory_bytes, cluster.server.gpu.name)
    report = simulate_cluster(
        cfg,
        cluster,
        parse_entries(ns.schedules, ns.plan),
        batch,
        budget,
        n_sub=ns.n_sub,
        max_tp=ns.max_tp,
        dtype=dtype,
        grad_reduce=grad_reduce,
        attention=ns.attention,
        model_name=ns.model,
        uncertainty=ns.uncertainty,
    )
    report.precision_source = priced
    print(format_report(report))
    paths = write_report(report, Path(ns.out))
    print("wrote " + ", ".join(map(str, paths)))
    return 0


def _epilog() -> str:
    from oases.planner.whatif import help_text

    return help_text()


SIMULATE = SubCommand(
    name="simulate",
    help="predict schedules and plans of a model on a cluster preset or cluster file",
    description="Simulate each schedule on a cluster without the hardware: step time, "
    "tokens/s, peak memory per GPU, the speedup over the first schedule listed and what "
    "bounds each step (compute, TP communication, DP communication, reshards, optimizer); "
    "with auto, the plan (a TP degree per region, a ZeRO stage) the planner picks for that "
    "cluster. "
    "Writes simulate.json and a timeline PNG to --out.",
    add_arguments=_simulate_arguments,
    run=_simulate,
    epilog=_epilog,
)
