"""Training precision: the one place that maps ``train.precision`` to dtypes and autocast.

    name    parameters, gradients, AdamW state,     forward/backward compute
            collectives, checkpoints
    auto    fp32                                    bf16 autocast on CUDA, fp32 on CPU
    fp32    fp32                                    fp32
    fp64    float64                                 float64 (exactness checks, debugging numerics)

A new precision is one row of ``PRECISIONS``. The model code itself is dtype-generic: where it
upcasts for accuracy (norms, rotary, the loss, the gradient norm) it goes to ``accum_dtype``, at
least fp32, so bf16/fp32 runs compute exactly as before and a float64 model stays float64.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

# name -> (parameter dtype, autocast dtype on CUDA or None, autocast dtype on CPU or None)
PRECISIONS: dict[str, tuple[torch.dtype, torch.dtype | None, torch.dtype | None]] = {
    "auto": (torch.float32, torch.bfloat16, None),
    "fp32": (torch.float32, None, None),
    "fp64": (torch.float64, None, None),
}


@dataclass(frozen=True)
class Precision:
    """The dtypes of one run: ``param_dtype`` for parameters and everything derived from them
    (gradients, optimizer state, gradient collectives, checkpoints); ``autocast_dtype`` the
    compute dtype of the forward/backward under autocast (None: compute in ``param_dtype``)."""

    name: str
    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    device_type: str

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        """The context every forward/backward of the run executes in."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)


def resolve_precision(name: str, device: torch.device) -> Precision:
    """The ``Precision`` of ``train.precision = name`` on ``device``; ValueError if unknown."""
    if name not in PRECISIONS:
        raise ValueError(f"train.precision={name!r} must be one of {', '.join(PRECISIONS)}")
    param, on_cuda, on_cpu = PRECISIONS[name]
    return Precision(name, param, on_cuda if device.type == "cuda" else on_cpu, device.type)


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to accumulate or normalize values of ``dtype`` in: at least fp32 (bf16 and
    fp16 go to fp32, fp32 stays fp32, float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


def upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in ``accum_dtype(t.dtype)`` (the tensor itself, no copy, when already there)."""
    return t.to(accum_dtype(t.dtype))
