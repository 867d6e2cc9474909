"""Collective times as NCCL prices and picks them, on the paths a group's ranks actually use.

NCCL's tuner (NVIDIA/nccl ``src/graph/tuning.cc``) prices every (algorithm, protocol) of a
collective as ``latency + bytes / bandwidth`` and runs the cheapest; this module does the same
with NCCL's structure and constants, and with each path's bus bandwidth from the public
microbenchmarks of ``planner.presets`` (where NCCL uses its own topology guesses)::

    ring    every rank sends to the next: all-reduce 2(n-1) steps, all-gather and
            reduce-scatter n-1; bandwidth = the slowest hop's bus bandwidth x n / steps
    tree    all-reduce only: a chain inside each server, a binary tree across servers
            (log2 of the servers' steps); bandwidth x 0.92 x 0.5, NCCL's size corrections
    nvls    all-reduce on a Hopper NVSwitch (NVLink SHARP): one switch reduction, 25 us
    protocols  LL (half the bandwidth, capped; lowest latency), LL128 (x0.92; NVLink paths
            only before Hopper), Simple (full bandwidth, highest latency)
    two_level  not run by NCCL on one communicator: reduce-scatter inside each sub-group
            (a bridged pair, or a server), the collective across sub-groups on 1/k of the
            bytes, all-gather inside; priced from the rings and trees above. Offered by
            ``algorithms=ALGORITHMS`` to see what a hierarchical runtime would gain.

Paths (``Route``): inside a server a group's ring runs at the server link's bus bandwidth with
every GPU's link carrying the ring both ways (``Link.duplex_bytes_per_s``: host-staged GeForce
PCIe is much slower both ways than one way); two ranks of an NVLink-bridged pair use the
bridge; whole bridged pairs of more ranks make a ring that alternates bridge and server link,
each GPU's server link carrying it one way, and the ring runs at the slower of the two (NCCL
does not route around the host-staged hops). Across servers the group's share of each server's
ports: every group of a partition (the TP groups of a degree, the DP groups) runs at once, so
a server's ports are split among its GPUs' groups. Latencies are NCCL's per-step hardware
latencies (NVLink, PCI, network rows) plus any the link adds (``Link.latency_s``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from oases.planner.clusters import Cluster, Link

OPS = ("all_reduce", "all_gather", "reduce_scatter")
PROTOCOLS = ("LL", "LL128", "Simple")
NCCL_ALGORITHMS = ("ring", "tree", "nvls")
ALGORITHMS = (*NCCL_ALGORITHMS, "two_level")

# NVIDIA/nccl src/graph/tuning.cc, ncclTunerConstantsDefaults (microseconds; GB/s); per protocol
# (LL, LL128, Simple).
BASE_LATENCY_US = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4), "nvls": (0.0, 0.0, 0.0)}
HW_LATENCY_US = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "nvls": (0.0, 0.0, 25.0)},
    "pcie": {"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7), "nvls": (0.0, 0.0, 0.0)},
    "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0), "nvls": (0.0, 0.0, 18.0)},
}
LL_MAX_BW_ONE_NODE = {"volta": 39.0, "ampere": 87.7, "hopper": 141.0}
LL_MAX_BW_NODES = (39.0, 20.4)  # 2 nodes, more (x86 Intel row; AMD's is 22.5, 19.0)
PER_CHANNEL_RING_LL128 = {"volta": 20.0, "ampere": 20.0, "hopper": 36.7}
PER_CHANNEL_TREE = {
    "volta": (26.5, 18.5, 10.0),
    "ampere": (24.0, 23.6, 17.8),
    "hopper": (38.7, 41.4, 36.0),
}  # 1 node, 2, more
PER_CHANNEL_TREE_LL128 = {
    "volta": (20.0, 20.0, 20.0),
    "ampere": (20.0, 20.0, 20.0),
    "hopper": (36.7, 36.7, 29.0),
}
NET_OVERHEAD_US = 1.0  # getNetOverhead: x86 Intel (x3 for Simple)
# treeCorrectionFactor: all-reduce trees at 64 B x 2^i
# fmt: off
TREE_CORRECTION = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0,
           1.0, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9,
              .9, .9, 1.0, 1.0, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7,
               .8, .9, .9, .9),
}
# fmt: on


@dataclass(frozen=True)
class Route:
    """What a group's collective crosses: ``ranks`` on ``nodes`` servers, ``per_node`` on each
    (at most), the bus bandwidth of its ring inside a server (``intra_bytes_per_s``, over a
    path of NCCL latency row ``intra_kind``) and its share of the ports of each server
    (``inter_bytes_per_s``); ``channels`` (NCCL's per-channel caps), ``ll128`` (whether NCCL
    enables LL128 on these paths), ``nvls_bytes_per_s`` (NVLink SHARP; 0 = none)."""

    ranks: int
    nodes: int
    per_node: int
    intra_kind: str
    intra_bytes_per_s: float
    inter_bytes_per_s: float
    channels: int
    ll128: bool
    arch: str
    intra_latency_s: float = 0.0
    inter_latency_s: float = 0.0
    nvls_bytes_per_s: float = 0.0

    @property
    def bus_bytes_per_s(self) -> float:
        """The ring's bus bandwidth: its slowest hop."""
        hops = ([self.intra_bytes_per_s] if self.per_node > 1 else []) + (
            [self.inter_bytes_per_s] if self.nodes > 1 else []
        )
        return min(hops) if hops else math.inf


@dataclass(frozen=True)
class Choice:
    """The (algorithm, protocol) NCCL's tuner runs for a collective, and its seconds."""

    algorithm: str
    protocol: str
    seconds: float
    bus_bytes_per_s: float  # the route's ring bus bandwidth (before protocol factors)


def arch_of(compute_capability: float) -> str:
    return "hopper" if compute_capability >= 9 else "ampere" if compute_capability >= 8 else "volta"


def route(cluster: Cluster, ranks: Iterable[int]) -> Route:
    """The paths a group of global ``ranks`` uses (rank r on server r // gpus_per_server; a
    bridge joins local GPUs 2i and 2i+1)."""
    ranks = sorted(set(ranks))
    s, gps = cluster.server, cluster.server.gpus_per_server
    per: dict[int, list[int]] = {}
    for r in ranks:
        if not 0 <= r < cluster.world_size:
            raise ValueError(
                f"rank {r} is outside {cluster.name} (world size {cluster.world_size})"
            )
        per.setdefault(r // gps, []).append(r % gps)
    local = set(per[ranks[0] // gps])
    per_node, nodes = max(len(v) for v in per.values()), len(per)
    used: list[Link] = []
    intra, kind, latency = math.inf, "pcie", 0.0
    if per_node > 1:
        pairs = s.pair_link is not None and all(r ^ 1 in local for r in local)
        if pairs and per_node == 2:  # one bridged pair: the bridge alone
            used, intra = [s.pair_link], s.pair_link.effective_bytes_per_s
        elif pairs:  # bridge, server link, bridge, ...: each GPU's server link one way
            used = [s.pair_link, s.link]
            intra = min(s.pair_link.effective_bytes_per_s, s.link.effective_bytes_per_s)
        else:  # a ring on the server link: each GPU's link both ways
            used, intra = [s.link], s.link.duplex_bytes_per_s
        kind = "nvlink" if all(link.kind == "nvlink" for link in used) else "pcie"
        latency = max(link.latency_s for link in used)
    inter, inter_latency = math.inf, 0.0
    if nodes > 1:
        net = cluster.inter_link
        assert net is not None  # check_cluster: several servers have an inter_link
        ports = net.effective_bytes_per_s * min(cluster.nics_per_server, gps)
        # every group of the partition crosses at once; what leaves a GPU crosses its own link
        inter = min(ports * per_node / gps, s.link.effective_bytes_per_s)
        inter_latency = net.latency_s
        used = [*used, net]
    cc = s.gpu.compute_capability
    ll128 = (
        all(link.kind == "nvlink" and not link.host_staged for link in used if link.kind != "net")
        and (nodes == 1 or cc >= 9.0)
        and bool(used)
    )
    nvls = (
        s.link.nvls_bus_bytes_per_s if nodes == 1 and kind == "nvlink" and s.link in used else 0.0
    )
    return Route(
        len(ranks),
        nodes,
        per_node,
        kind,
        intra,
        inter,
        min((link.channels for link in used), default=1),
        ll128,
        arch_of(cc),
        latency,
        inter_latency,
        nvls,
    )


def _bus_gbs(algorithm: str, protocol: str, r: Route) -> float:
    """NCCL's bus bandwidth (GB/s) of an algorithm and protocol after its refinements."""
    bw = r.bus_bytes_per_s / 1e9
    node_index = min(r.nodes, 3) - 1
    ll_max = LL_MAX_BW_ONE_NODE[r.arch] if r.nodes == 1 else LL_MAX_BW_NODES[min(r.nodes, 3) - 2]
    if algorithm == "ring":
        if protocol == "LL":
            return min(ll_max, bw * 0.5)
        if protocol == "LL128":
            return min(bw * 0.92, r.channels * PER_CHANNEL_RING_LL128[r.arch]) if r.ll128 else 0.0
        return bw
    if algorithm == "tree":
        bw = min(bw * 0.92, r.channels * PER_CHANNEL_TREE[r.arch][node_index])
        if protocol == "LL":
            return min(bw / 3.8, ll_max)
        if protocol == "LL128":
            return (
                min(
                    bw * (7 / 9 if r.nodes == 1 else 120 / 128),
                    r.channels * PER_CHANNEL_TREE_LL128[r.arch][node_index],
                )
                if r.ll128
                else 0.0
            )
        return bw
    return r.nvls_bytes_per_s / 1e9 if protocol == "Simple" else 0.0  # nvls


def _latency_us(op: str, algorithm: str, protocol: str, r: Route, nbytes: float) -> float:
    """NCCL's latency (microseconds) of an algorithm and protocol on a route."""
    p = PROTOCOLS.index(protocol)
    intra = HW_LATENCY_US[r.intra_kind][algorithm][p] + r.intra_latency_s * 1e6
    inter = HW_LATENCY_US["net"]["tree" if r.per_node == 1 else algorithm][
        p
    ] + r.inter_latency_s * 1e6 * (2 if protocol == "Simple" else 1)  # + the flush
    if algorithm == "nvls":
        return intra
    base = BASE_LATENCY_US[algorithm][p]
    if algorithm == "tree":
        return base + 2 * ((r.per_node - 1) * intra + int(math.log2(r.nodes)) * inter)
    steps = 2 * (r.ranks - 1) if op == "all_reduce" else r.ranks - 1
    crossing = 0 if r.nodes == 1 else 2 * (r.nodes - 1) if op == "all_reduce" else r.nodes - 1
    if r.nodes > 1:  # inter-node rings still launch a network post per step
        intra = max(intra, NET_OVERHEAD_US * (3 if protocol == "Simple" else 1))
    lat = base + (steps - crossing) * intra + crossing * inter
    if (
        protocol == "Simple"
        and r.nodes > 1
        and op == "all_reduce"
        and nbytes / (r.channels * r.ranks) >= 64
    ):
        lat *= 1.4 if r.arch != "volta" else 1.9  # NCCL: plateau effect of the ring
    return lat


def nccl_seconds(op: str, algorithm: str, protocol: str, r: Route, nbytes: float) -> float:
    """Seconds of one (algorithm, protocol) on a route, ``inf`` where NCCL does not offer it."""
    if r.ranks <= 1:
        return 0.0
    if algorithm in ("tree", "nvls") and op != "all_reduce":
        return math.inf
    bus = _bus_gbs(algorithm, protocol, r)
    if bus <= 0 or math.isinf(bus):
        return math.inf
    steps = 2 * (r.ranks - 1) if op == "all_reduce" else r.ranks - 1
    alg_gbs = bus * (0.5 if algorithm == "tree" else r.ranks / steps)
    if algorithm == "tree":
        log_size = int(math.log2(nbytes)) - 6 if nbytes >= 64 else -1
        if 0 <= log_size < 23:
            alg_gbs *= TREE_CORRECTION[protocol][log_size]
    return _latency_us(op, algorithm, protocol, r, nbytes) * 1e-6 + nbytes / (alg_gbs * 1e9)


def best(op: str, r: Route, nbytes: float, algorithms: Sequence[str] = NCCL_ALGORITHMS) -> Choice:
    """The cheapest (algorithm, protocol) of NCCL's on a route (``two_level`` is not one: see
    ``collective``)."""
    if r.ranks <= 1:
        return Choice("none", "none", 0.0, math.inf)
    options = [
        (nccl_seconds(op, a, p, r, nbytes), a, p)
        for a in algorithms
        if a != "two_level"
        for p in PROTOCOLS
    ]
    seconds, a, p = min(options)
    return Choice(a, p, seconds, r.bus_bytes_per_s)


def _two_level_groups(cluster: Cluster, ranks: list[int]) -> tuple[list[int], list[int]] | None:
    """(one inner group, one outer group) of the two-level schedule: whole servers across
    servers, else bridged pairs inside one; None if the group has no such structure."""
    gps = cluster.server.gpus_per_server
    servers = sorted({r // gps for r in ranks})
    if len(servers) > 1:
        inner = [r for r in ranks if r // gps == servers[0]]
        outer = [r for r in ranks if r % gps == ranks[0] % gps]
        return (inner, outer) if len(inner) > 1 else None
    if (
        cluster.server.pair_link is not None
        and len(ranks) > 2
        and all(r ^ 1 in ranks for r in ranks)
    ):
        return [ranks[0], ranks[0] ^ 1], [r for r in ranks if r % 2 == ranks[0] % 2]
    return None


def collective(
    cluster: Cluster,
    op: str,
    ranks: Iterable[int],
    nbytes: float,
    algorithms: Sequence[str] = NCCL_ALGORITHMS,
) -> Choice:
    """The cheapest way to run ``op`` over these global ranks among ``algorithms``;
    ``nbytes`` is the whole tensor (the all-gather's output, the reduce-scatter's input)."""
    if op not in OPS:
        raise ValueError(f"op={op!r}; valid: {', '.join(OPS)}")
    unknown = [a for a in algorithms if a not in ALGORITHMS]
    if unknown:
        raise ValueError(f"unknown algorithm(s) {unknown}; valid: {', '.join(ALGORITHMS)}")
    ranks = sorted(set(ranks))
    choice = best(op, route(cluster, ranks), nbytes, algorithms)
    split = _two_level_groups(cluster, ranks) if "two_level" in algorithms else None
    if split is not None:
        inner, outer = (route(cluster, g) for g in split)
        k = inner.ranks
        inside = [a for a in algorithms if a != "two_level"]
        if op == "all_reduce":
            parts = [
                best("reduce_scatter", inner, nbytes, inside),
                best("all_reduce", outer, nbytes / k, inside),
                best("all_gather", inner, nbytes, inside),
            ]
        elif op == "all_gather":
            parts = [
                best("all_gather", outer, nbytes / k, inside),
                best("all_gather", inner, nbytes, inside),
            ]
        else:
            parts = [
                best("reduce_scatter", inner, nbytes, inside),
                best("reduce_scatter", outer, nbytes / k, inside),
            ]
        seconds = sum(c.seconds for c in parts)
        if seconds < choice.seconds:
            choice = Choice(
                "two_level", "+".join(c.protocol for c in parts), seconds, choice.bus_bytes_per_s
            )
    return choice


def bus_factor(op: str, ranks: int) -> float:
    """nccl-tests' bus bandwidth over algorithm bandwidth: all-reduce 2(n-1)/n, all-gather and
    reduce-scatter (n-1)/n (so a figure's time is ``bus_factor * bytes / busbw``)."""
    return (2 if op == "all_reduce" else 1) * (ranks - 1) / ranks
