"""A prepared dataset, opened for training: memory-mapped shards, each rank reading its rows.

Shape legend: G global batch (sequences per step), dp data-parallel degree, B = G // dp rows per
DP rank, S sequence length, W = S + 1 window length.

``open_dataset(DIR)`` reads ``DIR/dataset.json`` and checks every shard's size and quick
checksum (``shards.check_shard``: a truncated or changed shard is one line naming it), then
maps nothing until a window is read: a rank's resident memory does not grow with the corpus.

``ShardBatches`` deals windows out (``batch(i)``, ``next_batch``, ``state_dict``) without
anything corpus-sized::

    global sample k = i * G + dp_rank * B + row            (row < B: this rank's rows only)
    (source c, sample m of c) = BlendPattern.locate(k)     (one source: c = 0, m = k)
    (epoch e, j) = divmod(m, windows of c)
    window = WindowPermutation(windows of c, seed + c, e)(j)   (validation: window = j)
    tokens, targets = stream_c[window*W : window*W + W][:-1], [1:]

Windows are non-overlapping W-token slices of each split's token stream (shards end to end), as
the in-memory path cuts them. A sample's window is a pure function of (seed, k), so resuming at
``position`` continues at the exact next sample, and within an epoch of a source no two samples
(no two DP ranks) share a window.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from oases.data.files import Fingerprint
from oases.data.order import BlendPattern, WindowPermutation, check_dp_split
from oases.data.prepare import FORMAT, MANIFEST, REQUEST
from oases.data.shards import DTYPES, TokenStream, check_shard


def is_prepared(source: str) -> bool:
    """Whether ``source`` is a folder of ``oases data prepare`` (finished or not)."""
    p = Path(source).expanduser()
    return (p / MANIFEST).is_file() or (p / REQUEST).is_file()


@dataclass
class PreparedDataset:
    """An opened dataset folder: its manifest and one ``TokenStream`` per source and split."""

    root: Path
    manifest: dict[str, Any]
    train: list[TokenStream]
    val: list[TokenStream]

    @property
    def weights(self) -> list[float]:
        return [float(s["weight"]) for s in self.manifest["sources"]]

    @property
    def fingerprint(self) -> Fingerprint:
        return Fingerprint.from_dict(self.manifest["fingerprint"])

    @property
    def source_fingerprint(self) -> Fingerprint:
        """The files' fingerprint of a one-source dataset (the in-memory path's)."""
        return Fingerprint.from_dict(self.manifest["sources"][0]["fingerprint"])

    @property
    def files(self) -> int:
        return sum(int(s["fingerprint"]["files"]) for s in self.manifest["sources"])

    def tokenizer(self) -> Any:
        """The dataset's tokenizer (``train.tokenizer`` objects)."""
        from oases.train.tokenizer import BPETokenizer, ByteTokenizer, HFTokenizer

        info = self.manifest["tokenizer"]
        if info["name"] == "byte":
            return ByteTokenizer()
        path = self.root / info["file"]
        if info["name"] == "bpe":
            return BPETokenizer.load(path)
        from tokenizers import Tokenizer

        return HFTokenizer(Tokenizer.from_file(str(path)), int(info["doc_sep_id"]))


def open_dataset(source: str | Path, verify: bool = False) -> PreparedDataset:
    """Open a prepared dataset folder; ValueError naming the file when it is unfinished,
    unreadable or a shard was truncated or changed (``verify``: every byte checked)."""
    root = Path(source).expanduser()
    path = root / MANIFEST
    if not path.is_file():
        if (root / REQUEST).is_file():
            raise ValueError(
                f"{root}: the preparation did not finish (no {MANIFEST}): run the "
                "same oases data prepare command again to finish it"
            )
        raise ValueError(f"{root}: not a prepared dataset (no {MANIFEST})")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable ({exc})") from None
    if manifest.get("format") != FORMAT:
        raise ValueError(
            f"{path}: format {manifest.get('format')!r}, this version reads "
            f"{FORMAT!r}: prepare the dataset again"
        )
    dtype = manifest["dtype"]
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    streams: dict[str, list[TokenStream]] = {"train": [], "val": []}
    for source in manifest["sources"]:
        for split in ("train", "val"):
            shards = source[split]["shards"]
            for shard in shards:
                check_shard(root, shard, itemsize, full=verify)
            streams[split].append(TokenStream(root, shards, dtype))
    return PreparedDataset(root, manifest, streams["train"], streams["val"])


class ShardBatches:
    """Deterministic, DP-sharded batches of windows of a prepared split (module docstring)."""

    def __init__(
        self,
        streams: list[TokenStream],
        weights: list[float],
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
        W = seq_len + 1
        self.streams, self.W = streams, W
        self.windows = [len(s) // W for s in streams]
        used = [c for c, w in enumerate(weights) if w > 0] if len(streams) > 1 else [0]
        for c in used:
            if self.windows[c] == 0:
                which = f"source {c} of " if len(streams) > 1 else ""
                raise ValueError(
                    f"{which}{name} has {len(streams[c])} tokens, fewer than one "
                    f"window of model.seq_len + 1 = {W}"
                )
        self.pattern = BlendPattern(weights if len(streams) > 1 else [1.0])
        self.offsets = np.concatenate([[0], np.cumsum(self.windows)])  # global window ids
        self.seq_len, self.global_batch, self.dp_rank, self.dp = seq_len, global_batch, dp_rank, dp
        self.seed, self.shuffle = seed, shuffle
        self.rows = global_batch // dp  # B
        self.position = 0
        self._perms: dict[tuple[int, int], WindowPermutation] = {}

    @property
    def n_windows(self) -> int:
        return int(self.offsets[-1])

    def _perm(self, c: int, epoch: int) -> WindowPermutation:
        if (c, epoch) not in self._perms:
            if len(self._perms) > 64:
                self._perms.clear()
            self._perms[c, epoch] = WindowPermutation(self.windows[c], self.seed + c, epoch)
        return self._perms[c, epoch]

    def sample_windows(self, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, window within it) of global samples ``k``."""
        source, m = self.pattern.locate(k)
        window = np.empty_like(m)
        for c in np.unique(source):
            sel = source == c
            epoch, j = np.divmod(m[sel], self.windows[c])
            if not self.shuffle:
                window[sel] = j
                continue
            out = np.empty_like(j)
            for e in np.unique(epoch):
                at = epoch == e
                out[at] = self._perm(int(c), int(e))(j[at])
            window[sel] = out
        return source, window

    def window_ids(self, index: int) -> list[int]:
        """Global window ids (source offset + window) of this rank's rows of batch ``index``."""
        first = index * self.global_batch + self.dp_rank * self.rows
        source, window = self.sample_windows(np.arange(first, first + self.rows))
        return [int(self.offsets[c] + w) for c, w in zip(source, window)]

    def batch(self, index: int) -> tuple[Tensor, Tensor]:
        """tokens, targets [B, S] int64 of global batch ``index`` for this DP rank."""
        first = index * self.global_batch + self.dp_rank * self.rows
        source, window = self.sample_windows(np.arange(first, first + self.rows))
        rows = np.stack(
            [self.streams[c].read(int(w) * self.W, self.W) for c, w in zip(source, window)]
        )  # [B, W]
        w = torch.from_numpy(rows)
        return w[:, :-1], w[:, 1:]

    def next_batch(self) -> tuple[Tensor, Tensor]:
        out = self.batch(self.position)
        self.position += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


def split_batches(
    ds: PreparedDataset,
    split: str,
    seq_len: int,
    global_batch: int,
    *,
    dp_rank: int = 0,
    dp: int = 1,
    seed: int = 0,
    name: str = "",
) -> ShardBatches:
    """The training (shuffled) or validation (stream order) batches of a dataset."""
    streams = ds.train if split == "train" else ds.val
    return ShardBatches(
        streams,
        ds.weights,
        seq_len,
        global_batch,
        dp_rank=dp_rank,
        dp=dp,
        seed=seed,
        shuffle=split == "train",
        name=name or f"the {'training' if split == 'train' else 'validation'} split",
    )
