"""The files a corpus is read from, without reading them: the embedded default (this Python's
standard library sources), a user's file, folder or glob, and their fingerprint.

``data.source = "stdlib"`` is the running interpreter's own standard library: every ``.py``
file under ``sysconfig.get_paths()["stdlib"]`` outside ``site-packages`` and test directories,
a deterministic choice of files capped at ``STDLIB_CAP_BYTES`` so start-up stays fast. Any
other source is a file, a directory (every file below it) or a glob.

A ``Fingerprint`` hashes the files' names (relative to the stdlib root, or to the common
folder of a user source) and sizes: one ``stat`` per file, never a read. Checkpoints record it,
so a run resumed on other data (another Python version's stdlib, edited files) is caught.

Torch-free (the preparation's worker processes import it).
"""

from __future__ import annotations

import glob
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STDLIB_CAP_BYTES = 4_000_000
VAL_EVERY = 20
DOC_SEP = 0
_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)


@dataclass(frozen=True)
class Fingerprint:
    """What a corpus was read from: ``digest`` (16 hex digits of the SHA-256 of every file's
    relative name and size, in sorted order), the number of files and their total size."""

    digest: str
    files: int
    bytes: int

    def __str__(self) -> str:
        return f"{self.digest} ({self.files} files, {self.bytes / 1e6:.2f} MB)"

    def to_dict(self) -> dict[str, str | int]:
        return {"digest": self.digest, "files": self.files, "bytes": self.bytes}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Fingerprint:
        return cls(str(d["digest"]), int(d["files"]), int(d["bytes"]))


def fingerprint_files(files: list[Path], root: Path) -> Fingerprint:
    """The fingerprint of ``files`` named relative to ``root`` (one ``stat`` per file)."""
    sizes = sorted((p.relative_to(root).as_posix(), p.stat().st_size) for p in files)
    h = hashlib.sha256()
    for name, size in sizes:
        h.update(f"{name}\0{size}\n".encode())
    return Fingerprint(h.hexdigest()[:16], len(sizes), sum(s for _, s in sizes))


def stdlib_root() -> Path:
    """The running interpreter's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_stdlib_files(cap_bytes: int = STDLIB_CAP_BYTES) -> list[Path]:
    """The default corpus files: sorted, deterministic, at most ``cap_bytes`` in total.

    Files are taken in the order of a hash of their relative path (a spread over the whole
    library rather than its first letters) until the cap, then returned in sorted order.
    """
    root = stdlib_root()
    found: list[Path] = []
    for here, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
        found += [Path(here, f) for f in files if f.endswith(".py")]
    found.sort()

    def key(p: Path) -> str:
        return hashlib.sha1(p.relative_to(root).as_posix().encode()).hexdigest()

    chosen, total = [], 0
    for p in sorted(found, key=key):
        size = p.stat().st_size
        if total + size > cap_bytes:
            continue
        chosen.append(p)
        total += size
    return sorted(chosen)


def resolve_source(source: str) -> list[Path]:
    """The sorted files of a user ``data.source`` (file, directory or glob); ValueError if none."""
    p = Path(source).expanduser()
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file())
    else:
        files = sorted(Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file())
    if not files:
        raise ValueError(f"data.source={source!r}: no such file, or no files match")
    return files


def source_root(files: list[Path]) -> Path:
    """The folder a user source's file names are taken relative to: their common folder."""
    return Path(os.path.commonpath([p.parent.resolve() for p in files]))
