"""The planner's loops compiled to machine code (numba), loaded together where they pay: the
event walk (``tape_kernel``) and the chain solver's walks (``chain_kernel``). Each hot path
asks for its kernel and runs its own Python or numpy code where there is none, to the same
numbers (the tests compare both, float for float).

numba is an optional dependency (``pip install oases[fast]``; ``make setup`` installs it):
where it does not import, or cannot compile or cache here, or ``OASES_NO_JIT=1`` is set, no
kernel loads. Loading costs about half a second (the import and numba's disk cache, beside
the modules; the first search after an install compiles them, a few seconds), so it is
loaded only where it pays::

    load_for(n_regions)   before a search forks its worker (which inherits what is loaded):
                          now, for a long model (``LONG_MODEL`` regions or more)
    ready()               the event walk's question: once this process's Python loop has
                          walked ``LOAD_AFTER_S`` (``walked``), load (a ski rental: a small
                          search never pays for it, a large one at most twice what it would
                          have known to pay)
"""

from __future__ import annotations

import os

_LOADED = False  # ``load`` has run (in this process, or in the one it was forked from)
LOADED_OK = False  # and the kernels compiled
LOAD_AFTER_S = 0.4  # the Python loop's seconds after which ``ready`` loads (what loading costs)
_python_s = 0.0  # seconds the event walk's Python loop has walked in this process


def load() -> bool:
    """Import numba and compile every kernel, or load them from numba's disk cache, once;
    whether they are there. False where numba is missing or cannot compile them here (the
    Python loops then, the same answers), or ``OASES_NO_JIT`` is set. The cache is skipped
    where numba finds no writable place for it (a read-only install)."""
    global _LOADED, LOADED_OK
    if _LOADED:
        return LOADED_OK
    _LOADED, LOADED_OK = True, False
    if os.environ.get("OASES_NO_JIT", "") not in ("", "0"):
        return False
    try:
        from numba import njit
    except ImportError:
        return False
    from oases.planner import chain_kernel, tape_kernel

    for cache in (True, False):
        try:
            tape_kernel.compile(njit, cache)
            chain_kernel.compile(njit, cache)
        except Exception:  # (no cache locator: a read-only install; a numba that cannot)
            tape_kernel.reset()  # (none half-loaded: each module as written)
            chain_kernel.reset()
            continue
        LOADED_OK = True
        return True
    return False


def ready() -> bool:
    """Whether the kernels are there for the event walk: loaded (``load``) once this process's
    Python loop has walked ``LOAD_AFTER_S`` (``walked``)."""
    if _LOADED or _python_s < LOAD_AFTER_S:
        return LOADED_OK
    return load()


def walked(seconds: float) -> None:
    """The event walk's Python loop walked ``seconds`` more (``ready``)."""
    global _python_s
    _python_s += seconds


LONG_MODEL = 64  # regions from which a search loads the kernels up front (``load_for``)


def load_for(n_regions: int) -> None:
    """``load`` now where a search of a model of ``n_regions`` regions will walk long enough
    to pay for it (its programs grow with the regions; measured: a 96-layer search walks 6.4
    s in the Python loop, a 24-layer one under 0.3 s); called before a search forks."""
    if n_regions >= LONG_MODEL:
        load()
