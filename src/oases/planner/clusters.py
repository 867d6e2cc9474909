"""What the hardware is: GPUs, links, servers and clusters, named presets, cluster files.

Every number comes from a public specification named in its ``source``; efficiencies (the part
of a peak that real kernels and collectives reach) are calibrated where the Oases paper (Li et
al., IEEE TPDS 2025) publishes measured figures (its RTX 3090 servers) and stated as assumptions
elsewhere. ``planner.hardware`` turns a
cluster and a model into seconds. A user describes their own cluster in a TOML or JSON file
with the same fields (``load_cluster``); a GPU or link may be given by preset name.

    # my-cluster.toml
    name = "lab"
    servers = 2
    inter_link = "25gbe"          # a preset name, or a table with the Link fields
    [server]
    gpus_per_server = 4
    gpu = "rtx3090"
    link = "pcie3-x16-geforce"
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class GPU:
    """One accelerator. ``peak_flops`` maps a dtype ("fp32", "tf32", "bf16", "fp16") to the
    dense peak in flop/s; ``matmul_efficiency`` and ``elementwise_efficiency`` are the fractions
    of peak flops and of memory bandwidth that large matmuls and streaming kernels reach;
    ``launch_overhead_s`` is charged once per scheduled compute piece."""

    name: str
    peak_flops: dict[str, float]
    memory_bytes: float
    memory_bandwidth_bytes_per_s: float
    matmul_efficiency: float
    elementwise_efficiency: float
    source: str
    launch_overhead_s: float = 20e-6


@dataclass(frozen=True)
class Link:
    """A link as ring collectives see it: ``bandwidth_bytes_per_s`` per direction per GPU (the
    nominal figure of the specification), ``efficiency`` the fraction of it a ring collective
    reaches (its bus bandwidth), ``latency_s`` per ring step."""

    name: str
    latency_s: float
    bandwidth_bytes_per_s: float
    source: str
    efficiency: float = 1.0

    @property
    def effective_bytes_per_s(self) -> float:
        return self.bandwidth_bytes_per_s * self.efficiency


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
    for key in ("memory_bytes", "memory_bandwidth_bytes_per_s", "matmul_efficiency",
                "elementwise_efficiency"):
        positive(f"{c.name}: gpu.{key}", getattr(g, key))
    if not g.peak_flops:
        raise ValueError(f"{c.name}: gpu.peak_flops is empty; give e.g. {{fp32 = 35.6e12}}")
    for dtype, flops in g.peak_flops.items():
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"{c.name}: gpu.peak_flops has unknown dtype {dtype!r}; "
                             f"valid: {', '.join(DTYPE_BYTES)}")
        positive(f"{c.name}: gpu.peak_flops.{dtype}", flops)
    for where, link in (("server.link", c.server.link), ("server.pair_link",
                                                         c.server.pair_link),
                        ("inter_link", c.inter_link)):
        if link is not None:
            positive(f"{c.name}: {where}.bandwidth_bytes_per_s", link.bandwidth_bytes_per_s)
            positive(f"{c.name}: {where}.efficiency", link.efficiency)
            if link.latency_s < 0:
                raise ValueError(f"{c.name}: {where}.latency_s={link.latency_s} must be >= 0")
    if c.servers > 1 and c.inter_link is None:
        raise ValueError(f"{c.name}: {c.servers} servers need an inter_link")


_AMPERE = "NVIDIA Ampere GA102 GPU architecture whitepaper v2.1, table 9 (GeForce RTX 3090)"
GPUS: dict[str, GPU] = {
    "rtx3090": GPU(
        "NVIDIA GeForce RTX 3090", {"fp32": 35.58e12, "tf32": 35.6e12, "bf16": 71e12,
                                    "fp16": 71e12},
        24e9, 936e9, 0.90, 0.82,
        f"{_AMPERE}: 35.6 TFLOP/s fp32 and tf32 dense, 71 bf16/fp16 with fp32 accumulate, "
        "24 GB GDDR6X at 936 GB/s. Efficiencies calibrated on the profile the Oases paper (Li et "
        "al., IEEE TPDS 2025) publishes (H=2048, t=4: attention forward 3.24 ms, MLP forward "
        "2.69 ms), see planner.hardware"),
    "a100": GPU(
        "NVIDIA A100 SXM4 80GB", {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12,
                                  "fp16": 312e12},
        80e9, 2039e9, 0.80, 0.85,
        "NVIDIA A100 Tensor Core GPU datasheet: 19.5 TFLOP/s fp32, 156 tf32, 312 bf16/fp16 "
        "dense, 80 GB HBM2e at 2039 GB/s. Efficiencies assumed (typical large cuBLAS GEMMs, "
        "STREAM-like copies), not calibrated here"),
    "h100": GPU(
        "NVIDIA H100 SXM5 80GB", {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12,
                                  "fp16": 989.4e12},
        80e9, 3.35e12, 0.70, 0.85,
        "NVIDIA H100 Tensor Core GPU datasheet (SXM5): 67 TFLOP/s fp32, 989 tf32 and 1979 "
        "bf16/fp16 with sparsity (half dense), 80 GB HBM3 at 3.35 TB/s. Efficiencies assumed"),
    "h200": GPU(
        "NVIDIA H200 SXM 141GB", {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12,
                                  "fp16": 989.4e12},
        141e9, 4.8e12, 0.70, 0.85,
        "NVIDIA H200 Tensor Core GPU datasheet (SXM): H100's compute (67 TFLOP/s fp32, 989 "
        "tf32 and 1979 bf16 with sparsity, half dense), 141 GB HBM3e at 4.8 TB/s. "
        "Efficiencies assumed"),
}

_PCIE = "PCI-SIG base specification: {gt} GT/s x16 with 128b/130b coding = {gbs} GB/s per direction"
LINKS: dict[str, Link] = {
    # in-server
    "pcie3-x16-geforce": Link(
        "PCIe 3.0 x16, GeForce (no peer-to-peer)", 5e-6, 15.75e9,
        _PCIE.format(gt=8, gbs=15.75) + "; efficiency 0.44 calibrated on the Oases paper's "
        "(Li et al., IEEE TPDS 2025) measured 4-GPU all-reduce of the H=2048 block output (32 "
        "MiB fp32, 7.29 ms): GeForce cards have no "
        "PCIe peer-to-peer, so NCCL stages every transfer through host memory", 0.44),
    "pcie4-x16": Link("PCIe 4.0 x16", 5e-6, 31.5e9,
                      _PCIE.format(gt=16, gbs=31.5) + "; efficiency 0.8 assumed", 0.8),
    "nvlink-bridge-3090": Link(
        "NVLink bridge (RTX 3090 pair)", 3e-6, 56.25e9,
        "NVIDIA GeForce RTX 3090 specifications: NVLink 112.5 GB/s total, 56.25 GB/s per "
        "direction; efficiency 0.8 assumed (as NCCL reaches on DGX NVLink)", 0.8),
    "nvswitch-a100": Link(
        "NVLink 3 + NVSwitch (DGX A100)", 2e-6, 300e9,
        "NVIDIA A100 datasheet: NVLink 600 GB/s total per GPU (300 per direction); "
        "efficiency 0.78 = nccl-tests all_reduce bus bandwidth ~235 GB/s on DGX A100", 0.78),
    "nvswitch-h100": Link(
        "NVLink 4 + NVSwitch (DGX H100/H200)", 2e-6, 450e9,
        "NVIDIA H100/H200 datasheets: NVLink 900 GB/s total per GPU (450 per direction); "
        "efficiency 0.8 = nccl-tests all_reduce bus bandwidth ~360 GB/s without NVLS", 0.8),
    # between servers (per port)
    "10gbe": Link("10 Gb Ethernet", 30e-6, 1.25e9,
                  "IEEE 802.3ae: 10 Gb/s = 1.25 GB/s; TCP sockets, efficiency 0.9 assumed", 0.9),
    "25gbe": Link("25 Gb Ethernet", 30e-6, 3.125e9,
                  "IEEE 802.3by: 25 Gb/s = 3.125 GB/s; TCP sockets, efficiency 0.9 assumed", 0.9),
    "100gbe": Link("100 Gb Ethernet", 20e-6, 12.5e9,
                   "IEEE 802.3ba/bj: 100 Gb/s = 12.5 GB/s; efficiency 0.8 assumed", 0.8),
    "ib-edr": Link("InfiniBand EDR 4x", 5e-6, 12.5e9,
                   "InfiniBand Trade Association roadmap: EDR 4x port 100 Gb/s = 12.5 GB/s; "
                   "efficiency 0.9 assumed (RDMA)", 0.9),
    "ib-hdr": Link("InfiniBand HDR 4x", 5e-6, 25e9,
                   "InfiniBand Trade Association roadmap: HDR 4x port 200 Gb/s = 25 GB/s; "
                   "efficiency 0.9 assumed (RDMA)", 0.9),
    "ib-ndr": Link("InfiniBand NDR 4x", 5e-6, 50e9,
                   "InfiniBand Trade Association roadmap: NDR 4x port 400 Gb/s = 50 GB/s; "
                   "efficiency 0.9 assumed (RDMA)", 0.9),
}

_3090_PCIE = Server(4, GPUS["rtx3090"], LINKS["pcie3-x16-geforce"])
_3090_NVLINK = Server(4, GPUS["rtx3090"], LINKS["pcie3-x16-geforce"], LINKS["nvlink-bridge-3090"])
_OASES = "the Oases paper (Li et al., IEEE TPDS 2025), its evaluation"
_PAPER = (f"{_OASES}: 8 servers of 4 RTX 3090; the paper does not name the network between "
          "servers, 100 Gb Ethernet (one port per server) is assumed")
_DGX = "DGX {gpu} server: 8 GPUs on NVSwitch"
CLUSTERS: dict[str, Cluster] = {
    "rtx3090-pcie": Cluster("rtx3090-pcie", 1, _3090_PCIE,
                            source=f"{_OASES}: a server of 4 RTX 3090 over PCIe 3.0"),
    "rtx3090-nvlink": Cluster("rtx3090-nvlink", 1, _3090_NVLINK,
                              source=f"{_OASES}: 4 RTX 3090, NVLink bridges between pairs"),
    "a100-nvlink": Cluster("a100-nvlink", 1, Server(8, GPUS["a100"], LINKS["nvswitch-a100"]),
                           source=_DGX.format(gpu="A100")),
    "h100-nvlink": Cluster("h100-nvlink", 1, Server(8, GPUS["h100"], LINKS["nvswitch-h100"]),
                           source=_DGX.format(gpu="H100")),
    "h200-nvlink": Cluster("h200-nvlink", 1, Server(8, GPUS["h200"], LINKS["nvswitch-h100"]),
                           source=_DGX.format(gpu="H200")),
    "paper-3090-pcie-32": Cluster("paper-3090-pcie-32", 8, _3090_PCIE, LINKS["100gbe"],
                                  source=_PAPER),
    "paper-3090-nvlink-32": Cluster("paper-3090-nvlink-32", 8, _3090_NVLINK, LINKS["100gbe"],
                                    source=_PAPER),
    "a100-ib-64": Cluster("a100-ib-64", 8, Server(8, GPUS["a100"], LINKS["nvswitch-a100"]),
                          LINKS["ib-hdr"], 8,
                          "8 DGX A100, one 200 Gb/s HDR port per GPU (8 per server)"),
    "h100-ib-64": Cluster("h100-ib-64", 8, Server(8, GPUS["h100"], LINKS["nvswitch-h100"]),
                          LINKS["ib-ndr"], 8,
                          "8 DGX H100, one 400 Gb/s NDR port per GPU (8 per server)"),
    "h200-ib-64": Cluster("h200-ib-64", 8, Server(8, GPUS["h200"], LINKS["nvswitch-h100"]),
                          LINKS["ib-ndr"], 8,
                          "8 DGX H200, one 400 Gb/s NDR port per GPU (8 per server)"),
}


def get_cluster(name: str) -> Cluster:
    """The preset ``name``, or ValueError listing the presets."""
    if name not in CLUSTERS:
        raise ValueError(f"unknown cluster preset {name!r}; valid: {', '.join(CLUSTERS)}")
    return CLUSTERS[name]


def describe_shape(cluster: Cluster) -> str:
    """"one server of 4 GPUs" or "8 servers x 4 GPUs (32)"."""
    gps = cluster.server.gpus_per_server
    if cluster.servers == 1:
        return f"one server of {gps} GPUs"
    return f"{cluster.servers} servers x {gps} GPUs ({cluster.world_size})"


def check_world_size(cluster: Cluster, world_size: int) -> None:
    """ValueError when ``world_size`` ranks do not fit on ``cluster``, naming the cluster
    presets that have that many GPUs (a plan for fewer ranks uses the first servers)."""
    if 1 <= world_size <= cluster.world_size:
        return
    if world_size < 1:
        raise ValueError(f"--world-size={world_size} must be >= 1")
    same = [n for n, c in CLUSTERS.items() if c.world_size == world_size]
    presets = (f"the cluster presets with {world_size} GPUs are {', '.join(same)}" if same else
               f"no cluster preset has {world_size} GPUs (" + ", ".join(
                   f"{n}: {c.world_size}" for n, c in CLUSTERS.items() if c.servers > 1) + ")")
    raise ValueError(f"{cluster.name} is {describe_shape(cluster)}, fewer than --world-size "
                     f"{world_size}: {presets}; or describe yours in a cluster file with "
                     f"servers x gpus_per_server = {world_size} (`oases simulate --help` shows "
                     "one)")


def group_spans_servers(cluster: Cluster, ranks: typing.Iterable[int]) -> bool:
    """Whether the global ``ranks`` of a process group lie on more than one server."""
    return len(group_layout(cluster, ranks)[1]) > 1


def group_layout(cluster: Cluster, ranks: typing.Iterable[int]) -> tuple[int, dict[int, int]]:
    """(most ranks of the group on one server, {server: ranks of the group on it})."""
    per: dict[int, int] = {}
    for r in ranks:
        if not 0 <= r < cluster.world_size:
            raise ValueError(f"rank {r} is outside {cluster.name} (world size "
                             f"{cluster.world_size})")
        per[r // cluster.server.gpus_per_server] = per.get(r // cluster.server.gpus_per_server,
                                                           0) + 1
    return max(per.values(), default=0), per


# -- cluster files ------------------------------------------------------------------------------

def _build(cls: type, data: Any, where: str, presets: dict[str, Any] | None = None) -> Any:
    """Build dataclass ``cls`` from a table (or a preset name), naming bad keys by path."""
    if isinstance(data, str) and presets is not None:
        if data not in presets:
            raise ValueError(f"{where}: unknown preset {data!r}; valid: {', '.join(presets)}")
        return presets[data]
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a table" + (" or a preset name" if presets else "")
                         + f", got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; valid keys: "
                         f"{', '.join(fields)}")
    missing = [n for n, f in fields.items() if n not in data
               and f.default is dataclasses.MISSING and n != "source"]
    if missing:
        raise ValueError(f"{where}: missing key(s) {', '.join(missing)}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        tp, key = hints[name], f"{where}.{name}" if where else name
        if value is None and tp == Link | None:
            pass  # JSON null: no such link
        elif tp in (GPU, Link, Server, Link | None):
            sub = GPU if tp is GPU else Server if tp is Server else Link
            pre = GPUS if sub is GPU else LINKS if sub is Link else None
            value = _build(sub, value, key, pre)
        elif tp == dict[str, float]:
            if not isinstance(value, dict) or not all(
                    isinstance(v, int | float) and not isinstance(v, bool) for v in value.values()):
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
