"""Training precision: the one place that maps ``train.precision`` to dtypes and autocast.

    name    master weights, gradients,      compute: matmuls and       TP collectives
            AdamW state, checkpoints        activations
    auto    fp32                            bf16 on CUDA, fp32 on CPU  as compute
    fp32    fp32                            fp32                       fp32
    bf16    fp32                            bf16 (autocast)            bf16
    fp64    float64                         float64                    float64 (exactness checks)

Under bf16 the forward and backward run inside ``torch.autocast``: matmuls in bf16 with fp32
accumulation, and the model keeps its *activations* in bf16 too (``to_activation``: the residual
stream, every norm's output, the partial sums a TP region all-reduces), so the executor's saved
tensors, the TP all-reduces and the reshards move 2 bytes an element. Weights, their gradients
(autocast's casts hand fp32 gradients back to fp32 weights) and AdamW's moments stay fp32, as
Megatron-LM's bf16 with fp32 main parameters. The data-parallel gradient reduction (the "dp"
all-reduces, ZeRO's reduce-scatters) runs in ``grad_reduce_dtype``: fp32 by default
(``parallel.grad_reduce_dtype``, Megatron-LM's accumulate-in-fp32 choice), bf16 on request
(half the bytes, gradients rounded to 8 bits of mantissa before they are summed).

A new precision is one row of ``PRECISIONS``. The model code is dtype-generic: where it upcasts
for accuracy (norm statistics, rotary, the loss, the gradient norm) it goes to ``accum_dtype``,
at least fp32, so a float64 model stays float64.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

# name -> (parameter dtype, autocast dtype on CUDA or None, autocast dtype on CPU or None)
PRECISIONS: dict[str, tuple[torch.dtype, torch.dtype | None, torch.dtype | None]] = {
    "auto": (torch.float32, torch.bfloat16, None),
    "fp32": (torch.float32, None, None),
    "bf16": (torch.float32, torch.bfloat16, torch.bfloat16),
    "fp64": (torch.float64, None, None),
}
# parallel.grad_reduce_dtype -> the dtype of the data-parallel gradient reduction ("fp32": the
# master dtype itself, so an fp64 run reduces in float64)
GRAD_REDUCE_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}
DTYPE_NAMES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float64: "fp64",
}


@dataclass(frozen=True)
class Precision:
    """The dtypes of one run: ``param_dtype`` for master weights and everything derived from
    them (gradients, optimizer state, checkpoints); ``autocast_dtype`` the compute dtype of the
    forward/backward under autocast (None: compute in ``param_dtype``); ``grad_reduce_dtype``
    the dtype the data-parallel gradient reduction moves."""

    name: str
    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    device_type: str
    grad_reduce_dtype: torch.dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        """Matmuls, activations, saved tensors and TP collectives."""
        return self.autocast_dtype or self.param_dtype

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        """The context every forward/backward of the run executes in."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def describe(self) -> dict[str, str]:
        """Dtype names by kind (``oases profile`` records this)."""
        return {
            "compute": DTYPE_NAMES[self.compute_dtype],
            "grad_reduce": DTYPE_NAMES[self.grad_reduce_dtype],
            "master": DTYPE_NAMES[self.param_dtype],
        }


def resolve_precision(name: str, device: torch.device, grad_reduce: str = "fp32") -> Precision:
    """The ``Precision`` of ``train.precision = name`` on ``device`` with
    ``parallel.grad_reduce_dtype = grad_reduce``; ValueError if either is unknown."""
    if name not in PRECISIONS:
        raise ValueError(f"train.precision={name!r} must be one of {', '.join(PRECISIONS)}")
    if grad_reduce not in GRAD_REDUCE_DTYPES:
        raise ValueError(
            f"parallel.grad_reduce_dtype={grad_reduce!r} must be one of "
            f"{', '.join(GRAD_REDUCE_DTYPES)}"
        )
    param, on_cuda, on_cpu = PRECISIONS[name]
    return Precision(
        name,
        param,
        on_cuda if device.type == "cuda" else on_cpu,
        device.type,
        GRAD_REDUCE_DTYPES[grad_reduce] or param,
    )


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to accumulate or normalize values of ``dtype`` in: at least fp32 (bf16 and
    fp16 go to fp32, fp32 stays fp32, float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


def upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in ``accum_dtype(t.dtype)`` (the tensor itself, no copy, when already there)."""
    return t.to(accum_dtype(t.dtype))


def to_activation(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the dtype activations run in: the autocast dtype inside autocast (so a bf16 run
    keeps its residual stream, norm outputs and partial sums in bf16, and with them the saved
    tensors and the TP collectives), else ``t`` itself. Autocast alone would hand back fp32 from
    every norm and from every add of an fp32 bias or position."""
    kind = t.device.type
    if t.is_floating_point() and torch.is_autocast_enabled(kind):
        return t.to(torch.get_autocast_dtype(kind))
    return t
