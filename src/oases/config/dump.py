"""Writing a run configuration: as plain ``{section: {key: value}}``, as TOML text that
:func:`oases.config.load_config` reads back to an equal ``Config``, or to a file."""

import dataclasses
import os
from pathlib import Path
from typing import Any

from oases.config.sections import Config


def config_to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """The config as ``{section: {key: value}}`` (plain Python scalars)."""
    return dataclasses.asdict(cfg)


# TOML basic strings must escape '"', '\\' and control characters other than tab.
_TOML_ESCAPES = {c: f"\\u{c:04x}" for c in [*range(0x20), 0x7F] if c != 0x09}
_TOML_ESCAPES |= {ord('"'): '\\"', ord("\\"): "\\\\"}


def _toml_scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # shortest round-tripping form; 'inf'/'nan' are valid TOML too
    if isinstance(value, str):
        return '"' + value.translate(_TOML_ESCAPES) + '"'
    raise TypeError(f"cannot write {type(value).__name__} value {value!r} as TOML")


def dump_toml(cfg: Config) -> str:
    """Render the config as TOML that :func:`load_config` reads back to an equal Config."""
    lines: list[str] = []
    for section, table in config_to_dict(cfg).items():
        lines.append(f"[{section}]")
        lines.extend(f"{k} = {_toml_scalar(v)}" for k, v in table.items() if v is not None)
        lines.append("")
    return "\n".join(lines)


def save_config(cfg: Config, path: str | os.PathLike[str], header: str = "") -> None:
    """Write ``dump_toml(cfg)`` to ``path`` (after ``header``, TOML comments: a run writes
    what it did there, ``train.effective``), creating parent directories."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(header + dump_toml(cfg), encoding="utf-8")
