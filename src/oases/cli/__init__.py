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
    oases data prepare SOURCE [SOURCE ...] --out DIR [--tokenizer byte|bpe|hf:PATH] [...]
    oases data inspect DIR [--samples N] [--verify]

Without CONFIG the main job's ``configs/default.toml`` is used. Overrides are every argument of
the form ``--section.key=value`` or ``--section.key value``. User errors end with one
``error: ...`` line on stderr and exit code 2 (``main`` catches them for every subcommand;
``oases train`` with local ranks has its first rank make the config and data checks, before
any rank trains: ``train.launch``). ``--help`` shows every default. Only the subcommand on the
line gets its arguments built, and nothing here imports torch: ``oases train`` starts its ranks
first, each imports torch once.

Each subcommand is one :class:`~oases.cli.command.SubCommand` (its texts, arguments, the
function that runs it) in the module of its family:

    command.py     SubCommand, the help format, the default run files
    overrides.py   --section.key=value: splitting them off, the key list of ``train --help``
    train.py       train, export
    bench.py       bench, profile
    plan.py        plan (and --verify)
    simulate.py    simulate
    data.py        data prepare, data inspect

A new subcommand is its module (or a SubCommand in its family's) plus its entry in
``SUBCOMMANDS`` below.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from oases.cli.bench import BENCH, PROFILE
from oases.cli.command import HelpFormatter, SubCommand
from oases.cli.data import DATA
from oases.cli.overrides import split_overrides
from oases.cli.plan import PLAN
from oases.cli.simulate import SIMULATE
from oases.cli.train import EXPORT, TRAIN
from oases.train.launch import EXIT_USER_ERROR  # one definition, where the ranks exit with it

__all__ = ["COMMANDS", "EXIT_USER_ERROR", "SUBCOMMANDS", "main", "split_overrides"]

# In the order ``oases --help`` lists them.
SUBCOMMANDS: tuple[SubCommand, ...] = (TRAIN, BENCH, PROFILE, PLAN, SIMULATE, EXPORT, DATA)
COMMANDS: dict[str, SubCommand] = {command.name: command for command in SUBCOMMANDS}


def _parser(chosen: str | None = None) -> argparse.ArgumentParser:
    """``oases``'s parser; only subcommand ``chosen`` (every one when None) gets its arguments,
    so ``oases train ...`` parses without importing the planner or torch."""
    parser = argparse.ArgumentParser(
        prog="oases", allow_abbrev=False, formatter_class=HelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for command in SUBCOMMANDS:
        command.add_parser(commands, arguments=chosen in (None, command.name))
    return parser


def _chosen(args: Sequence[str]) -> str:
    """The subcommand on the line: its first argument that is not an option (``oases`` itself
    has no option but --help)."""
    return next((arg for arg in args if not arg.startswith("-")), "")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``oases`` subcommand; a user error is one ``error: ...`` line and exit code 2."""
    overrides, rest = split_overrides(list(sys.argv[1:] if argv is None else argv))
    ns = _parser(_chosen(rest)).parse_args(rest)
    command = COMMANDS[ns.command]
    try:
        if overrides and not command.takes_overrides:
            raise ValueError(
                f"oases {ns.command} takes no --section.key=value overrides "
                f"(got {' '.join(overrides)})"
            )
        return command.run(ns, overrides)
    except (ValueError, OSError) as exc:
        return _user_error(exc)
    except RuntimeError as exc:
        if not command.launches_ranks:
            raise
        return _user_error(exc)


def _user_error(exc: BaseException) -> int:
    print(f"error: {exc}", file=sys.stderr)
    return EXIT_USER_ERROR
