"""Emulate a commodity interconnect on one machine: ranks in a fresh network namespace whose
loopback is shaped by a token-bucket filter (``tc qdisc ... tbf``), root only.

On one machine the ranks talk over loopback, far faster next to a CPU's compute than PCIe is next
to a GPU's. Shaping the loopback restores the ratio of the hardware a benchmark speaks for: the
link really waits while the cores really compute, so overlap on this path is real.

Rate model: a 2-rank all-reduce of n bytes moves about 2n bytes through the (shared) loopback
queue, so at rate R bytes/s it takes about ``latency + 2n / R``. ``rate_for_ratio`` inverts it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from oases.planner.hardware import CLUSTERS, PAPER_REFERENCE_MODEL, comm_to_compute

SHAPED_ENV = "OASES_LINK_SHAPED"  # set inside the shaped namespace, so we never nest


@dataclass(frozen=True)
class LinkPreset:
    """How slow a region's all-reduce is next to that region's forward compute on real
    hardware: ``comm_to_compute`` = all-reduce time / forward time of one TP region."""

    name: str
    comm_to_compute: float
    source: str


# (cluster preset of planner.hardware, TP degree, dtype) whose ratio each link preset copies,
# for the paper's reference layer (H=2048, S=1024, 4 sequences per TP group): the 3090 servers
# at the paper's t=4 (PCIe) and at t=2 (one NVLink-bridged pair), DGX servers at t=8 in bf16.
_LINK_REFERENCES = {
    "rtx3090-pcie": ("rtx3090-pcie", 4, "fp32"),
    "rtx3090-nvlink": ("rtx3090-nvlink", 2, "fp32"),
    "a100-nvlink": ("a100-nvlink", 8, "bf16"),
    "h100-nvlink": ("h100-nvlink", 8, "bf16"),
    "h200-nvlink": ("h200-nvlink", 8, "bf16"),
}


def link_presets() -> dict[str, LinkPreset]:
    """The link presets, derived from the hardware presets (one place for hardware numbers):
    rtx3090-pcie comes out at about 1.57 (a 4.6 ms all-reduce of the H=2048 block output on a
    PCIe 4.0 host-staged ring over a mean(3.24, 2.69) ms attention and MLP forward, the
    compute the Oases paper, Li et al., IEEE TPDS 2025, measured). Until 2026-12-02 it was
    2.46, from the paper's 7.29 ms all-reduce, which its prototype timed over all 32 GPUs of
    the cluster, not over the 4 of a TP group (``planner.hardware``)."""
    presets = {}
    for name, (cluster, tp, dtype) in _LINK_REFERENCES.items():
        ratio = comm_to_compute(CLUSTERS[cluster], PAPER_REFERENCE_MODEL, tp, 4, dtype)
        presets[name] = LinkPreset(
            name,
            round(ratio, 2),
            f"planner.hardware preset {cluster}: region all-reduce / forward at H=2048, "
            f"S=1024, 4 sequences, t={tp}, {dtype}",
        )
    return presets


LINK_PRESETS = link_presets()


def shaping_unavailable() -> str | None:
    """None if this process can shape a loopback, else the reason it cannot."""
    if os.name != "posix" or os.geteuid() != 0:
        return "link shaping needs root (network namespaces and tc)"
    for tool in ("unshare", "tc", "ip"):
        if shutil.which(tool) is None:
            return f"link shaping needs the '{tool}' command"
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create a network namespace: {probe.stderr.strip()}"
    return None


def rate_for_ratio(
    allreduce_bytes: int, region_forward_s: float, ratio: float, world: int = 2
) -> float:
    """tbf rate (bytes/s) at which an all-reduce of ``allreduce_bytes`` over ``world`` ranks
    takes ``ratio`` x ``region_forward_s``: a ring moves 2(w-1)/w of the bytes per rank, and all
    ranks share the one loopback queue."""
    traffic = 2 * (world - 1) / world * allreduce_bytes * world
    return traffic / (ratio * region_forward_s)


def shaped_command(cmd: list[str], rate_bytes_per_s: float) -> list[str]:
    """``cmd`` wrapped to run in a new network namespace with a shaped loopback."""
    rate_kbit = max(int(rate_bytes_per_s * 8 / 1000), 8)
    # A real link earns no credit while idle, but a token bucket does: up to ``burst`` bytes go
    # at memory speed after every compute phase, which flatters synchronous schedules. So the
    # loopback MTU is lowered to 16 KiB and the bucket holds just two such packets; the queue is
    # deep so nothing is dropped (a drop would stall TCP for a retransmit timeout).
    script = (
        "set -e; ip link set lo mtu 16384; ip link set lo up; "
        f"tc qdisc add dev lo root tbf rate {rate_kbit}kbit burst 32kb limit 256mb; "
        'exec "$@"'
    )
    return ["unshare", "-n", "--", "sh", "-c", script, "oases-shaped", *cmd]


def run_shaped(
    cmd: list[str],
    rate_bytes_per_s: float | None,
    *,
    env: dict | None = None,
    timeout_s: float | None = None,
) -> subprocess.CompletedProcess:
    """Run ``cmd`` (on a shaped loopback when a rate is given), streaming its output."""
    full_env = dict(os.environ if env is None else env)
    if rate_bytes_per_s is not None:
        full_env[SHAPED_ENV] = str(rate_bytes_per_s)
        cmd = shaped_command(cmd, rate_bytes_per_s)
    return subprocess.run(cmd, env=full_env, timeout=timeout_s, check=False)
