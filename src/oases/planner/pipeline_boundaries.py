"""Pipeline stage boundaries: where to cut the chain of regions into ``pp`` stages.

``balanced_stage_starts`` cuts at block starts (a stage holds whole blocks; the embedding sits
on stage 0, the head on the last) so that the largest stage's cost is the least, by dynamic
programming over the blocks (checked against a brute force in
``tests/test_pipeline_search.py``); ``stage_shares`` is what each stage costs of the chain.
"""

from __future__ import annotations

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
    # cost of blocks [a, b) as a stage, the embedding on stage 0 and the head on the last
    prefix = [0.0]
    for layer in range(n_layers):
        prefix.append(prefix[-1] + region_s[2 * layer + 1] + region_s[2 * layer + 2])

    def cost(a: int, b: int) -> float:
        extra = (region_s[0] if a == 0 else 0.0) + (region_s[-1] if b == n_layers else 0.0)
        return prefix[b] - prefix[a] + extra

    inf = float("inf")
    # best[s][b]: the least largest stage of blocks [0, b) cut into s stages
    best = [[inf] * (n_layers + 1) for _ in range(pp + 1)]
    cut = [[0] * (n_layers + 1) for _ in range(pp + 1)]
    best[0][0] = 0.0
    for s in range(1, pp + 1):
        for b in range(s, n_layers + 1):
            for a in range(s - 1, b):
                if a and a not in allowed:
                    continue
                value = max(best[s - 1][a], cost(a, b))
                if value < best[s][b]:
                    best[s][b], cut[s][b] = value, a
    if best[pp][n_layers] == inf:
        raise ValueError(
            f"blocks {sorted(allowed)} of {n_layers} give no {pp} pipeline stages to start at"
        )
    starts, b = [], n_layers
    for s in range(pp, 1, -1):
        b = cut[s][b]
        starts.append(block_start(b))
    return tuple(reversed(starts))


def stage_shares(region_s: list[float], starts: tuple[int, ...]) -> list[float]:
    """Each stage's share of the chain's cost (``region_s`` per region)."""
    total = sum(region_s) or 1.0
    edges = (0, *starts, len(region_s))
    return [sum(region_s[a:b]) / total for a, b in zip(edges, edges[1:])]
