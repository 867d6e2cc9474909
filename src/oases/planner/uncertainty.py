"""How sure a prediction is: its range over the inputs we are unsure of, and which moves it most.

A simulated step rests on a few numbers that public figures pin down only loosely. Each is
an ``Input`` with bounds, stated here and nowhere else, as factors on the preset's value:

    input                    bounds      why
    server link efficiency   x0.5-1.25   host-staged GeForce PCIe (no nccl-tests figure at PCIe
                             x0.9-1.05   4.0: the PCIe 3.0 figures scaled by 1.98-2.74x, the
                                         one-way and both-ways ratios of the staged copies;
                                         x0.5 is the PCIe 3.0 rate itself); other paths:
                                         nccl-tests figures of the same path differ by 5-10%
    pair link efficiency     x0.8-1.17   the 3090 bridge's 48 GB/s is NCCL's model, not a
                                         measurement: at most the 56.25 GB/s of the
                                         specification, at least the 0.78 of its rate NCCL's
                                         ring reaches on A100 NVLink
    inter-server rate        x0.5-1.3    Ethernet: TCP sockets reach 0.32-0.48 of the line
                             x0.9-1.02   rate (NVIDIA/nccl#450), RDMA up to 0.97; InfiniBand:
                                         0.96-0.98 measured, no more than the line
    matmul efficiency        x0.85-1.1   RTX 3090: the paper's other profile rows come out
                                         within 17% of the calibrated 0.90 (never above 1.0)

``simulate_ranges`` re-simulates fixed plans (the rows of ``oases simulate``) with each input at
each bound and with all of them at once at the bounds that slow a step and at those that speed
it; a row's range is the least and the most over these scenarios, and the input that moves it
most is the one whose two bounds are furthest apart in the row's speedup over the baseline row
(the baseline row: in its tokens/s). The plans are not re-planned under the perturbed inputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from oases.config import ModelConfig
from oases.plan import ParallelPlan
from oases.planner.batch import BatchShape
from oases.planner.clusters import Cluster
from oases.planner.simulate import simulate_plan


@dataclass(frozen=True)
class Input:
    """One uncertain input: ``name``, its bounds as factors on the preset's value (those of
    host-staged links or Ethernet where they differ), and the reason."""

    name: str
    low: float
    high: float
    why: str
    low_wide: float | None = None  # for host-staged server links / Ethernet between servers
    high_wide: float | None = None

    def bounds(self, cluster: Cluster) -> tuple[float, float] | None:
        """(low, high) factors for this cluster, None where the input does not apply."""
        s = cluster.server
        if self.name == "pair link efficiency" and s.pair_link is None:
            return None
        if self.name == "inter-server rate":
            if cluster.inter_link is None or cluster.servers == 1:
                return None
            wide = "InfiniBand" not in cluster.inter_link.name
        else:
            wide = self.name == "server link efficiency" and s.link.host_staged
        if wide and self.low_wide is not None and self.high_wide is not None:
            return self.low_wide, self.high_wide
        return self.low, self.high


INPUTS: tuple[Input, ...] = (
    Input(
        "server link efficiency",
        0.9,
        1.05,
        "host-staged PCIe 4.0: PCIe 3.0 figures scaled by 1.98-2.74x (x0.5 is PCIe 3.0); "
        "other paths: nccl-tests figures of one path differ by 5-10%",
        0.5,
        1.25,
    ),
    Input(
        "pair link efficiency",
        0.8,
        56.25 / 48,
        "NCCL's 48 GB/s model of the 3090 bridge: up to the 56.25 GB/s specification, down "
        "to the 0.78 of the line rate NCCL's ring reaches on A100 NVLink",
    ),
    Input(
        "inter-server rate",
        0.9,
        1.02,
        "Ethernet: 0.32-0.48 of the line over TCP (NVIDIA/nccl#450) up to 0.97 with RDMA; "
        "InfiniBand: 0.96-0.98 measured",
        0.5,
        1.3,
    ),
    Input(
        "matmul efficiency",
        0.85,
        1.1,
        "the paper's other profile rows within 17% of the calibrated 0.90; at most 1.0",
    ),
)


def perturb(cluster: Cluster, name: str, factor: float) -> Cluster:
    """``cluster`` with one input scaled by ``factor`` (efficiencies capped at 1)."""
    s = cluster.server

    def scaled(link: object) -> object:
        return dataclasses.replace(
            link,
            efficiency=min(1.0, link.efficiency * factor),
            duplex_efficiency=min(1.0, link.duplex_efficiency * factor),
            nvls_bus_bytes_per_s=link.nvls_bus_bytes_per_s * factor,
        )

    if name == "server link efficiency":
        s = dataclasses.replace(s, link=scaled(s.link))
    elif name == "pair link efficiency" and s.pair_link is not None:
        s = dataclasses.replace(s, pair_link=scaled(s.pair_link))
    elif name == "matmul efficiency":
        gpu = dataclasses.replace(
            s.gpu,
            matmul_efficiency=min(1.0, s.gpu.matmul_efficiency * factor),
            dtype_efficiency={k: min(1.0, v * factor) for k, v in s.gpu.dtype_efficiency.items()},
        )
        s = dataclasses.replace(s, gpu=gpu)
    elif name == "inter-server rate" and cluster.inter_link is not None:
        return dataclasses.replace(cluster, inter_link=scaled(cluster.inter_link))
    elif name not in {i.name for i in INPUTS}:
        raise ValueError(f"unknown input {name!r}; valid: {', '.join(i.name for i in INPUTS)}")
    return dataclasses.replace(cluster, server=s)


@dataclass
class Range:
    """A row's predictions over the scenarios: (least, most) of each, and per input the
    step seconds and speedup at its low and high bound."""

    step_s: tuple[float, float]
    tokens_per_s: tuple[float, float]
    speedup: tuple[float, float]
    by_input: dict[str, dict[str, dict[str, float]]]
    most_sensitive: str

    def to_json(self) -> dict:
        return {
            "step_s": list(self.step_s),
            "tokens_per_s": list(self.tokens_per_s),
            "speedup": list(self.speedup),
            "by_input": self.by_input,
            "most_sensitive": self.most_sensitive,
        }


def input_bounds(
    cluster: Cluster, overrides: dict[str, tuple[float, float]] | None = None
) -> dict[str, tuple[float, float]]:
    """The inputs that apply to ``cluster`` and their (low, high) factors; ``overrides``
    replaces some."""
    out = {}
    for inp in INPUTS:
        b = inp.bounds(cluster)
        if b is not None:
            out[inp.name] = b
    for name, b in (overrides or {}).items():
        if name not in {i.name for i in INPUTS}:
            raise ValueError(f"unknown input {name!r}; valid: {', '.join(i.name for i in INPUTS)}")
        if not b[0] <= 1.0 <= b[1]:
            raise ValueError(f"{name}: bounds {b} must enclose 1.0 (the preset's value)")
        out[name] = b
    return out


def simulate_ranges(
    cfg: ModelConfig,
    cluster: Cluster,
    rows: Sequence[tuple[ParallelPlan, BatchShape]],
    dtype: str = "fp32",
    bounds: dict[str, tuple[float, float]] | None = None,
    grad_reduce: str = "fp32",
    attention: str = "materialized",
) -> list[Range]:
    """The range of every row (a fixed plan and batch; the first is the speedups' baseline)
    over the inputs' bounds (``input_bounds(cluster)`` unless given)."""
    from oases.planner.hardware import HardwareCosts

    bounds = input_bounds(cluster) if bounds is None else bounds
    world = cluster.world_size

    def steps(c: Cluster) -> list[float]:
        costs = HardwareCosts(c, cfg, dtype, grad_reduce, attention=attention)
        return [
            simulate_plan(cfg, plan, costs, world, batch, timeline=False).step_s
            for plan, batch in rows
        ]

    point = steps(cluster)
    scenarios = {"point": point}
    for name, (lo, hi) in bounds.items():
        scenarios[f"{name}:low"] = steps(perturb(cluster, name, lo))
        scenarios[f"{name}:high"] = steps(perturb(cluster, name, hi))
    for corner in ("slow", "fast"):  # every input at its bound that slows (speeds) row 0
        c = cluster
        for name, (lo, hi) in bounds.items():
            slower = scenarios[f"{name}:low"][0] >= scenarios[f"{name}:high"][0]
            c = perturb(c, name, lo if slower == (corner == "slow") else hi)
        scenarios[corner] = steps(c)
    out = []
    for i, (_, batch) in enumerate(rows):
        tokens = batch.global_batch * cfg.seq_len
        step = [s[i] for s in scenarios.values()]
        speed = [s[0] / s[i] for s in scenarios.values()]
        by_input = {
            name: {
                b: {
                    "step_s": scenarios[f"{name}:{b}"][i],
                    "speedup": scenarios[f"{name}:{b}"][0] / scenarios[f"{name}:{b}"][i],
                }
                for b in ("low", "high")
            }
            for name in bounds
        }
        key = "step_s" if i == 0 else "speedup"
        swing = {name: abs(v["high"][key] - v["low"][key]) for name, v in by_input.items()}
        top = max(swing, key=swing.__getitem__) if swing else ""
        out.append(
            Range(
                (min(step), max(step)),
                (tokens / max(step), tokens / min(step)),
                (min(speed), max(speed)),
                by_input,
                top,
            )
        )
    return out
