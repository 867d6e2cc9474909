"""`oases train`: the training loop's pieces, and the CLI end to end (slow: subprocesses).

Fast: LR schedule, optimizer groups, global grad-norm clipping (single process and tp=2 / dp=2
against the single-device model), the setup agreement that makes one rank's error stop all.
Slow: a 2-rank CLI run of configs/tiny.toml (in float64: its losses equal an in-process tp=1
run's to 1e-10), and bad configs failing fast with one line. Parity in float64 (tests/exactness.py).
"""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from exactness import EXACT64, to64
from oases.config import TrainConfig, load_config
from oases.model import build_model
from oases.train.optim import build_optimizer, clip_grad_norm_, lr_at

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny.toml"


# ---------------------------------------------------------------- loop pieces, one process


def test_lr_warmup_then_cosine_to_min_lr():
    t = TrainConfig(steps=20, lr=1e-3, min_lr=1e-4, warmup_steps=4)
    lrs = [lr_at(s, t) for s in range(t.steps)]
    assert lrs[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))  # non-increasing after warmup
    assert lr_at(t.steps, t) == pytest.approx(1e-4)
    assert lrs[-1] > 1e-4
    no_warmup = TrainConfig(steps=10, lr=1e-3, min_lr=0.0, warmup_steps=0)
    assert lr_at(0, no_warmup) == pytest.approx(1e-3)


def test_no_weight_decay_on_biases_norms_and_embeddings():
    model = build_model(load_config(TINY).model)
    opt = build_optimizer(model, TrainConfig(weight_decay=0.1))
    names = {id(p): n for n, p in model.named_parameters()}
    decay = {names[id(p)] for p in opt.param_groups[0]["params"]}
    no_decay = {names[id(p)] for p in opt.param_groups[1]["params"]}
    assert opt.param_groups[0]["weight_decay"] == 0.1 and opt.param_groups[1]["weight_decay"] == 0
    assert {"embed.weight", "pos_embed.weight", "norm.weight", "norm.bias"} <= no_decay
    assert "blocks.0.attn.qkv.bias" in no_decay and "blocks.0.attn_norm.weight" in no_decay
    assert decay == {
        n for n in names.values() if n.endswith("weight") and "norm" not in n and "embed" not in n
    }
    assert "head.weight" in decay


@pytest.mark.exact
def test_clip_matches_torch_on_one_process():
    from oases.parallel.context import init_distributed

    ctx = init_distributed(tp=1)
    torch.manual_seed(0)
    a = to64(build_model(load_config(TINY).model))
    b = to64(build_model(load_config(TINY).model))
    b.load_state_dict(a.state_dict())
    tokens = torch.randint(0, 256, (2, 32))
    for m in (a, b):
        m(tokens[:, :-1], tokens[:, 1:]).backward()
    norm = clip_grad_norm_(a.parameters(), 0.1, ctx.tp_group)
    ref = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.1)
    assert ref.dtype == torch.float64 and norm == pytest.approx(float(ref), rel=EXACT64["rtol"])
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, **EXACT64)


# ---------------------------------------------------------------- loop pieces, 2 ranks


def _grad_norm_rank(rank, world_size):
    """tp=2 and dp=2 grad norms (before and after clipping) equal the single-device model's
    (float64)."""
    from oases.config import Config
    from oases.parallel.apply import parallelize, shard_spec, shard_tensor
    from oases.parallel.context import init_distributed
    from oases.schedule import build_schedule
    from oases.train.agree import PeerError, agree_on_setup

    cfg = Config()
    cfg.model = load_config(TINY).model
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 256, (4, 33), generator=g)  # the global batch, same on all ranks
    torch.manual_seed(0)
    ref = to64(build_model(cfg.model))
    ref(tokens[:, :-1], tokens[:, 1:]).backward()
    ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05))
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    out = {}
    for tp in (2, 1):
        ctx = init_distributed(tp=tp)
        torch.manual_seed(0)
        model = parallelize(to64(build_model(cfg.model)), ctx)
        rows = slice(ctx.dp_rank * 4 // ctx.dp, (ctx.dp_rank + 1) * 4 // ctx.dp)
        build_schedule("megatron", micro_batch=2).step(model, tokens[rows, :-1], tokens[rows, 1:])
        norm = clip_grad_norm_(model.parameters(), 0.05, ctx.tp_group)
        assert norm == pytest.approx(ref_norm, rel=EXACT64["rtol"]), (tp, norm, ref_norm)
        for name, p in model.named_parameters():
            spec = shard_spec(p)
            want = (
                ref_grads[name]
                if spec is None
                else shard_tensor(ref_grads[name], spec, ctx.tp_rank, ctx.tp)
            )
            torch.testing.assert_close(p.grad, want, **EXACT64)
        out[tp] = norm
    # one rank's setup error stops every rank; only the failing rank keeps the message
    ctx = init_distributed(tp=2)
    mine = ValueError("data.source='x': missing") if rank == 1 else None
    try:
        agree_on_setup(ctx, mine)
        out["agree"] = "ok"
    except PeerError:
        out["agree"] = "peer"
    except ValueError as exc:
        out["agree"] = str(exc)
    agree_on_setup(ctx, None)  # no error anywhere: returns on every rank
    return out


@pytest.mark.exact
def test_grad_norm_over_tp_shards_and_dp_matches_single_device(spawn_ranks):
    r0, r1 = spawn_ranks(_grad_norm_rank, 2, timeout_s=90)
    assert r0[2] == r1[2] and r0[1] == pytest.approx(r0[2], rel=EXACT64["rtol"])
    assert r0["agree"] == "peer" and r1["agree"] == "rank 1: data.source='x': missing"


# ---------------------------------------------------------------- the CLI (subprocesses)


def _run_cli(args, timeout_s):
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "TORCHELASTIC_RUN_ID",
            "LOCAL_RANK",
            "RANK",
            "WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
        )
    }
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "oases", "train", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    return proc, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.exact
def test_cli_two_rank_tiny_run(tmp_path):
    import io

    from oases.train.loop import train

    run_dir = tmp_path / "run"
    proc, _ = _run_cli(
        [
            str(TINY),
            "--nproc-per-node",
            "2",
            f"--train.run_dir={run_dir}",
            "--train.precision=fp64",
        ],
        120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the same run at tp=1 in this process: the CLI's tp=2 losses, float64 end to end
    ref = train(
        load_config(
            TINY,
            [
                f"--train.run_dir={tmp_path / 'tp1'}",
                "--parallel.tp=1",
                "--train.precision=fp64",
                "--train.sample_tokens=0",
                "--checkpoint.resume=never",
            ],
        ),
        log=io.StringIO(),
    )
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, lines) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 7))
    torch.testing.assert_close([r["loss"] for r in rows], ref["losses"], **EXACT64)
    assert set(rows[0]) == {
        "step",
        "loss",
        "lr",
        "grad_norm",
        "step_time_s",
        "tokens_per_s",
        "peak_mem_mb",
        "live_peak_mb",
    }
    evals = [r for r in map(json.loads, lines) if "val_loss" in r]
    assert [r["step"] for r in evals] == [3, 6]  # tiny.toml: eval_every = 3
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step_000003",
        "step_000006",
    ]
    assert all(math.isfinite(r["loss"]) and 0 < r["loss"] < 7 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]
    saved = load_config(run_dir / "config.toml")
    assert saved.parallel.tp == 2 and saved.train.run_dir == str(run_dir)
    assert saved.train.precision == "fp64"
    assert "tp=2" in proc.stdout and "validation loss" in proc.stdout
    assert proc.stdout.count("step ") >= 3  # rank 0 only: one line per log_every steps
    assert "sample:" in proc.stdout  # the end-of-run sample
    assert (run_dir / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"loss curve {run_dir / 'loss.png'}" in proc.stdout


@pytest.mark.slow
def test_cli_bpe_tokenizer_is_trained_saved_and_reloaded_on_resume(tmp_path):
    run_dir = tmp_path / "run"
    args = [
        str(TINY),
        "--nproc-per-node",
        "2",
        f"--train.run_dir={run_dir}",
        "--data.tokenizer=bpe",
        "--model.vocab_size=384",
        "--train.sample_tokens=8",
    ]
    proc, _ = _run_cli(args, 180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    trained = (run_dir / "tokenizer.json").read_text()
    assert (run_dir / "checkpoints" / "step_000006" / "tokenizer.json").read_text() == trained
    proc, _ = _run_cli([*args, "--train.steps=8"], 180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resumed from" in proc.stdout
    assert (run_dir / "checkpoints" / "step_000008" / "tokenizer.json").read_text() == trained


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--model.dim=48", "--model.n_heads=3"],
            "model.n_heads=3 is not divisible by parallel.tp=2",
        ),
        (["--model.n_heads=3"], "model.n_heads=3"),
        (["--model.dimm=5"], "unknown key 'model.dimm'"),
        (["--nproc-per-node", "3"], "world_size=3 is not divisible by parallel.tp=2"),
        (["--data.source=/no/such/dir/*.txt"], "data.source='/no/such/dir/*.txt'"),
        (["--checkpoint.keep=0"], "checkpoint.keep=0 must be >= 1"),
        (["--max-restarts", "-1"], "--max-restarts=-1 must be >= 0"),
    ],
)
def test_cli_bad_config_fails_fast_with_one_line(args, expected):
    proc, elapsed = _run_cli([str(TINY), *args], 60)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines
    assert "Traceback" not in proc.stdout + proc.stderr
    assert elapsed < 30  # checked in the parent, before any rank starts: no hang


@pytest.mark.slow
def test_cli_error_found_inside_the_ranks_is_one_line(tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("too short for one window\n")
    proc, _ = _run_cli(
        [str(TINY), f"--data.source={text}", f"--train.run_dir={tmp_path / 'run'}"], 90
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "fewer than one window" in lines[0], proc.stderr
    assert lines[0].startswith("error: data.source=") and "Traceback" not in proc.stderr
