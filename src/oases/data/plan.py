"""A preparation's plan: each source's files, its train/validation split, and the tasks (one
shard each) that tokenize it.

Order of operations (``plan_source``, then ``split_source`` and ``plan_tasks`` per split)::

    SOURCE  -> files (sorted; stdlib: its UTF-8 files)  -> fingerprint (names and sizes)
            -> split, as the in-memory path splits:
                 by file: file i is held out when i % VAL_EVERY == VAL_EVERY - 1 (when one such
                          file is not empty), else
                 by tail: the last 1/VAL_EVERY of the whole stream (bytes), cut inside its file
            -> pieces: files larger than a task cut at a document or line boundary
            -> tasks: consecutive pieces of about ``task_bytes`` (one shard each)

``task_bytes`` depends only on the total size (``task_size``), so an interrupted preparation
plans the same tasks again and keeps the shards it finished. A task's ``key`` hashes its pieces
with their files' sizes and modification times: a shard is reused only for the same input.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import BinaryIO

from oases.data.files import (
    VAL_EVERY,
    Fingerprint,
    fingerprint_files,
    list_stdlib_files,
    resolve_source,
    source_root,
    stdlib_root,
)
from oases.data.formats import (
    HFDS_PREFIX,
    Piece,
    file_kind,
    first_good_cut,
    import_optional,
    read_error,
)

MIN_TASK_BYTES = 1 << 20
MAX_TASK_BYTES = 64 << 20
TASKS_TARGET = 64
_SEARCH_BYTES = 1 << 20


@dataclass(frozen=True)
class Task:
    """Tokenize ``pieces`` (in order) into one shard: source ``source``, split ``split``."""

    source: int
    split: str  # "train" | "val"
    index: int
    pieces: tuple[Piece, ...]
    input_bytes: int  # file bytes read (progress)
    stamps: tuple[tuple[int, int], ...] = ()  # (size, mtime_ns) of each piece's file

    @property
    def name(self) -> str:
        return f"source-{self.source}/{self.split}-{self.index:05d}"

    def key(self) -> str:
        """What the shard was made from: equal keys, equal input."""
        blob = json.dumps([[asdict(p) for p in self.pieces], self.stamps], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:32]


@dataclass
class SourcePlan:
    """One SOURCE: its files as pieces (whole files) and its fingerprint."""

    spec: str
    files: list[Piece]
    fingerprint: Fingerprint
    input_bytes: int
    split_rule: str = ""  # "file" | "tail"
    train: list[Piece] = field(default_factory=list)
    val: list[Piece] = field(default_factory=list)


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and (
        (path / "dataset_dict.json").is_file()
        or ((path / "state.json").is_file() and (path / "dataset_info.json").is_file())
    )


def _stdlib_files() -> list[Path]:
    kept = []
    for path in list_stdlib_files():  # as load_corpus: only the files that are UTF-8
        try:
            path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        kept.append(path)
    return kept


def _parquet_piece(path: Path, text_field: str) -> tuple[Piece, int]:
    pq = import_optional("pyarrow.parquet", "pyarrow", str(path))
    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as exc:  # the library's own error types
        raise read_error(str(path), exc) from None
    groups, size = meta.num_row_groups, path.stat().st_size
    return Piece(str(path), "parquet", False, 0, groups, groups, text_field, nbytes=size), size


def _dataset_piece(spec: str, text_field: str) -> tuple[Piece, Fingerprint, int]:
    from oases.data.formats import open_hf_dataset

    ds = open_hf_dataset(spec, text_field)
    rows = len(ds)
    nbytes = int(getattr(ds.data, "nbytes", 0))
    stamp = f"{spec}\0{rows}\0{getattr(ds, '_fingerprint', '')}"
    digest = hashlib.sha256(stamp.encode()).hexdigest()[:16]
    piece = Piece(spec, "hfds", False, 0, rows, rows, text_field, nbytes=nbytes)
    return piece, Fingerprint(digest, 1, nbytes), nbytes


def plan_source(spec: str, text_field: str = "text", exclude: Path | None = None) -> SourcePlan:
    """The files of SOURCE (``stdlib``, a file, folder or glob, a ``datasets`` folder, or
    ``hfds:NAME[:SPLIT]``) as whole-file pieces, with the fingerprint the in-memory path gives
    the same files; files under ``exclude`` (the dataset being written, when it lies inside
    SOURCE) are left out. ValueError naming SOURCE when there is nothing to read."""
    if spec.startswith(HFDS_PREFIX) or _is_saved_dataset(Path(spec).expanduser()):
        name = spec if spec.startswith(HFDS_PREFIX) else str(Path(spec).expanduser())
        piece, fp, nbytes = _dataset_piece(name, text_field)
        return SourcePlan(spec, [piece], fp, nbytes)
    if spec == "stdlib":
        paths, root = _stdlib_files(), stdlib_root()
    else:
        paths = [p.resolve() for p in resolve_source(spec)]
        if exclude is not None:
            out = exclude.resolve()
            paths = [p for p in paths if out not in p.parents]
            if not paths:
                raise ValueError(f"data.source={spec!r}: no files outside {out}")
        root = source_root(paths)
    pieces, total = [], 0
    for path in paths:
        kind, gz = file_kind(str(path))
        if kind == "parquet":
            piece, size = _parquet_piece(path, text_field)
        else:
            size = path.stat().st_size
            piece = Piece(str(path), kind, gz, 0, size, size, text_field, nbytes=size)
        pieces.append(piece)
        total += size
    if total == 0:
        raise ValueError(f"data.source={spec!r}: the data is empty ({len(paths)} empty files)")
    return SourcePlan(spec, pieces, fingerprint_files(paths, root), total)


def _nonempty(piece: Piece) -> bool:
    return piece.size > 0


def stream_size(piece: Piece) -> int | None:
    """Bytes of a piece's stream when its file size tells (plain text), else None."""
    if piece.kind != "text" or piece.gz:
        return None
    return piece.hi - piece.lo + (1 if piece.hi == piece.size and piece.size > 0 else 0)


def split_source(
    plan: SourcePlan, task_bytes: int, measure: Callable[[list[Piece]], list[int]]
) -> None:
    """Set ``plan.train`` and ``plan.val`` (module docstring) as pieces of at most about
    ``task_bytes``; ``measure`` returns the stream bytes of pieces whose size does not tell
    (jsonl, gzip, parquet, datasets), only needed for the tail split."""
    files = plan.files
    val = [p for i, p in enumerate(files) if i % VAL_EVERY == VAL_EVERY - 1]
    if val and any(_nonempty(p) for p in val):
        plan.split_rule = "file"
        for i, whole in enumerate(files):
            split = plan.val if i % VAL_EVERY == VAL_EVERY - 1 else plan.train
            split += cut_piece(whole, task_bytes)
        return
    plan.split_rule = "tail"
    pieces = [p for whole in files for p in cut_piece(whole, task_bytes)]
    unknown = [p for p in pieces if stream_size(p) is None]
    measured = dict(zip([id(p) for p in unknown], measure(unknown))) if unknown else {}
    sizes = [stream_size(p) if stream_size(p) is not None else measured[id(p)] for p in pieces]
    total = sum(sizes)
    cut = total - total // VAL_EVERY
    at = 0
    for piece, size in zip(pieces, sizes):
        if at + size <= cut:
            plan.train.append(piece)
        elif at >= cut:
            plan.val.append(piece)
        else:  # the cut falls inside this piece's stream
            plan.train.append(replace(piece, cut=(0, cut - at)))
            plan.val.append(replace(piece, cut=(cut - at, size)))
        at += size


def task_size(total_bytes: int) -> int:
    """Bytes of input per task: about ``TASKS_TARGET`` tasks, within [1 MiB, 64 MiB]."""
    return int(min(max(total_bytes // TASKS_TARGET, MIN_TASK_BYTES), MAX_TASK_BYTES))


def _next_cut(fh: BinaryIO, kind: str, start: int, size: int) -> int:
    """The first position >= ``start`` after a line end (jsonl) or a good cut (text: after a
    document end, or a newline between non-blank bytes); ``size`` when there is none."""
    pos = max(start - 2, 0)
    while pos < size:
        fh.seek(pos)
        buf = fh.read(_SEARCH_BYTES)
        if not buf:
            break
        lo = start - pos
        if kind == "jsonl":
            p = buf.find(b"\n", max(lo - 1, 0))
            cut = p + 1 if p >= 0 else -1
        else:
            cut = first_good_cut(buf, lo)
        if cut >= 0:
            return pos + cut
        if pos + len(buf) >= size:
            break
        pos += len(buf) - 2
    return size


def cut_piece(piece: Piece, task_bytes: int) -> list[Piece]:
    """A text or jsonl file larger than ``task_bytes`` as several pieces (cuts from
    ``_next_cut``); other pieces as they are."""
    if (
        piece.kind not in ("text", "jsonl")
        or piece.gz
        or piece.cut is not None
        or piece.hi - piece.lo <= task_bytes
    ):
        return [piece]
    out, lo = [], piece.lo
    try:
        with open(piece.path, "rb") as fh:
            while lo < piece.hi:
                hi = (
                    piece.hi
                    if piece.hi - lo <= task_bytes
                    else _next_cut(fh, piece.kind, lo + task_bytes, piece.hi)
                )
                out.append(replace(piece, lo=lo, hi=hi))
                lo = hi
    except OSError as exc:
        raise read_error(piece.path, exc) from None
    return out


def _weight(piece: Piece) -> int:
    """Input bytes a piece stands for (rows and row groups: their share of the file)."""
    if piece.kind in ("text", "jsonl") and not piece.gz:
        return piece.hi - piece.lo
    if piece.kind in ("parquet", "hfds"):
        return piece.nbytes * (piece.hi - piece.lo) // max(piece.size, 1)
    return piece.nbytes


def _unit_pieces(piece: Piece, task_bytes: int) -> list[Piece]:
    """Row-based pieces (parquet row groups, dataset rows) cut into about ``task_bytes``."""
    if piece.kind not in ("parquet", "hfds") or piece.cut is not None:
        return [piece]
    per_unit = max(piece.nbytes // max(piece.size, 1), 1)
    step = max(task_bytes // per_unit, 1)
    return [
        replace(piece, lo=lo, hi=min(lo + step, piece.hi)) for lo in range(piece.lo, piece.hi, step)
    ]


def _stamp(path: str) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except OSError:  # a hfds:NAME spec is no file
        return (0, 0)
    return (st.st_size, st.st_mtime_ns)


def plan_tasks(source: int, split: str, pieces: list[Piece], task_bytes: int) -> list[Task]:
    """Consecutive pieces (``split_source``'s) grouped into tasks of about ``task_bytes`` input
    bytes; rows of parquet files and datasets cut into such tasks."""
    tasks: list[Task] = []
    group: list[Piece] = []
    size = 0

    def flush() -> None:
        nonlocal group, size
        if group:
            stamps = tuple(_stamp(p.path) for p in group)
            tasks.append(Task(source, split, len(tasks), tuple(group), size, stamps))
        group, size = [], 0

    for piece in pieces:
        for unit in _unit_pieces(piece, task_bytes):
            w = _weight(unit)
            if group and size + w > task_bytes:
                flush()
            group.append(unit)
            size += w
    flush()
    return tasks
