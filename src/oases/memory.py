"""Peak memory of this process: CUDA's allocator peak on a GPU, else the peak resident set."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak window (CUDA allocator stats; on Linux, the process's VmHWM)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory in MiB since the start or the last ``reset_peak_memory``."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB -> MiB
    except OSError:
        pass
    import resource  # not Linux: ru_maxrss (bytes on macOS)

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
