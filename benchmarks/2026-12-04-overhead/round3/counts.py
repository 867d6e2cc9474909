"""Load-independent counts per step of 24 x 64 (tp=1, 4 x 16 tokens): engine calls (at the C++
engine's entry, so torch.autograd.backward and the executor's direct call count alike), Python
function calls (cProfile's total, torch's Python included) and collective instructions run.
Usage: PYTHONPATH=<src> python counts.py ENTRY... (ENTRY: NAME or NAME@k=K)."""

import cProfile
import pstats
import sys

import torch
from torch.autograd.variable import Variable

from oases.bench.overhead import OVERHEAD_MODELS, parse_overhead_entry
from oases.model import Transformer
from oases.parallel.apply import parallelize
from oases.parallel.context import init_distributed
from oases.schedule import build_schedule

cfg = OVERHEAD_MODELS["gpt2-24x64"]
torch.manual_seed(0)
model = parallelize(Transformer(cfg), init_distributed(tp=1))
tokens = torch.randint(0, cfg.vocab_size, (4, 16))
targets = torch.randint(0, cfg.vocab_size, (4, 16))


class CountingEngine:
    def __init__(self, engine) -> None:  # noqa: ANN001
        self.engine, self.calls = engine, 0

    def run_backward(self, *a, **k):  # noqa: ANN002, ANN003, ANN201
        self.calls += 1
        return self.engine.run_backward(*a, **k)


for entry in sys.argv[1:]:
    name, k = parse_overhead_entry(entry)
    schedule = build_schedule(name, n_sub=k)
    for _ in range(2):
        schedule.step(model, tokens, targets)
    counter = CountingEngine(Variable._execution_engine)
    Variable._execution_engine = counter
    try:
        schedule.step(model, tokens, targets)
    finally:
        Variable._execution_engine = counter.engine
    prof = cProfile.Profile()
    prof.enable()
    schedule.step(model, tokens, targets)
    prof.disable()
    stats = pstats.Stats(prof)
    print(f"{entry}: {counter.calls} engine calls, {stats.total_calls} Python calls per step")
