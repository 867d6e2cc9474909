"""Token shards on disk: how one is written (atomically), checked and memory-mapped.

A shard is three files beside each other, for one task of the plan (``plan.Task.name``)::

    source-0/train-00012.bin    the tokens, raw little-endian uint8/uint16/uint32 (no header)
    source-0/train-00012.idx    int64 token offsets, within the shard, where documents end
                                (just after each document-separator token)
    source-0/train-00012.json   written last: what the shard was made from (the task's key,
                                the tokenizer's hash, the dtype) and holds (tokens, documents,
                                text bytes, checksums); a shard without it is unfinished

``.bin`` and ``.idx`` are written as ``*.part`` and renamed once written, then the ``.json``:
killed at any point, a preparation leaves finished shards whole and redoes the others.

Two checksums guard a shard against truncation and later change: ``checksum`` (SHA-256 of
every token byte, computed while writing; ``oases data inspect --verify`` reads it all) and
``quick`` (SHA-256 of the size and the first and last ``QUICK_BYTES``), which opening a dataset
checks for every shard so training starts in milliseconds. SHA-256 because CPUs hash it in
hardware (1.5 GB/s a core here, three times BLAKE2b).

``.bin`` and ``.idx`` are renamed into place without ``fsync`` (it cost half of a byte-level
preparation's time); the ``.json`` marker and the manifest are flushed to disk, and a resumed
preparation reuses a finished shard only when its sizes and quick checksum match the marker.

``TokenStream`` is one split of one source: its shards end to end as one sequence of tokens.
The files are raw arrays (``np.memmap`` maps them: ``map_shard``), but training reads each
window with ``os.pread`` into a buffer of its own, through the page cache: nothing is mapped
into the rank, so its resident memory stays the same however much of the corpus it has read.
(Measured on this machine, a memory map instead grew a rank by about 1.5 MB per window read:
the kernel maps whole large page-cache folios, 8 MB readahead, even under ``MADV_RANDOM``.)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

QUICK_BYTES = 1 << 16
OPEN_FILES = 64  # shard files a TokenStream keeps open
DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32}


def smallest_dtype(vocab_size: int) -> str:
    """The smallest token dtype that holds ids ``[0, vocab_size)``."""
    for name, dt in DTYPES.items():
        if vocab_size - 1 <= np.iinfo(dt).max:
            return name
    raise ValueError(f"a vocabulary of {vocab_size} tokens does not fit in uint32")


def dtype_limit(name: str) -> int:
    """How many token ids ``name`` holds."""
    return int(np.iinfo(DTYPES[name]).max) + 1


def quick_checksum(path: Path) -> str:
    """BLAKE2b of a file's size and its first and last ``QUICK_BYTES``."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as fh:
        h.update(fh.read(QUICK_BYTES))
        if size > QUICK_BYTES:
            fh.seek(max(size - QUICK_BYTES, QUICK_BYTES))
            h.update(fh.read(QUICK_BYTES))
    return h.hexdigest()[:32]


def full_checksum(path: Path) -> str:
    """SHA-256 of every byte of a file (as ``ShardWriter`` computes it)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()[:32]


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` through a ``.part`` file (flushed, then renamed)."""
    part = path.with_name(path.name + ".part")
    with open(part, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(part, path)


class ShardWriter:
    """Appends encoded blocks to one shard's ``.part`` files; ``commit`` renames them and
    writes the ``.json`` that marks the shard finished."""

    def __init__(self, root: Path, name: str, dtype: str) -> None:
        self.bin, self.idx = root / f"{name}.bin", root / f"{name}.idx"
        self.meta = root / f"{name}.json"
        self.bin.parent.mkdir(parents=True, exist_ok=True)
        self.meta.unlink(missing_ok=True)  # an older shard of this name is unfinished from now
        self._bin = open(self.bin.with_name(self.bin.name + ".part"), "wb")  # noqa: SIM115
        self._idx = open(self.idx.with_name(self.idx.name + ".part"), "wb")  # noqa: SIM115
        self.dtype = np.dtype(DTYPES[dtype]).newbyteorder("<")
        self.hash = hashlib.sha256()
        self.tokens = self.documents = self.text_bytes = 0

    def write(self, tokens: np.ndarray, doc_ends: np.ndarray, text_bytes: int) -> None:
        data = np.ascontiguousarray(tokens, dtype=self.dtype)
        self._bin.write(memoryview(data).cast("B"))
        self.hash.update(memoryview(data).cast("B"))
        ends = (np.asarray(doc_ends, dtype=np.int64) + self.tokens).astype("<i8")
        self._idx.write(ends.tobytes())
        self.tokens += len(data)
        self.documents += len(ends)
        self.text_bytes += text_bytes

    def commit(self, extra: dict[str, Any]) -> dict[str, Any]:
        """Flush, rename and mark finished; returns the shard's record."""
        for fh in (self._bin, self._idx):
            fh.flush()
            fh.close()
        os.replace(self.bin.with_name(self.bin.name + ".part"), self.bin)
        os.replace(self.idx.with_name(self.idx.name + ".part"), self.idx)
        record = {
            "tokens": self.tokens,
            "documents": self.documents,
            "text_bytes": self.text_bytes,
            "checksum": self.hash.hexdigest()[:32],
            "quick": quick_checksum(self.bin),
            **extra,
        }
        write_json_atomic(self.meta, record)
        return record

    def abort(self) -> None:
        for fh in (self._bin, self._idx):
            fh.close()


def read_done(root: Path, name: str) -> dict[str, Any] | None:
    """The record of a finished shard, or None (unfinished, or its files are gone, truncated
    or changed: sizes and quick checksum)."""
    try:
        record = json.loads((root / f"{name}.json").read_text(encoding="utf-8"))
        itemsize = np.dtype(DTYPES[record["dtype"]]).itemsize
        check_shard(root, {"file": f"{name}.bin", **record}, itemsize)
    except (OSError, ValueError, KeyError):
        return None
    return record


def check_shard(root: Path, shard: dict[str, Any], itemsize: int, full: bool = False) -> None:
    """ValueError naming the file when a shard's files are missing, truncated or changed since
    the preparation (sizes and the quick checksum; with ``full`` every byte)."""
    path = root / shard["file"]
    advice = "prepare the dataset again (oases data prepare)"
    for file, want in (
        (path, shard["tokens"] * itemsize),
        (path.with_suffix(".idx"), shard["documents"] * 8),
    ):
        try:
            size = file.stat().st_size
        except OSError:
            raise ValueError(f"{file}: missing ({advice})") from None
        if size != want:
            raise ValueError(
                f"{file}: {size} bytes, the manifest says {want}: truncated or "
                f"changed since it was prepared ({advice})"
            )
    if quick_checksum(path) != shard["quick"] or (
        full and full_checksum(path) != shard["checksum"]
    ):
        raise ValueError(
            f"{path}: its content changed since it was prepared (checksum differs; {advice})"
        )


class TokenStream:
    """The shards of one split of one source as one sequence of tokens (module docstring)."""

    def __init__(self, root: Path, shards: list[dict[str, Any]], dtype: str) -> None:
        self.root, self.shards = root, shards
        self.dtype = np.dtype(DTYPES[dtype]).newbyteorder("<")
        sizes = np.array([s["tokens"] for s in shards], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(sizes)])  # [n_shards + 1]
        self._files: OrderedDict[int, int] = OrderedDict()  # shard -> open descriptor (LRU)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _fd(self, k: int) -> int:
        if k in self._files:
            self._files.move_to_end(k)
            return self._files[k]
        if len(self._files) >= OPEN_FILES:
            os.close(self._files.popitem(last=False)[1])
        self._files[k] = os.open(self.root / self.shards[k]["file"], os.O_RDONLY)
        return self._files[k]

    def _pread(self, k: int, lo: int, n: int) -> np.ndarray:
        size = self.dtype.itemsize
        data = os.pread(self._fd(k), n * size, lo * size)
        if len(data) != n * size:
            raise ValueError(
                f"{self.root / self.shards[k]['file']}: truncated since it was "
                "opened (prepare the dataset again)"
            )
        return np.frombuffer(data, dtype=self.dtype)

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` as a new int64 array."""
        if start < 0 or start + length > len(self):
            raise IndexError(f"tokens [{start}, {start + length}) outside [0, {len(self)})")
        out = np.empty(length, dtype=np.int64)
        at, k = 0, int(np.searchsorted(self.starts, start, side="right")) - 1
        while at < length:
            lo = start + at - int(self.starts[k])
            n = min(length - at, int(self.starts[k + 1]) - (start + at))
            if n > 0:
                out[at : at + n] = self._pread(k, lo, n)
                at += n
            k += 1
        return out

    def read_all(self) -> np.ndarray:
        """Every token (tests and small streams only)."""
        return self.read(0, len(self))

    def map_shard(self, k: int) -> np.ndarray:
        """Shard k as a read-only ``np.memmap`` (tools; training reads with ``read``)."""
        return np.memmap(
            self.root / self.shards[k]["file"],
            dtype=self.dtype,
            mode="r",
            shape=(int(self.shards[k]["tokens"]),),
        )

    def __del__(self) -> None:
        for fd in getattr(self, "_files", {}).values():
            with contextlib.suppress(OSError):
                os.close(fd)
