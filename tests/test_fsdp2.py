"""The "fsdp2" benchmark peer (PyTorch's fully_shard, pure DP) against the single-device model.

One spawn of 2 gloo ranks, each config inside the rank function. Each case, in float64 (1e-10,
tests/exactness.py): every rank feeds its half of the global batch in 2 micro-batches of
accumulation, gradients are clipped by their global norm (small enough to clip every step) and
AdamW (``oases.train.optim.build_optimizer``, ``lr_at`` schedule) steps 3 times; each step's
loss (mean over ranks), its gradient norm and, after the steps, every parameter (gathered with
``full_tensor()``) equal the single-device model's run of the whole batch. Also: the command
``oases bench --schedules fsdp2`` end to end.
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from distributed import REPO_ROOT
from exactness import EXACT64, to64
from oases.bench.fsdp2 import FSDP2Schedule, build_world_mesh, fsdp2_optimizer_step, shard_fsdp2
from oases.bench.runner import fsdp2_rows
from oases.config import ModelConfig, TrainConfig
from oases.model import build_model
from oases.parallel.context import init_distributed
from oases.train.optim import build_optimizer, lr_at

B, S, VOCAB, STEPS = 8, 16, 101, 3  # vocabulary 101: the embedding's shards are uneven (51 + 50)
TRAIN = TrainConfig(
    steps=STEPS,
    global_batch=B,
    micro_batch=2,
    lr=1e-2,
    min_lr=1e-3,
    warmup_steps=1,
    weight_decay=0.1,
    grad_clip=0.05,
)
GPT2_TIED = dict(
    arch="gpt2", n_layers=2, dim=32, n_heads=4, vocab_size=VOCAB, seq_len=S, tie_embeddings=True
)
LLAMA = dict(arch="llama", n_layers=2, dim=32, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, seq_len=S)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (
        torch.randint(0, VOCAB, (B, S), generator=g),
        torch.randint(0, VOCAB, (B, S), generator=g),
    )


def _reference_step(ref, opt, step: int) -> tuple[float, float]:
    """The single-device step on the whole batch, clipped by hand as oases.train.loop clips."""
    for group in opt.param_groups:
        group["lr"] = lr_at(step, TRAIN)
    opt.zero_grad(set_to_none=True)
    tokens, targets = _batch(step)
    loss = ref(tokens, targets)
    loss.backward()
    grads = [p.grad for p in ref.parameters()]
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
    assert norm > TRAIN.grad_clip, f"step {step}: norm {norm} would not be clipped"
    for g in grads:
        g.mul_(TRAIN.grad_clip / (norm + 1e-6))
    opt.step()
    return float(loss), norm


def _check_case(kwargs: dict, ctx, mesh, seed: int) -> dict:
    cfg = ModelConfig(**kwargs)
    where = f"{cfg.arch} tied={cfg.tie_embeddings} rank={ctx.rank}"
    torch.manual_seed(seed)
    ref = to64(build_model(cfg))
    init = copy.deepcopy(ref)
    model = shard_fsdp2(copy.deepcopy(ref), mesh)
    # every parameter is one Shard(0) DTensor over the world; a tied weight is still one
    names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in ref.named_parameters()], where
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0),), f"{where}: {name}"
    if cfg.tie_embeddings:
        assert model.head.weight is model.embed.weight, f"{where}: tie lost"
        assert "head.weight" not in names, where
    rows = model.embed.weight.to_local().shape[0]
    assert rows == (51, 50)[ctx.rank], f"{where}: embedding shard of {rows} rows"

    ref_opt, opt = build_optimizer(ref, TRAIN), build_optimizer(model, TRAIN)
    sched = FSDP2Schedule(micro_batch=TRAIN.micro_batch)
    half = slice(ctx.rank * B // 2, (ctx.rank + 1) * B // 2)  # 4 rows: 2 micro-batches of 2
    losses, norms = [], []
    for step in range(STEPS):
        ref_loss, ref_norm = _reference_step(ref, ref_opt, step)
        tokens, targets = _batch(step)
        local = sched.step(model, tokens[half], targets[half])
        assert not local.requires_grad, f"{where}: step() loss is not detached"
        loss = local.clone()
        dist.all_reduce(loss)
        loss = float(loss) / ctx.world_size
        norm = fsdp2_optimizer_step(model, opt, step, TRAIN)
        assert loss == pytest.approx(ref_loss, rel=EXACT64["rtol"], abs=EXACT64["atol"]), (
            f"{where}: step {step} loss {loss} vs {ref_loss}"
        )
        assert norm == pytest.approx(ref_norm, rel=EXACT64["rtol"], abs=EXACT64["atol"]), (
            f"{where}: step {step} grad norm {norm} vs {ref_norm}"
        )
        assert all(p.grad is None for p in model.parameters()), f"{where}: grads not zeroed"
        losses.append(loss)
        norms.append(norm)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(
            p.detach().full_tensor(),
            ref_params[name].detach(),
            **EXACT64,
            msg=lambda m, n=name: f"{where}: {n}: {m}",
        )
    moved = max(
        float((p.detach().full_tensor() - q).abs().max())
        for p, q in zip(model.parameters(), init.parameters())
    )
    return {"losses": losses, "norms": norms, "moved": moved}


def _rank_fsdp2(rank: int, world_size: int, cases: list[tuple[str, dict]]) -> dict:
    ctx = init_distributed(tp=1)
    mesh = build_world_mesh(ctx)
    assert mesh.mesh.tolist() == list(range(world_size))
    return {key: _check_case(kwargs, ctx, mesh, 10 + i) for i, (key, kwargs) in enumerate(cases)}


@pytest.mark.exact
def test_fsdp2_equals_single_device(spawn_ranks) -> None:
    cases = [("gpt2-tied", GPT2_TIED), ("llama", LLAMA)]
    results = spawn_ranks(_rank_fsdp2, 2, cases)
    for key, _ in cases:
        assert results[0][key]["losses"] == results[1][key]["losses"], key
        assert results[0][key]["norms"] == results[1][key]["norms"], key
        assert results[0][key]["moved"] > 1e-3, f"{key}: the steps did not move the weights"


def test_fsdp2_rows_split_each_tp_groups_batch() -> None:
    assert [fsdp2_rows(4, 2, r) for r in (0, 1)] == [slice(0, 2), slice(2, 4)]
    assert fsdp2_rows(3, 1, 0) == slice(0, 3)
    with pytest.raises(ValueError, match="must divide by parallel.tp=2"):
        fsdp2_rows(3, 2, 0)


@pytest.mark.slow
def test_bench_runs_fsdp2(tmp_path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "oases",
            "bench",
            "configs/tiny.toml",
            "--link",
            "none",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--schedules",
            "fsdp2",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    row = result["schedules"]["fsdp2"]
    assert row["median_step_s"] > 0 and row["peak_mem_mb"] > 0
    assert "fsdp2" in (tmp_path / "report.md").read_text()
