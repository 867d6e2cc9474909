"""What an ``oases`` subcommand is: its parser's texts and arguments, the function that runs it,
and how ``oases.cli.main`` treats its overrides and errors; the help format they all share.

    oases.cli._parser()   each SubCommand.add_parser: its texts, then add_arguments(parser)
                          for the subcommand on the line only (the others' arguments and
                          epilogs import their families: the planner, torch)
    oases.cli.main(argv)  split the overrides off, parse the rest, refuse overrides unless
                          takes_overrides, run(ns, overrides) -> exit code; a ValueError or
                          OSError (a RuntimeError too where launches_ranks) -> one error line
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parents[3] / "configs" / "default.toml"
BENCH_CONFIG = DEFAULT_CONFIG.with_name("bench.toml")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written; every option's default shown (unless its help
    already says what the default is)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" in text
            or not action.option_strings
            or action.default in (None, False, argparse.SUPPRESS)
        ):
            return text
        return text + " (default: %(default)s)"


@dataclass(frozen=True)
class SubCommand:
    """One ``oases NAME`` subcommand.

    ``run(ns, overrides)`` returns the exit code; ``overrides`` are the line's
    ``--section.key=value`` arguments, which ``main`` refuses unless ``takes_overrides``.
    ``launches_ranks``: its ranks run in child processes, and a RuntimeError ("... ranks failed;
    see output above") is the one line after the ranks' own output; for any other subcommand a
    RuntimeError is a bug and keeps its traceback. ``epilog`` is built when the parser is.
    """

    name: str
    help: str  # its line in ``oases --help``
    description: str  # the top of ``oases NAME --help``
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, list[str]], int]
    epilog: Callable[[], str] | None = None  # the bottom of ``oases NAME --help``
    takes_overrides: bool = False
    launches_ranks: bool = False

    def add_parser(
        self, commands: argparse._SubParsersAction, arguments: bool = True
    ) -> argparse.ArgumentParser:
        """Add this subcommand's parser to ``oases``'s subparsers: with its arguments and
        epilog, or (``arguments=False``: a subcommand not on the line) its name and help line
        alone, which imports nothing of its family."""
        parser = commands.add_parser(
            self.name,
            allow_abbrev=False,
            help=self.help,
            description=self.description,
            epilog=self.epilog() if self.epilog and arguments else None,
            formatter_class=HelpFormatter,
        )
        if arguments:
            self.add_arguments(parser)
        return parser
