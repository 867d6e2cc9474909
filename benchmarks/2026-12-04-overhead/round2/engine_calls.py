import sys, torch
from oases.bench.overhead import OVERHEAD_MODELS
from oases.model import Transformer
from oases.parallel.apply import parallelize
from oases.parallel.context import init_distributed
from oases.schedule import build_schedule
cfg = OVERHEAD_MODELS["gpt2-24x64"]
torch.manual_seed(0)
model = parallelize(Transformer(cfg), init_distributed(tp=1))
tokens = torch.randint(0, cfg.vocab_size, (4, 16)); targets = torch.randint(0, cfg.vocab_size, (4, 16))
real = torch.autograd.backward; n = [0]
def spy(*a, **k):
    n[0] += 1; return real(*a, **k)
torch.autograd.backward = spy
for a in sys.argv[1:]:
    name, k = (a.split("@")[0], int(a.split("=")[1]) if "@" in a else 1)
    s = build_schedule(name, n_sub=k); n[0] = 0
    s.step(model, tokens, targets); print(f"{a}: {n[0]} engine calls per step")
