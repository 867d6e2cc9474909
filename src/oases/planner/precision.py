"""Bytes per element by tensor kind and dtype: the one place the planner prices a dtype.

A run's precision (``oases.precision``; ``train.precision``, ``parallel.grad_reduce_dtype``)
puts each kind of tensor in one of three dtypes, and the simulator, the memory walk and the
search price every byte through ``PlanPrecision``::

    kind                                    dtype        bytes: fp32 run   bf16 run
    activations, saved tensors (compute)    compute                4         2
    TP all-reduces, reshards                compute                4         2
    DP gradient all-reduce, ZeRO's          grad_reduce            4         4 (2 with
      gradient reduce-scatter                                                grad_reduce=bf16)
    ZeRO's weight all-gathers               master                 4         4
    weights, gradients                      master                 4         4
    AdamW moments (exp_avg, exp_avg_sq)     master x 2             8         8

ZeRO's all-gathers move master weights: the runtime gathers the fp32 flat buffer it shards
(``parallel.shard``) and autocast casts each matmul's weight to bf16 where it is used, so the
gathers stay 4 bytes an element under bf16 (what the runtime does, not what it could do).
The gradients stay fp32: autocast's casts hand fp32 gradients back to the fp32 weights.

A profile records the precision it measured (``Profile.precision``; one without the record was
measured in fp32); the hardware presets price a precision by their peak at the compute dtype
(``planner.hardware``). ``resolve_plan_precision`` maps a run's settings to one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# bytes of one element of each dtype name the planner knows ("tf32": fp32 storage, TF32 matmuls)
DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp64": 8}
OPTIMIZER_STATES = 2  # AdamW: exp_avg and exp_avg_sq per parameter, in the master dtype
GRAD_REDUCE_DTYPES = ("fp32", "bf16")  # parallel.grad_reduce_dtype


@dataclass(frozen=True)
class PlanPrecision:
    """The dtypes of a planned run: ``compute`` (matmuls, activations, saved tensors, TP
    collectives and reshards), ``grad_reduce`` (the DP gradient all-reduce and ZeRO's
    reduce-scatter), ``master`` (weights, gradients, AdamW moments, ZeRO's gathers)."""

    compute: str = "fp32"
    grad_reduce: str = "fp32"
    master: str = "fp32"

    def __post_init__(self) -> None:
        for kind in ("compute", "grad_reduce", "master"):
            name = getattr(self, kind)
            if name not in DTYPE_BYTES:
                raise ValueError(f"precision {kind}={name!r}; valid: {', '.join(DTYPE_BYTES)}")

    @property
    def activation_bytes(self) -> int:
        """An activation element: saved tensors, TP all-reduces, reshards."""
        return DTYPE_BYTES[self.compute]

    @property
    def grad_reduce_bytes(self) -> int:
        """A gradient element as the DP all-reduce and ZeRO's reduce-scatter move it."""
        return DTYPE_BYTES[self.grad_reduce]

    @property
    def master_bytes(self) -> int:
        """A weight, a gradient, or an element a ZeRO all-gather moves (master weights)."""
        return DTYPE_BYTES[self.master]

    @property
    def optimizer_bytes(self) -> int:
        """AdamW's state per parameter."""
        return OPTIMIZER_STATES * DTYPE_BYTES[self.master]

    def describe(self) -> dict[str, str]:
        """As ``oases.precision.Precision.describe`` writes it (a profile's record)."""
        return {"compute": self.compute, "grad_reduce": self.grad_reduce, "master": self.master}

    def label(self) -> str:
        """``bf16 compute, fp32 grad reduce, fp32 master`` (what report headers say)."""
        return (
            f"{self.compute} compute, {self.grad_reduce} grad reduce, {self.master} master "
            "weights and AdamW"
        )

    @staticmethod
    def from_record(record: Any) -> PlanPrecision:
        """A profile's ``precision`` record; None (a profile from before the record): fp32."""
        if record is None:
            return FP32
        if not isinstance(record, dict):
            raise ValueError(f"precision record {record!r} is not a table")
        compute = str(record.get("compute", "fp32"))
        master = str(record.get("master", "fp64" if compute == "fp64" else "fp32"))
        return PlanPrecision(compute, str(record.get("grad_reduce", master)), master)


FP32 = PlanPrecision()


def precision_of(costs: object) -> PlanPrecision:
    """The precision ``costs`` price (a profile's record, a preset's dtype); fp32 if none."""
    value = getattr(costs, "precision", None)
    return value if isinstance(value, PlanPrecision) else FP32


def resolve_plan_precision(
    name: str, grad_reduce: str = "fp32", *, gpu: bool = True
) -> PlanPrecision:
    """``train.precision = name`` with ``parallel.grad_reduce_dtype = grad_reduce`` on GPUs
    (``gpu``, a hardware preset) or CPU ranks, as ``oases.precision.resolve_precision``
    resolves it: "auto" is bf16 on GPUs and fp32 on CPU; "fp64" keeps everything float64."""
    if grad_reduce not in GRAD_REDUCE_DTYPES:
        raise ValueError(
            f"parallel.grad_reduce_dtype={grad_reduce!r} must be one of "
            f"{', '.join(GRAD_REDUCE_DTYPES)}"
        )
    if name == "auto":
        name = "bf16" if gpu else "fp32"
    if name == "fp64":
        return PlanPrecision("fp64", "fp64" if grad_reduce == "fp32" else grad_reduce, "fp64")
    if name not in ("fp32", "bf16"):
        raise ValueError(f"train.precision={name!r} must be one of auto, fp32, bf16, fp64")
    return PlanPrecision(name, grad_reduce)
