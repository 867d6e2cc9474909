"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): atomic, resharding, safe to read.

Layout of a checkpoint folder (``checkpoint.dir``, default ``<run_dir>/checkpoints``)::

    step_000120/            a complete checkpoint: renamed from step_000120.tmp when finished
        .metadata           DCP's index (read with a restricted unpickler, see below)
        __0_0.distcp ...    tensors, one file per writing rank (torch.save of plain tensors)
        oases.json          step, data position, resolved config, layout, the effective run
                            (``run``: train.effective), every file's size
        COMPLETE            written last inside the .tmp folder, before the rename
    step_000130.tmp/        a save in progress (or killed): never read, removed by the next save

Saving is atomic: every rank writes into ``step_N.tmp``, then rank 0 writes ``oases.json`` and
``COMPLETE`` (fsynced) and renames the folder; the rename is the commit. Older complete
checkpoints beyond ``checkpoint.keep`` are deleted only after that. A kill at any moment leaves
the previous complete checkpoint as ``latest_checkpoint``'s answer.

Resharding. Keys name the *full* (unsharded) tensors, so any tp reads any other tp's files:

    model.<param>              replicated parameter (norms, row-parallel biases, pos_embed)
    model.<param>/part<i>      part i of a sharded parameter (fused Q, K, V are parts 0, 1, 2)
    optim.<param>.exp_avg[/part<i>], optim.<param>.exp_avg_sq[/part<i>], optim.<param>.step
    rng.rank<r>.cpu, rng.rank<r>.cuda   each rank's torch RNG state (uint8 tensors)

Part i of a sharded parameter is saved as a ``DTensor`` sharded along ``ShardSpec.dim`` over the
TP sub-mesh of a (dp, tp) device mesh at the degree of the parameter's region (a mixed-degree plan
passes one mesh per degree), with the part's full shape. A padded part (the
vocabulary) has ``parts[i]`` real rows; with the chunk size c = ceil(parts[i] / tp), rank r's
real rows are ``[r*c, min((r+1)*c, parts[i]))`` - exactly ``torch.chunk``'s uneven chunks, which
is how DTensor places ``Shard(dim)``, so the padding is sliced off before saving and zero-filled
on loading. DCP writes replicated tensors once (it de-duplicates equal keys across ranks) and
each shard once (the DP replicas of a shard have the same key and offset). Loading builds the
same keys in the *current* layout and lets DCP read the overlapping pieces, so a run resumes at
any tp and under any plan (uniform or mixed), whatever layout saved it.

Safety: DCP 2.13 reads tensors with ``torch.load(weights_only=True)`` but its ``.metadata`` with
a plain ``pickle.load``, and it hands "bytes" entries to ``torch.load(weights_only=False)``.
``safe_load.SafeReader`` reads ``.metadata`` with an unpickler that resolves only DCP's metadata
dataclasses, ``torch.Size``, torch dtypes/layouts/memory formats and ``pathlib`` paths (every
other global is refused), and ``safe_load.TensorOnlyPlanner`` refuses bytes entries, so reading
a checkpoint never runs pickled code.
Extras are JSON; RNG states are tensors.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from oases.config import Config, config_to_dict
from oases.parallel import comm
from oases.parallel.apply import parameter_degrees
from oases.parallel.context import ParallelContext
from oases.parallel.layers import ShardSpec, shard_spec
from oases.train import faults

FORMAT_VERSION = 1
MANIFEST = "oases.json"
COMPLETE = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def checkpoint_root(cfg: Config) -> Path:
    """``checkpoint.dir``, or ``<run_dir>/checkpoints`` when it is empty."""
    return Path(cfg.checkpoint.dir or Path(cfg.train.run_dir) / "checkpoints")


def is_complete(path: Path) -> bool:
    return _STEP_DIR.match(path.name) is not None and (path / COMPLETE).is_file()


def complete_checkpoints(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """(step, path) of the complete checkpoints in ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))]
    return sorted((s, p) for s, p in found if is_complete(p))


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint of the highest step in ``root``; ``.tmp`` and unfinished ignored."""
    done = complete_checkpoints(root)
    return done[-1][1] if done else None


def read_manifest(path: Path) -> dict[str, Any]:
    """Check that ``path`` is a complete, untruncated checkpoint; return its ``oases.json``.

    ValueError naming the path for a missing folder, a missing ``COMPLETE`` marker, an
    unreadable manifest or a file whose size differs from the one recorded at save time.
    """
    if not path.is_dir():
        raise ValueError(f"checkpoint {path}: no such checkpoint folder")
    if not (path / COMPLETE).is_file():
        raise ValueError(f"checkpoint {path}: incomplete (no {COMPLETE} marker)")
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"checkpoint {path}: unreadable {MANIFEST} ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        raise ValueError(f"checkpoint {path}: {MANIFEST} is not format {FORMAT_VERSION}")
    for name, size in manifest.get("files", {}).items():
        f = path / name
        if not f.is_file():
            raise ValueError(f"checkpoint {path}: missing file {name}")
        if f.stat().st_size != size:
            raise ValueError(
                f"checkpoint {path}: {name} has {f.stat().st_size} bytes, {size} when saved"
                " (truncated or corrupt)"
            )
    return manifest


# ---------------------------------------------------------------- state in the current layout


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


def _parts(local: Tensor, spec: ShardSpec, tp_rank: int, tp: int) -> list[tuple[Tensor, Any]]:
    """This rank's real rows of each part of a shard, with each part's full shape.

    A view of ``local`` per part: [.., padded_i / tp, ..] narrowed to the real rows."""
    sizes = [p // tp for p in spec.padded_parts(tp)]
    out = []
    for piece, full in zip(local.split(sizes, dim=spec.dim), spec.parts):
        c = piece.shape[spec.dim]
        real = max(0, min(c, full - tp_rank * c))
        shape = list(local.shape)
        shape[spec.dim] = full
        out.append((piece.narrow(spec.dim, 0, real), torch.Size(shape)))
    return out


def _entries(
    name: str, t: Tensor, spec: ShardSpec | None, tp: int, ctx: ParallelContext, mesh: Any
) -> dict[str, Tensor]:
    """Checkpoint entries of one tensor with a parameter's layout (sharded over the TP group of
    degree ``tp``, whose mesh is ``mesh``): views or DTensors of ``t``."""
    if spec is None:
        return {name: t}
    out: dict[str, Tensor] = {}
    tp_rank = ctx.groups_for(tp)[0].rank
    for i, (piece, full_shape) in enumerate(_parts(t, spec, tp_rank, tp)):
        if mesh is None:
            out[f"{name}/part{i}"] = piece
        else:
            from torch.distributed.tensor import DTensor, Shard

            out[f"{name}/part{i}"] = DTensor.from_local(
                piece,
                mesh,
                [Shard(spec.dim)],
                run_check=False,
                shape=full_shape,
                stride=_contiguous_stride(full_shape),
            )
    return out


def _adam_state(optimizer: torch.optim.Optimizer, p: nn.Parameter) -> dict[str, Tensor]:
    """The AdamW state of ``p``, created as AdamW would (zeros) if it has not stepped yet."""
    state = optimizer.state[p]
    if not state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def _local_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> list[tuple[str, Tensor, ShardSpec | None, int]]:
    """(key, local tensor, spec, TP degree) for every parameter and optimizer-state tensor."""
    degrees = parameter_degrees(model)
    out = []
    for name, p in model.named_parameters():  # a tied weight once, under its first name
        spec, tp = shard_spec(p), degrees.get(id(p), 1)
        out.append((f"model.{name}", p.data, spec, tp))
        state = _adam_state(optimizer, p)
        out.append((f"optim.{name}.exp_avg", state["exp_avg"], spec, tp))
        out.append((f"optim.{name}.exp_avg_sq", state["exp_avg_sq"], spec, tp))
        out.append((f"optim.{name}.step", state["step"], None, tp))
    return out


def _rng_state(device: torch.device) -> dict[str, Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


# ---------------------------------------------------------------- save


def save_checkpoint(
    root: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    extras: dict[str, Any],
    cfg: Config,
    ctx: ParallelContext,
    meshes: dict[int, Any],
    keep: int,
    files: dict[str, Path] | None = None,
    run: dict[str, Any] | None = None,
) -> Path:
    """Write checkpoint ``root/step_<step>`` atomically on every rank; returns its path.

    ``meshes``: the TP mesh of every degree the model uses (``build_tp_mesh(ctx, tp)``).

    ``extras`` (JSON: the data position and the like) is stored with the step, the resolved
    config, the layout and ``run`` (``EffectiveRun.record``: what the run did, compared on
    resume); ``files`` (name -> path on rank 0, e.g. the tokenizer) are copied in
    before the commit.
    """
    import torch.distributed.checkpoint as dcp  # (1.4 s of a rank's start: only when used)

    final = root / step_dir_name(step)
    tmp = root / (final.name + ".tmp")
    if ctx.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a killed save
            shutil.rmtree(tmp)
    comm.barrier(ctx.world_group)
    state: dict[str, Tensor] = {}
    for key, t, spec, tp in _local_tensors(model, optimizer):
        state |= _entries(key, t.detach(), spec, tp, ctx, meshes.get(tp))
    for kind, t in _rng_state(ctx.device).items():
        state[f"rng.rank{ctx.rank}.{kind}"] = t
    with _single_process_quiet():  # returns once every rank's files and .metadata are written
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), no_dist=_single_process())
    faults.on_save(step)  # testing hook (train/faults.py); returns at once unless armed
    if ctx.rank == 0:
        for name, src in (files or {}).items():
            shutil.copyfile(src, tmp / name)
            _fsync(tmp / name)
        files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.is_file()}
        manifest = {
            "format": FORMAT_VERSION,
            "step": step,
            "tp": ctx.tp,
            "dp": ctx.dp,
            "degrees": _region_degrees(model),
            "world_size": ctx.world_size,
            "torch": torch.__version__,
            "extras": extras,
            "config": config_to_dict(cfg),
            "files": files,
            **({"run": run} if run is not None else {}),
        }
        _write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1))
        _write_synced(tmp / COMPLETE, f"{step}\n")
        _commit(tmp, final)
        _prune(root, keep, final)
    comm.barrier(ctx.world_group)
    return final


def _region_degrees(model: nn.Module) -> dict[str, int]:
    """The TP degree of every region of a parallelized model (for the record)."""
    plan = getattr(model, "parallel_plan", None)
    return {} if plan is None else {r.name: r.tp for r in plan.regions}


def _single_process() -> bool:
    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Silence DCP's "assuming a single process" warning: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync(path: Path) -> None:
    """Flush a file's data or a folder's entries to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``; an older ``final`` (same step) is moved aside first."""
    _fsync(tmp)
    old = final.with_name(final.name + ".old.tmp")
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
    tmp.rename(final)
    _fsync(final.parent)
    if old.exists():
        shutil.rmtree(old)


def _prune(root: Path, keep: int, just_saved: Path) -> None:
    """Delete complete checkpoints older than the newest ``keep`` (never the one just saved)
    and stale ``.tmp`` folders."""
    for _, p in complete_checkpoints(root)[:-keep]:
        if p != just_saved:
            shutil.rmtree(p, ignore_errors=True)
    for p in root.iterdir():
        if p.name.endswith(".tmp") and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


# ---------------------------------------------------------------- load


def check_checkpoint(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: ParallelContext
) -> dict[str, Any]:
    """Local checks (no collective) that ``path`` is complete and fits ``model``; returns the
    manifest. ValueError naming the path: incomplete, truncated, or shapes that differ."""
    from oases.train.safe_load import load_metadata

    manifest = read_manifest(path)
    saved = load_metadata(path).state_dict_metadata
    for key, t, spec, tp in _local_tensors(model, optimizer):
        entries = _entries(key, t, spec, tp, ctx, None)  # plain views: the full shapes below
        for k, v in entries.items():
            full = v.shape if spec is None else _full_shape(k, t, spec)
            if k not in saved:
                raise ValueError(f"checkpoint {path}: no entry {k!r}; saved for another model?")
            if tuple(saved[k].size) != tuple(full):
                raise ValueError(
                    f"checkpoint {path}: {k} has shape {tuple(saved[k].size)}, this model"
                    f" needs {tuple(full)} (set checkpoint.resume=never or another run_dir)"
                )
    return manifest


def _full_shape(key: str, t: Tensor, spec: ShardSpec) -> torch.Size:
    i = int(key.rsplit("/part", 1)[1])
    shape = list(t.shape)
    shape[spec.dim] = spec.parts[i]
    return torch.Size(shape)


def load_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ctx: ParallelContext,
    meshes: dict[int, Any],
) -> dict[str, Any]:
    """Load checkpoint ``path`` into ``model`` and ``optimizer`` (any saved tp) on every rank and
    restore this rank's RNG; returns the manifest. Call ``check_checkpoint`` first (locally) so
    that user errors surface before this collective. A read failure inside DCP raises the same
    one-line ValueError on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from oases.train.safe_load import SafeReader, TensorOnlyPlanner, load_metadata

    manifest = read_manifest(path)
    saved = load_metadata(path).state_dict_metadata
    targets = _local_tensors(model, optimizer)
    state: dict[str, Tensor] = {}
    buffers: list[tuple[Tensor, Tensor]] = []  # (destination view, buffer DCP fills)
    for key, t, spec, tp in targets:
        mesh = meshes.get(tp)
        for k, view in _entries(key, t.detach(), spec, tp, ctx, None).items():
            buf = torch.empty_like(view, memory_format=torch.contiguous_format)
            buffers.append((view, buf))
            if spec is None or mesh is None:
                state[k] = buf
            else:
                from torch.distributed.tensor import DTensor, Shard

                full = _full_shape(k, t, spec)
                state[k] = DTensor.from_local(
                    buf,
                    mesh,
                    [Shard(spec.dim)],
                    run_check=False,
                    shape=full,
                    stride=_contiguous_stride(full),
                )
    src = ctx.rank if f"rng.rank{ctx.rank}.cpu" in saved else 0
    rng = {
        kind: torch.empty(saved[f"rng.rank{src}.{kind}"].size, dtype=torch.uint8)
        for kind in _rng_state(ctx.device)
        if f"rng.rank{src}.{kind}" in saved
    }
    for kind, buf in rng.items():
        state[f"rng.rank{src}.{kind}"] = buf
    try:
        with _single_process_quiet():
            dcp.load(
                state,
                storage_reader=SafeReader(path),
                planner=TensorOnlyPlanner(),
                no_dist=_single_process(),
            )
    except (Exception, CheckpointException) as exc:  # a failure on any rank reaches every rank
        raise ValueError(
            f"checkpoint {path}: a tensor file is corrupt or unreadable ({_last_line(exc)})"
        ) from None
    with torch.no_grad():
        for _, t, spec, _ in targets:
            if spec is not None and spec.pad:
                t.zero_()  # padding rows of the vocabulary stay zero
        for view, buf in buffers:
            view.copy_(buf)
    if "cpu" in rng:
        torch.set_rng_state(rng["cpu"])
    if "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"], ctx.device)
    return manifest


def _last_line(exc: BaseException) -> str:
    """The innermost message of a (possibly multi-rank, multi-line) DCP failure, one line."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))[0]  # (exception, stack) of the lowest rank
        text = (str(inner).strip().splitlines() or [""])[0]
        lines = [f"{type(inner).__name__}: {text}"]
    return lines[-1][:120] if lines else type(exc).__name__


def read_full_tensors(path: str | os.PathLike[str], prefix: str = "") -> dict[str, Tensor]:
    """Every saved full tensor whose key starts with ``prefix``, read in this process alone
    (inspection, export, tests). Sharded parameters come back as their parts."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from oases.train.safe_load import SafeReader, TensorOnlyPlanner, load_metadata

    path = Path(path)
    read_manifest(path)
    saved = load_metadata(path).state_dict_metadata
    state = {
        k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
        for k, v in saved.items()
        if k.startswith(prefix)
    }
    try:
        with _single_process_quiet():
            dcp.load(
                state, storage_reader=SafeReader(path), planner=TensorOnlyPlanner(), no_dist=True
            )
    except (Exception, CheckpointException) as exc:
        raise ValueError(f"checkpoint {path}: cannot be read ({_last_line(exc)})") from None
    return state
