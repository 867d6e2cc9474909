"""Input formats: what bytes of text a piece of a source file stands for.

A *source file* is read as the in-memory path (``oases.train.data.load_corpus``) reads it: its
*stream* is its documents, each followed by ``DOC_SEP`` (byte 0):

    text (any other name)     the file's bytes as one document
    NAME.jsonl                one document per non-blank line: the line's JSON object's
                              string field (``text`` unless ``--text-field`` says otherwise)
    NAME.parquet              one document per row of the text column (needs ``pyarrow``)
    a ``datasets`` folder     one document per row (``save_to_disk``'s folder, or
                              ``hfds:NAME[:SPLIT]`` from the local cache; needs ``datasets``)
    NAME.gz                   gzip'd text or jsonl (NAME.jsonl.gz)

A ``Piece`` is a part of one file: bytes ``[lo, hi)`` of a text or jsonl file (cut at a line or
document boundary), row groups ``[lo, hi)`` of a parquet file, rows ``[lo, hi)`` of a dataset,
or a whole gzip file (not seekable). ``piece_chunks`` yields its stream in chunks;
``cut_blocks`` re-cuts chunks into blocks of about ``BLOCK_BYTES`` that end at a document
boundary where there is one (so every document is encoded whole, as the in-memory path does),
else after a newline between two non-blank characters (a pre-token boundary of byte-level BPEs:
their encoding of a longer document is the same). Every read error is a ``ValueError`` whose
message starts with the file's path.

Optional packages (``pyarrow``, ``datasets``) are imported where they are read.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

DOC_SEP = b"\x00"
READ_BYTES = 8 << 20
BLOCK_BYTES = 16 << 20
HFDS_PREFIX = "hfds:"
_SPACE = frozenset(b" \t\n\r\x0b\x0c")


@dataclass(frozen=True)
class Piece:
    """A part of one source file (module docstring); ``cut`` keeps only bytes
    ``[cut[0], cut[1])`` of the piece's stream (the validation split's cut inside a file)."""

    path: str
    kind: str  # "text" | "jsonl" | "parquet" | "hfds"
    gz: bool
    lo: int
    hi: int
    size: int  # bytes of a text/jsonl/gz file, row groups of a parquet file, rows of a dataset
    field: str = "text"
    cut: tuple[int, int] | None = None
    nbytes: int = 0  # the whole file's bytes (progress and task sizes)

    @property
    def whole(self) -> bool:
        return self.lo == 0 and self.hi == self.size


def file_kind(path: str) -> tuple[str, bool]:
    """(kind, gzip'd) of a file by its name."""
    name = path.lower()
    gz = name.endswith(".gz")
    base = name[:-3] if gz else name
    if base.endswith(".parquet"):
        if gz:
            raise ValueError(
                f"{path}: a gzip'd parquet file is not read (parquet compresses "
                "itself): decompress it"
            )
        return "parquet", False
    return ("jsonl" if base.endswith(".jsonl") else "text"), gz


def read_error(path: str, exc: BaseException) -> ValueError:
    """One line naming ``path`` for an exception raised while reading it."""
    if isinstance(exc, OSError) and not isinstance(exc, gzip.BadGzipFile):
        return ValueError(f"{path}: cannot read ({exc.strerror or exc})")
    if isinstance(exc, gzip.BadGzipFile | EOFError | zlib.error):
        return ValueError(f"{path}: not a valid gzip file ({exc})")
    return ValueError(f"{path}: cannot read ({type(exc).__name__}: {exc})")


def _raw_bytes(piece: Piece) -> Iterator[bytes]:
    """The file bytes of a text or jsonl piece (decompressed for gzip)."""
    if piece.gz:
        with gzip.open(piece.path, "rb") as fh:
            while chunk := fh.read(READ_BYTES):
                yield chunk
        return
    with open(piece.path, "rb") as fh:
        fh.seek(piece.lo)
        left = piece.hi - piece.lo
        while left > 0 and (chunk := fh.read(min(READ_BYTES, left))):
            left -= len(chunk)
            yield chunk


def _text_chunks(piece: Piece) -> Iterator[bytes]:
    seen = False
    for chunk in _raw_bytes(piece):
        seen = True
        yield chunk
    if (piece.gz and seen) or (not piece.gz and piece.hi == piece.size and piece.size > 0):
        yield DOC_SEP  # the file's one document ends here


def _lines(piece: Piece) -> Iterator[bytes]:
    rest = b""
    for chunk in _raw_bytes(piece):
        lines = (rest + chunk).split(b"\n")
        rest = lines.pop()
        yield from lines
    if rest:
        yield rest


def _line_number(piece: Piece, k: int) -> int:
    """The file's line number of the k-th line (0-based) of a jsonl piece (on errors only)."""
    if piece.gz or piece.lo == 0:
        return k + 1
    with open(piece.path, "rb") as fh:
        before, left = 0, piece.lo
        while left > 0 and (chunk := fh.read(min(READ_BYTES, left))):
            before += chunk.count(b"\n")
            left -= len(chunk)
    return before + k + 1


def _jsonl_texts(piece: Piece) -> Iterator[str]:
    for k, raw in enumerate(_lines(piece)):
        line = raw.decode("utf-8", errors="replace")
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{piece.path}:{_line_number(piece, k)}: invalid JSON ({exc.msg})"
            ) from None
        if not isinstance(record, dict) or not isinstance(record.get(piece.field), str):
            raise ValueError(
                f"{piece.path}:{_line_number(piece, k)}: expected an object with "
                f"a string {piece.field!r} field"
            )
        yield record[piece.field]


def _column_texts(piece: Piece, column: Iterable[str | None], first_row: int) -> Iterator[str]:
    for r, text in enumerate(column):
        if not isinstance(text, str):
            raise ValueError(
                f"{piece.path}: row {first_row + r}: the {piece.field!r} field is "
                f"{'null' if text is None else type(text).__name__}, not a string"
            )
        yield text


def _parquet_texts(piece: Piece) -> Iterator[str]:
    pq = import_optional("pyarrow.parquet", "pyarrow", piece.path)
    pf = pq.ParquetFile(piece.path)
    names = pf.schema_arrow.names
    if piece.field not in names:
        raise ValueError(f"{piece.path}: no column {piece.field!r} (columns: {', '.join(names)})")
    row = sum(pf.metadata.row_group(g).num_rows for g in range(piece.lo))
    for g in range(piece.lo, piece.hi):
        column = pf.read_row_group(g, columns=[piece.field]).column(0).to_pylist()
        yield from _column_texts(piece, column, row)
        row += len(column)


_DATASETS: dict[str, object] = {}


def open_hf_dataset(spec: str, field: str) -> object:
    """A ``datasets.Dataset`` from a ``save_to_disk`` folder or ``hfds:NAME[:SPLIT]`` in the
    local cache (never downloaded); cached per process. Checks the text field."""
    if spec in _DATASETS:
        return _DATASETS[spec]
    datasets = import_optional("datasets", "datasets", spec)
    try:
        if spec.startswith(HFDS_PREFIX):
            name, _, split = spec[len(HFDS_PREFIX) :].partition(":")
            os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the cache only, no download
            ds = datasets.load_dataset(name, split=split or "train")
        else:
            ds = datasets.load_from_disk(spec)
            if isinstance(ds, datasets.DatasetDict):
                if "train" not in ds:
                    raise ValueError(
                        f"{spec}: a dataset dictionary without a 'train' split "
                        f"(splits: {', '.join(ds)}): give the split's folder"
                    )
                ds = ds["train"]
    except ValueError:
        raise
    except Exception as exc:  # the library's own errors (missing from the cache, ...)
        raise ValueError(f"{spec}: cannot load the dataset ({type(exc).__name__}: {exc})") from None
    if field not in ds.column_names:
        raise ValueError(f"{spec}: no column {field!r} (columns: {', '.join(ds.column_names)})")
    _DATASETS[spec] = ds
    return ds


def _hfds_texts(piece: Piece) -> Iterator[str]:
    ds = open_hf_dataset(piece.path, piece.field).with_format("arrow")
    step = 10_000
    for lo in range(piece.lo, piece.hi, step):
        column = ds[lo : min(piece.hi, lo + step)][piece.field].to_pylist()
        yield from _column_texts(piece, column, lo)


def _document_chunks(piece: Piece, texts: Iterator[str]) -> Iterator[bytes]:
    """Each text + DOC_SEP, batched; a whole file of one empty text is no document at all (the
    in-memory path joins a file's texts into one document and skips an empty one)."""
    first = next(texts, None)
    if first is None:
        return
    second = next(texts, None)
    if second is None and first == "" and piece.whole:
        return
    out, size = [first.encode("utf-8", errors="replace"), DOC_SEP], len(first) + 1
    for text in texts if second is None else _chain_one(second, texts):
        data = text.encode("utf-8", errors="replace")
        out += (data, DOC_SEP)
        size += len(data) + 1
        if size >= READ_BYTES:
            yield b"".join(out)
            out, size = [], 0
    if out:
        yield b"".join(out)


def _chain_one(first: str, rest: Iterator[str]) -> Iterator[str]:
    yield first
    yield from rest


def _uncut_chunks(piece: Piece) -> Iterator[bytes]:
    if piece.kind == "text":
        yield from _text_chunks(piece)
    elif piece.kind == "jsonl":
        yield from _document_chunks(piece, _jsonl_texts(piece))
    elif piece.kind == "parquet":
        yield from _document_chunks(piece, _parquet_texts(piece))
    elif piece.kind == "hfds":
        yield from _document_chunks(piece, _hfds_texts(piece))
    else:
        raise AssertionError(piece.kind)


def piece_chunks(piece: Piece) -> Iterator[bytes]:
    """The stream of ``piece`` (its ``cut`` applied), in chunks; errors name the file."""
    try:
        if piece.cut is None:
            yield from _uncut_chunks(piece)
            return
        lo, hi = piece.cut
        at = 0
        for chunk in _uncut_chunks(piece):
            a, b = max(lo - at, 0), min(hi - at, len(chunk))
            if a < b:
                yield chunk[a:b]
            at += len(chunk)
            if at >= hi:
                return
    except ValueError:
        raise
    except (OSError, EOFError, zlib.error) as exc:
        raise read_error(piece.path, exc) from None


def stream_length(piece: Piece) -> int:
    """Bytes of the piece's stream (reads it: gzip and jsonl have no other way)."""
    return sum(len(c) for c in piece_chunks(piece))


def good_cut(buf: bytes | bytearray, start: int, end: int) -> int:
    """The last position p in (start, end] after a document end, else after a newline between
    two non-blank bytes (a byte-level BPE's pre-token boundary); -1 when there is neither."""
    p = buf.rfind(DOC_SEP, start, end)
    if p >= 0:
        return p + 1
    p = end
    while (p := buf.rfind(b"\n", start, p)) > start:
        if p + 1 < len(buf) and buf[p - 1] not in _SPACE and buf[p + 1] not in _SPACE:
            return p + 1
    return -1


def first_good_cut(buf: bytes, start: int) -> int:
    """The first position p >= ``start`` (>= 1) that ``good_cut`` would accept; -1 if none."""
    start = max(start, 1)
    p = buf.find(DOC_SEP, start - 1)
    best = p + 1 if p >= 0 else -1
    q = start - 1
    while (q := buf.find(b"\n", q)) >= 0 and (best < 0 or q + 1 < best):
        if q >= 1 and q + 1 < len(buf) and buf[q - 1] not in _SPACE and buf[q + 1] not in _SPACE:
            return q + 1
        q += 1
    return best


def fallback_cut(buf: bytes | bytearray, end: int) -> int:
    """A cut at or before ``end`` for text with no good cut: after a blank before a non-blank
    byte, else at a UTF-8 character boundary (never inside a character)."""
    for p in range(end, max(end - 4096, 1), -1):
        if buf[p - 1] in _SPACE and buf[p] not in _SPACE:
            return p
    p = end
    while p > 1 and (buf[p] & 0xC0) == 0x80:  # a continuation byte: step back
        p -= 1
    return p


def cut_blocks(chunks: Iterable[bytes], block_bytes: int = 0) -> Iterator[bytes]:
    """Re-cut a stream into blocks of about ``block_bytes`` (default ``BLOCK_BYTES``) that end
    at good cuts (``good_cut``; ``fallback_cut`` past 4 blocks without one); the last block
    ends where the stream does."""
    block_bytes = block_bytes or BLOCK_BYTES
    buf = bytearray()
    for chunk in chunks:
        buf += chunk
        while len(buf) >= block_bytes:
            p = good_cut(buf, max(len(buf) - 4 * block_bytes, 0), len(buf) - 1)
            if p <= 0:
                if len(buf) < 4 * block_bytes:
                    break
                p = fallback_cut(buf, len(buf) - 1)
            yield bytes(buf[:p])
            del buf[:p]
            if len(buf) >= block_bytes and good_cut(buf, 0, len(buf) - 1) < 0:
                break  # wait for more bytes
    if buf:
        yield bytes(buf)


def import_optional(module: str, package: str, path: str) -> object:
    """Import an optional package's module, or a ValueError naming the file that needs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(
            f"{path}: reading it needs the {package!r} package "
            f"(pip install {package}); it is not installed"
        ) from None
