"""Memory of this process: CUDA's allocator peak on a GPU, else the peak resident set; the
resident set now; on a GPU also the reserved peak and the device memory outside the allocator.

What a rank holds on a GPU, in the terms the profile, the simulator and ``oases plan --verify``
share::

    device baseline   CUDA context, NCCL's communicator buffers, library workspaces outside
                      torch's allocator (``device_baseline_bytes``: measured once the groups
                      have run a collective), paid once per rank
    allocated peak    the tensors (``torch.cuda.max_memory_allocated``): what the simulator's
                      memory walk predicts
    reserved peak     the allocator's cached segments (``max_memory_reserved``) >= allocated;
                      baseline + reserved is what the device must hold: the real OOM margin

On a CPU the peak resident set holds all three, and the profile's baseline is the resident set
before the model. The tensors alone (``peak_live_bytes``, ``tensor_bytes``) are counted on a
CPU from the profiler's allocation events: what the simulator's walk predicts there too."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import Tensor


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


def file_backed_memory_bytes() -> float:
    """This process's resident file-backed pages now (``RssFile``: mostly shared libraries'
    code, paged in as torch first runs a kernel; 0 where ``/proc`` is missing). A CPU's peak
    resident set counts them, a tensor accounting does not."""
    return (_proc_status_kb("RssFile") or 0) * 1024.0


def peak_reserved_mb(device: torch.device) -> float:
    """The allocator's peak reserved memory in MiB on CUDA (cached segments, >= the allocated
    peak); on a CPU the peak resident set, as ``peak_memory_mb``."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**20
    return peak_memory_mb(device)


def device_baseline_bytes(device: torch.device) -> float:
    """CUDA: device memory in use outside torch's caching allocator, ``(total - free) -
    memory_reserved`` from ``torch.cuda.mem_get_info``: the CUDA context, NCCL's buffers and
    library workspaces (and whatever another process holds on the same GPU: one rank per GPU
    is assumed). Call it after the process groups have run a collective (NCCL allocates its
    buffers then). CPU: 0 (the resident set holds everything: ``resident_memory_bytes``)."""
    if device.type != "cuda":
        return 0.0
    free, total = torch.cuda.mem_get_info(device)
    return float(max(0, (total - free) - torch.cuda.memory_reserved(device)))


@contextlib.contextmanager
def peak_live_bytes(device: torch.device) -> Iterator[dict[str, int]]:
    """Inside the block, measure the peak of live tensor bytes above those alive at its
    start; the dict it yields holds ``"peak"`` after the block. On a GPU CUDA's allocator
    peak (its peak statistics are reset); on a CPU the allocation and free events the
    profiler records from torch's CPU allocator (``profile_memory``), summed in time order
    (the resident set would also hold the allocator's free lists, gloo's buffers and code
    pages)."""
    out = {"peak": 0}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield out
        torch.cuda.synchronize(device)
        out["peak"] = torch.cuda.max_memory_allocated(device) - start
        return
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with prof:
        yield out
        ended = time.perf_counter()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):  # + an allocation, - a free
        live += e.nbytes()
        peak = max(peak, live)
    out["peak"] = peak
    out["counting_s"] = time.perf_counter() - ended  # the profiler's stop and this sum


def tensor_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the storages under ``tensors``, each storage counted once."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
    """The tensors a training step starts from: parameters, their gradients where kept, and
    the optimizer's state."""
    for p in model.parameters():
        yield p
        if p.grad is not None:
            yield p.grad
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, Tensor))
