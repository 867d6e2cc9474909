"""A search keeps every compiled program it built until it ends (``planner.tape.tapes_kept``):
a bounded cache made the 96-layer search at 24 GB build a third of its programs twice."""

from oases.planner import simulate
from oases.planner.tape import kept_count, kept_tape, tapes_kept


def test_inside_a_search_every_tape_is_built_once_and_let_go_after():
    built = []

    def build(key: int):  # noqa: ANN202
        return lambda: built.append(key) or ("tape", key)

    with tapes_kept():
        first = kept_tape(0, build(0))
        for key in range(1, 400):  # more than the bounded cache outside holds
            kept_tape(key, build(key))
        with tapes_kept():  # a nested search shares the outer one's tapes
            assert kept_tape(0, build(0)) is first
    assert built == list(range(400))
    kept_tape(0, build(0))  # outside: built again (nothing kept by the scope)
    assert built[-1] == 0 and len(built) == 401
    assert kept_count() == 0


def test_the_simulator_keeps_its_tapes_in_a_search(monkeypatch):
    calls = []
    real = simulate._recent_tape.__wrapped__
    monkeypatch.setattr(simulate, "_recent_tape", lambda *a: calls.append(a) or real(*a))
    key = ("megatron", 6, 1, (("n_micro", 1),))
    with tapes_kept():
        assert simulate._tape(*key) is simulate._tape(*key)
        assert kept_count() == 1
    assert len(calls) == 1


def test_a_search_freezes_what_it_keeps_and_thaws_it_at_its_end():
    """The kept tapes leave the cycle collector's full collections while the search runs
    (round 8: 7.0 s of a 50 s search), and come back when it ends."""
    import gc

    assert gc.get_freeze_count() == 0
    with tapes_kept():
        kept_tape("a", lambda: ["tape"])
        assert gc.get_freeze_count() > 0
        with tapes_kept():  # a nested search thaws nothing
            kept_tape("b", lambda: ["tape"])
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    gc.freeze()  # frozen by someone else before the search: left frozen after it
    try:
        with tapes_kept():
            kept_tape("c", lambda: ["tape"])
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
