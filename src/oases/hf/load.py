"""``load_hf``: a local Hugging Face GPT-2 / LLaMA directory -> Oases model, sliced on read.

The model is built on the ``meta`` device (no weights), parallelized there when a context is
given (so every parameter carries its ``ShardSpec``), moved to real empty storage, and each
parameter is filled from the rows this rank owns::

    ShardSpec(dim, parts, pad), rank r of t:  for each part p (padded to P, chunk c = P/t)
        rows [off_p + r c, off_p + min((r+1) c, p))  read from the file  -> then zeros up to c

A row range of an Oases parameter maps to ranges of its HF pieces (``convert.Piece``); a
transposed piece (GPT-2 Conv1D, stored [in, out]) is read by columns. Reads go through
``safetensors.safe_open(...).get_slice(name)[...]``: a rank never reads, nor holds, a full
sharded weight.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor

from oases.config import ModelConfig
from oases.hf.convert import PREFIX, Piece, config_from_hf, hf_pieces
from oases.model import Transformer, rope_tables
from oases.parallel.apply import parallelize, parameter_degrees
from oases.parallel.context import ParallelContext
from oases.parallel.layers import ShardSpec, shard_spec
from oases.plan import ParallelPlan

T = TypeVar("T")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def safetensors_module(what: str = "safetensors") -> Any:
    """``import safetensors`` (or a submodule), as a ValueError with the fix when missing."""
    import importlib

    try:
        return importlib.import_module(what)
    except ImportError:
        raise ValueError(
            "Hugging Face import/export needs safetensors: pip install 'oases[hf]'"
        ) from None


def user_input_errors(fn: Callable[..., T]) -> Callable[..., T]:
    """Turn what a damaged user file raises (a missing JSON field, invalid JSON, an unreadable
    or corrupt safetensors file) into one ValueError line naming the path (first argument)."""

    @functools.wraps(fn)
    def wrapper(path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> T:
        try:
            return fn(path, *args, **kwargs)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: invalid JSON: {exc}") from None
        except ValueError:
            raise
        except KeyError as exc:
            raise ValueError(f"{path}: a required field or tensor is missing: {exc}") from None
        except Exception as exc:  # OSError, SafetensorError, JSON errors, ...
            from_file = isinstance(exc, OSError | json.JSONDecodeError)
            if from_file or "Safetensor" in type(exc).__name__:
                raise ValueError(f"{path}: {type(exc).__name__}: {exc}") from None
            raise

    return wrapper


def read_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The directory's ``config.json`` as a dict (ValueError when it is missing)."""
    p = Path(path) / "config.json"
    if not p.is_file():
        raise ValueError(f"{path}: missing config.json (not a Hugging Face model directory)")
    return json.loads(p.read_text(encoding="utf-8"))


def tensor_files(path: str | os.PathLike[str]) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (single file or sharded with an
    index). ValueError naming the missing file."""
    root = Path(path)
    if (root / INDEX_FILE).is_file():
        weight_map = json.loads((root / INDEX_FILE).read_text(encoding="utf-8"))["weight_map"]
        files = {name: root / fname for name, fname in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise ValueError(f"{path}: missing {f.name} (listed in {INDEX_FILE})")
        return files
    if (root / SINGLE_FILE).is_file():
        safe_open = safetensors_module().safe_open
        with safe_open(str(root / SINGLE_FILE), framework="pt") as fh:
            return dict.fromkeys(fh.keys(), root / SINGLE_FILE)
    other = (
        " (pytorch_model.bin is not read: save with safetensors)"
        if (root / "pytorch_model.bin").is_file()
        else ""
    )
    raise ValueError(f"{path}: missing {SINGLE_FILE} or {INDEX_FILE}{other}")


class _Reader:
    """Open safetensors files (once each) and read row/column ranges of named tensors."""

    def __init__(self, path: str | os.PathLike[str], arch: str) -> None:
        self.path, self.files = str(path), tensor_files(path)
        self.prefix = PREFIX[arch]
        self.stack = contextlib.ExitStack()
        self.handles: dict[Path, Any] = {}

    def _resolve(self, name: str) -> str:
        bare = name.removeprefix(self.prefix)
        for candidate in (name, bare):
            if candidate in self.files:
                return candidate
        raise ValueError(f"{self.path}: missing tensor {name!r} in the safetensors files")

    def slice(self, name: str) -> Any:
        safe_open = safetensors_module().safe_open
        name = self._resolve(name)
        f = self.files[name]
        if f not in self.handles:
            self.handles[f] = self.stack.enter_context(safe_open(str(f), framework="pt"))
        return self.handles[f].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.slice(name).get_shape())


def _read_range(reader: _Reader, pieces: list[Piece], dim: int, start: int, stop: int) -> Tensor:
    """Rows (dim 0) or columns (dim 1) [start, stop) of the Oases tensor made of ``pieces``."""
    out, offset = [], 0
    for pc in pieces:
        sl = reader.slice(pc.name)
        if dim == 1:  # every piece contributes the same columns
            out.append(sl[start:stop].t() if pc.transposed else sl[:, start:stop])
            continue
        lo, hi = max(start, offset) - offset, min(stop, offset + pc.rows) - offset
        offset += pc.rows
        if lo < hi:
            out.append(sl[:, lo:hi].t() if pc.transposed else sl[lo:hi])
    return torch.cat(out, dim=0)


def read_local(
    reader: _Reader,
    pieces: list[Piece],
    shape: torch.Size,
    spec: ShardSpec | None,
    rank: int,
    tp: int,
) -> Tensor:
    """This rank's shard (or the whole tensor when ``spec`` is None) of an Oases parameter of
    local ``shape``, read slice by slice; vocabulary padding rows are zeros."""
    if spec is None:
        return _read_range(reader, pieces, 0, 0, shape[0])
    chunks, offset = [], 0
    for size, padded in zip(spec.parts, spec.padded_parts(tp)):
        c = padded // tp
        lo, hi = offset + min(rank * c, size), offset + min((rank + 1) * c, size)
        if lo < hi:
            chunks.append(_read_range(reader, pieces, spec.dim, lo, hi))
        if c - (hi - lo):
            pad = list(shape)
            pad[spec.dim] = c - (hi - lo)
            chunks.append(torch.zeros(pad))
        offset += size
    return torch.cat(chunks, dim=spec.dim)


def _check_shapes(
    reader: _Reader, pieces: dict[str, list[Piece]], full: dict[str, torch.Size]
) -> None:
    """Compare every piece's stored shape with the config's (reads headers only)."""
    for ours, pcs in pieces.items():
        for pc in pcs:
            want = (pc.rows, *full[ours][1:])
            want = want[::-1] if pc.transposed else want
            got = reader.shape(pc.name)
            ok = got == want or (
                ours == "pos_embed.weight" and got[0] >= want[0] and got[1:] == want[1:]
            )
            if not ok:
                raise ValueError(
                    f"{reader.path}: tensor {pc.name!r} has shape {list(got)}, "
                    f"config.json implies {list(want)}"
                )


@user_input_errors
def hf_model_config(
    path: str | os.PathLike[str], *, max_seq_len: int | None = None, dropout: float = 0.0
) -> ModelConfig:
    """The ModelConfig of HF directory ``path`` (its ``config.json``), seq_len capped by
    ``max_seq_len``, with ``dropout`` (HF's dropout settings are not carried over)."""
    cfg = config_from_hf(read_hf_config(path), f"{path}/config.json", max_seq_len)
    return dataclasses.replace(cfg, dropout=dropout) if dropout else cfg


@user_input_errors
def load_hf(
    path: str | os.PathLike[str],
    ctx: ParallelContext | None = None,
    plan: ParallelPlan | None = None,
    *,
    max_seq_len: int | None = None,
    dropout: float = 0.0,
) -> tuple[ModelConfig, Transformer]:
    """Read a local HF GPT-2 / LLaMA / Mistral directory (``config.json`` + safetensors).

    Without ``ctx``: the single-device fp32 model on the CPU. With ``ctx``: the model
    parallelized over ``ctx.tp_group`` (or by ``plan``, every region at its own degree) on
    ``ctx.device``, each rank reading only its slices.
    ``max_seq_len`` caps ``seq_len`` (GPT-2 keeps the first rows of its position table);
    ``dropout`` is the model's (default 0: HF dropout settings are not carried over).
    ValueError (one line) for a missing file or tensor and for unsupported architectures.
    """
    cfg = hf_model_config(path, max_seq_len=max_seq_len, dropout=dropout)
    reader = _Reader(path, cfg.arch)
    with reader.stack:
        with torch.device("meta"):
            model = Transformer(cfg)
        pieces = hf_pieces(cfg)
        _check_shapes(reader, pieces, {name: p.shape for name, p in model.named_parameters()})
        device, degrees = torch.device("cpu"), {}
        if ctx is not None:
            parallelize(model, ctx, plan)  # on meta: shapes and shard specs only, no memory
            device = ctx.device
            by_id = parameter_degrees(model)
            degrees = {name: by_id[id(p)] for name, p in model.named_parameters()}
        specs = {name: shard_spec(p) for name, p in model.named_parameters()}
        model.to_empty(device=device)
        # to_empty gives every module a new Parameter (meta -> cpu): re-attach the ShardSpecs
        # and re-tie the head
        if cfg.tie_embeddings:
            model.head.weight = model.embed.weight
        for name, p in model.named_parameters():
            if specs[name] is not None:
                p._oases_shard = specs[name]  # type: ignore[attr-defined]
        with torch.no_grad():
            for name, p in model.named_parameters():  # a tied head appears once, as embed
                tp = degrees.get(name, 1)  # this rank's TP group at the region's degree
                rank = 0 if ctx is None else ctx.groups_for(tp)[0].rank
                local = read_local(reader, pieces[name], p.shape, shard_spec(p), rank, tp)
                if local.shape != p.shape:
                    raise ValueError(
                        f"{path}: {name} read as {list(local.shape)}, expected {list(p.shape)}"
                    )
                p.copy_(local)
    for block in model.blocks:  # non-persistent buffers were never materialized
        attn = block.attn
        if attn.use_rope:
            cos, sin = rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta)
            attn.rope_cos, attn.rope_sin = cos.to(device), sin.to(device)
    return cfg, model
