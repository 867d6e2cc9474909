"""Oases: overlapped and automated tensor model parallelism for training transformers.

The public entry points::

    cfg = oases.ModelConfig(arch="gpt2", dim=256, n_heads=8)
    model = oases.build_model(cfg)              # single-device PyTorch model
    ctx = oases.init_distributed(tp=2)          # under torchrun
    model = oases.parallelize(model, ctx)       # Megatron-style TP, in place
    loss = oases.build_schedule("megatron").step(model, tokens, targets)

``import oases`` is light: each name (and each subpackage, ``oases.train`` say) is imported on
first use, so a process that needs only ``oases.data``'s tokenizing workers never loads torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Config": "oases.config",
    "ModelConfig": "oases.config",
    "load_config": "oases.config",
    "load_hf": "oases.hf",
    "save_hf": "oases.hf",
    "build_model": "oases.model",
    "count_params": "oases.model",
    "parallelize": "oases.parallel.apply",
    "record_collectives": "oases.parallel.comm",
    "ParallelContext": "oases.parallel.context",
    "init_distributed": "oases.parallel.context",
    "build_schedule": "oases.schedule",
    "record_timeline": "oases.schedule",
}


def __getattr__(name: str) -> Any:
    """A public name from its module, or a subpackage (``oases.bench``), imported now."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        try:
            value = importlib.import_module(f"oases.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"oases.{name}":
                raise
            raise AttributeError(f"module 'oases' has no attribute {name!r}") from None
    globals()[name] = value
    return value


__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"
