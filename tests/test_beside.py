"""``search_prefetch.Beside``: a search run in a forked process beside the caller's (``oases
plan --pp``'s pipeline search beside the flat one) answers what it answers run inline, raises
what it raises, and says so when its process dies."""

from __future__ import annotations

import os

import pytest

from oases.planner import search_prefetch
from oases.planner.search_prefetch import Beside


@pytest.fixture(params=[1, 2], ids=["inline", "forked"])
def processes(request, monkeypatch):
    if request.param == 2 and "fork" not in __import__("multiprocessing").get_all_start_methods():
        pytest.skip("no fork on this platform")
    monkeypatch.setattr(search_prefetch, "PROCESSES", request.param)
    return request.param


def _answer() -> tuple:
    return os.getpid(), search_prefetch.PROCESSES, {"plans": [1.5, 2.25]}


def test_the_answer_is_the_inline_one(processes):
    pid, inner, payload = Beside(_answer).result()
    assert payload == {"plans": [1.5, 2.25]}
    assert inner == 1  # (beside the caller, the search runs on one process)
    assert (pid != os.getpid()) == (processes == 2)


def _fails() -> None:
    raise ValueError("no pipeline depth fits 3 ranks")


def test_its_error_is_raised_by_the_caller(processes):
    job = Beside(_fails)
    with pytest.raises(ValueError, match="no pipeline depth fits 3 ranks"):
        job.result()


def _dies() -> None:
    os._exit(3)


def test_a_process_that_dies_is_named(monkeypatch):
    monkeypatch.setattr(search_prefetch, "PROCESSES", 2)
    with pytest.raises(RuntimeError, match="died .exit code 3"):
        Beside(_dies).result()
