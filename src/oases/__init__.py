"""Oases: overlapped and automated tensor model parallelism for training transformers.

The public entry points::

    cfg = oases.ModelConfig(arch="gpt2", dim=256, n_heads=8)
    model = oases.build_model(cfg)              # single-device PyTorch model
    ctx = oases.init_distributed(tp=2)          # under torchrun
    model = oases.parallelize(model, ctx)       # Megatron-style TP, in place
    loss = oases.build_schedule("megatron").step(model, tokens, targets)
"""

from oases.config import Config, ModelConfig, load_config
from oases.hf import load_hf, save_hf
from oases.model import build_model, count_params
from oases.parallel.apply import parallelize
from oases.parallel.comm import record_collectives
from oases.parallel.context import ParallelContext, init_distributed
from oases.schedule import build_schedule, record_timeline

__all__ = [
    "Config",
    "ModelConfig",
    "ParallelContext",
    "build_model",
    "build_schedule",
    "count_params",
    "init_distributed",
    "load_config",
    "load_hf",
    "parallelize",
    "record_collectives",
    "record_timeline",
    "save_hf",
]
__version__ = "0.1.0"
