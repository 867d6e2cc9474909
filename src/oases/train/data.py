"""The in-memory path: a source read and tokenized whole, in one process (the reference).

Training reads memory-mapped shards (``oases.data``, ``train.run_data``); this module keeps the
path every rank used to run at start-up, because it defines the token stream: the shards of a
prepared source hold exactly ``tokenize_corpus(load_corpus(source), tok)`` (a test proves it).
Batches of windows come from the shards (``data.dataset.ShardBatches``) only.

Shape legend: G global batch (sequences per step), dp data-parallel degree, B = G // dp rows per
DP rank, S sequence length (``model.seq_len``), W = S + 1 window length.

Sources (``oases.data.files``): ``"stdlib"`` (the running interpreter's standard library
sources, its UTF-8 files only) or a file, a directory or a glob of user text files; files ending
in ``.jsonl`` hold one JSON object per line with a ``"text"`` field.

Validation is split off by file: file i (in sorted order) is held out when
``i % VAL_EVERY == VAL_EVERY - 1``. With fewer than ``VAL_EVERY`` files no file is held out and
the last 1/VAL_EVERY of the byte stream is used instead.

Documents are joined with ``DOC_SEP`` (byte 0, absent from text) into one stream; a tokenizer
encodes each piece between separators on its own. The stream is cut into non-overlapping
windows of W tokens; a window gives ``tokens = w[:-1]`` and ``targets = w[1:]``
(``ShardBatches`` deals them out in global batches of G: DP rank r gets the B contiguous rows
``[r*B, (r+1)*B)`` of each, every TP rank of a DP group the same rows).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

# The files and fingerprints live in ``oases.data.files``, the tokenizers in ``tokenizer.py``;
# re-exported here for existing imports.
from oases.data.files import (  # noqa: F401
    DOC_SEP,
    STDLIB_CAP_BYTES,
    VAL_EVERY,
    Fingerprint,
    fingerprint_files,
    list_stdlib_files,
    resolve_source,
    source_root,
    stdlib_root,
)
from oases.train.tokenizer import (  # noqa: F401
    TOKENIZERS,
    BPETokenizer,
    ByteTokenizer,
    Tokenizer,
    build_tokenizer,
    load_tokenizer,
    train_bpe,
)


@dataclass
class Corpus:
    """Token streams of the training and validation splits and the files they came from: bytes
    (uint8) from ``load_corpus``, token ids (int32) after ``tokenize_corpus`` with a BPE."""

    train: Tensor  # [N_train] uint8 bytes, or int32 token ids
    val: Tensor  # [N_val] uint8 bytes, or int32 token ids
    train_files: list[str]
    val_files: list[str]
    fingerprint: Fingerprint | None = None  # of the files read (``load_corpus``)


def check_source(source: str) -> None:
    """Cheap start-up check of ``data.source``: a prepared dataset opens (its manifest and
    shards), else files exist and are not all empty."""
    if source == "stdlib":
        return
    from oases.data.dataset import is_prepared, open_dataset

    if is_prepared(source):
        open_dataset(source)
        return
    files = resolve_source(source)
    if all(f.stat().st_size == 0 for f in files):
        raise ValueError(f"data.source={source!r}: the data is empty ({len(files)} empty files)")


def _read_document(path: Path) -> bytes:
    data = path.read_bytes()
    if path.suffix != ".jsonl":
        return data
    texts = []
    for n, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: invalid JSON ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f'{path}:{n}: expected an object with a string "text" field')
        texts.append(record["text"].encode("utf-8"))
    return bytes([DOC_SEP]).join(texts)


def _join(docs: list[bytes]) -> Tensor:
    """Documents -> one uint8 stream, each document followed by DOC_SEP."""
    stream = b"".join(d + bytes([DOC_SEP]) for d in docs if d)
    return (
        torch.frombuffer(bytearray(stream), dtype=torch.uint8)
        if stream
        else torch.empty(0, dtype=torch.uint8)
    )


def load_corpus(source: str = "stdlib") -> Corpus:
    """Read ``source`` (``"stdlib"`` or user files) and split it into train / validation."""
    docs: list[tuple[str, bytes]] = []
    read: list[Path] = []
    if source == "stdlib":
        root = stdlib_root()
        for path in list_stdlib_files():
            data = path.read_bytes()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            docs.append((str(path), data))
            read.append(path)
    else:
        read = [p.resolve() for p in resolve_source(source)]
        root = source_root(read)
        docs = [(str(path), _read_document(path)) for path in read]
    if sum(len(d) for _, d in docs) == 0:
        raise ValueError(f"data.source={source!r}: the data is empty")
    fingerprint = fingerprint_files(read, root)
    train = [d for i, d in enumerate(docs) if i % VAL_EVERY != VAL_EVERY - 1]
    val = [d for i, d in enumerate(docs) if i % VAL_EVERY == VAL_EVERY - 1]
    if val and any(d for _, d in val):
        return Corpus(
            _join([d for _, d in train]),
            _join([d for _, d in val]),
            [n for n, _ in train],
            [n for n, _ in val],
            fingerprint,
        )
    stream = _join([d for _, d in docs])  # too few files: hold out the tail of the stream
    cut = len(stream) - len(stream) // VAL_EVERY
    return Corpus(stream[:cut], stream[cut:], [n for n, _ in docs], [], fingerprint)


def stream_documents(stream: Tensor) -> list[str]:
    """The non-empty documents of a byte stream (split at ``DOC_SEP``) as text, e.g. to train a
    tokenizer on. Bytes that are not UTF-8 become U+FFFD."""
    docs = bytes(stream.numpy()).split(bytes([DOC_SEP]))
    return [d.decode("utf-8", errors="replace") for d in docs if d]


def tokenize_stream(stream: Tensor, tok: Tokenizer) -> Tensor:
    """Byte stream [N] uint8 -> token stream [M] int32: each piece between ``DOC_SEP`` bytes is
    encoded on its own and every ``DOC_SEP`` becomes ``tok.doc_sep_id``. The byte tokenizer
    returns ``stream`` itself."""
    if isinstance(tok, ByteTokenizer):
        return stream
    pieces = bytes(stream.numpy()).split(bytes([DOC_SEP]))
    encoded = tok.encode_batch([p.decode("utf-8", errors="replace") for p in pieces])
    flat: list[int] = []
    for i, ids in enumerate(encoded):
        if i:
            flat.append(tok.doc_sep_id)
        flat += ids
    return torch.tensor(flat, dtype=torch.int32)


def tokenize_corpus(corpus: Corpus, tok: Tokenizer) -> Corpus:
    """``corpus`` with both splits encoded by ``tok`` (the same object for the byte tokenizer)."""
    if isinstance(tok, ByteTokenizer):
        return corpus
    return Corpus(
        tokenize_stream(corpus.train, tok),
        tokenize_stream(corpus.val, tok),
        corpus.train_files,
        corpus.val_files,
        corpus.fingerprint,
    )
