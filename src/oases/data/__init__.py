"""Corpora of any size: tokenized once into memory-mapped token shards (``oases data``).

    files.py     the files a corpus is read from (stdlib, file, folder, glob), fingerprints
    formats.py   text, jsonl, parquet, gzip, ``datasets``: a piece of a file -> its text stream
    plan.py      a source's files -> train/validation split -> tasks (one shard each)
    sample.py    the bounded, seeded sample a BPE is trained on
    encode.py    a task's text -> tokens and document ends (worker processes)
    shards.py    shard files: atomic writing, checksums, memory-mapped token streams
    progress.py  the progress and throughput lines of a preparation
    prepare.py   ``oases data prepare``: the whole preparation, resumable; the manifest
    order.py     seeded window permutation (Feistel) and source blending, O(batch) memory
    dataset.py   a prepared folder opened for training: ``ShardBatches``
    inspect.py   ``oases data inspect``

Submodules are imported where used; none imports torch but ``dataset.py``.
"""
