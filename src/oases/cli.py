"""``oases`` command line: wiring only; the work lives in the modules it calls.

    oases train [CONFIG.toml] [--section.key=value ...] [--nproc-per-node N] [--max-restarts N]
    oases export --checkpoint DIR --out HF_DIR
    oases profile [CONFIG.toml] --out profile.json [--link ...] [--nproc-per-node N]
    oases plan [CONFIG.toml] --world-size N [--memory-gb M] (--profile FILE | --hardware PRESET)
               [--out plan.json]
    oases bench [CONFIG.toml] [--schedules LIST] [--link none|RATE|auto:PRESET] [--steps N]
                [--out DIR] [--nproc-per-node N] [--section.key=value ...]
    oases simulate --model PRESET|CONFIG --cluster PRESET|FILE [--schedules LIST]
                   [--plan auto|tp=N] [--global-batch B] [--micro-batch M] [--out DIR]

Without CONFIG the main job's ``configs/default.toml`` is used. Overrides are every argument of
the form ``--section.key=value`` or ``--section.key value``. User errors end with one
``error: ...`` line on stderr and exit code 2 (``main`` catches them for every subcommand),
before any rank starts where the world size is known. ``--help`` shows every default.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

from oases import cli_data
from oases.config import SECTIONS, Config, load_config
from oases.train.launch import EXIT_USER_ERROR  # one definition, where the ranks exit with it

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "default.toml"
BENCH_CONFIG = DEFAULT_CONFIG.with_name("bench.toml")


def _is_override(arg: str) -> bool:
    return arg.startswith("--") and "." in arg.partition("=")[0]


def split_overrides(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """(overrides as ``--section.key=value``, the other arguments). ``--section.key value``
    (a space, as argparse options take) is read as ``--section.key=value`` when the next
    argument is not an option itself."""
    overrides, rest, i = [], [], 0
    while i < len(args):
        arg = args[i]
        if _is_override(arg) and "=" not in arg and i + 1 < len(args) \
                and not args[i + 1].startswith("--"):
            overrides.append(f"{arg}={args[i + 1]}")
            i += 2
            continue
        (overrides if _is_override(arg) else rest).append(arg)
        i += 1
    return overrides, rest


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written; every option's default shown (unless its help
    already says what the default is)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or not action.option_strings
                or action.default in (None, False, argparse.SUPPRESS)):
            return text
        return text + " (default: %(default)s)"


def _config_keys_help() -> str:
    """The epilog of ``oases train --help``: every config key with its built-in default."""
    lines = ["config keys (--section.key=value or --section.key value; a CONFIG file's values",
             "replace these built-in defaults, overrides replace both):"]
    for name, cls in SECTIONS.items():
        keys = " ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls))
        lines += textwrap.wrap(f"[{name}] {keys}", 96, initial_indent="  ",
                               subsequent_indent="    ")
    lines += ["",
              "train.global_batch: sequences per optimizer step over the whole job.",
              "train.micro_batch: sequences per model replica (one TP group at parallel.tp =",
              "  one DP rank) per forward/backward; each DP rank accumulates global_batch /",
              "  (micro_batch * dp) of them per step, dp = world size / parallel.tp.",
              "data.vocab_size: a BPE's size; the model's vocabulary follows it (4096 when",
              "  neither is given); model.vocab_size larger only pads the embedding.",
              "checkpoint.resume: auto (newest checkpoint in the run, else a fresh start), never",
              "  (a new run: refused where checkpoints exist; use another train.run_dir) or PATH."]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oases", allow_abbrev=False,
                                     formatter_class=_HelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser(
        "train",
        allow_abbrev=False,
        help="train a model",
        description="Train a model. Overrides: --section.key=value (e.g. --train.steps=50).",
        epilog=_config_keys_help(),
        formatter_class=_HelpFormatter,
    )
    train.add_argument("config", nargs="?", help=f"TOML run file (default: {DEFAULT_CONFIG})")
    train.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="N",
        help="local ranks to start (default: a plan file's world size, else parallel.tp); "
        "ignored under torchrun",
    )
    train.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="restart all ranks up to N times after a failure; with checkpoint.resume=auto "
        "(the default) they continue from the newest checkpoint. Under torchrun use its "
        "own --max-restarts",
    )
    from oases.bench.link import LINK_PRESETS
    from oases.bench.suite import DEFAULT_SCHEDULES
    from oases.planner.budget import DEFAULT_BUDGET_HELP

    bench = commands.add_parser(
        "bench",
        allow_abbrev=False,
        formatter_class=_HelpFormatter,
        help="compare schedules side by side on an emulated interconnect",
        description="Run every schedule in one launch, interleaved, on a loopback shaped like a "
        "commodity interconnect (root + tc), and report medians, speedups and the limit.",
    )
    bench.add_argument("config", nargs="?", default=str(BENCH_CONFIG),
                       help=f"TOML run file (default: {BENCH_CONFIG})")
    bench.add_argument("--schedules", default=",".join(DEFAULT_SCHEDULES),
                       help="comma-separated schedules, each NAME[@OPTION=VALUE,...] with "
                       "options zero=0|1|2|3, precision=fp32|bf16, sp=gathered|shards (sequence "
                       "parallelism), dw=off (its weight gradients inline, for comparison); "
                       "e.g. oases,overlap@sp=gathered,dw=off (default: %(default)s)")
    bench.add_argument("--link", default=f"auto:{next(iter(LINK_PRESETS))}",
                       help="none, a tbf rate (200mbit, 25MB) or auto:PRESET with PRESET in "
                       f"{{{', '.join(LINK_PRESETS)}}} (default: %(default)s)")
    bench.add_argument("--steps", type=int, default=5, help="measured steps per schedule")
    bench.add_argument("--warmup", type=int, default=2, help="warm-up steps per schedule")
    bench.add_argument("--out", default="runs/bench", help="output folder")
    bench.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                       help="local ranks (default: parallel.tp)")
    bench.add_argument("--with-optimizer", action="store_true",
                       help="time whole training steps: also clipping and the AdamW step "
                       "(default: forward, backward and the gradient sync)")
    bench.add_argument("--memory", action="store_true",
                       help="instead of timing: each entry in a launch of its own, unshaped; "
                       "model state by kind, measured peak and the simulator's prediction "
                       "(memory.md)")
    bench.add_argument("--memory-profile", metavar="FILE", default=None,
                       help="with --memory: predict from this `oases profile` file (its measured "
                       "activations; default: the analytic sizes)")
    profile = commands.add_parser(
        "profile",
        allow_abbrev=False,
        formatter_class=_HelpFormatter,
        help="measure this model's regions and this machine's collectives for the planner",
        description="Measure forward, backward and recompute time of every region kind at "
        "every candidate TP degree and sub-batch size, collectives per group size (fitted to "
        "latency + bytes/bandwidth), saved activations and the optimizer; write a profile.",
    )
    profile.add_argument("config", nargs="?", default=str(BENCH_CONFIG),
                         help=f"TOML run file (default: {BENCH_CONFIG})")
    profile.add_argument("--out", default="profile.json", help="profile file to write")
    profile.add_argument("--link", default="none",
                         help="none, a tbf rate (200mbit) or auto:PRESET, as for bench")
    profile.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                         help="local ranks = the world size profiled (default: parallel.tp)")
    profile.add_argument("--repeats", type=int, default=3, help="timed repeats per point")
    plan = commands.add_parser(
        "plan",
        allow_abbrev=False,
        formatter_class=_HelpFormatter,
        help="choose every region's TP degree and the schedule under a memory budget",
        description="Simulate every uniform plan and schedule, solve for a degree per region "
        "under the budget, print the chosen plan beside the others (each with what bounds its "
        "step), write it and print the command that runs it.",
    )
    plan.add_argument("config", nargs="?", default=str(BENCH_CONFIG),
                      help=f"TOML run file (default: {BENCH_CONFIG})")
    plan.add_argument("--world-size", type=int, required=True, metavar="N",
                      help="ranks (GPUs) to plan for; the batch is the config's "
                      "train.global_batch, fed train.micro_batch sequences per model replica "
                      "(per DP rank) at parallel.tp, which every plan keeps across the world")
    plan.add_argument("--memory-gb", type=float, default=0.0, metavar="G",
                      help=DEFAULT_BUDGET_HELP)
    source = plan.add_mutually_exclusive_group(required=True)
    source.add_argument("--profile", metavar="FILE", help="a profile from `oases profile`")
    source.add_argument("--hardware", metavar="PRESET",
                        help="a hardware/cluster preset name or a cluster TOML/JSON file")
    plan.add_argument("--schedules", default=None,
                      help="comma-separated schedules to consider (default: all)")
    plan.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=None,
                      help="ZeRO stage of every plan (default: search 0-3, one per plan)")
    plan.add_argument("--max-tp", type=int, default=None, metavar="T",
                      help="search TP degrees up to T only (default: every candidate degree)")
    plan.add_argument("--sequence-parallel", default="auto",
                      choices=("auto", "off", "gathered", "shards"),
                      help="sequence parallelism: auto searches both recompute modes beside "
                      "plans without it (default); off: none; gathered/shards: only that mode "
                      "beside plans without it")
    plan.add_argument("--fixed-micro-batch", action="store_true",
                      help="keep train.micro_batch (default: also search 2^j times it, "
                      "|j| <= 3, under the same train.global_batch)")
    plan.add_argument("--out", default="plan.json", help="plan file to write")
    plan.add_argument("--verify", metavar="DIR", default=None,
                      help="then run every uniform candidate and the chosen plan on "
                      "--world-size local ranks and write prediction vs measurement to DIR")
    plan.add_argument("--link", default="none",
                      help="with --verify: none, a tbf rate (200mbit) or auto:PRESET")
    plan.add_argument("--steps", type=int, default=4, help="with --verify: timed steps")
    plan.add_argument("--warmup", type=int, default=2, help="with --verify: warm-up steps")
    plan.add_argument("--rounds", type=int, default=2,
                      help="with --verify: launches per candidate, interleaved")
    plan.add_argument("--candidates", choices=("all", "chosen"), default="all",
                      help="with --verify: every uniform candidate and the chosen plan, or "
                      "only the chosen plan")
    _simulate_parser(commands)
    cli_data.add_parser(commands)  # oases data prepare|inspect
    export = commands.add_parser(
        "export",
        allow_abbrev=False,
        formatter_class=_HelpFormatter,
        help="write a Hugging Face model directory from an Oases checkpoint",
        description="Convert an Oases checkpoint (any tp) into a directory transformers loads "
        "(config.json, model.safetensors).",
    )
    export.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="a checkpoint (.../step_000123), a folder of them or a run "
                        "directory (its newest checkpoint)")
    export.add_argument("--out", required=True, metavar="HF_DIR", help="output directory")
    export.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"),
                        help="the weights' dtype in model.safetensors (cast from the "
                        "checkpoint's master weights)")
    return parser


def _simulate_parser(commands: argparse._SubParsersAction) -> None:
    from oases.planner.budget import DEFAULT_BUDGET_HELP
    from oases.planner.whatif import help_text

    sim = commands.add_parser(
        "simulate",
        allow_abbrev=False,
        help="predict schedules and plans of a model on a cluster preset or cluster file",
        description="Simulate each schedule on a cluster without the hardware: step time, "
        "tokens/s, peak memory per GPU, the speedup over the first schedule listed and what "
        "bounds each step (compute, TP communication, DP communication, reshards, optimizer); "
        "with auto, the plan (a TP degree per region, a ZeRO stage) the planner picks for that "
        "cluster. "
        "Writes simulate.json and a timeline PNG to --out.",
        epilog=help_text(),
        formatter_class=_HelpFormatter,
    )
    sim.add_argument("--model", required=True, metavar="PRESET|CONFIG",
                     help="a model preset (paper-h1024-l24, ...) or a TOML run file (its "
                     "[model]; its train.global_batch, train.micro_batch and parallel.tp "
                     "where it sets them and no flag does)")
    sim.add_argument("--cluster", required=True, metavar="PRESET|FILE",
                     help="a cluster preset or a cluster TOML/JSON file (see below)")
    sim.add_argument("--schedules", default="megatron-recompute,merak,oases",
                     help="comma-separated schedules, each optionally @PLAN; the first is the "
                     "baseline of the speedups (default: %(default)s)")
    sim.add_argument("--plan", default="auto",
                     help="plan of schedules without @PLAN: auto, tp=N or tp=N+, each "
                     "optionally with ,zero=Z (ZeRO stage Z for every region; auto without it "
                     "searches stages 0-3) (default: auto)")
    sim.add_argument("--global-batch", type=int, default=None, metavar="B",
                     help="sequences per optimizer step (default: the run file's "
                     "train.global_batch, else one micro-batch: the largest of the rows)")
    sim.add_argument("--micro-batch", type=int, default=None, metavar="M",
                     help="sequences per model replica (per DP rank) per forward/backward, as "
                     "train.micro_batch and Megatron-LM count them: a plan at tp=t runs "
                     "M*GPUs/t across the cluster per micro-batch (default: the run file's "
                     "train.micro_batch, else one sequence per GPU)")
    sim.add_argument("--micro-batch-tp", type=int, default=None, metavar="T",
                     help="the TP degree at which --micro-batch counts (a divisor of the GPUs; "
                     "needs a micro-batch): auto plans mix degrees, so they keep the cluster "
                     "micro-batch of tp=T, M*GPUs/T (default: the run file's parallel.tp with "
                     "its micro_batch, else one server's GPUs)")
    sim.add_argument("--memory-gb", type=float, default=0.0, metavar="G",
                     help=DEFAULT_BUDGET_HELP)
    sim.add_argument("--n-sub", type=int, default=2,
                     help="sub-batches of overlapped schedules at a fixed plan (tp=N); auto "
                     "plans search 1, 2, 4 and this (default: %(default)s)")
    sim.add_argument("--max-tp", type=int, default=None, metavar="N",
                     help="auto: largest TP degree (default: GPUs per server, more only if "
                     "nothing fits)")
    sim.add_argument("--inter-gbps", type=float, default=None, metavar="GBPS",
                     help="replace the nominal rate of the link between servers (Gb/s)")
    sim.add_argument("--dtype", default="fp32", choices=("fp32", "tf32", "bf16", "fp16"),
                     help="compute dtype: matmuls at the GPU's peak in it; activations, saved "
                     "tensors, TP all-reduces and reshards in its bytes (tf32: fp32 bytes); "
                     "master weights, gradients and AdamW stay fp32 (default: %(default)s)")
    sim.add_argument("--grad-reduce-dtype", default="fp32", choices=("fp32", "bf16"),
                     help="dtype of the DP gradient all-reduce and ZeRO's reduce-scatter, as "
                     "parallel.grad_reduce_dtype (default: %(default)s)")
    sim.add_argument("--attention", default="materialized", choices=("materialized", "fused"),
                     help="attention as the paper's prototype ran it (scores materialized) or "
                     "a flash-style fused kernel (causal, no score traffic), as PyTorch's SDPA "
                     "runs it on GPUs (default: %(default)s)")
    sim.add_argument("--uncertainty", action="store_true",
                     help="each row's tokens/s and speedup range over the uncertain inputs "
                     "(link efficiencies, the rate between servers, matmul efficiency, at their "
                     "stated bounds), and which input moves it most; in the table and "
                     "simulate.json")
    sim.add_argument("--out", default="runs/simulate", help="output folder")


def _simulate(ns: argparse.Namespace, overrides: list[str]) -> int:
    from oases.planner.batch import simulate_batch
    from oases.planner.budget import memory_budget
    from oases.planner.models import load_model
    from oases.planner.report import format_report
    from oases.planner.whatif import (
        load_any_cluster,
        parse_entries,
        simulate_cluster,
        write_report,
    )

    cfg = load_model(ns.model)
    cluster = load_any_cluster(ns.cluster, ns.inter_gbps)
    batch = simulate_batch(ns.model, cluster, ns.global_batch, ns.micro_batch,
                           ns.micro_batch_tp)
    budget = memory_budget(ns.memory_gb, cluster.memory_bytes, cluster.server.gpu.name)
    report = simulate_cluster(cfg, cluster, parse_entries(ns.schedules, ns.plan), batch,
                              budget, n_sub=ns.n_sub, max_tp=ns.max_tp, dtype=ns.dtype,
                              grad_reduce=ns.grad_reduce_dtype, attention=ns.attention,
                              model_name=ns.model,
                              uncertainty=ns.uncertainty)
    print(format_report(report))
    paths = write_report(report, Path(ns.out))
    print("wrote " + ", ".join(map(str, paths)))
    return 0


def _export(ns: argparse.Namespace, overrides: list[str]) -> int:
    from oases.hf import export_checkpoint

    out = export_checkpoint(ns.checkpoint, ns.out, ns.dtype)
    print(f"wrote {out}")
    return 0


def _bench(ns: argparse.Namespace, overrides: list[str]) -> int:
    from oases.bench import split_entries
    from oases.bench.suite import run_bench

    if ns.steps < 1 or ns.warmup < 0:
        raise ValueError(f"--steps={ns.steps} must be >= 1 and --warmup={ns.warmup} >= 0")
    nproc = ns.nproc_per_node or load_config(ns.config, overrides).parallel.tp
    if ns.memory:
        from oases.bench.suite import run_memory

        run_memory(ns.config, overrides, split_entries(ns.schedules), ns.steps,
                   Path(ns.out), nproc=nproc, warmup=max(1, ns.warmup),
                   profile=ns.memory_profile)
        return 0
    run_bench(ns.config, overrides, split_entries(ns.schedules), ns.link,
              ns.steps, Path(ns.out), nproc=nproc, warmup=ns.warmup,
              with_optimizer=ns.with_optimizer)
    return 0


def _profile(ns: argparse.Namespace, overrides: list[str]) -> int:
    import tempfile

    from oases.bench.suite import launch_ranks, resolve_link

    cfg = load_config(ns.config, overrides)
    nproc = ns.nproc_per_node or cfg.parallel.tp
    if nproc < 1 or ns.repeats < 1:
        raise ValueError(f"--nproc-per-node={nproc} and --repeats={ns.repeats} must be >= 1")
    cfg.validate(nproc)
    out = Path(ns.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    rate, label, _ = resolve_link(ns.link, ns.config, overrides, nproc, cfg.parallel.tp)
    with tempfile.TemporaryDirectory() as tmp:
        launch_ranks("oases.bench.profile_runner",
                     {"config": ns.config, "overrides": overrides, "out": str(out),
                      "repeats": ns.repeats, "link_label": label}, nproc, rate, Path(tmp))
    print(f"wrote {out}")
    return 0


def _plan(ns: argparse.Namespace, overrides: list[str]) -> int:
    from oases.planner import costs_budget, format_candidates, load_costs, plan_model
    from oases.planner.report import plan_header, run_command

    cfg = load_config(ns.config, overrides)
    if ns.world_size < 1:
        raise ValueError(f"--world-size={ns.world_size} must be >= 1")
    costs = load_costs(ns.profile or f"hw:{ns.hardware}", cfg.model, cfg.train.precision,
                       cfg.parallel.grad_reduce_dtype)
    budget = costs_budget(ns.memory_gb, costs)
    schedules = tuple(s for s in ns.schedules.split(",") if s) if ns.schedules else None
    zeros = (0, 1, 2, 3) if ns.zero is None else (ns.zero,)
    sps = {"auto": ("gathered", "shards"), "off": ()}.get(ns.sequence_parallel,
                                                           (ns.sequence_parallel,))
    best, candidates = plan_model(cfg, ns.world_size, costs, budget.bytes, schedules,
                                  zeros=zeros, search_micro_batch=not ns.fixed_micro_batch,
                                  max_tp=ns.max_tp, sps=sps)
    best.plan.save(ns.out)
    text = "\n".join([
        plan_header(ns.config, cfg, costs, ns.profile, ns.world_size, budget,
                    searched_micro_batch=not ns.fixed_micro_batch), "",
        format_candidates(best, candidates, budget.bytes,
                          tokens_per_step=cfg.train.global_batch * cfg.model.seq_len)])
    print(text)
    print(f"wrote {ns.out}")
    cluster = getattr(costs, "cluster", None)
    print(run_command(ns.config, overrides, ns.out, ns.world_size,
                      None if cluster is None else cluster.server.gpus_per_server))
    if ns.verify:
        return _verify(ns, overrides, cfg, best, candidates, budget.bytes, text, costs)
    return 0


def _verify(ns: argparse.Namespace, overrides: list[str], cfg: Config, best, candidates,  # noqa: ANN001
            budget: float, text: str, costs: object) -> int:
    from oases.bench.suite import resolve_link
    from oases.planner.profile import Profile
    from oases.planner.verify import (
        format_rows,
        format_summary,
        measure_candidates,
        predict_from_retimed,
        summarize,
        write_report,
    )

    if ns.steps < 1 or ns.warmup < 0 or ns.rounds < 1:
        raise ValueError(f"--steps={ns.steps} and --rounds={ns.rounds} must be >= 1 and "
                         f"--warmup={ns.warmup} >= 0")
    out = Path(ns.verify)
    out.mkdir(parents=True, exist_ok=True)
    rate, label, _ = resolve_link(ns.link, ns.config, overrides, ns.world_size, cfg.parallel.tp)
    chosen = [best]
    if ns.candidates == "all":
        chosen += [c for c in candidates if c is not best and (c.kind == "uniform" or (
            c.fits and not c.plan.is_uniform()))]  # and every mixed plan the search found
    profiled = isinstance(costs, Profile)  # re-time the pieces as the profile timed them
    rows = measure_candidates(ns.config, overrides, chosen, ns.world_size, rate, ns.steps,
                              ns.warmup, out, ns.rounds, retime=profiled)
    if profiled:
        predict_from_retimed(rows, chosen, costs, cfg.model, ns.world_size,
                             cfg.schedule.max_inflight)
    summary = summarize(rows, best.label(), budget) | {"link": label}
    write_report(rows, summary, out, text)
    print(format_rows(rows, summary["chosen"]))
    print(format_summary(summary))
    print(f"wrote {out / 'report.md'}")
    return 0


def _default_world_size(cfg: Config) -> int:
    """Local ranks when --nproc-per-node is not given: a plan file's world, else parallel.tp."""
    if cfg.parallel.plan and cfg.parallel.plan != "auto":
        from oases.plan import ParallelPlan

        first = ParallelPlan.load(cfg.parallel.plan).regions[0]
        return first.tp * first.dp
    return cfg.parallel.tp


def _train(ns: argparse.Namespace, overrides: list[str]) -> int:
    from oases.train.data import check_source
    from oases.train.launch import launch, under_torchrun
    from oases.train.setup import check_config

    nproc, max_restarts = ns.nproc_per_node, ns.max_restarts
    if ns.config is None and not DEFAULT_CONFIG.is_file():
        raise ValueError(f"no CONFIG given and the default {DEFAULT_CONFIG} is missing")
    cfg: Config = load_config(ns.config or DEFAULT_CONFIG, overrides)
    if nproc is not None and nproc < 1:
        raise ValueError(f"--nproc-per-node={nproc} must be >= 1")
    if max_restarts < 0:
        raise ValueError(f"--max-restarts={max_restarts} must be >= 0")
    if not under_torchrun():  # under torchrun each rank checks against the real world size
        nproc = nproc or _default_world_size(cfg)
        check_config(cfg, nproc)
    check_source(cfg.data.source)
    return launch(cfg, nproc or 1, max_restarts)


Command = Callable[[argparse.Namespace, list[str]], int]
COMMANDS: dict[str, Command] = {"train": _train, "bench": _bench, "profile": _profile,
                                "plan": _plan, "simulate": _simulate, "export": _export,
                                "data": lambda ns, _: cli_data.run(ns)}
TAKES_OVERRIDES = {"train", "bench", "profile", "plan"}
# Their ranks run in child processes; RuntimeError("... ranks failed; see output above") is
# the one line after the ranks' own output. Anywhere else a RuntimeError is a bug: traceback.
LAUNCHES_RANKS = {"bench", "profile", "plan"}


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``oases`` subcommand; a user error is one ``error: ...`` line and exit code 2."""
    overrides, rest = split_overrides(list(sys.argv[1:] if argv is None else argv))
    ns = _parser().parse_args(rest)
    try:
        if overrides and ns.command not in TAKES_OVERRIDES:
            raise ValueError(f"oases {ns.command} takes no --section.key=value overrides "
                             f"(got {' '.join(overrides)})")
        return COMMANDS[ns.command](ns, overrides)
    except (ValueError, OSError) as exc:
        return _user_error(exc)
    except RuntimeError as exc:
        if ns.command not in LAUNCHES_RANKS:
            raise
        return _user_error(exc)


def _user_error(exc: BaseException) -> int:
    print(f"error: {exc}", file=sys.stderr)
    return EXIT_USER_ERROR
