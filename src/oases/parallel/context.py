"""Process state: the one place that reads the launcher's environment and builds process groups.

``init_distributed(tp)`` returns a ``ParallelContext`` that is passed down explicitly; nothing else
in Oases reads environment variables or keeps process-wide state. One more variable is read
here, only for testing: ``OASES_FAULT`` (``fault_spec()``), the fault that ``train/faults.py``
injects into a rank; unset in any real run.

Rank layout for world size W = pp * dp * tp: TP innermost (TP groups are contiguous, so on a
multi-GPU server a TP group stays on one machine's fast links), then DP, then the pipeline
stages (across servers: only activations cross a stage boundary)::

    tp=2, dp=2:          TP groups {0,1} {2,3}     DP groups {0,2} {1,3}
    pp=2, tp=2, dp=2:    stage 0 = ranks 0-3, stage 1 = ranks 4-7, each laid out as above
                         (TP {0,1} {2,3} | {4,5} {6,7}; DP {0,2} {1,3} | {4,6} {5,7})

global rank = pp_rank * (W / pp) + stage rank, where the stage rank is the rank inside the
stage's own tp x dp world (``stage_ranks``). ``pp_outer=False`` turns it around (stage rank
* pp + pp_rank: a pipeline's stages on neighbouring ranks, e.g. inside one server, and each
stage's TP and DP groups strided across servers). Every stage builds its TP, DP and reshard
groups over its own ranks. Across stages: the ``pp`` group (the ranks of one stage rank in
every stage: the loss and the gradient norm), the ``embed`` group (the first and last stage's
ranks of one stage rank: a tied embedding's gradient) and, per boundary and stage rank, two
point-to-point pairs, one a direction (``p2p``; NCCL runs a group's operations in order on
one stream, so a receive posted early in one direction never blocks a send in the other)::

    pp=2, tp=2, dp=1:    pp groups {0,2} {1,3}   embed {0,2} {1,3}   p2p fwd/bwd {0,2} {1,3}

and two more pairs from the last stage back to the first (keyed "wrap-next" on the last stage,
"wrap-prev" on the first): the interleaved schedule's last chunk of a round hands its output
to the first stage's next chunk (``oases.stages.StageLayout``).
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
    pp: int = 1
    pp_rank: int = 0
    pp_outer: bool = True  # the rank layout (``stage_ranks``)
    stage_group: Group | None = None  # this stage's ranks (None: one stage, ``world_group``)
    pp_group: Group | None = None  # this stage rank in every stage
    embed_group: Group | None = None  # this stage rank on the first and last stage
    # ("fwd" | "bwd", "prev" | "next") -> the pair with the neighbouring stage's rank
    p2p_groups: dict[tuple[str, str], Group] = field(default_factory=dict, compare=False)

    @property
    def stage(self) -> Group:
        """The ranks of this pipeline stage (the whole world without a pipeline)."""
        return self.stage_group if self.stage_group is not None else self.world_group

    @property
    def stage_size(self) -> int:
        """Ranks per pipeline stage: the tp x dp world every stage lays out alike."""
        return self.world_size // self.pp

    @property
    def prev_rank(self) -> int | None:
        """The previous stage's rank of the same stage rank (None on the first stage)."""
        group = self.p2p_groups.get(("fwd", "prev"))
        return None if group is None else group.ranks[0]

    @property
    def next_rank(self) -> int | None:
        """The next stage's rank of the same stage rank (None on the last stage)."""
        group = self.p2p_groups.get(("fwd", "next"))
        return None if group is None else group.ranks[1]

    def groups_for(self, tp: int) -> tuple[Group, Group]:
        """(TP group, DP group) at degree ``tp`` (built by ``init_distributed(degrees=...)``)."""
        if tp not in self.groups:
            raise ValueError(
                f"no process groups for tp={tp}: pass it in "
                f"init_distributed(degrees=...) (built: {sorted(self.groups)})"
            )
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
        pp = f"pp={self.pp} (stage {self.pp_rank}) " if self.pp > 1 else ""
        return (
            f"rank {self.rank}/{self.world_size} {pp}tp={self.tp} (tp_rank {self.tp_rank}) "
            f"dp={self.dp} (dp_rank {self.dp_rank}) {self.backend} on {self.device}"
        )


def check_degrees(world_size: int, tp: int, pp: int = 1) -> None:
    """Raise ValueError unless pp divides world_size and tp the ranks of one stage."""
    if pp < 1 or world_size % pp != 0:
        raise ValueError(
            f"parallel.pp={pp} must be a positive divisor of the world size {world_size}"
        )
    stage = world_size // pp
    if tp < 1 or stage % tp != 0:
        where = f"the {stage} ranks of a pipeline stage" if pp > 1 else "the world size"
        raise ValueError(f"parallel.tp={tp} must be a positive divisor of {where} {stage}")


def stage_ranks(world_size: int, pp: int, stage: int, pp_outer: bool = True) -> list[int]:
    """The global ranks of pipeline ``stage``, in stage-rank order (module docstring)."""
    size = world_size // pp
    if pp_outer:
        return [stage * size + i for i in range(size)]
    return [i * pp + stage for i in range(size)]


def check_local_devices(local_rank: int, local_world_size: int, device_count: int) -> None:
    """ValueError unless every local rank of an NCCL job has a GPU of its own: more ranks than
    visible GPUs would share one (NCCL then fails far from the cause, or runs two ranks'
    memory on one device)."""
    if device_count < 1:
        raise ValueError(
            "parallel.backend='nccl' needs a CUDA device; none is visible (CUDA_VISIBLE_DEVICES?)"
        )
    if local_world_size > device_count or local_rank >= device_count:
        raise ValueError(
            f"{max(local_world_size, local_rank + 1)} ranks on this machine "
            f"(LOCAL_WORLD_SIZE={local_world_size}, LOCAL_RANK={local_rank}) but "
            f"{device_count} visible GPU(s): one rank per GPU; start at most "
            f"--nproc-per-node={device_count}"
        )


def _group_options(backend: str, high_priority: bool) -> Any:
    """``pg_options`` of a group: NCCL's with ``is_high_priority_stream`` when asked (its
    collectives' kernels then go to a high-priority CUDA stream, scheduled ahead of compute
    kernels waiting beside them); None otherwise (gloo has no streams: the knob is ignored)."""
    if backend != "nccl" or not high_priority:
        return None
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    return options


def _new_group(
    ranks: list[int], timeout: datetime.timedelta, options: Any = None
) -> dist.ProcessGroup | None:
    # Every rank must call new_group for every group, in the same order.
    return dist.new_group(ranks, timeout=timeout, pg_options=options) if len(ranks) > 1 else None


def _groups_for(
    d: int,
    members: list[int],
    rank: int,
    timeout: datetime.timedelta,
    device: torch.device,
    tp_options: Any = None,
    many: bool = True,
) -> tuple[Group, Group] | None:
    """The TP group (contiguous stage ranks) and DP group (equal TP rank) at degree ``d`` of
    the stage whose global ranks are ``members`` (in stage-rank order), for this ``rank``
    (None if it is not a member); ``tp_options``: the TP groups' ``pg_options``; ``many``:
    more than one process in the job (else no process group is made)."""
    tp_group = dp_group = None
    size = len(members)
    mine = members.index(rank) if rank in members else -1
    index, tp_rank = divmod(mine, d)
    for i in range(size // d):
        ranks = members[i * d : (i + 1) * d]
        pg = _new_group(ranks, timeout, tp_options) if many else None
        if mine >= 0 and i == index:
            tp_group = Group("tp", tuple(ranks), tp_rank, pg, device)
    for j in range(d):
        ranks = members[j::d]
        pg = _new_group(ranks, timeout) if many else None
        if mine >= 0 and j == tp_rank:
            dp_group = Group("dp", tuple(ranks), index, pg, device)
    if mine < 0:
        return None
    assert tp_group is not None and dp_group is not None
    return tp_group, dp_group


def _merge_group(
    a: int,
    b: int,
    members: list[int],
    rank: int,
    timeout: datetime.timedelta,
    device: torch.device,
    many: bool = True,
) -> Group | None:
    """The ranks whose degree-``a`` TP groups merge into this rank's degree-``b`` group and
    that hold the same shard (equal stage rank % a), in the stage of global ranks
    ``members``: a reshard between degrees a < b gathers (or slices) the batch over these b/a
    ranks, in rank order (None if ``rank`` is not in the stage)::

        world 4, a=1, b=4: {0,1,2,3}          world 4, a=2, b=4: {0,2} {1,3}
    """
    mine = None
    for base in range(0, len(members), b):
        for offset in range(a):
            ranks = [members[base + offset + j * a] for j in range(b // a)]
            pg = _new_group(ranks, timeout) if many else None
            if rank in ranks:
                mine = Group(f"merge{a}-{b}", tuple(ranks), ranks.index(rank), pg, device)
    return mine


def _pipeline_groups(
    world_size: int,
    pp: int,
    rank: int,
    pp_outer: bool,
    timeout: datetime.timedelta,
    device: torch.device,
) -> dict[str, Any]:
    """The groups across stages (module docstring), built by every rank in one order:
    ``stage_group``, ``pp_group``, ``embed_group`` and ``p2p_groups`` of ``ParallelContext``."""
    stages = [stage_ranks(world_size, pp, s, pp_outer) for s in range(pp)]
    out: dict[str, Any] = {"p2p_groups": {}}
    for s, members in enumerate(stages):
        pg = _new_group(members, timeout)
        if rank in members:
            out["stage_group"] = Group("stage", tuple(members), members.index(rank), pg, device)
            out["pp_rank"] = s
    for i in range(world_size // pp):
        column = [members[i] for members in stages]
        for name, ranks in (("pp", column), ("embed", [column[0], column[-1]])):
            pg = _new_group(ranks, timeout)
            if rank in ranks:
                out[f"{name}_group"] = Group(name, tuple(ranks), ranks.index(rank), pg, device)
        for s in range(pp):  # (s = pp - 1: the pair that wraps around)
            for direction in ("fwd", "bwd"):  # one pair a direction (module docstring)
                pair = [column[s], column[(s + 1) % pp]]
                pg = _new_group(pair, timeout)
                if rank in pair:
                    side = "next" if rank == pair[0] else "prev"
                    side = side if s < pp - 1 else f"wrap-{side}"
                    out["p2p_groups"][direction, side] = Group(
                        f"p2p-{direction}", tuple(pair), pair.index(rank), pg, device
                    )
    return out


def init_distributed(
    tp: int = 1,
    *,
    backend: str | None = None,
    timeout_s: float = 60.0,
    degrees: tuple[int, ...] = (),
    high_priority_tp: bool = False,
    pp: int = 1,
    pp_outer: bool = True,
) -> ParallelContext:
    """Join (or reuse) the default process group and build the TP and DP groups (of every
    pipeline stage, ``pp`` > 1: ``stage_ranks``, and the groups across stages).

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
            raise ValueError(
                f"parallel.backend={backend!r} but the process group already uses {existing!r}"
            )
        backend = "nccl" if "nccl" in existing else "gloo"
    else:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        if backend in (None, "auto"):
            backend = "nccl" if torch.cuda.is_available() else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(local_rank + 1)))
    check_degrees(world_size, tp, pp)

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
        dist.init_process_group(
            backend, timeout=timeout, device_id=device if backend == "nccl" else None
        )
    tp_options = _group_options(backend, high_priority_tp)

    all_degrees = sorted({tp, *degrees})
    for d in all_degrees:
        check_degrees(world_size, d, pp)
    # Every rank creates every group, in this same order (new_group is collective).
    stages = [stage_ranks(world_size, pp, s, pp_outer) for s in range(pp)]
    many = world_size > 1
    groups, merges = {}, {}
    for d in all_degrees:
        for members in stages:
            built = _groups_for(d, members, rank, timeout, device, tp_options, many)
            if built is not None:
                groups[d] = built
    for a in all_degrees:
        for b in all_degrees:
            if a < b:
                for members in stages:
                    built_merge = _merge_group(a, b, members, rank, timeout, device, many)
                    if built_merge is not None:
                        merges[a, b] = built_merge
    pipeline = _pipeline_groups(world_size, pp, rank, pp_outer, timeout, device) if pp > 1 else {}
    tp_group, dp_group = groups[tp]
    dp = world_size // (pp * tp)
    world = Group(
        "world",
        tuple(range(world_size)),
        rank,
        dist.group.WORLD if world_size > 1 else None,
        device,
    )
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
        pp=pp,
        pp_outer=pp_outer,
        **pipeline,
    )


def launch_identity() -> tuple[int, int]:
    """(global rank, attempt) of this process as its launcher set them: ``RANK`` and
    ``TORCHELASTIC_RESTART_COUNT`` (torchrun's agent and oases' supervisor both count restarts
    there; 0 for the first attempt and outside any launcher)."""
    return (
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    )


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
    across = [ctx.stage_group, ctx.pp_group, ctx.embed_group, *ctx.p2p_groups.values()]
    pgs.update({id(g.pg): g.pg for g in across if g is not None and g.pg is not None})
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
    ``ctx.groups_for(tp)`` (checked); with pipeline stages, a (pp, dp, tp) mesh (the default
    ``pp_outer`` layout)."""
    tp = ctx.tp if tp is None else tp
    if tp == 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed.device_mesh import init_device_mesh

    if ctx.pp > 1:
        mesh = init_device_mesh(
            ctx.device.type, (ctx.pp, ctx.stage_size // tp, tp), mesh_dim_names=("pp", "dp", "tp")
        )
    else:
        mesh = init_device_mesh(
            ctx.device.type, (ctx.world_size // tp, tp), mesh_dim_names=("dp", "tp")
        )
    tp_mesh = mesh["tp"]
    ranks = tuple(int(r) for r in tp_mesh.mesh.flatten().tolist())
    group = ctx.groups_for(tp)[0]
    if ranks != group.ranks:
        raise RuntimeError(f"DeviceMesh TP ranks {ranks} differ from the TP group {group}")
    return tp_mesh
