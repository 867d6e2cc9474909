"""Encoding: one task's text into one shard, in a worker process or in this one.

Per block of text (``formats.cut_blocks``: about 16 MiB, ending at a document boundary)::

    block bytes -> split at DOC_SEP -> each piece decoded (UTF-8, bad bytes -> U+FFFD) and
                   encoded on its own -> pieces joined by doc_sep_id   (the in-memory path's
                   ``tokenize_stream``, piece for piece)
    byte tokenizer: the block's bytes are the tokens (DOC_SEP is token 0)

so the shards of a split, end to end, hold exactly the token stream the in-memory path builds
from the same files. Documents end just after each separator token (the shard's ``.idx``).

A worker process (``init_worker``) loads the tokenizer once from the dataset's
``tokenizer.json`` and runs the library single-threaded (``RAYON_NUM_THREADS=1``): the
parallelism is one process per core, each on its own tasks. This module imports neither torch
nor the training code, so a worker starts in a fraction of a second.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np

from oases.data.formats import DOC_SEP, cut_blocks, piece_chunks, stream_length
from oases.data.plan import Task
from oases.data.shards import ShardWriter, dtype_limit


@dataclass(frozen=True)
class EncoderSpec:
    """What a process needs to encode: the tokenizer (None: bytes), its separator and size."""

    tokenizer_file: str | None
    doc_sep_id: int
    vocab_size: int
    dtype: str


class Encoder:
    """Text blocks -> tokens (int64) and document ends (module docstring)."""

    def __init__(self, spec: EncoderSpec) -> None:
        self.spec = spec
        self.tokenizer: Any = None
        if spec.tokenizer_file is not None:
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(spec.tokenizer_file)
        self.limit = min(spec.vocab_size, dtype_limit(spec.dtype))

    def encode(self, block: bytes) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [N], document ends [D]) of one block."""
        if self.tokenizer is None:
            tokens = np.frombuffer(block, dtype=np.uint8)
            return tokens, np.flatnonzero(tokens == 0) + 1
        parts = block.split(DOC_SEP)
        if parts[-1] == b"":
            parts.pop()  # the block ends with a document: nothing after its separator
        n_sep = block.count(DOC_SEP)
        texts = [p.decode("utf-8", errors="replace") for p in parts]
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        ids = [e.ids for e in encodings]
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        lengths[:n_sep] += 1  # every piece but a last unfinished one is followed by a separator
        sep = [self.spec.doc_sep_id]
        flat = chain.from_iterable(chain(x, sep) if i < n_sep else x for i, x in enumerate(ids))
        tokens = np.fromiter(flat, dtype=np.int64, count=int(lengths.sum()))
        if tokens.size and int(tokens.max()) >= self.limit:
            bad = int(tokens.max())
            raise ValueError(
                f"the tokenizer gave token id {bad}, outside the vocabulary of "
                f"{self.spec.vocab_size} the {self.spec.dtype} shards hold"
            )
        return tokens, np.cumsum(lengths)[:n_sep]


def run_task(task: Task, root: Path, encoder: Encoder, extra: dict[str, Any]) -> dict[str, Any]:
    """Encode ``task`` into its shard under ``root``; returns the shard's record. A read error
    is a ValueError naming the file (the shard stays unfinished)."""
    writer = ShardWriter(root, task.name, encoder.spec.dtype)
    try:
        chunks = chain.from_iterable(piece_chunks(p) for p in task.pieces)
        # bytes are tokens: any cut is exact, so the chunks as read are the blocks
        for block in chunks if encoder.tokenizer is None else cut_blocks(chunks):
            tokens, ends = encoder.encode(block)
            writer.write(tokens, ends, len(block))
    except BaseException:
        writer.abort()
        raise
    return writer.commit({"key": task.key(), "name": task.name, **extra})


# ---------------------------------------------------------------- worker processes

_WORKER: dict[str, Any] = {}


def init_worker(spec: EncoderSpec | None, root: str, extra: dict[str, Any]) -> None:
    """A worker process's set-up: one thread for the tokenizer library, the encoder; Ctrl-C
    is the parent's to handle (it terminates the workers)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER.update(encoder=None if spec is None else Encoder(spec), root=Path(root), extra=extra)


def worker_task(task: Task) -> dict[str, Any]:
    """Run one task in a worker (``init_worker`` first)."""
    return run_task(task, _WORKER["root"], _WORKER["encoder"], _WORKER["extra"])


def worker_measure(piece: Any) -> int:
    """Bytes of a piece's stream, in a worker (the validation split's tail cut)."""
    return stream_length(piece)
