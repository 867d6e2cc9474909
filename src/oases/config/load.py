"""Loading a run configuration: TOML file, then ``--section.key=value`` overrides, then
``Config``.

    load_config(path, overrides)
      _read_toml(path)          every [section] and key known, every value of its field's type
      _apply_override(...)      each override parsed by its field's type; later ones win
      resolve_vocab(values)     one vocabulary size for a BPE and the model
      Config(**sections)        each section's own checks; a ValueError becomes ConfigError

Unknown sections or keys, values of the wrong type and malformed overrides raise
:class:`ConfigError` with a one-line message that names the key and lists the valid names.
"""

import os
import tomllib
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from oases.config.sections import DEFAULT_BPE_VOCAB, SECTIONS, Config


class ConfigError(ValueError):
    """A configuration file, override or value is invalid."""


def _field_types(section: str) -> dict[str, Any]:
    """Declared field types of a section; ConfigError listing the valid sections if unknown."""
    if section not in SECTIONS:
        raise ConfigError(f"unknown section '{section}'; valid sections: {', '.join(SECTIONS)}")
    return typing.get_type_hints(SECTIONS[section])


def _type_name(tp: Any) -> str:
    return "int or none" if tp == int | None else tp.__name__


def _check_toml_value(key: str, tp: Any, value: Any) -> Any:
    """Type-check a value read from TOML; ints are accepted (and converted) for float fields."""
    ok = {
        bool: isinstance(value, bool),
        str: isinstance(value, str),
        float: isinstance(value, int | float) and not isinstance(value, bool),
    }.get(tp, isinstance(value, int) and not isinstance(value, bool))
    if not ok:
        got = f"{value!r} ({type(value).__name__})"
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {got}")
    return float(value) if tp is float else value


def _parse_override_value(key: str, tp: Any, text: str) -> Any:
    """Parse a CLI override string according to the field's type."""
    low = text.strip().lower()
    if tp is str:
        return text
    if tp is bool and low in ("true", "false"):
        return low == "true"
    if tp == int | None and low in ("none", "null"):
        return None
    try:
        if tp is float:
            return float(text)
        if tp is not bool:
            return int(text)
    except ValueError:
        pass
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {text!r}")


def _field_type(section: str, key: str) -> Any:
    """The declared type of ``section.key``; ConfigError listing the valid keys if unknown."""
    types = _field_types(section)
    if key not in types:
        valid = ", ".join(types)
        raise ConfigError(f"unknown key '{section}.{key}'; valid keys in [{section}]: {valid}")
    return types[key]


def _read_toml(path: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    p = Path(path)
    try:
        with p.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {p}") from None
    except OSError as exc:  # a directory, no permission, ...
        raise ConfigError(f"cannot read config file {p}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"invalid TOML in {p}: {exc}") from None
    values: dict[str, dict[str, Any]] = {}
    for section, table in data.items():
        _field_types(section)
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}] must be a table, got {table!r}")
        for key, value in table.items():
            tp = _field_type(section, key)
            values.setdefault(section, {})[key] = _check_toml_value(f"{section}.{key}", tp, value)
    return values


def _apply_override(values: dict[str, dict[str, Any]], override: str) -> None:
    name, eq, text = override.removeprefix("--").partition("=")
    parts = name.strip().split(".")
    if not eq or len(parts) != 2 or not all(parts):
        raise ConfigError(f"malformed override {override!r}; expected --section.key=value")
    section, key = parts
    tp = _field_type(section, key)
    values.setdefault(section, {})[key] = _parse_override_value(f"{section}.{key}", tp, text)


def resolve_vocab(values: dict[str, dict[str, Any]]) -> None:
    """One vocabulary size for a BPE and the model, from what the user gave (in place): the
    size given for either one is the other's; with neither, ``DEFAULT_BPE_VOCAB``. A larger
    ``model.vocab_size`` than ``data.vocab_size`` pads the embedding."""
    data, model = values.get("data", {}), values.get("model", {})
    if data.get("tokenizer") != "bpe":
        return
    if not data.get("vocab_size"):
        data["vocab_size"] = model.get("vocab_size", DEFAULT_BPE_VOCAB)
    model.setdefault("vocab_size", data["vocab_size"])
    values["data"], values["model"] = data, model


def load_config(
    path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()
) -> Config:
    """Build a Config from defaults, an optional TOML file and ``--section.key=value`` overrides."""
    if isinstance(overrides, str):
        overrides = [overrides]
    values = _read_toml(path) if path is not None else {}
    for override in overrides:
        _apply_override(values, override)
    resolve_vocab(values)
    try:
        return Config(**{name: cls(**values.get(name, {})) for name, cls in SECTIONS.items()})
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
