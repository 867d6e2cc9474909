"""``oases train`` (start the ranks of a run, or be one under torchrun) and ``oases export``
(a checkpoint as a Hugging Face directory)."""

from __future__ import annotations

import argparse

from oases.cli.command import DEFAULT_CONFIG, SubCommand
from oases.cli.overrides import config_keys_help
from oases.config import Config, load_config


def _train_arguments(train: argparse.ArgumentParser) -> None:
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


def _default_world_size(cfg: Config) -> int:
    """Local ranks when --nproc-per-node is not given: a plan file's world, else parallel.tp."""
    if cfg.parallel.plan and cfg.parallel.plan != "auto":
        from oases.plan import ParallelPlan

        first = ParallelPlan.load(cfg.parallel.plan).regions[0]
        return first.tp * first.dp
    return cfg.parallel.tp


def _train(ns: argparse.Namespace, overrides: list[str]) -> int:
    from oases.train.launch import launch, under_torchrun  # no torch: the ranks import it

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
    return launch(cfg, nproc or 1, max_restarts)  # checks the config and data.source first


def _export_arguments(export: argparse.ArgumentParser) -> None:
    export.add_argument(
        "--checkpoint",
        required=True,
        metavar="DIR",
        help="a checkpoint (.../step_000123), a folder of them or a run "
        "directory (its newest checkpoint)",
    )
    export.add_argument("--out", required=True, metavar="HF_DIR", help="output directory")
    export.add_argument(
        "--dtype",
        default="fp32",
        choices=("fp32", "bf16", "fp16"),
        help="the weights' dtype in model.safetensors (cast from the checkpoint's master weights)",
    )
    export.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the model HF_DIR already holds (without it, such a folder is refused)",
    )


def _export(ns: argparse.Namespace, overrides: list[str]) -> int:
    from oases.hf import export_checkpoint

    out = export_checkpoint(ns.checkpoint, ns.out, ns.dtype, overwrite=ns.overwrite)
    print(f"wrote {out}")
    return 0


TRAIN = SubCommand(
    name="train",
    help="train a model",
    description="Train a model. Overrides: --section.key=value (e.g. --train.steps=50).",
    add_arguments=_train_arguments,
    run=_train,
    epilog=config_keys_help,
    takes_overrides=True,
)
EXPORT = SubCommand(
    name="export",
    help="write a Hugging Face model directory from an Oases checkpoint",
    description="Convert an Oases checkpoint (any tp) into a directory transformers loads "
    "(config.json, model.safetensors).",
    add_arguments=_export_arguments,
    run=_export,
)
