"""``--section.key=value`` on the ``oases`` command line: telling the overrides from the other
arguments, and the list of every config key that ``oases train --help`` ends with."""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Sequence

from oases.config import SECTIONS


def _is_override(arg: str) -> bool:
    return arg.startswith("--") and "." in arg.partition("=")[0]


def split_overrides(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """(overrides as ``--section.key=value``, the other arguments). ``--section.key value``
    (a space, as argparse options take) is read as ``--section.key=value`` when the next
    argument is not an option itself."""
    overrides, rest, i = [], [], 0
    while i < len(args):
        arg = args[i]
        if (
            _is_override(arg)
            and "=" not in arg
            and i + 1 < len(args)
            and not args[i + 1].startswith("--")
        ):
            overrides.append(f"{arg}={args[i + 1]}")
            i += 2
            continue
        (overrides if _is_override(arg) else rest).append(arg)
        i += 1
    return overrides, rest


def config_keys_help() -> str:
    """The epilog of ``oases train --help``: every config key with its built-in default."""
    lines = [
        "config keys (--section.key=value or --section.key value; a CONFIG file's values",
        "replace these built-in defaults, overrides replace both):",
    ]
    for name, cls in SECTIONS.items():
        keys = " ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls))
        lines += textwrap.wrap(
            f"[{name}] {keys}", 96, initial_indent="  ", subsequent_indent="    "
        )
    lines += [
        "",
        "train.global_batch: sequences per optimizer step over the whole job.",
        "train.micro_batch: sequences per model replica (one TP group at parallel.tp =",
        "  one DP rank) per forward/backward; each DP rank accumulates global_batch /",
        "  (micro_batch * dp) of them per step, dp = world size / parallel.tp.",
        "data.vocab_size: a BPE's size; the model's vocabulary follows it (4096 when",
        "  neither is given); model.vocab_size larger only pads the embedding.",
        "checkpoint.resume: auto (newest checkpoint in the run, else a fresh start), never",
        "  (a new run: refused where checkpoints exist; use another train.run_dir) or PATH.",
    ]
    return "\n".join(lines)
