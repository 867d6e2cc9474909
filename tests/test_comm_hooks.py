"""``comm.add_issue_hook`` and ``record_collectives`` on 2 gloo ranks: a hook sees every
collective as it is issued until it is removed, and hooks are told apart by identity (a hook that
compares equal to another, as two empty lists do, is never removed in its place)."""

from __future__ import annotations

import torch

from distributed import run_ranks
from oases.parallel import comm
from oases.parallel.context import init_distributed


class _EqualToAll:
    """A hook that compares equal to anything: removal by equality would take the wrong one."""

    def __init__(self) -> None:
        self.tags: list[str] = []

    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = None  # type: ignore[assignment]

    def __call__(self, record: comm.CollectiveRecord) -> None:
        self.tags.append(record.tag)


def _rank_hooks(rank: int, world_size: int) -> dict:
    ctx = init_distributed(tp=world_size)
    t = torch.ones(4)
    first, second = _EqualToAll(), _EqualToAll()
    remove_first = comm.add_issue_hook(first)
    with comm.record_collectives() as empty:  # its exit must remove its own hook only
        pass
    remove_second = comm.add_issue_hook(second)
    with comm.record_collectives() as log:
        comm.all_reduce_(t, ctx.tp_group, tag="a")
    remove_second()  # not `first`, though they compare equal
    comm.all_reduce_(t, ctx.tp_group, tag="b")
    remove_first()
    comm.all_reduce_(t, ctx.tp_group, tag="c")
    with comm.record_collectives() as after:
        comm.all_reduce_(t, ctx.tp_group, tag="d")
    return {"first": first.tags, "second": second.tags, "empty": len(empty),
            "log": [r.tag for r in log], "after": [r.tag for r in after],
            "hooks_left": len(comm._HOOKS)}


def test_issue_hooks_fire_until_removed_and_are_removed_by_identity(tmp_path):
    for result in run_ranks(_rank_hooks, 2, tmp_path):
        assert result == {"first": ["a", "b"], "second": ["a"], "empty": 0, "log": ["a"],
                          "after": ["d"], "hooks_left": 0}
