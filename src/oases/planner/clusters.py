"""What the hardware is: GPUs, links, servers and clusters, named presets, cluster files.

Every number comes from a public specification or a public microbenchmark named in its
``source`` (nccl-tests bus bandwidths, CUDA's p2pBandwidthLatencyTest, NCCL's own topology
constants); none is fitted to end-to-end training results, which are what the simulator is
checked against (``benchmarks/2026-12-02-collectives``). ``planner.collectives`` turns the
links into collective times the way NCCL's tuner does, ``planner.hardware`` a cluster and a
model into seconds. A user describes their own cluster in a TOML or JSON file with the same
fields (``load_cluster``); a GPU or link may be given by preset name.

    # my-cluster.toml
    name = "lab"
    servers = 2
    inter_link = "25gbe"          # a preset name, or a table with the Link fields
    [server]
    gpus_per_server = 4
    gpu = "rtx3090"
    link = "pcie4-x16-geforce"
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oases.planner.precision import DTYPE_BYTES


@dataclass(frozen=True)
class GPU:
    """One accelerator. ``peak_flops`` maps a dtype ("fp32", "tf32", "bf16", "fp16") to the
    dense peak in flop/s; ``matmul_efficiency`` and ``elementwise_efficiency`` are the fractions
    of peak flops and of memory bandwidth that large matmuls and streaming kernels reach;
    ``dtype_efficiency`` gives the matmul efficiency of a dtype where a microbenchmark says it
    differs (bf16 tensor-core matmuls: ``matmul_efficiency_at``);
    ``launch_overhead_s`` is the flat per-piece launch cost of profiles and cluster files made
    before the kernel model (kept for reading them; the kernel model prices launches by
    kernel count); ``compute_capability`` picks the row of NCCL's tuning tables (8.x Ampere,
    9.0 Hopper); ``kernels`` is the GPU's kernel table (``planner.kernels.sources``: SMs,
    the GEMM anchor shape, launch and host costs, NCCL's SMs, fused-attention series; {}:
    the kernel model's defaults), which ``oases profile --kernels`` measures."""

    name: str
    peak_flops: dict[str, float]
    memory_bytes: float
    memory_bandwidth_bytes_per_s: float
    matmul_efficiency: float
    elementwise_efficiency: float
    source: str
    launch_overhead_s: float = 20e-6
    compute_capability: float = 8.0
    dtype_efficiency: dict[str, float] = field(default_factory=dict)
    kernels: dict[str, float] = field(default_factory=dict)

    def matmul_efficiency_at(self, dtype: str) -> float:
        """The fraction of ``peak_flops[dtype]`` large matmuls in ``dtype`` reach."""
        return self.dtype_efficiency.get(dtype, self.matmul_efficiency)


LINK_KINDS = ("nvlink", "pcie", "net")  # the rows of NCCL's hardware latency table


@dataclass(frozen=True)
class Link:
    """A path between GPUs as NCCL's ring sees it.

    ``bandwidth_bytes_per_s``: the nominal rate per direction (the specification);
    ``efficiency``: the fraction of it a ring's Simple protocol reaches as bus bandwidth on
    this path at large messages (nccl-tests' busbw), with each GPU's link carrying the ring's
    traffic one way (a ring whose neighbouring hop is another path). ``host_staged``: GeForce
    cards without PCIe peer-to-peer, where NCCL copies every chunk through host memory (its SHM
    transport); ``duplex_efficiency`` is then the fraction reached when each GPU's link carries
    staged traffic both ways at once (a ring of host-staged hops only), 0 = ``efficiency``.
    ``kind`` selects NCCL's latency row; ``latency_s`` is added to NCCL's per-step latency (0
    unless a measurement says more); ``channels``: the rings NCCL builds on the path (its
    per-channel bandwidth caps); ``nvls_bus_bytes_per_s``: NVLink SHARP's all-reduce bus
    bandwidth on NVSwitch (Hopper), 0 = none."""

    name: str
    latency_s: float
    bandwidth_bytes_per_s: float
    source: str
    efficiency: float = 1.0
    kind: str = "pcie"
    host_staged: bool = False
    duplex_efficiency: float = 0.0
    channels: int = 2
    nvls_bus_bytes_per_s: float = 0.0

    @property
    def effective_bytes_per_s(self) -> float:
        """Bus bandwidth with each GPU's link carrying the ring one way."""
        return self.bandwidth_bytes_per_s * self.efficiency

    @property
    def duplex_bytes_per_s(self) -> float:
        """Bus bandwidth of a ring of these hops only (each GPU's link both ways)."""
        return self.bandwidth_bytes_per_s * (self.duplex_efficiency or self.efficiency)


@dataclass(frozen=True)
class Server:
    """``gpus_per_server`` identical GPUs joined by ``link``; with ``pair_link`` (e.g. RTX 3090
    NVLink bridges) GPUs 2i and 2i+1 are also joined by that faster link."""

    gpus_per_server: int
    gpu: GPU
    link: Link
    pair_link: Link | None = None


@dataclass(frozen=True)
class Cluster:
    """``servers`` identical servers joined by ``inter_link``, ``nics_per_server`` ports each
    (one per GPU on rail-optimized DGX-style servers, one shared port on commodity ones).
    Global rank r lives on server ``r // gpus_per_server``."""

    name: str
    servers: int
    server: Server
    inter_link: Link | None = None
    nics_per_server: int = 1
    source: str = ""

    @property
    def world_size(self) -> int:
        return self.servers * self.server.gpus_per_server

    @property
    def memory_bytes(self) -> float:
        """Memory of one GPU, the budget of one rank."""
        return self.server.gpu.memory_bytes

    def __post_init__(self) -> None:
        check_cluster(self)


def check_cluster(c: Cluster) -> None:
    """ValueError naming the first non-positive or inconsistent number."""

    def positive(where: str, value: float) -> None:
        if not value > 0:
            raise ValueError(f"{where}={value!r} must be > 0")

    positive(f"{c.name}: servers", c.servers)
    positive(f"{c.name}: nics_per_server", c.nics_per_server)
    positive(f"{c.name}: server.gpus_per_server", c.server.gpus_per_server)
    g = c.server.gpu
    for key in (
        "memory_bytes",
        "memory_bandwidth_bytes_per_s",
        "matmul_efficiency",
        "elementwise_efficiency",
    ):
        positive(f"{c.name}: gpu.{key}", getattr(g, key))
    if not g.peak_flops:
        raise ValueError(f"{c.name}: gpu.peak_flops is empty; give e.g. {{fp32 = 35.6e12}}")
    for dtype, flops in g.peak_flops.items():
        if dtype not in DTYPE_BYTES:
            raise ValueError(
                f"{c.name}: gpu.peak_flops has unknown dtype {dtype!r}; "
                f"valid: {', '.join(DTYPE_BYTES)}"
            )
        positive(f"{c.name}: gpu.peak_flops.{dtype}", flops)
    for dtype, eff in g.dtype_efficiency.items():
        if dtype not in g.peak_flops:
            raise ValueError(
                f"{c.name}: gpu.dtype_efficiency has {dtype!r}, which "
                f"gpu.peak_flops lacks ({', '.join(g.peak_flops)})"
            )
        positive(f"{c.name}: gpu.dtype_efficiency.{dtype}", eff)
    for where, link in (
        ("server.link", c.server.link),
        ("server.pair_link", c.server.pair_link),
        ("inter_link", c.inter_link),
    ):
        if link is not None:
            positive(f"{c.name}: {where}.bandwidth_bytes_per_s", link.bandwidth_bytes_per_s)
            positive(f"{c.name}: {where}.efficiency", link.efficiency)
            positive(f"{c.name}: {where}.channels", link.channels)
            for key in ("latency_s", "duplex_efficiency", "nvls_bus_bytes_per_s"):
                if getattr(link, key) < 0:
                    raise ValueError(f"{c.name}: {where}.{key}={getattr(link, key)} must be >= 0")
            if link.kind not in LINK_KINDS:
                raise ValueError(
                    f"{c.name}: {where}.kind={link.kind!r}; valid: {', '.join(LINK_KINDS)}"
                )
    if c.servers > 1 and c.inter_link is None:
        raise ValueError(f"{c.name}: {c.servers} servers need an inter_link")


def __getattr__(name: str) -> Any:
    """``CLUSTERS``, ``GPUS`` and ``LINKS``: the named presets of ``planner.presets`` (which
    builds them from the classes above, so it is imported on first use)."""
    if name in ("CLUSTERS", "GPUS", "LINKS"):
        from oases.planner import presets

        return getattr(presets, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_cluster(name: str) -> Cluster:
    """The preset ``name``, or ValueError listing the presets."""
    from oases.planner.presets import CLUSTERS

    if name not in CLUSTERS:
        raise ValueError(f"unknown cluster preset {name!r}; valid: {', '.join(CLUSTERS)}")
    return CLUSTERS[name]


def describe_shape(cluster: Cluster) -> str:
    """ "one server of 4 GPUs" or "8 servers x 4 GPUs (32)"."""
    gps = cluster.server.gpus_per_server
    if cluster.servers == 1:
        return f"one server of {gps} GPUs"
    return f"{cluster.servers} servers x {gps} GPUs ({cluster.world_size})"


def check_world_size(cluster: Cluster, world_size: int) -> None:
    """ValueError when ``world_size`` ranks do not fit on ``cluster``, naming the cluster
    presets that have that many GPUs (a plan for fewer ranks uses the first servers)."""
    from oases.planner.presets import CLUSTERS

    if 1 <= world_size <= cluster.world_size:
        return
    if world_size < 1:
        raise ValueError(f"--world-size={world_size} must be >= 1")
    same = [n for n, c in CLUSTERS.items() if c.world_size == world_size]
    presets = (
        f"the cluster presets with {world_size} GPUs are {', '.join(same)}"
        if same
        else f"no cluster preset has {world_size} GPUs ("
        + ", ".join(f"{n}: {c.world_size}" for n, c in CLUSTERS.items() if c.servers > 1)
        + ")"
    )
    raise ValueError(
        f"{cluster.name} is {describe_shape(cluster)}, fewer than --world-size "
        f"{world_size}: {presets}; or describe yours in a cluster file with "
        f"servers x gpus_per_server = {world_size} (`oases simulate --help` shows "
        "one)"
    )


def group_spans_servers(cluster: Cluster, ranks: typing.Iterable[int]) -> bool:
    """Whether the global ``ranks`` of a process group lie on more than one server."""
    return len(group_layout(cluster, ranks)[1]) > 1


def group_layout(cluster: Cluster, ranks: typing.Iterable[int]) -> tuple[int, dict[int, int]]:
    """(most ranks of the group on one server, {server: ranks of the group on it})."""
    per: dict[int, int] = {}
    for r in ranks:
        if not 0 <= r < cluster.world_size:
            raise ValueError(
                f"rank {r} is outside {cluster.name} (world size {cluster.world_size})"
            )
        per[r // cluster.server.gpus_per_server] = (
            per.get(r // cluster.server.gpus_per_server, 0) + 1
        )
    return max(per.values(), default=0), per


# -- cluster files ------------------------------------------------------------------------------


def _build(cls: type, data: Any, where: str, presets: dict[str, Any] | None = None) -> Any:
    """Build dataclass ``cls`` from a table (or a preset name), naming bad keys by path."""
    if isinstance(data, str) and presets is not None:
        if data not in presets:
            raise ValueError(f"{where}: unknown preset {data!r}; valid: {', '.join(presets)}")
        return presets[data]
    if not isinstance(data, dict):
        raise ValueError(
            f"{where}: expected a table"
            + (" or a preset name" if presets else "")
            + f", got {data!r}"
        )
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(fields)}"
        )
    missing = [
        n
        for n, f in fields.items()
        if n not in data
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and n != "source"
    ]
    if missing:
        raise ValueError(f"{where}: missing key(s) {', '.join(missing)}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        tp, key = hints[name], f"{where}.{name}" if where else name
        if value is None and tp == Link | None:
            pass  # JSON null: no such link
        elif tp in (GPU, Link, Server, Link | None):
            sub = GPU if tp is GPU else Server if tp is Server else Link
            from oases.planner.presets import GPUS, LINKS

            pre = GPUS if sub is GPU else LINKS if sub is Link else None
            value = _build(sub, value, key, pre)
        elif tp == dict[str, float]:
            if not isinstance(value, dict) or not all(
                isinstance(v, int | float) and not isinstance(v, bool) for v in value.values()
            ):
                raise ValueError(f"{key}: expected a table of numbers, got {value!r}")
            value = {k: float(v) for k, v in value.items()}
        elif tp is float:
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ValueError(f"{key}: expected a number, got {value!r}")
            value = float(value)
        elif not isinstance(value, tp) or isinstance(value, bool) and tp is int:
            raise ValueError(f"{key}: expected {tp.__name__}, got {value!r}")
        kwargs[name] = value
    if "source" in fields and "source" not in kwargs:
        kwargs["source"] = "user cluster file"
    return cls(**kwargs)


def cluster_from_dict(data: dict[str, Any], where: str = "") -> Cluster:
    """A Cluster from plain data with the dataclass fields (GPUs and links may be preset
    names); ValueError naming the missing or unknown key."""
    return _build(Cluster, data, where)


def load_cluster(path: str | Path) -> Cluster:
    """A Cluster from a ``.toml`` or ``.json`` file (see the module docstring)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read cluster file {p}: {exc.strerror}") from None
    try:
        data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        kind = "JSON" if p.suffix == ".json" else "TOML"
        raise ValueError(f"invalid {kind} in {p}: {exc}") from None
    try:
        return cluster_from_dict(data)
    except ValueError as exc:
        raise ValueError(f"{p}: {exc}") from None


def save_cluster(cluster: Cluster, path: str | Path) -> None:
    """Write ``cluster`` as JSON that ``load_cluster`` reads back to an equal Cluster."""
    Path(path).write_text(json.dumps(dataclasses.asdict(cluster), indent=1), encoding="utf-8")
