"""A profile: what one model's regions and this machine's collectives cost, measured.

``oases profile`` (``bench.profile_runner`` on every rank) writes it; the planner reads it through
the ``planner.costs.Costs`` interface. JSON, versioned, naming the machine and model it was
made for::

    format, version, created, machine {cpu, cores, torch, backend, world_size, link, device,
    device_name, device_memory_bytes (None for CPU ranks; absent in older profiles), ...}, model,
    config {file, overrides, train.micro_batch, train.global_batch, parallel.tp}
    compute      [{region, phase, piece, tp, rows, overlapped, s}]   median of one sub-batch's
                 piece in real steps of the synchronous (or, overlapped, the overlapped) schedules
    collectives  [{op, group_size, nbytes, s}]               fitted to latency + bytes / bandwidth
    memory       [{region, mode, tp, rows, saved_bytes}]     activations kept forward -> backward
    optimizer    [{n_params, s}]                             one AdamW step
    baseline_bytes                                           a rank's memory before the model
                                                             (CPU: resident set; CUDA: device
                                                             memory outside the allocator:
                                                             context, NCCL buffers, workspaces)
    workspace_bytes                                          what warm steps leave resident
                                                             beyond the tensors (0: older)
    contention   {op: factor}      compute slowdown while that collective is in flight; a
                                   profile that has it timed its pieces with no collective
                                   running (older ones: inside real steps, and none)
    comm_contention {op: factor}   a collective's slowdown while compute runs beside it on
                                   every rank ({} in older profiles: none)
    precision    {compute, grad_reduce, master}   the dtypes it measured in
                                   (``oases.precision.Precision.describe``; absent in older
                                   profiles: fp32), so its collectives' bytes and saved
                                   activations are that precision's (``planner.precision``)

Between measured row counts compute time is interpolated linearly (and extrapolated from the
two nearest points); a single point scales in proportion to rows.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from oases.config import ModelConfig
from oases.planner.precision import FP32, PlanPrecision

FORMAT, VERSION = "oases-profile", 1
SHAPE_KEYS = (
    "arch",
    "dim",
    "n_heads",
    "n_kv_heads",
    "ffn_dim",
    "vocab_size",
    "seq_len",
    "tie_embeddings",
)


def fit_latency_bandwidth(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``s = latency + nbytes / bandwidth`` over (nbytes, s) points (both kept
    non-negative). Returns (latency_s, bandwidth_bytes_per_s)."""
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    if len(points) == 1 or np.ptp(x) == 0:
        return 0.0, float(x.mean() / max(y.mean(), 1e-12))
    slope, intercept = np.polyfit(x, y, 1)
    if slope <= 0:
        return float(y.mean()), float("inf")
    if intercept < 0:  # through the origin
        return 0.0, float((x * x).sum() / (x * y).sum())
    return float(intercept), float(1.0 / slope)


def check_collective_fit(
    op: str, group_size: int, points: list[tuple[float, float]]
) -> tuple[float, float]:
    """``fit_latency_bandwidth`` of one collective's measured (nbytes, s) points, or ValueError
    when the fitted bandwidth is not finite and positive: times that do not grow with size
    were not timed to the collective's end (on CUDA, a clock read at enqueue, without events
    or a synchronize), and a plan made from them would price every byte at zero."""
    latency, bandwidth = fit_latency_bandwidth(points)
    if not (np.isfinite(bandwidth) and bandwidth > 0):
        shown = ", ".join(f"{int(n)} B: {s * 1e6:.1f} us" for n, s in sorted(points))
        raise ValueError(
            f"the profile's {op} over {group_size} ranks fits a bandwidth of "
            f"{bandwidth} B/s: its times do not grow with size ({shown}); the "
            "measurement did not wait for the collectives to end (or the sizes "
            "are too small to tell latency from bandwidth); profile again"
        )
    return latency, bandwidth


@dataclass
class Profile:
    model: dict
    machine: dict
    compute: list[dict] = field(default_factory=list)
    collectives: list[dict] = field(default_factory=list)
    memory: list[dict] = field(default_factory=list)
    optimizer: list[dict] = field(default_factory=list)
    baseline_bytes: float = 0.0
    created: str = ""
    config: dict = field(default_factory=dict)  # the run file and overrides it was made from
    # resident memory that warm steps leave beyond the baseline and every tensor alive: the
    # compute libraries' workspaces and caches, allocator slack (bench.profile_runner)
    workspace_bytes: float = 0.0
    # how much slower compute runs while a collective of each kind is in flight (the CPU ranks'
    # cores are shared with the communication threads); {} in older profiles
    contention_factors: dict = field(default_factory=dict)
    # how much slower each kind of collective runs while compute runs beside it
    comm_contention_factors: dict = field(default_factory=dict)
    # the dtypes it measured in (planner.precision; older profiles: fp32)
    precision: PlanPrecision = FP32

    @property
    def reduce_scatter_copies_input(self) -> bool:
        """A reduce-scatter on gloo holds a second full-size buffer beside its input: the
        all-to-all's receive buffer of ``comm.core._ReduceScatter`` (gloo's own reduce-scatter,
        which it replaces, held a full-size copy too: a 47.7 MiB scatter over 2 ranks raised
        the peak by 73 MiB); the memory walk counts it (``planner.peak_memory``)."""
        return self.machine.get("backend") == "gloo"

    @property
    def all_gather_copies_output(self) -> bool:
        """gloo's all-gather gathers into an output-size buffer of its own and copies it out
        (measured with torch 2.13: an 8 MiB all-gather over 2 ranks raised the peak by 7.9 MiB
        beyond its preallocated output); the memory walk counts it."""
        return self.machine.get("backend") == "gloo"

    def __post_init__(self) -> None:
        self._compute: dict[tuple, dict[int, float]] = {}
        for e in self.compute:
            key = (e["region"], e["phase"], e["piece"], int(e["tp"]), bool(e.get("overlapped")))
            self._compute.setdefault(key, {})[int(e["rows"])] = float(e["s"])
        by_group: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for e in self.collectives:
            by_group.setdefault((e["op"], int(e["group_size"])), []).append(
                (float(e["nbytes"]), float(e["s"]))
            )
        self._fits = {k: fit_latency_bandwidth(v) for k, v in by_group.items()}
        self._memory: dict[tuple, dict[int, float]] = {}
        for e in self.memory:
            key = (e["region"], e["mode"], int(e["tp"]))
            self._memory.setdefault(key, {})[int(e["rows"])] = float(e["saved_bytes"])

    # ---------------------------------------------------------------------- Costs interface
    def degrees(self) -> list[int]:
        return sorted({k[3] for k in self._compute})

    measures_overlap = True  # compute_s takes ``overlapped``: times beside collectives

    def compute_s(
        self, region: str, phase: str, piece: str, tp: int, rows: int, overlapped: bool = False
    ) -> float:
        """Seconds of one sub-batch's piece; ``overlapped``: as measured inside an overlapped
        schedule (falls back to the synchronous measurement where there is none)."""
        points = (
            self._compute.get((region, phase, piece, tp, True)) if overlapped else None
        ) or self._compute.get((region, phase, piece, tp, False))
        if points is None and piece in ("sp-dx", "sp-dw"):  # a profile from before the
            # deferred weight gradients: the whole backward where the input gradient runs
            return (
                self.compute_s(region, phase, "tp", tp, rows, overlapped)
                if piece == "sp-dx"
                else 0.0
            )
        if points is None:
            raise ValueError(
                f"the profile has no {phase} {piece} time for {region} at tp={tp} "
                f"(profiled degrees: {self.degrees()}); profile with a world "
                "size that includes it"
            )
        return _interpolate(points, rows)

    def collective_s(self, op: str, group_size: int, nbytes: int) -> float:
        if group_size <= 1 or nbytes <= 0:
            return 0.0
        fit = self._fits.get((op, group_size))
        if fit is None:
            known = sorted({f"{o}/{g}" for o, g in self._fits})
            raise ValueError(f"the profile has no {op} over {group_size} ranks (has: {known})")
        latency, bandwidth = fit
        return latency + nbytes / bandwidth

    def contention(self, op: str) -> float:
        """Compute's slowdown while collective ``op`` is in flight (1.0 where not measured)."""
        return max(1.0, float(self.contention_factors.get(op, 1.0)))

    def comm_contention(self, op: str) -> float:
        """A collective's slowdown while compute runs beside it (1.0 where not measured)."""
        return max(1.0, float(self.comm_contention_factors.get(op, 1.0)))

    def collective_fit(self, op: str, group_size: int) -> tuple[float, float] | None:
        return self._fits.get((op, group_size))

    def optimizer_s(self, n_params: int) -> float:
        if not self.optimizer:
            return 0.0
        pts = [(float(e["n_params"]), float(e["s"])) for e in self.optimizer]
        latency, rate = fit_latency_bandwidth(pts)
        return latency + n_params / rate

    def saved_bytes(self, region: str, mode: str, tp: int, rows: int) -> float | None:
        points = self._memory.get((region, mode, tp))
        if not points:
            return None
        ref = max(points)
        return points[ref] * rows / ref

    def retimed(self, compute: list[dict], optimizer: list[dict]) -> Profile:
        """This profile with ``compute`` entries (measured later, on the same machine and model)
        in place of its own for the same piece and rows, and ``optimizer`` (when given) in
        place of all of its own (a fit over times of two moments would mix them); everything
        else (collectives, contention, memory) kept. ``oases plan
        --verify`` re-times each candidate's pieces in the launch that measures it, so that
        how fast the machine runs now and how well the schedule is modelled can be told
        apart."""

        def piece(e: dict) -> tuple:
            return (
                e["region"],
                e["phase"],
                e["piece"],
                int(e["tp"]),
                int(e["rows"]),
                bool(e.get("overlapped")),
            )

        new_pieces = {piece(e) for e in compute}
        return Profile(
            self.model,
            self.machine,
            [e for e in self.compute if piece(e) not in new_pieces] + list(compute),
            self.collectives,
            self.memory,
            list(optimizer or self.optimizer),
            self.baseline_bytes,
            self.created,
            self.config,
            self.workspace_bytes,
            self.contention_factors,
            self.comm_contention_factors,
            self.precision,
        )

    # ---------------------------------------------------------------------------- checks, io
    def check_precision(self, wanted: PlanPrecision) -> None:
        """ValueError unless the profile measured in ``wanted``'s compute and grad-reduce
        dtypes: a profile's compute times are of its own dtype and no factor turns them into
        another's (this repository's CPU ran bf16 matmuls 11-14x slower than fp32,
        ``benchmarks/2026-12-02-bf16``, where a GPU's tensor cores run them faster)."""
        have = self.precision
        if (have.compute, have.grad_reduce) != (wanted.compute, wanted.grad_reduce):
            raise ValueError(
                f"the profile was measured in {have.label()}, the run asks for "
                f"{wanted.label()}: its compute times and bytes are its own dtype's; run oases "
                f"profile with --train.precision={wanted.compute} "
                f"--parallel.grad_reduce_dtype={wanted.grad_reduce}"
            )

    def check_model(self, cfg: ModelConfig) -> None:
        """ValueError unless the profile measured regions of this model's shape (the number
        of layers may differ: costs are per region)."""
        bad = [
            f"{k}: profile {self.model.get(k)!r}, model {getattr(cfg, k)!r}"
            for k in SHAPE_KEYS
            if self.model.get(k) != getattr(cfg, k)
        ]
        if bad:
            raise ValueError(
                "the profile was made for another model shape ("
                + "; ".join(bad)
                + "); run oases profile with this config"
            )

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "created": self.created,
            "machine": self.machine,
            "model": self.model,
            "compute": self.compute,
            "collectives": self.collectives,
            "memory": self.memory,
            "optimizer": self.optimizer,
            "baseline_bytes": self.baseline_bytes,
            "workspace_bytes": self.workspace_bytes,
            "contention": self.contention_factors,
            "comm_contention": self.comm_contention_factors,
            "config": self.config,
            "precision": self.precision.describe(),
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @staticmethod
    def load(path: str | os.PathLike[str]) -> Profile:
        try:
            raw = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ValueError(f"cannot read profile {path}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not a profile: {exc}") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ValueError(f"{path} is not an oases profile (no format={FORMAT!r})")
        if raw.get("version") != VERSION:
            raise ValueError(
                f"{path}: profile version {raw.get('version')} is not {VERSION}; "
                "run oases profile again"
            )
        try:
            return Profile(
                raw["model"],
                raw["machine"],
                raw["compute"],
                raw["collectives"],
                raw.get("memory", []),
                raw.get("optimizer", []),
                float(raw.get("baseline_bytes", 0.0)),
                raw.get("created", ""),
                raw.get("config", {}),
                float(raw.get("workspace_bytes", 0.0)),
                {str(k): float(v) for k, v in raw.get("contention", {}).items()},
                {str(k): float(v) for k, v in raw.get("comm_contention", {}).items()},
                PlanPrecision.from_record(raw.get("precision")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{path}: malformed profile ({exc!r})") from None


def _interpolate(points: dict[int, float], rows: int) -> float:
    if rows in points:
        return points[rows]
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]] * rows / xs[0]
    lo = max([x for x in xs if x < rows], default=xs[0])
    hi = min([x for x in xs if x > rows], default=xs[-1])
    if lo == hi:  # outside: the two nearest points
        lo, hi = (xs[0], xs[1]) if rows < xs[0] else (xs[-2], xs[-1])
    slope = (points[hi] - points[lo]) / (hi - lo)
    return max(0.0, points[lo] + slope * (rows - lo))
