"""Process state: the one place that reads the launcher's environment and builds process groups.

``init_distributed(tp)`` returns a ``ParallelContext`` that is passed down explicitly; nothing else
in Oases reads environment variables or keeps process-wide state. One more variable is read
here, only for testing: ``OASES_FAULT`` (``fault_spec()``), the fault that ``train/faults.py``
injects into a rank; unset in any real run.

Rank layout for world size W = tp * dp (TP groups are contiguous, so on a multi-GPU server a TP
group stays on one machine's fast links)::

    tp=2, dp=2:   TP groups {0,1} {2,3}     DP groups {0,2} {1,3}
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Group:
    """A communicator this rank belongs to: ``ranks`` (global ids), this rank's index in it,
    and the process group (``None`` when the group has a single member: no communication)."""

    name: str
    ranks: tuple[int, ...]
    rank: int
    pg: dist.ProcessGroup | None = field(default=None, compare=False)
    device: torch.device = field(default=torch.device("cpu"), compare=False)  # tensors it moves

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class ParallelContext:
    """Who this process is and which groups it talks in."""

    world_size: int
    rank: int
    local_rank: int
    tp: int
    dp: int
    tp_group: Group
    dp_group: Group
    world_group: Group
    device: torch.device
    backend: str
    timeout_s: float
    groups: dict[int, tuple[Group, Group]] = field(default_factory=dict, compare=False)
    merge_groups: dict[tuple[int, int], Group] = field(default_factory=dict, compare=False)

    def groups_for(self, tp: int) -> tuple[Group, Group]:
        """(TP group, DP group) at degree ``tp`` (built by ``init_distributed(degrees=...)``)."""
        if tp not in self.groups:
            raise ValueError(f"no process groups for tp={tp}: pass it in "
                             f"init_distributed(degrees=...) (built: {sorted(self.groups)})")
        return self.groups[tp]

    def merge_group(self, a: int, b: int) -> Group:
        """The group a batch reshard between degrees ``a`` and ``b`` runs over."""
        key = (min(a, b), max(a, b))
        if key not in self.merge_groups:
            raise ValueError(f"no reshard group between tp={a} and tp={b}")
        return self.merge_groups[key]

    @property
    def tp_rank(self) -> int:
        return self.tp_group.rank

    @property
    def dp_rank(self) -> int:
        return self.dp_group.rank

    def __str__(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size} tp={self.tp} (tp_rank {self.tp_rank}) "
            f"dp={self.dp} (dp_rank {self.dp_rank}) {self.backend} on {self.device}"
        )


def check_degrees(world_size: int, tp: int) -> None:
    """Raise ValueError unless tp is a positive divisor of world_size."""
    if tp < 1 or world_size % tp != 0:
        raise ValueError(
            f"parallel.tp={tp} must be a positive divisor of the world size {world_size}"
        )


def check_local_devices(local_rank: int, local_world_size: int, device_count: int) -> None:
    """ValueError unless every local rank of an NCCL job has a GPU of its own: more ranks than
    visible GPUs would share one (NCCL then fails far from the cause, or runs two ranks'
    memory on one device)."""
    if device_count < 1:
        raise ValueError("parallel.backend='nccl' needs a CUDA device; none is visible "
                         "(CUDA_VISIBLE_DEVICES?)")
    if local_world_size > device_count or local_rank >= device_count:
        raise ValueError(f"{max(local_world_size, local_rank + 1)} ranks on this machine "
                         f"(LOCAL_WORLD_SIZE={local_world_size}, LOCAL_RANK={local_rank}) but "
                         f"{device_count} visible GPU(s): one rank per GPU; start at most "
                         f"--nproc-per-node={device_count}")


def _group_options(backend: str, high_priority: bool) -> Any:
    """``pg_options`` of a group: NCCL's with ``is_high_priority_stream`` when asked (its
    collectives' kernels then go to a high-priority CUDA stream, scheduled ahead of compute
    kernels waiting beside them); None otherwise (gloo has no streams: the knob is ignored)."""
    if backend != "nccl" or not high_priority:
        return None
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    return options


def _new_group(ranks: list[int], timeout: datetime.timedelta,
               options: Any = None) -> dist.ProcessGroup | None:
    # Every rank must call new_group for every group, in the same order.
    return (dist.new_group(ranks, timeout=timeout, pg_options=options) if len(ranks) > 1
            else None)


def _groups_for(d: int, world_size: int, rank: int, timeout: datetime.timedelta,
                device: torch.device, tp_options: Any = None) -> tuple[Group, Group]:
    """This rank's TP group (contiguous ranks) and DP group (equal TP rank) at degree ``d``;
    ``tp_options``: the TP groups' ``pg_options``."""
    tp_group = dp_group = None
    index, tp_rank = divmod(rank, d)
    for i in range(world_size // d):
        ranks = list(range(i * d, (i + 1) * d))
        pg = _new_group(ranks, timeout, tp_options) if world_size > 1 else None
        if i == index:
            tp_group = Group("tp", tuple(ranks), tp_rank, pg, device)
    for j in range(d):
        ranks = list(range(j, world_size, d))
        pg = _new_group(ranks, timeout) if world_size > 1 else None
        if j == tp_rank:
            dp_group = Group("dp", tuple(ranks), index, pg, device)
    assert tp_group is not None and dp_group is not None
    return tp_group, dp_group


def _merge_group(a: int, b: int, world_size: int, rank: int, timeout: datetime.timedelta,
                 device: torch.device) -> Group:
    """The ranks whose degree-``a`` TP groups merge into this rank's degree-``b`` group and
    that hold the same shard (equal rank % a): a reshard between degrees a < b gathers (or
    slices) the batch over these b/a ranks, in rank order::

        world 4, a=1, b=4: {0,1,2,3}          world 4, a=2, b=4: {0,2} {1,3}
    """
    mine = None
    for base in range(0, world_size, b):
        for offset in range(a):
            ranks = [base + offset + j * a for j in range(b // a)]
            pg = _new_group(ranks, timeout) if world_size > 1 else None
            if rank in ranks:
                mine = Group(f"merge{a}-{b}", tuple(ranks), ranks.index(rank), pg, device)
    assert mine is not None
    return mine


def init_distributed(
    tp: int = 1, *, backend: str | None = None, timeout_s: float = 60.0,
    degrees: tuple[int, ...] = (), high_priority_tp: bool = False,
) -> ParallelContext:
    """Join (or reuse) the default process group and build the TP and DP groups.

    Launch under ``torchrun`` (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); an already
    initialized default group (a test's file:// rendezvous) is reused; with neither, this is a
    single process and no collective ever runs. ``degrees``: further TP degrees a plan mixes
    in; their TP/DP groups and the merge groups between every pair are built too.
    ``backend`` is "gloo", "nccl" or None/"auto"
    (NCCL when CUDA is available, else gloo). Every collective of a group made here is bounded
    by ``timeout_s`` (a reused default group keeps the timeout it was created with), so a dead
    peer ends the job with an error instead of a hang. The degree check runs before any
    collective, so a bad ``tp`` fails on every rank at once.

    NCCL: each local rank takes GPU ``LOCAL_RANK`` (ValueError when the machine's ranks,
    ``LOCAL_WORLD_SIZE``, outnumber the visible GPUs: ``check_local_devices``); the default
    group is created eagerly on that device (``device_id``: its communicator exists at once
    and the groups made here are split from it); ``high_priority_tp`` puts the TP groups'
    collectives on high-priority streams (``parallel.high_priority_tp``; ignored by gloo).
    """
    if timeout_s <= 0:
        raise ValueError(f"parallel.timeout_s={timeout_s} must be positive")
    if dist.is_available() and dist.is_initialized():
        world_size, rank = dist.get_world_size(), dist.get_rank()
        existing = str(dist.get_backend())
        if backend not in (None, "auto") and backend != existing:
            raise ValueError(f"parallel.backend={backend!r} but the process group already "
                             f"uses {existing!r}")
        backend = "nccl" if "nccl" in existing else "gloo"
    else:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        if backend in (None, "auto"):
            backend = "nccl" if torch.cuda.is_available() else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(local_rank + 1)))
    check_degrees(world_size, tp)

    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("parallel.backend='nccl' needs CUDA, which is not available")
        check_local_devices(local_rank, local_world_size, torch.cuda.device_count())
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    timeout = datetime.timedelta(seconds=timeout_s)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout,
                                device_id=device if backend == "nccl" else None)
    tp_options = _group_options(backend, high_priority_tp)

    all_degrees = sorted({tp, *degrees})
    for d in all_degrees:
        check_degrees(world_size, d)
    # Every rank creates every group, in this same order (new_group is collective).
    groups = {d: _groups_for(d, world_size, rank, timeout, device, tp_options)
              for d in all_degrees}
    merges = {(a, b): _merge_group(a, b, world_size, rank, timeout, device)
              for a in all_degrees for b in all_degrees if a < b}
    tp_group, dp_group = groups[tp]
    dp = world_size // tp
    world = Group("world", tuple(range(world_size)), rank,
                  dist.group.WORLD if world_size > 1 else None, device)
    return ParallelContext(
        world_size=world_size,
        rank=rank,
        local_rank=local_rank,
        tp=tp,
        dp=dp,
        tp_group=tp_group,
        dp_group=dp_group,
        world_group=world,
        groups=groups,
        merge_groups=merges,
        device=device,
        backend=backend,
        timeout_s=timeout_s,
    )


def launched_by_torchrun() -> bool:
    """True when this process is one rank started by torchrun / torch elastic."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def launch_identity() -> tuple[int, int]:
    """(global rank, attempt) of this process as its launcher set them: ``RANK`` and
    ``TORCHELASTIC_RESTART_COUNT`` (torchrun's agent and oases' supervisor both count restarts
    there; 0 for the first attempt and outside any launcher)."""
    return (int(os.environ.get("RANK", "0")),
            int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))


def fault_spec() -> str:
    """``OASES_FAULT``: a testing hook, the fault to inject into this rank (``train/faults.py``
    parses it; empty, the default, injects nothing). Read at each call, not at import."""
    return os.environ.get("OASES_FAULT", "")


def release_groups(ctx: ParallelContext) -> None:
    """Destroy the process groups ``ctx`` built (not the default group), when a context is
    replaced by another (the training loop's first context, before it has read a plan): each
    holds a communicator (NCCL: device buffers and a stream) that would live to the end."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    pgs = {id(g.pg): g.pg for pair in ctx.groups.values() for g in pair if g.pg is not None}
    pgs.update({id(g.pg): g.pg for g in ctx.merge_groups.values() if g.pg is not None})
    for pg in pgs.values():
        if pg is not dist.group.WORLD:
            dist.destroy_process_group(pg)


def close_distributed() -> None:
    """Destroy the default process group (and its communication threads) before the process
    exits; left to interpreter shutdown, gloo's threads can abort the process."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def build_tp_mesh(ctx: ParallelContext, tp: int | None = None) -> Any:
    """The "tp" sub-mesh of a (dp, tp) ``DeviceMesh`` at degree ``tp`` (default ``ctx.tp``; for
    DTensor: checkpoints, the torch-tp peer), or None when nothing is sharded across processes
    (tp == 1 or one process). Collective: every rank calls it, in the same order. The row-major
    (dp, tp) layout puts ranks ``i*tp .. i*tp+tp-1`` in one TP mesh, exactly the TP group of
    ``ctx.groups_for(tp)`` (checked)."""
    tp = ctx.tp if tp is None else tp
    if tp == 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size // tp, tp),
                            mesh_dim_names=("dp", "tp"))
    tp_mesh = mesh["tp"]
    ranks = tuple(int(r) for r in tp_mesh.mesh.flatten().tolist())
    group = ctx.groups_for(tp)[0]
    if ranks != group.ranks:
        raise RuntimeError(f"DeviceMesh TP ranks {ranks} differ from the TP group {group}")
    return tp_mesh
