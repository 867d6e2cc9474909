"""The memory budget per device that ``oases plan``, ``oases simulate`` and ``parallel.plan =
"auto"`` plan under: one unit, one default, one sentence saying what it is.

Units: a budget is *given* in GB = 10^9 bytes, the unit printed on a card ("RTX 3090, 24 GB")
and in its datasheet (``--memory-gb``, ``parallel.memory_gb``); every memory the planner
*prints* (peaks, budgets) is in GiB = 2^30 bytes, as ``torch.cuda.memory_allocated`` and
``nvidia-smi`` count (24 GB = 22.35 GiB)::

    memory_budget(0, cluster_gpu_bytes, "NVIDIA GeForce RTX 3090")   95% of 24 GB
    memory_budget(20, ...)                                            20 GB = 18.63 GiB
    memory_budget(0, None, "x", unknown="why")                        no budget, and why

Default: ``DEFAULT_MEMORY_FRACTION`` of the device's memory wherever the costs know it: a
hardware preset or cluster file (its GPU), or a profile measured on GPUs (``oases profile``
records ``torch.cuda.get_device_properties(dev).total_memory``). The paper's planner plans
under 95% of device memory, the rest being the CUDA context, the allocator's fragmentation and
the communication buffers the model does not see. ``DEFAULT_BUDGET_HELP`` says it for
``--help``. CPU ranks have no device memory of their own (they share the host's RAM), and a
profile older than that field does not say: there the default is no budget, and the output
says why.
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


# --memory-gb's help in oases plan and oases simulate ("%%": argparse formats help with %)
DEFAULT_BUDGET_HELP = (
    "memory budget per device in GB = 10^9 bytes, as printed on the card (default: "
    f"{DEFAULT_MEMORY_FRACTION:.0%} of one device's memory: the GPU of a hardware preset or "
    "cluster file, or the GPU a profile was measured on; none for a profile of CPU ranks, "
    "or one made before profiles recorded their device's memory). Memory is printed in GiB = "
    "2^30 bytes"
).replace("%", "%%")


def memory_budget(
    memory_gb: float, device_bytes: float | None, device: str, unknown: str = ""
) -> Budget:
    """``memory_gb`` GB per device if > 0; else the default: ``DEFAULT_MEMORY_FRACTION`` of
    ``device_bytes`` (the memory of one ``device``, e.g. a GPU's name), or none where the
    device's memory is unknown (``device_bytes`` None; ``unknown`` says why)."""
    if memory_gb < 0:
        raise ValueError(f"--memory-gb={memory_gb} must be >= 0 (0: the default budget)")
    if memory_gb > 0:
        b = memory_gb * GB
        over = ""
        if device_bytes is not None and b > device_bytes:
            over = (
                f"; more than the {device_bytes / GB:g} GB = {device_bytes / GIB:.2f} GiB "
                f"of one {device}"
            )
        return Budget(
            b,
            f"{b / GIB:.2f} GiB per device (--memory-gb {memory_gb:g}: "
            f"{memory_gb:g} GB = 10^9 bytes{over})",
        )
    if device_bytes is None:
        why = unknown or f"{device} have no device memory the planner knows"
        return Budget(
            float("inf"), f"none: {why} (--memory-gb G plans under G GB = 10^9 bytes per rank)"
        )
    b = DEFAULT_MEMORY_FRACTION * device_bytes
    return Budget(
        b,
        f"{b / GIB:.2f} GiB per device, the default: "
        f"{DEFAULT_MEMORY_FRACTION:.0%} of one {device}'s {device_bytes / GB:g} GB "
        f"({device_bytes / GIB:.2f} GiB; --memory-gb G sets G GB = 10^9 bytes)",
    )


def costs_budget(memory_gb: float, costs: object) -> Budget:
    """``memory_budget`` for a ``planner.costs.Costs``: a hardware preset knows its GPU; a
    measured profile records the memory of the GPU it ran on (``machine.device_memory_bytes``),
    None for CPU ranks, nothing if it predates the field."""
    cluster = getattr(costs, "cluster", None)
    if cluster is not None:
        return memory_budget(memory_gb, cluster.memory_bytes, cluster.server.gpu.name)
    machine = getattr(costs, "machine", {}) or {}
    where = str(machine.get("device", "cpu")).split(":")[0]
    if "device_memory_bytes" not in machine:
        return memory_budget(
            memory_gb,
            None,
            where,
            unknown=(
                f"the profile does not record its {where} device's memory (made before oases "
                "profile recorded it; profile again for the default of "
                f"{DEFAULT_MEMORY_FRACTION:.0%} of a GPU's memory)"
            ),
        )
    device_bytes = machine["device_memory_bytes"]
    if device_bytes is None:
        return memory_budget(
            memory_gb,
            None,
            where,
            unknown=(
                f"the profile's {where} ranks have no device memory of their own (they share the "
                "host's RAM)"
            ),
        )
    name = machine.get("device_name") or where
    return memory_budget(memory_gb, float(device_bytes), name)
