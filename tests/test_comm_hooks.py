"""``comm.add_issue_hook`` and ``record_collectives`` on 2 gloo ranks: a hook sees every
collective as it is issued until it is removed, and hooks are told apart by identity (a hook that
compares equal to another, as two empty lists do, is never removed in its place). And the
boundary that lets a hook see every collective: only ``oases.parallel.comm`` calls them."""

from __future__ import annotations

import ast

import torch

from distributed import SRC_DIR, run_ranks
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
    return {
        "first": first.tags,
        "second": second.tags,
        "empty": len(empty),
        "log": [r.tag for r in log],
        "after": [r.tag for r in after],
        "hooks_left": len(comm._HOOKS),
    }


def test_issue_hooks_fire_until_removed_and_are_removed_by_identity(tmp_path):
    for result in run_ranks(_rank_hooks, 2, tmp_path):
        assert result == {
            "first": ["a", "b"],
            "second": ["a"],
            "empty": 0,
            "log": ["a"],
            "after": ["d"],
            "hooks_left": 0,
        }


# torch.distributed's functions that move data between ranks or synchronize them
_COLLECTIVES = {
    *("all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "broadcast_object_list"),
    *("all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object"),
    *("all_gather_coalesced", "gather", "gather_object", "scatter", "scatter_object_list"),
    *("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all"),
    *("all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv"),
    *("send_object_list", "recv_object_list", "barrier", "monitored_barrier"),
}


def _collective_calls(path) -> list[str]:
    """``torch.distributed`` collectives ``path`` names: through ``import torch.distributed
    [as x]``, ``from torch import distributed [as x]`` or ``from torch.distributed import f``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    aliases, found = {"torch.distributed"}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            found += [a.name for a in node.names if a.name in _COLLECTIVES]
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in _COLLECTIVES
            and ast.unparse(node.value) in aliases
        ):
            found.append(node.attr)
    return found


def test_only_the_comm_package_calls_collectives():
    """DESIGN: ``parallel/comm/`` is the only place that calls collectives (so the issue hooks
    and the recorded timelines see every one). Its own modules are scanned too, to show that
    the scan finds what it looks for."""
    comm_dir = SRC_DIR / "oases" / "parallel" / "comm"
    inside, outside = {}, {}
    for path in sorted((SRC_DIR / "oases").rglob("*.py")):
        calls = _collective_calls(path)
        if calls:
            (inside if comm_dir in path.parents else outside)[path.name] = calls
    assert not outside, f"collectives called outside parallel/comm/: {outside}"
    assert {"all_reduce", "all_gather_single", "all_to_all_single"} <= {
        c for calls in inside.values() for c in calls
    }, inside
