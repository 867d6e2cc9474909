"""Where the executor links pieces into one autograd graph (``schedule.links``), and that a
linked program runs one engine call per backward Compute (Megatron's [norm, epi, tp])."""

import collections
import copy

import pytest
import torch

from oases.config import ModelConfig
from oases.model import Transformer
from oases.parallel.apply import parallelize
from oases.parallel.context import init_distributed
from oases.schedule import build_schedule, executor_backward
from oases.schedule.instructions import Start, Wait
from oases.schedule.links import handed_on, program_links
from oases.schedule.program import build_program


def test_megatron_links_every_glue_and_partial():
    program = build_program("megatron", 6, 1)
    links = program_links(program, "none", None, False)
    assert links.x == frozenset(range(1, 6))  # norm:i on epi:i-1's output
    assert links.p == frozenset(range(5))  # epi:i on p_i: every region but the head
    assert handed_on(program, links, "none", 5).h == frozenset()  # a "bwd" all-reduce after tp:i
    at_tp1 = [ins for ins in program if not (isinstance(ins, (Start, Wait)) and ins.kind == "bwd")]
    assert handed_on(at_tp1, links, "none", 5).h == frozenset(range(1, 6))  # all but the embedding
    # a block recompute: not where norm:i reads a saved leaf (the blocks' inputs 1, 3, and the
    # head after a glue run without a graph); the communication-free recompute: nowhere
    block = build_program("megatron-recompute", 6, 1)
    block_links = program_links(block, "block", None, False)
    block = [ins for ins in block if not (isinstance(ins, (Start, Wait)) and ins.kind == "bwd")]
    assert handed_on(block, block_links, "block", 5, frozenset({1, 3, 5})).h == frozenset({2, 4})
    # the communication-free recompute (no p-links): every region but the embedding, the
    # recompute Computes between; not where its norm reads a saved leaf (after a reshard)
    free = build_program("commfree-recompute", 6, 1)
    free_links = program_links(free, "commfree", None, False)
    free = [ins for ins in free if not (isinstance(ins, (Start, Wait)) and ins.kind == "bwd")]
    assert handed_on(free, free_links, "commfree", 5).h == frozenset(range(1, 6))
    assert handed_on(free, free_links, "commfree", 5, frozenset({3})).h == frozenset({1, 2, 4, 5})


def test_a_collective_between_stops_the_hand_on():
    """A "dp" all-reduce started after tp:3 (its bucket's gradients must be whole by then)
    keeps tp:3's engine call where it is; the other regions still hand on."""
    program = build_program("megatron", 6, 1)
    links = program_links(program, "none", None, False)
    steps = [ins for ins in program if not (isinstance(ins, (Start, Wait)) and ins.kind == "bwd")]
    at = next(n for n, ins in enumerate(steps) if getattr(ins, "pieces", ())[-1:] == (("tp", 3),))
    steps.insert(at + 1, Start("dp", 3, 0))
    assert handed_on(steps, links, "none", 5).h == frozenset({1, 2, 4, 5})


def test_recompute_sp_and_zero_keep_their_partials_apart():
    oases = program_links(build_program("oases", 6, 2), "commfree", None, False)
    assert oases.p == frozenset() and oases.x  # the recompute's [epi:i-1, body:i] still link
    assert program_links(build_program("megatron", 6, 1), "none", None, True).p == frozenset()
    sp = program_links(build_program("megatron", 6, 1, sp="gathered"), "none", "gathered", False)
    assert sp.x == sp.p == frozenset()


def test_block_recompute_links_its_partials_in_the_recompute():
    links = program_links(build_program("megatron-recompute", 6, 1), "block", None, False)
    assert links.p == frozenset(range(5)) and links.x


@pytest.mark.parametrize(
    "name",
    [
        "megatron",
        "overlap",
        "megatron-recompute",
        "overlap-recompute",
        "commfree-recompute",
        "oases",
    ],
)
def test_linked_programs_run_one_engine_call_per_backward_compute(monkeypatch, name):
    """At tp=1 without recompute every tp:i hands its roots on (h-links): one engine call per
    sub-batch, from its loss, as the plain model's; with a block recompute one per backward
    Compute, plus the norms whose input is a saved leaf, less a block's MLP's, which hands on
    to its attention's Compute (its norm reads the recomputed attention glue's output); with
    the communication-free recompute one per region (each glue's, where a recompute lies
    between, and the embedding's), not two."""
    torch.manual_seed(0)
    cfg = ModelConfig(n_layers=2, dim=16, n_heads=2, seq_len=8, vocab_size=32)
    plain = Transformer(cfg)
    model = parallelize(copy.deepcopy(plain), init_distributed(tp=1))
    tokens, targets = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    calls = []
    real = executor_backward._ENGINE_RUN  # the engine's entry: every backward the executor runs
    monkeypatch.setattr(
        executor_backward, "_ENGINE_RUN", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    n_sub = 2 if name.startswith("overlap") or name == "oases" else 1
    schedule = build_schedule(name, n_sub=n_sub)
    schedule.step(model, tokens, targets)
    backward = [i for i in schedule.program(model, 2) if getattr(i, "phase", "") == "backward"]
    # a block recompute's norm:i runs on its own where x_i is the block's saved input, and the
    # head's, whose glue epi:i-1 ran in the forward without a graph: per sub-batch, one a block
    # and the head's
    if name in ("commfree-recompute", "oases"):  # the head's tp hands on; each other Compute
        assert len(calls) == len(backward)  # one call, and the embedding's lookup one more
    elif name.endswith("recompute"):  # each block's MLP hands on to its attention's Compute
        assert len(calls) == len(backward) + (cfg.n_layers + 1) * n_sub - cfg.n_layers * n_sub
    else:
        assert len(calls) == n_sub
    plain(tokens, targets).backward()
    for (name, p), q in zip(plain.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_engine_entry_checks_shapes_and_falls_back(monkeypatch):
    """The executor's direct engine call still rejects a root gradient of the wrong shape, and
    without torch's private entry it falls back to ``torch.autograd.backward`` (same grads)."""
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="shape"):
        executor_backward.run_backward((x * 2,), (torch.ones(4, 3, dtype=torch.float64),))
    executor_backward.run_backward((x * 2,), (g,))
    direct, x.grad = x.grad, None
    monkeypatch.delattr(torch.autograd.graph, "_engine_run_backward")
    monkeypatch.setattr(executor_backward, "_ENGINE_RUN", executor_backward._engine_entry())
    executor_backward.run_backward((x * 2,), (g,))
    torch.testing.assert_close(x.grad, direct, rtol=0, atol=0)


def _graph_nodes(roots) -> collections.Counter:  # noqa: ANN001
    seen, stack = set(), [r.grad_fn for r in roots if r.grad_fn is not None]
    kinds: collections.Counter = collections.Counter()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        kinds[type(fn).__name__] += 1
        stack += [g for g, _ in fn.next_functions]
    return kinds


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_at_tp1_a_megatron_step_runs_the_plain_models_graph(monkeypatch, arch):
    """h-linked regions: the row-parallel bias joins its matmul, so the one engine call runs
    the plain model's graph node for node, but for the loss (the vocab-parallel
    cross-entropy's own node against ``F.cross_entropy``'s) and one view per x-linked norm
    (which keeps the sum of the norm's own uses before the residual's, as the recompute twin
    sums them: ``test_a_schedule_and_its_recompute_twin_agree_bit_for_bit_at_tp1``)."""
    torch.manual_seed(0)
    cfg = ModelConfig(arch=arch, n_layers=3, dim=16, n_heads=2, seq_len=8, vocab_size=32)
    plain = Transformer(cfg)
    model = parallelize(copy.deepcopy(plain), init_distributed(tp=1))
    tokens, targets = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    graphs = []
    real = executor_backward._ENGINE_RUN
    monkeypatch.setattr(
        executor_backward,
        "_ENGINE_RUN",
        lambda t, *a, **k: graphs.append(_graph_nodes(t)) or real(t, *a, **k),
    )
    build_schedule("megatron").step(model, tokens, targets)
    loss_nodes = {
        "LogSoftmaxBackward0",
        "NllLossBackward0",
        "MaskedFillBackward0",
        "MeanBackward0",
        "_VocabParallelCEBackward",
    }
    (ours,) = graphs
    theirs = _graph_nodes([plain(tokens, targets)])
    for kinds in (ours, theirs):
        for name in loss_nodes:
            kinds.pop(name, None)
    theirs["ViewBackward0"] += 2 * cfg.n_layers + 1  # norm:i on epi:i-1's output, i >= 1
    assert ours == theirs


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_schedule_and_its_recompute_twin_agree_bit_for_bit_at_tp1(arch):
    """At tp=1 (h-links: one engine call without recompute, one per block or MLP with it),
    fp32 under dropout: megatron and megatron-recompute, overlap and overlap-recompute give
    the same gradients bit for bit (LLaMA's RMSNorm reads x_i twice: the sum order matters)."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        arch=arch, n_layers=3, dim=32, n_heads=4, seq_len=8, vocab_size=64, dropout=0.1
    )
    base = Transformer(cfg).train()
    tokens = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(2))
    grads = {}
    for name, k in (
        ("megatron", 1),
        ("megatron-recompute", 1),
        ("overlap", 2),
        ("overlap-recompute", 2),
    ):
        model = parallelize(copy.deepcopy(base), init_distributed(tp=1)).train()
        torch.manual_seed(5)
        build_schedule(name, n_sub=k).step(model, tokens, targets)
        grads[name] = [p.grad for p in model.parameters()]
    for plain_name in ("megatron", "overlap"):
        for a, b in zip(grads[plain_name], grads[f"{plain_name}-recompute"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
