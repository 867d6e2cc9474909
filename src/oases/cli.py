"""``oases`` command line: wiring only; the work lives in the modules it calls.

    oases train [CONFIG.toml] [--section.key=value ...] [--nproc-per-node N] [--max-restarts N]
    oases export --checkpoint DIR --out HF_DIR
    oases bench [CONFIG.toml] [--schedules LIST] [--link none|RATE|auto:PRESET] [--steps N]
                [--out DIR] [--nproc-per-node N] [--section.key=value ...]

Without CONFIG the main job's ``configs/default.toml`` is used. Overrides are every argument of
the form ``--section.key=value``. User errors end with one ``error: ...`` line on stderr and a
non-zero exit code, before any rank starts where the world size is known.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from oases.config import Config, load_config

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "default.toml"
BENCH_CONFIG = DEFAULT_CONFIG.with_name("bench.toml")
EXIT_USER_ERROR = 2


def _is_override(arg: str) -> bool:
    return arg.startswith("--") and "." in arg.partition("=")[0]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oases", allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser(
        "train",
        allow_abbrev=False,
        help="train a model",
        description="Train a model. Overrides: --section.key=value (e.g. --train.steps=50).",
    )
    train.add_argument("config", nargs="?", help=f"TOML run file (default: {DEFAULT_CONFIG})")
    train.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="N",
        help="local ranks to start (default: parallel.tp); ignored under torchrun",
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

    bench = commands.add_parser(
        "bench",
        allow_abbrev=False,
        help="compare schedules side by side on an emulated interconnect",
        description="Run every schedule in one launch, interleaved, on a loopback shaped like a "
        "commodity interconnect (root + tc), and report medians, speedups and the limit.",
    )
    bench.add_argument("config", nargs="?", default=str(BENCH_CONFIG),
                       help=f"TOML run file (default: {BENCH_CONFIG})")
    bench.add_argument("--schedules", default=",".join(DEFAULT_SCHEDULES),
                       help="comma-separated schedules (default: %(default)s)")
    bench.add_argument("--link", default=f"auto:{next(iter(LINK_PRESETS))}",
                       help="none, a tbf rate (200mbit, 25MB) or auto:PRESET with PRESET in "
                       f"{{{', '.join(LINK_PRESETS)}}} (default: %(default)s)")
    bench.add_argument("--steps", type=int, default=5, help="measured steps per schedule")
    bench.add_argument("--warmup", type=int, default=2, help="warm-up steps per schedule")
    bench.add_argument("--out", default="runs/bench", help="output folder")
    bench.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                       help="local ranks (default: parallel.tp)")
    export = commands.add_parser(
        "export",
        allow_abbrev=False,
        help="write a Hugging Face model directory from an Oases checkpoint",
        description="Convert an Oases checkpoint (any tp) into a directory transformers loads "
        "(config.json, model.safetensors).",
    )
    export.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="a checkpoint (.../step_000123) or a folder of them (the newest)")
    export.add_argument("--out", required=True, metavar="HF_DIR", help="output directory")
    return parser


def _export(ns: argparse.Namespace) -> int:
    from oases.hf import export_checkpoint

    try:
        out = export_checkpoint(ns.checkpoint, ns.out)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"wrote {out}")
    return 0


def _bench(ns: argparse.Namespace, overrides: list[str]) -> int:
    from oases.bench.suite import run_bench

    try:
        if ns.steps < 1 or ns.warmup < 0:
            raise ValueError(f"--steps={ns.steps} must be >= 1 and --warmup={ns.warmup} >= 0")
        nproc = ns.nproc_per_node or load_config(ns.config, overrides).parallel.tp
        run_bench(ns.config, overrides, [s for s in ns.schedules.split(",") if s], ns.link,
                  ns.steps, Path(ns.out), nproc=nproc, warmup=ns.warmup)
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


def _train(
    config: str | None, overrides: list[str], nproc: int | None, max_restarts: int = 0
) -> int:
    from oases.train.data import check_source
    from oases.train.launch import launch, under_torchrun
    from oases.train.loop import check_config

    try:
        if config is None and not DEFAULT_CONFIG.is_file():
            raise ValueError(f"no CONFIG given and the default {DEFAULT_CONFIG} is missing")
        cfg: Config = load_config(config or DEFAULT_CONFIG, overrides)
        if nproc is not None and nproc < 1:
            raise ValueError(f"--nproc-per-node={nproc} must be >= 1")
        if max_restarts < 0:
            raise ValueError(f"--max-restarts={max_restarts} must be >= 0")
        if not under_torchrun():  # under torchrun each rank checks against the real world size
            nproc = nproc or cfg.parallel.tp
            check_config(cfg, nproc)
        check_source(cfg.data.source)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    return launch(cfg, nproc or 1, max_restarts)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    overrides = [a for a in args if _is_override(a)]
    ns = _parser().parse_args([a for a in args if not _is_override(a)])
    if ns.command == "train":
        return _train(ns.config, overrides, ns.nproc_per_node, ns.max_restarts)
    if ns.command == "bench":
        return _bench(ns, overrides)
    if ns.command == "export":
        return _export(ns)
    return EXIT_USER_ERROR  # pragma: no cover - argparse requires a command
