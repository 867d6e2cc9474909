"""The order of training samples: a seeded permutation of windows and the blend of sources.

Neither holds anything the size of the corpus: a rank computes the window of each of its rows
from the row's global index alone, in O(rows) time and memory.

``WindowPermutation(n, seed, epoch)`` is a bijection of ``[0, n)``: a balanced Feistel network
of ``ROUNDS`` rounds on ``2 * half`` bits (``4**half >= n``, so at most 4 times ``n``), each
round mixing one half with a key drawn from (seed, epoch, round) by SplitMix64's finalizer, and
*cycle walking* (an output ``>= n`` is permuted again until it falls inside; a Feistel network
is a permutation of its whole domain, so the walk ends and stays a bijection of ``[0, n)``)::

    j (< n) -> [L | R] -> (L, R) = (R, L ^ F_k(R)) x ROUNDS -> x; while x >= n: x = P(x)

For 40 M windows (5 GB of text at S = 128) that is 8 bytes of state instead of a 320 MB
``randperm``; a batch of B rows costs a few vector operations on B integers.

``BlendPattern(weights)`` deals samples to sources as Megatron-LM's blended datasets do (each
next sample to the source furthest below its weight), but over one period of ``PERIOD``
samples whose per-source counts are the weights rounded by largest remainders, repeated: sample
k is ``pattern[k % PERIOD]`` of its source's ``(k // PERIOD) * count + rank in the period``-th
sample. Every source's share is within ``0.5 / PERIOD`` of its weight over every period.
"""

from __future__ import annotations

import numpy as np

ROUNDS = 6
PERIOD = 1000
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on uint64 values (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _keys(seed: int, epoch: int, rounds: int) -> np.ndarray:
    base = np.array([(seed * 1_000_003 + epoch) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)
    steps = np.arange(1, rounds + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        return _mix64(_mix64(base) + steps)


class WindowPermutation:
    """A seeded bijection of ``[0, n)`` evaluated on demand (module docstring)."""

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs at least one element, got n={n}")
        self.n = n
        self.half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)  # 4**half >= n
        self.keys = _keys(seed, epoch, ROUNDS)

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self.half)
        mask = np.uint64((1 << self.half) - 1)
        left, right = x >> h, x & mask
        with np.errstate(over="ignore"):
            for key in self.keys:
                left, right = right, left ^ (_mix64(right ^ key) & mask)
        return (left << h) | right

    def __call__(self, index: np.ndarray) -> np.ndarray:
        """The images of ``index`` (int array of values in [0, n)) as int64."""
        x = np.asarray(index, dtype=np.uint64)
        if x.size and int(x.max()) >= self.n:
            raise IndexError(f"index {int(x.max())} is outside the permutation of {self.n}")
        x = self._feistel(x)
        outside = x >= np.uint64(self.n)
        while outside.any():  # cycle walking (at most a few rounds: the domain is < 4n)
            x[outside] = self._feistel(x[outside])
            outside = x >= np.uint64(self.n)
        return x.astype(np.int64)


def blend_counts(weights: list[float], period: int = PERIOD) -> list[int]:
    """Samples per source in one period: ``weights`` normalized, times ``period``, rounded by
    largest remainders (sum = ``period``); every source of positive weight gets at least 1."""
    if not weights or any(not w >= 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"blend weights must be non-negative with a positive sum, got {weights}")
    total = float(sum(weights))
    exact = [w / total * period for w in weights]
    counts = [max(int(e), 1 if w > 0 else 0) for e, w in zip(exact, weights)]
    order = sorted(range(len(weights)), key=lambda i: (counts[i] - exact[i], i))
    i = 0
    while sum(counts) < period:
        counts[order[i % len(order)]] += 1
        i += 1
    while sum(counts) > period:  # only when many tiny weights were lifted to 1
        j = max(range(len(counts)), key=lambda c: (counts[c] - exact[c], c))
        counts[j] -= 1
    return counts


class BlendPattern:
    """Which source each sample comes from, and its index within that source (module
    docstring). One source: sample k is that source's sample k."""

    def __init__(self, weights: list[float], period: int = PERIOD) -> None:
        self.counts = blend_counts(weights, period) if len(weights) > 1 else [period]
        self.period = period
        source = np.empty(period, dtype=np.int64)
        rank = np.empty(period, dtype=np.int64)
        emitted = [0] * len(self.counts)
        for k in range(period):  # each next sample to the source furthest below its count
            c = max(
                range(len(self.counts)),
                key=lambda s: (self.counts[s] * (k + 1) / period - emitted[s], -s),
            )
            source[k], rank[k] = c, emitted[c]
            emitted[c] += 1
        self.source, self.rank = source, rank

    def locate(self, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, index within that source's samples) of global samples ``k`` (int64)."""
        block, off = np.divmod(np.asarray(k, dtype=np.int64), self.period)
        source = self.source[off]
        counts = np.asarray(self.counts, dtype=np.int64)
        return source, block * counts[source] + self.rank[off]


def check_dp_split(global_batch: int, dp: int, dp_rank: int) -> None:
    """ValueError unless a global batch deals out evenly over ``dp`` ranks and ``dp_rank`` is
    one of them (the batchers of ``data.dataset`` and ``train.data``)."""
    if global_batch % dp:
        raise ValueError(f"train.global_batch={global_batch} is not divisible by dp={dp}")
    if not 0 <= dp_rank < dp:
        raise ValueError(f"dp_rank={dp_rank} is outside [0, {dp})")
