"""Run configuration: typed dataclasses, TOML loading, CLI overrides and cross-field checks.

Precedence is CLI overrides > TOML file > dataclass defaults. Overrides are written
``--section.key=value`` (the leading ``--`` is optional). Unknown sections or keys, values of the
wrong type and malformed overrides raise :class:`ConfigError` (a ``ValueError``) with a one-line
message that names the key and lists the valid names. Checks that involve the world size or
several sections live in :meth:`Config.validate`, which every rank runs before any collective.

Where each part lives (import every name from ``oases.config``):

    checks.py     the one-line value checks every section runs
    model.py      ModelConfig: the [model] section, parameter counts, FLOPs per token;
                  format_params (a count as people read it)
    sections.py   the other sections, Config (+ validate), SECTIONS, DEFAULT_BPE_VOCAB
    load.py       TOML file + overrides -> Config: ConfigError, resolve_vocab, load_config
    dump.py       Config -> dict, TOML text, file: config_to_dict, dump_toml, save_config
"""

from oases.config.dump import config_to_dict, dump_toml, save_config
from oases.config.load import ConfigError, load_config, resolve_vocab
from oases.config.model import ModelConfig, format_params
from oases.config.sections import (
    DEFAULT_BPE_VOCAB,
    SECTIONS,
    CheckpointConfig,
    Config,
    DataConfig,
    ParallelConfig,
    ScheduleConfig,
    TrainConfig,
)

__all__ = [
    "DEFAULT_BPE_VOCAB",
    "SECTIONS",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "ModelConfig",
    "ParallelConfig",
    "ScheduleConfig",
    "TrainConfig",
    "config_to_dict",
    "dump_toml",
    "format_params",
    "load_config",
    "resolve_vocab",
    "save_config",
]
