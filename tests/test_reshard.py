"""Groups per TP degree and batch reshards between degrees (the base of mixed-degree plans).

Layout at degree d on W ranks: TP group g = rank // d holds global batch rows
[g * B d / W, (g + 1) * B d / W), replicated over its d ranks. A reshard from degree a to b must
turn one layout into the other, forward, and the gradient layout back, backward. A reshard only
moves rows, so it is bit-exact (in float64 here: gloo's float64 collectives).
"""

import pytest
import torch

from exactness import BITWISE
from oases.parallel.comm import reduce_scatter, reshard_batch
from oases.parallel.context import init_distributed
from test_mixed_plans import layout_rows

W, B = 4, 8


def _rank_reshard(rank, world_size):
    ctx = init_distributed(tp=1, degrees=(2, 4))
    out = {
        "tp2": ctx.groups_for(2)[0].ranks,
        "dp2": ctx.groups_for(2)[1].ranks,
        "m12": ctx.merge_group(1, 2).ranks,
        "m24": ctx.merge_group(2, 4).ranks,
        "m14": ctx.merge_group(4, 1).ranks,
    }
    g = torch.Generator().manual_seed(0)
    full = torch.randn(B, 3, generator=g, dtype=torch.float64)  # the global activations
    grad_full = torch.randn(B, 3, generator=g, dtype=torch.float64)  # the global gradient
    for a, b in [(1, 2), (1, 4), (2, 4), (2, 1), (4, 1), (4, 2)]:
        x = layout_rows(full, rank, W, a).clone().requires_grad_(True)
        y = reshard_batch(x, a, b, ctx.merge_group(a, b))
        torch.testing.assert_close(y, layout_rows(full, rank, W, b), **BITWISE)
        y.backward(layout_rows(grad_full, rank, W, b))
        torch.testing.assert_close(x.grad, layout_rows(grad_full, rank, W, a), **BITWISE)
    tp2 = ctx.groups_for(2)[0]
    # summed over the pair, then split (small integers: every order sums them exactly)
    mine = torch.arange(12.0, dtype=torch.float64).reshape(4, 3) * (rank + 1)
    expect = torch.arange(12.0, dtype=torch.float64).reshape(4, 3) * sum(r + 1 for r in tp2.ranks)
    torch.testing.assert_close(reduce_scatter(mine, tp2), expect.chunk(2)[tp2.rank], **BITWISE)
    return out


@pytest.mark.exact
def test_groups_and_reshards_between_degrees(spawn_ranks):
    results = spawn_ranks(_rank_reshard, W)
    assert results[0]["tp2"] == (0, 1) and results[3]["tp2"] == (2, 3)
    assert results[1]["dp2"] == (1, 3)
    assert results[2]["m12"] == (2, 3)
    assert results[0]["m24"] == (0, 2) and results[1]["m24"] == (1, 3)
    assert all(r["m14"] == (0, 1, 2, 3) for r in results)
