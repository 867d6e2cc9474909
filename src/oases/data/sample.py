"""The texts a BPE is trained on: the whole training split when it is small, else a bounded,
seeded sample of it.

Up to ``BPE_SAMPLE_BYTES`` (64 MiB) of training text the sample is the whole split, read in
order and cut at document separators, so the tokenizer is the one the in-memory path trains on
the same files (the embedded default, 4 MB, among them). Above it, the tasks of the training
splits are visited in the order of a permutation drawn from ``seed`` and the first ``take``
bytes of each (``take`` = the bound over the number of tasks, at least 1 MiB, cut at a
document or line boundary) are kept until the bound is reached; the kept slices are used in
task order. Why a bound: the library's BPE trainer holds every distinct pre-token of its input
with its count and pair statistics, so its memory and time grow with the text; a BPE's merges
are its most frequent pairs, which 64 MiB of a corpus already rank as the whole corpus does
(``benchmarks/2026-12-03-data`` measures training time and compression against the sample
size). Reading the sample costs one pass over at most the bound, whatever the corpus size.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from oases.data.formats import DOC_SEP, good_cut, piece_chunks
from oases.data.plan import Task

BPE_SAMPLE_BYTES = 64 << 20
MIN_TAKE_BYTES = 1 << 20


def _documents(stream: bytes) -> list[str]:
    """The non-empty documents of a stream, decoded (as ``train.data.stream_documents``)."""
    return [d.decode("utf-8", errors="replace") for d in stream.split(DOC_SEP) if d]


def _head(task: Task, take: int) -> bytes:
    """The first ``take`` bytes of a task's stream, cut back to a good boundary."""
    got, size = [], 0
    for piece in task.pieces:
        for chunk in piece_chunks(piece):
            got.append(chunk)
            size += len(chunk)
            if size >= take:
                break
        if size >= take:
            break
    data = b"".join(got)
    if len(data) <= take:
        return data
    cut = good_cut(data, 0, take)
    return data[: cut if cut > 0 else take]


def sample_texts(
    tasks: list[Task], bound: int = BPE_SAMPLE_BYTES, seed: int = 0
) -> tuple[Iterator[str], int]:
    """(texts to train a BPE on, bytes of text they hold) from the training ``tasks``."""
    total = sum(t.input_bytes for t in tasks)
    if total <= bound:
        streams = []
        for source in sorted({t.source for t in tasks}):
            mine = [t for t in tasks if t.source == source]
            streams.append(b"".join(c for t in mine for p in t.pieces for c in piece_chunks(p)))
        texts = [d for s in streams for d in _documents(s)]
        return iter(texts), sum(len(s) for s in streams)
    take = max(bound // max(len(tasks), 1), MIN_TAKE_BYTES)
    order = np.random.default_rng(seed).permutation(len(tasks))
    kept: dict[int, bytes] = {}
    size = 0
    for k in order:
        if size >= bound:
            break
        kept[int(k)] = _head(tasks[int(k)], min(take, bound - size))
        size += len(kept[int(k)])
    texts = [d for k in sorted(kept) for d in _documents(kept[k])]
    return iter(texts), size
