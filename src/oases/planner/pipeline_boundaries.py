"""Pipeline stage boundaries: where to cut the chain of regions into ``pp`` stages.

``balanced_stage_starts`` cuts at block starts (a stage holds whole blocks; the embedding sits
on stage 0, the head on the last) so that the largest stage's cost is the least, by dynamic
programming over the blocks, vectorised over the cuts with numpy (checked against a brute
force and against the scalar loops in ``tests/test_pipeline_search.py``); ``stage_shares`` is
what each stage costs of the chain.
"""

from __future__ import annotations

import numpy as np

from oases.stages import block_start


def balanced_stage_starts(
    region_s: list[float], pp: int, cuts: set[int] | None = None
) -> tuple[int, ...]:
    """Stage boundaries at block starts that minimise the largest stage's cost (``region_s``:
    a cost per region of the chain embed, attn, mlp, ..., head), by dynamic programming over
    the blocks; ties go to the earliest cut. ``cuts``: the blocks a stage may start at (None:
    every block; a mixed layout's: where the degrees agree, ``pipeline_mixed.stage_cuts``);
    ValueError where they do not give ``pp`` stages."""
    n_layers = (len(region_s) - 2) // 2
    if n_layers < pp:
        raise ValueError(f"{n_layers} blocks do not fill {pp} pipeline stages")
    allowed = set(range(1, n_layers)) if cuts is None else set(cuts)
    prefix_sums = [0.0]  # blocks [0, b)'s cost, as the sum runs
    for layer in range(n_layers):
        prefix_sums.append(prefix_sums[-1] + region_s[2 * layer + 1] + region_s[2 * layer + 2])
    prefix = np.array(prefix_sums)
    inf = float("inf")
    # cost[a, b]: blocks [a, b) as a stage, the embedding on stage 0 and the head on the last:
    # prefix[b] - prefix[a] + extra, the float operations of a scalar loop in its order
    first = np.where(np.arange(n_layers + 1) == 0, region_s[0], 0.0)
    last = np.where(np.arange(n_layers + 1) == n_layers, region_s[-1], 0.0)
    cost = (prefix[None, :] - prefix[:, None]) + (first[:, None] + last[None, :])
    a_ix, b_ix = np.meshgrid(np.arange(n_layers + 1), np.arange(n_layers + 1), indexing="ij")
    usable = (a_ix < b_ix) & np.array([a == 0 or a in allowed for a in range(n_layers + 1)])[
        :, None
    ]
    # best[s][b]: the least largest stage of blocks [0, b) cut into s stages; cut[s][b] the
    # start of the last of them (the first a to reach the least: ties go to the earliest cut)
    best = np.full((pp + 1, n_layers + 1), inf)
    cut = np.zeros((pp + 1, n_layers + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for s in range(1, pp + 1):
        value = np.where(usable & (a_ix >= s - 1), np.maximum(best[s - 1][:, None], cost), inf)
        at = np.argmin(value, axis=0)
        least = value[at, np.arange(n_layers + 1)]
        reached = least < inf
        best[s] = np.where(reached, least, inf)
        cut[s] = np.where(reached, at, 0)
    if best[pp][n_layers] == inf:
        raise ValueError(
            f"blocks {sorted(allowed)} of {n_layers} give no {pp} pipeline stages to start at"
        )
    starts, b = [], n_layers
    for s in range(pp, 1, -1):
        b = int(cut[s][b])
        starts.append(block_start(b))
    return tuple(reversed(starts))


def stage_shares(region_s: list[float], starts: tuple[int, ...]) -> list[float]:
    """Each stage's share of the chain's cost (``region_s`` per region)."""
    total = sum(region_s) or 1.0
    edges = (0, *starts, len(region_s))
    return [sum(region_s[a:b]) / total for a, b in zip(edges, edges[1:])]
