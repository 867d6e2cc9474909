"""The memory budget per device that ``oases plan``, ``oases simulate`` and ``parallel.plan =
"auto"`` plan under: one unit, one default, one sentence saying what it is.

Units: a budget is *given* in GB = 10^9 bytes, the unit printed on a card ("RTX 3090, 24 GB")
and in its datasheet (``--memory-gb``, ``parallel.memory_gb``); every memory the planner
*prints* (peaks, budgets) is in GiB = 2^30 bytes, as ``torch.cuda.memory_allocated`` and
``nvidia-smi`` count (24 GB = 22.35 GiB)::

    memory_budget(0, cluster_gpu_bytes, "NVIDIA GeForce RTX 3090")   95% of 24 GB
    memory_budget(20, ...)                                            20 GB = 18.63 GiB
    memory_budget(0, None, "cpu ranks (profile)")                     no budget

Default: ``DEFAULT_MEMORY_FRACTION`` of the device's memory where the costs know the device
(a hardware preset or cluster file): the paper's planner plans under 95% of device memory, the
rest being the CUDA context, the allocator's fragmentation and the communication buffers the
model does not see. A measured profile of CPU ranks has no device memory of its own: there the
default is no budget, and the output says so.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9  # what --memory-gb counts: as printed on the card
GIB = 2**30  # what the planner prints
DEFAULT_MEMORY_FRACTION = 0.95


@dataclass(frozen=True)
class Budget:
    """``bytes`` per device (``inf``: none) and the sentence that says where it comes from."""

    bytes: float
    text: str

    @property
    def limited(self) -> bool:
        return self.bytes != float("inf")


def memory_budget(memory_gb: float, device_bytes: float | None, device: str) -> Budget:
    """``memory_gb`` GB per device if > 0; else the default: ``DEFAULT_MEMORY_FRACTION`` of
    ``device_bytes`` (the memory of one ``device``, e.g. a GPU's name), or none where the
    device's memory is unknown (``device_bytes`` None)."""
    if memory_gb < 0:
        raise ValueError(f"--memory-gb={memory_gb} must be >= 0 (0: the default budget)")
    if memory_gb > 0:
        b = memory_gb * GB
        over = ""
        if device_bytes is not None and b > device_bytes:
            over = (f"; more than the {device_bytes / GB:g} GB = {device_bytes / GIB:.2f} GiB "
                    f"of one {device}")
        return Budget(b, f"{b / GIB:.2f} GiB per device (--memory-gb {memory_gb:g}: "
                         f"{memory_gb:g} GB = 10^9 bytes{over})")
    if device_bytes is None:
        return Budget(float("inf"), f"none: {device} have no device memory the planner knows "
                                    "(--memory-gb G plans under G GB = 10^9 bytes per rank)")
    b = DEFAULT_MEMORY_FRACTION * device_bytes
    return Budget(b, f"{b / GIB:.2f} GiB per device, the default: "
                     f"{DEFAULT_MEMORY_FRACTION:.0%} of one {device}'s {device_bytes / GB:g} GB "
                     f"({device_bytes / GIB:.2f} GiB; --memory-gb G sets G GB = 10^9 bytes)")


def costs_budget(memory_gb: float, costs: object) -> Budget:
    """``memory_budget`` for a ``planner.costs.Costs``: a hardware preset knows its GPU; a
    measured profile names the device its ranks ran on but not its memory."""
    cluster = getattr(costs, "cluster", None)
    if cluster is not None:
        return memory_budget(memory_gb, cluster.memory_bytes, cluster.server.gpu.name)
    machine = getattr(costs, "machine", {}) or {}
    where = str(machine.get("device", "cpu")).split(":")[0]
    return memory_budget(memory_gb, None, f"the profile's {where} ranks")
