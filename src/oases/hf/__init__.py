"""Bring your own model: load and save Hugging Face GPT-2 and LLaMA-family checkpoints.

    cfg, model = load_hf("path/to/hf_dir")            # single device
    cfg, model = load_hf("path/to/hf_dir", ctx)       # parallelized; each rank reads its slices
    save_hf(model, "out_dir")                         # any tp; rank 0 writes
    export_checkpoint("runs/x/checkpoints/step_000100", "out_dir")

``safetensors`` (and, for the tests, ``transformers``) are optional: install ``oases[hf]``.
"""

from oases.hf.convert import config_from_hf, config_to_hf, hf_pieces
from oases.hf.load import hf_model_config, load_hf, read_hf_config
from oases.hf.save import export_checkpoint, gather_full_tensor, save_hf

__all__ = [
    "config_from_hf",
    "config_to_hf",
    "export_checkpoint",
    "gather_full_tensor",
    "hf_model_config",
    "hf_pieces",
    "load_hf",
    "read_hf_config",
    "save_hf",
]
