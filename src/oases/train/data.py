"""The in-memory path: a source read and tokenized whole, in one process (the reference).

Training reads memory-mapped shards (``oases.data``, ``train.run_data``); this module keeps the
path every rank used to run at start-up, because it defines the token stream: the shards of a
prepared source hold exactly ``tokenize_corpus(load_corpus(source), tok)`` (a test proves it),
and ``PackedBatches`` is the small-data batcher the shards' ``ShardBatches`` mirrors.

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
windows of W tokens; a window gives ``tokens = w[:-1]`` and ``targets = w[1:]``.
``PackedBatches`` orders the windows by a seeded permutation per epoch and deals them out in
global batches of G; DP rank r gets the B contiguous rows ``[r*B, (r+1)*B)`` of each global
batch, and every TP rank of a DP group gets the same rows.
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
from oases.data.order import check_dp_split
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


def n_windows(stream: Tensor, seq_len: int) -> int:
    return len(stream) // (seq_len + 1)


class PackedBatches:
    """Deterministic, DP-sharded batches of packed windows from a token stream.

    ``position`` is the index of the next global batch; ``batch(i)`` is a pure function of the
    stream, ``seed``, ``i`` and this rank's DP coordinates, so saving ``position`` is enough to
    resume. With ``shuffle=False`` the windows are taken in stream order (validation).
    """

    def __init__(
        self,
        stream: Tensor,
        seq_len: int,
        global_batch: int,
        *,
        dp_rank: int = 0,
        dp: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        name: str = "the token stream",
    ) -> None:
        check_dp_split(global_batch, dp, dp_rank)
        n = n_windows(stream, seq_len)
        if n == 0:
            raise ValueError(
                f"{name} has {len(stream)} tokens, fewer than one window of"
                f" model.seq_len + 1 = {seq_len + 1}"
            )
        W = seq_len + 1
        self.windows = stream[: n * W].view(n, W)  # [n, W] uint8 or int32
        self.seq_len, self.global_batch, self.dp_rank, self.dp = seq_len, global_batch, dp_rank, dp
        self.seed, self.shuffle = seed, shuffle
        self.rows = global_batch // dp  # B
        self.position = 0
        self._perm_epoch, self._perm = -1, torch.arange(n)

    @property
    def n_windows(self) -> int:
        return self.windows.shape[0]

    def _order(self, epoch: int) -> Tensor:
        if not self.shuffle:
            return torch.arange(self.n_windows)
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.n_windows, generator=g), epoch
        return self._perm

    def window_ids(self, index: int) -> list[int]:
        """Window ids of this rank's rows of global batch ``index``."""
        first = index * self.global_batch + self.dp_rank * self.rows
        ids = []
        for k in range(first, first + self.rows):
            epoch, j = divmod(k, self.n_windows)
            ids.append(int(self._order(epoch)[j]))
        return ids

    def batch(self, index: int) -> tuple[Tensor, Tensor]:
        """tokens, targets [B, S] int64 of global batch ``index`` for this DP rank."""
        w = self.windows[self.window_ids(index)].long()  # [B, W]
        return w[:, :-1], w[:, 1:]

    def next_batch(self) -> tuple[Tensor, Tensor]:
        out = self.batch(self.position)
        self.position += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])
