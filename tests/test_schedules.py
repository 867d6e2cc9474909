"""Schedules on real ranks: numbers equal to megatron and to the single-device model, recompute
twins equal under dropout, collective counts and order, saved-activation accounting, DP with
gradient accumulation, measured timelines.

Numbers are compared in float64 (1e-10) and once per path in fp32 within the bound derived from
its reductions; recompute twins bit for bit (tests/exactness.py says why each bound holds).

Chain of R = 2L + 2 regions: 0 embedding, 2l+1 / 2l+2 block l's attention / MLP, R-1 the head.
Each test is one spawn of the ranks with many cases inside the rank function (process start
dominates); the tp=1 case runs in this process (a single process never calls a collective).
"""

from __future__ import annotations

import collections
import copy
import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks
from exactness import BITWISE, EXACT64, fp32_tol, to64
from oases import record_collectives
from oases.config import ModelConfig
from oases.model import build_model
from oases.parallel.apply import parallelize, shard_spec, shard_tensor
from oases.parallel.context import init_distributed
from oases.schedule import SCHEDULES, build_schedule, record_timeline
from oases.schedule.instructions import Start

B, S, DIM, N_LAYERS, VOCAB = 4, 16, 32, 2, 101
LR = 1e-2
# recompute schedule -> its non-recompute twin with the same sub-batches
TWINS = {
    "megatron-recompute": "megatron",
    "commfree-recompute": "megatron",  # both one sub-batch whatever n_sub says
    "overlap-recompute": "overlap",
    "oases": "overlap",
}
# forward-direction all-reduces of the blocks per block and sub-batch
FWD_PER_BLOCK = {
    "megatron": 2,
    "megatron-recompute": 4,
    "commfree-recompute": 2,
    "overlap": 2,
    "overlap-recompute": 4,
    "oases": 2,
}


# --------------------------------------------------------------------------------------------
# helpers (run inside the ranks)


def _cfg(arch: str, tp: int, dropout: float = 0.0, n_layers: int = N_LAYERS) -> ModelConfig:
    """Tiny gpt2 (tied embeddings) or llama (grouped-query: fewer kv heads than heads)."""
    if arch == "gpt2":
        return ModelConfig(
            arch="gpt2",
            n_layers=n_layers,
            dim=DIM,
            n_heads=4,
            vocab_size=VOCAB,
            seq_len=S,
            tie_embeddings=True,
            dropout=dropout,
        )
    n_heads = 4 if tp <= 2 else 8  # n_kv_heads must split over tp and stay below n_heads
    return ModelConfig(
        arch="llama",
        n_layers=n_layers,
        dim=DIM,
        n_heads=n_heads,
        n_kv_heads=n_heads // 2,
        vocab_size=VOCAB,
        seq_len=S,
        dropout=dropout,
    )


def _tokens(seed: int, batch: int = B) -> torch.Tensor:
    """Random tokens, identical on every rank."""
    return torch.randint(0, VOCAB, (batch, S), generator=torch.Generator().manual_seed(seed))


def _build(cfg: ModelConfig, seed: int, fp64: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = build_model(cfg)
    return to64(model) if fp64 else model


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _expected_shard(full: torch.Tensor, par_param: torch.Tensor, ctx) -> torch.Tensor:
    spec = shard_spec(par_param)
    return full if spec is None else shard_tensor(full, spec, ctx.tp_rank, ctx.tp)


def _assert_grads_equal(got: dict, want: dict, where: str, tol=EXACT64) -> None:
    """``tol``: assert_close arguments, or a function of the expected tensor giving them."""
    assert set(got) == set(want), f"{where}: names differ {sorted(set(got) ^ set(want))}"
    for n, g in want.items():
        assert got[n] is not None, f"{where}: {n} has no grad"
        torch.testing.assert_close(
            got[n],
            g,
            **(tol(g) if callable(tol) else tol),
            msg=lambda m, n=n: f"{where}: grad {n}: {m}",
        )


def _assert_grads_match_single_device(par, ref, ctx, where: str, tol=EXACT64) -> None:
    """Each rank's gradient equals its shard of the single-device gradient."""
    ref_params = dict(ref.named_parameters())
    want = {n: _expected_shard(ref_params[n].grad, p, ctx) for n, p in par.named_parameters()}
    _assert_grads_equal({n: p.grad for n, p in par.named_parameters()}, want, where, tol)


def _step(
    name: str, ref, ctx, tokens, targets, n_sub: int = 2, seed: int | None = None, **kwargs
) -> tuple:
    """Step a parallelized copy of ``ref`` with ``name``: (loss, grads, model, schedule)."""
    model = parallelize(copy.deepcopy(ref), ctx)
    model.zero_grad(set_to_none=True)  # replicated params keep a deep-copied .grad otherwise
    sched = build_schedule(name, n_sub=n_sub, **kwargs)
    if seed is not None:
        torch.manual_seed(seed)  # the same RNG state (dropout masks) for every schedule
    loss = sched.step(model, tokens, targets)
    assert not loss.requires_grad, f"{name}: step() returned a loss that requires grad"
    return loss, _grads(model), model, sched


def _block_tag_counts(records, prefix: str, n_layers: int, n_subs: int) -> dict:
    """{(block, sub): number of all-reduces tagged "<prefix>:i:j" with i a region of block}."""
    counts = {(blk, j): 0 for blk in range(n_layers) for j in range(n_subs)}
    for r in records:
        m = re.fullmatch(rf"{prefix}:(\d+):(\d+)", r.tag)
        if m and 1 <= int(m[1]) <= 2 * n_layers:
            assert r.op == "all_reduce" and r.group == "tp", r
            counts[(int(m[1]) - 1) // 2, int(m[2])] += 1
    return counts


# --------------------------------------------------------------------------------------------
# rank functions (module level so the spawned children can import them)


def _rank_match_megatron(rank: int, world_size: int) -> dict:
    """Every schedule x both flavours at tp = world size: loss and gradients equal megatron's and
    the single-device model's (dropout 0, float64); then the oases schedule once in fp32."""
    ctx = init_distributed(tp=world_size)
    losses = {}
    for f, arch in enumerate(("gpt2", "llama")):
        cfg = _cfg(arch, ctx.tp)
        ref = _build(cfg, 10 + f, fp64=True)
        tokens, targets = _tokens(20 + f), _tokens(30 + f)
        ref_loss = ref(tokens, targets)
        ref_loss.backward()
        base_loss, base_grads, _, _ = _step("megatron", ref, ctx, tokens, targets)
        for name in SCHEDULES:
            where = f"{arch} tp={ctx.tp} rank={rank} {name}"
            loss, grads, model, _ = _step(name, ref, ctx, tokens, targets, n_sub=2)
            assert loss.dtype == torch.float64, f"{where}: {loss.dtype}"
            torch.testing.assert_close(
                loss, base_loss, **EXACT64, msg=lambda m, w=where: f"{w}: {m}"
            )
            torch.testing.assert_close(
                loss,
                ref_loss.detach(),
                **EXACT64,
                msg=lambda m, w=where: f"{w} vs single device: {m}",
            )
            _assert_grads_equal(grads, base_grads, f"{where} vs megatron")
            _assert_grads_match_single_device(model, ref, ctx, f"{where} vs single device")
            losses[arch, name] = loss.item()
    # fp32, the schedules' one case: oases (two sub-batches, commfree recompute) against the
    # single-device model, loss and gradients of one backward within the derived bound
    cfg = _cfg("gpt2", ctx.tp)
    ref = _build(cfg, 12)
    tokens, targets = _tokens(22), _tokens(32)
    ref_loss = ref(tokens, targets)
    ref_loss.backward()
    loss, _, model, _ = _step("oases", ref, ctx, tokens, targets, n_sub=2)
    n = tokens.numel()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss.detach(), **fp32_tol(ref_loss, cfg, n, False))
    _assert_grads_match_single_device(
        model,
        ref,
        ctx,
        f"fp32 oases tp={ctx.tp} rank={rank}",
        tol=lambda want: fp32_tol(want, cfg, n, True),
    )
    return losses


def _rank_dropout_twins(rank: int, world_size: int) -> dict:
    """Dropout 0.1 in train mode: each recompute schedule reproduces its twin bit for bit
    (recompute restores the RNG state, so the masks are the forward's)."""
    ctx = init_distributed(tp=world_size)
    out = {}
    for f, arch in enumerate(("gpt2", "llama")):
        cfg = _cfg(arch, ctx.tp, dropout=0.1)
        ref = _build(cfg, 40 + f)
        ref.train()
        tokens, targets = _tokens(50 + f), _tokens(60 + f)
        runs = {
            name: _step(name, ref, ctx, tokens, targets, n_sub=2, seed=1234)
            for name in ("megatron", "overlap", *TWINS)
        }
        # no-dropout control: dropout really changes the loss (the masks are in play)
        ref0 = copy.deepcopy(ref).eval()
        eval_loss = ref0(tokens, targets).item()
        for name, twin in TWINS.items():
            where = f"{arch} tp={ctx.tp} rank={rank} {name} vs {twin}"
            # Exact: the recompute runs the same kernels on the same inputs with the same masks,
            # and the backward accumulates in the same order, so no rounding difference arises.
            torch.testing.assert_close(
                runs[name][0], runs[twin][0], **BITWISE, msg=lambda m, w=where: f"{w}: loss {m}"
            )
            _assert_grads_equal(runs[name][1], runs[twin][1], where, BITWISE)
        out[arch] = {
            "train": runs["megatron"][0].item(),
            "eval": eval_loss,
            "overlap": runs["overlap"][0].item(),
        }
    return out


def _rank_counts_and_order(rank: int, world_size: int) -> dict:
    """Collectives per block and sub-batch, and the executed order of the program's Starts."""
    ctx = init_distributed(tp=world_size)
    cfg = _cfg("gpt2", ctx.tp)
    ref = _build(cfg, 70)
    tokens, targets = _tokens(71), _tokens(72)
    out = {}
    for name in SCHEDULES:
        model = parallelize(copy.deepcopy(ref), ctx)
        sched = build_schedule(name, n_sub=2)
        with record_collectives() as records:
            sched.step(model, tokens, targets)
        k = 2 if name in ("overlap", "overlap-recompute", "oases") else 1
        fwd = _block_tag_counts(records, "fwd", cfg.n_layers, k)
        bwd = _block_tag_counts(records, "bwd", cfg.n_layers, k)
        program = sched.program(model, tokens.shape[0])
        starts = [f"{i.kind}:{i.index}:{i.sub}" for i in program if isinstance(i, Start)]
        issued = [r.tag for r in records if re.match(r"(fwd|bwd|dp):", r.tag)]
        assert issued == starts, f"{name}: issued {issued}\n   program {starts}"
        for r in records:
            if r.tag.startswith("fwd:"):
                assert r.direction == "forward", r
            if r.tag.startswith("bwd:"):
                assert r.direction == "backward", r
            if re.match(r"(fwd|bwd):", r.tag):  # one activation [b, S, H] fp32 per sub-batch
                assert r.nbytes == (B // k) * S * cfg.dim * 4 and r.is_async, r
        other = collections.Counter(r.tag for r in records if not re.match(r"(fwd|bwd):", r.tag))
        out[name] = {"fwd": fwd, "bwd": bwd, "other": dict(other)}
    return out


def _rank_memory(rank: int, world_size: int) -> dict:
    """Bytes kept from forward to backward per region, by the executor's own accounting."""
    ctx = init_distributed(tp=world_size)
    out = {}
    for arch in ("gpt2", "llama"):
        cfg = _cfg(arch, ctx.tp)
        ref = _build(cfg, 80)
        tokens, targets = _tokens(81), _tokens(82)
        for name in SCHEDULES:
            model = parallelize(copy.deepcopy(ref), ctx)
            sched = build_schedule(name, n_sub=2)
            executor = sched.executor(model)
            executor.track_memory = True
            sched.step(model, tokens, targets)
            saved = dict(executor.saved_bytes)
            out[arch, name] = {
                blk: saved.get(2 * blk + 1, 0) + saved.get(2 * blk + 2, 0)
                for blk in range(cfg.n_layers)
            }
    return out


def _rank_timeline(rank: int, world_size: int, out_dir: str) -> dict:
    ctx = init_distributed(tp=world_size)
    cfg = _cfg("gpt2", ctx.tp)
    model = parallelize(_build(cfg, 90), ctx)
    sched = build_schedule("oases", n_sub=2)
    with record_timeline() as timeline:
        sched.step(model, _tokens(91), _tokens(92))
    dist.barrier()  # every comm-completion callback of this step has fired
    lanes = {e.lane for e in timeline.events}
    out_dir = Path(out_dir)
    trace = out_dir / f"trace{rank}.json"
    png = out_dir / f"t{rank}.png"
    timeline.save_chrome_trace(trace)
    timeline.plot(png)
    data = json.loads(trace.read_text())
    # measured order: the forward all-reduce of sub 0 of a block region is issued before the
    # compute of sub 1 of that region starts
    issue = {
        (e.phase, e.name.split()[-1], e.sub): e.start_s for e in timeline.events if e.lane == "comm"
    }
    body_start = {}
    for e in timeline.events:
        if e.lane == "compute" and e.phase == "forward":
            for piece in e.name.split():
                kind, i = piece.split(":")
                if kind == "body":
                    body_start[int(i), e.sub] = e.start_s
    chain = sched.executor(model).chain
    for region in chain[1:-1]:
        assert issue["fwd", str(region.index), 0] < body_start[region.index, 1], region.name
    return {
        "lanes": sorted(lanes),
        "ranks": sorted({e.rank for e in timeline.events}),
        "n_trace": len(data["traceEvents"]),
        "n_events": len(timeline.events),
        "png_head": png.read_bytes()[:8],
        "compute_phases": sorted({e.phase for e in timeline.events if e.lane == "compute"}),
    }


def _rank_tp2_dp2(rank: int, world_size: int) -> dict:
    """tp=2 x dp=2, oases with n_sub=2, whole local batch and micro-batches of 2 rows: each DP
    rank steps its contiguous half of a global batch of 8 against the single-device model."""
    ctx = init_distributed(tp=2)
    assert (ctx.tp, ctx.dp) == (2, 2)
    global_batch = 8
    half = global_batch // ctx.dp
    rows = slice(ctx.dp_rank * half, (ctx.dp_rank + 1) * half)
    out = {}
    for arch in ("gpt2", "llama"):
        cfg = _cfg(arch, ctx.tp)
        for micro_batch in (None, 2):
            where = f"{arch} micro_batch={micro_batch} rank={rank}"
            ref = _build(cfg, 100, fp64=True)
            par = parallelize(copy.deepcopy(ref), ctx)
            sched = build_schedule("oases", n_sub=2, micro_batch=micro_batch)
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
            par_opt = torch.optim.AdamW(par.parameters(), lr=LR)
            losses = []
            for step in range(3):
                tokens = _tokens(200 + step, global_batch)
                targets = _tokens(300 + step, global_batch)
                ref_opt.zero_grad()
                par_opt.zero_grad()
                ref_loss = ref(tokens, targets)
                ref_loss.backward()
                with record_collectives() as records:
                    local = sched.step(par, tokens[rows], targets[rows])
                glob = local.clone()
                dist.all_reduce(glob, group=ctx.dp_group.pg)
                glob /= ctx.dp
                torch.testing.assert_close(
                    glob,
                    ref_loss.detach(),
                    **EXACT64,
                    msg=lambda m, w=where, s=step: f"{w} step {s}: {m}",
                )
                _assert_grads_match_single_device(par, ref, ctx, f"{where} step {step}")
                dp_recs = [r for r in records if r.tag.startswith("dp:")]
                assert dp_recs and all(r.group == "dp" for r in dp_recs), where
                program = sched.program(par, half)
                starts = [f"{i.kind}:{i.index}:{i.sub}" for i in program if isinstance(i, Start)]
                issued = [r.tag for r in records if re.match(r"(fwd|bwd|dp):", r.tag)]
                assert issued == starts, f"{where}: issued {issued}\n   program {starts}"
                ref_opt.step()
                par_opt.step()
                losses.append(glob.item())
            ref_params = dict(ref.named_parameters())  # float64: the bound holds through AdamW
            for n, p in par.named_parameters():
                torch.testing.assert_close(
                    p.detach(),
                    _expected_shard(ref_params[n].detach(), p, ctx),
                    **EXACT64,
                    msg=lambda m, w=where, n=n: f"{w}: param {n} after 3 AdamW steps: {m}",
                )
            out[arch, micro_batch] = losses
    return out


# --------------------------------------------------------------------------------------------
# tests


@pytest.mark.exact
def test_schedules_match_megatron_tp1():
    """tp = 1 (world 1) in this process: no collective is ever called."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like the spawned ranks; several threads only contend here
    try:
        results = _rank_match_megatron(0, 1)
    finally:
        torch.set_num_threads(threads)
    assert len(results) == 2 * len(SCHEDULES)


@pytest.mark.exact
@pytest.mark.parametrize("tp", (2, 4))
def test_schedules_match_megatron_and_single_device(spawn_ranks, tp):
    results = spawn_ranks(_rank_match_megatron, tp)
    assert all(r == results[0] for r in results)  # the same losses on every TP rank


@pytest.mark.exact
def test_recompute_equals_its_twin_under_dropout(spawn_ranks):
    results = spawn_ranks(_rank_dropout_twins, 2)
    for r in results:
        for arch, losses in r.items():
            # dropout is active: the training loss differs from the eval-mode loss
            assert losses["train"] != losses["eval"], (arch, losses)


@pytest.fixture(scope="module")
def counts_tp2(tmp_path_factory) -> list:
    """One spawn of 2 ranks recording every schedule's collectives (shared by two tests)."""
    return run_ranks(_rank_counts_and_order, 2, tmp_path_factory.mktemp("counts"))


def test_collective_counts_per_block_and_order(counts_tp2):
    for r in counts_tp2:
        for name, counts in r.items():
            assert set(counts["fwd"].values()) == {FWD_PER_BLOCK[name]}, (name, counts["fwd"])
            assert set(counts["bwd"].values()) == {2}, (name, counts["bwd"])
            # outside the fwd/bwd activation all-reduces: only the vocab-parallel loss
            assert set(counts["other"]) <= {"ce-max", "ce-stats"}, (name, counts["other"])


def test_commfree_recompute_repeats_no_collective(counts_tp2):
    """A communication-free recompute issues exactly the collectives of its no-recompute twin."""
    for r in counts_tp2:
        for name in ("commfree-recompute", "oases"):
            assert r[name]["other"] == r[TWINS[name]]["other"], (name, r[name], r[TWINS[name]])


def test_oases_keeps_at_most_4sbh_per_block(spawn_ranks):
    results = spawn_ranks(_rank_memory, 2)
    limit = 4 * S * B * DIM * 4  # 4 activations [B, S, H] fp32 per block (all sub-batches)
    for r in results:
        for arch in ("gpt2", "llama"):
            oases, overlap = r[arch, "oases"], r[arch, "overlap"]
            print(f"{arch}: saved bytes per block: oases {oases}, overlap {overlap}, limit {limit}")
            for blk, nbytes in oases.items():
                assert 0 < nbytes <= limit, (
                    f"{arch} oases block {blk}: executor.saved_bytes says {nbytes} bytes are kept "
                    f"from forward to backward, above 4*S*B*H*4 = {limit}"
                )
                assert overlap[blk] > nbytes, (arch, blk, overlap[blk], nbytes)
            # commfree-recompute (one sub-batch of B rows) keeps the same per-block bound
            for blk, nbytes in r[arch, "commfree-recompute"].items():
                assert 0 < nbytes <= limit, (arch, "commfree-recompute", blk, nbytes, limit)


def test_oases_timeline_trace_and_png(spawn_ranks, tmp_path):
    results = spawn_ranks(_rank_timeline, 2, str(tmp_path))
    for rank, r in enumerate(results):
        assert r["lanes"] == ["comm", "compute"], r
        assert r["ranks"] == [rank], r
        assert r["n_trace"] >= r["n_events"] > 0, r
        assert r["png_head"] == b"\x89PNG\r\n\x1a\n", r
        assert {"forward", "recompute", "backward"} <= set(r["compute_phases"]), r
        assert (tmp_path / f"t{rank}.png").stat().st_size > 1000


@pytest.mark.exact
def test_tp2_dp2_oases_with_gradient_accumulation(spawn_ranks):
    results = spawn_ranks(_rank_tp2_dp2, 4)
    assert all(r == results[0] for r in results)  # every rank saw the same global losses


@pytest.mark.parametrize("arch", ("gpt2", "llama"))
def test_the_forward_keeps_no_reduced_partial_sum_of_a_glue_it_keeps_a_graph_for(arch):
    """Without recompute the executor keeps each glue's graph from forward to backward with
    its reduced input r_i as a leaf, for r_i's gradient; no backward reads r_i's values (the
    bias and residual adds keep nothing, dropout keeps its mask), so its storage is freed in
    the forward, as plain autograd would free it. After every forward instruction of a
    megatron step (tp=1, in this process) every kept r_i holds no memory, except where the
    glue is the identity (llama's embedding: x_1 *is* r_0), and the step's gradients stay
    those of the single-device model."""
    ctx = init_distributed(tp=1)
    cfg = _cfg(arch, 1, dropout=0.1)
    ref = _build(cfg, 5, fp64=True).train()
    model = parallelize(copy.deepcopy(ref), ctx)
    sched = build_schedule("megatron")
    tokens, targets = _tokens(6), _tokens(7)
    ex = sched.executor(model)
    kept, identity, backward = {}, set(), ex._bwd_epi

    def first_backward(i: int, j: int) -> None:  # the forward is over: look at what it kept
        if not kept:
            for key, (_, rl, out) in ex.eg.items():
                kept[key] = rl.untyped_storage().nbytes()
                if rl.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
                    identity.add(key)
        backward(i, j)

    ex._bwd_epi = first_backward
    torch.manual_seed(8)
    loss = sched.step(model, tokens, targets)
    assert len(kept) == len(ex.chain) - 1
    assert all(n == 0 for key, n in kept.items() if key not in identity), kept
    assert identity <= {(0, 0)}
    torch.manual_seed(8)
    ref_loss = ref(tokens, targets)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **EXACT64)
    _assert_grads_match_single_device(model, ref, ctx, f"{arch} megatron tp=1")
