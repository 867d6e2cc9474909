"""Memory of this process: CUDA's allocator peak on a GPU, else the peak resident set; and the
resident set now."""

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


def _proc_status_kb(key: str) -> int | None:
    """A ``/proc/self/status`` field in kB (``VmHWM``, ``VmRSS``); None off Linux."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory in MiB since the start or the last ``reset_peak_memory``."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak_kb = _proc_status_kb("VmHWM")
    if peak_kb is not None:
        return peak_kb / 1024  # kB -> MiB
    import resource  # not Linux: ru_maxrss (bytes on macOS)

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def resident_memory_bytes() -> float:
    """This process's resident set now (0 where ``/proc`` is missing)."""
    return (_proc_status_kb("VmRSS") or 0) * 1024.0
