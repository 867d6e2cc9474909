"""Host cost of one engine call on a tiny graph (y = x * 2 on [4, 16, 64], then its backward),
three ways, against the op alone; means of 2000 after 200 warm-ups, three rounds. Run under the
shared CPU lock with OMP_NUM_THREADS=1."""

import time

import torch
from torch.autograd.graph import _engine_run_backward
from torch.autograd.variable import Variable

x = torch.randn(4, 16, 64, requires_grad=True)
g = torch.randn(4, 16, 64)


def public() -> None:  # what the executor called before round 3
    torch.autograd.backward([x * 2], [g])


def entry() -> None:  # what it calls now (executor_backward.run_backward)
    _engine_run_backward((x * 2,), (g,), False, False, (), allow_unreachable=True,
                         accumulate_grad=True)


def engine() -> None:  # the C++ engine itself (no context stash)
    Variable._execution_engine.run_backward((x * 2,), (g,), False, False, (),
                                            allow_unreachable=True, accumulate_grad=True)


def op_only() -> None:
    x * 2


for _ in range(3):
    for f in (public, entry, engine, op_only):
        for _ in range(200):
            f()
        t = time.perf_counter()
        for _ in range(2000):
            f()
        print(f"{f.__name__:8} {(time.perf_counter() - t) / 2000 * 1e6:6.1f} us")
