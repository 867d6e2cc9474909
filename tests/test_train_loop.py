"""The training loop end to end, in-process ranks (no CLI): resume, resharding, tp x dp, metrics.

Every run trains a tiny GPT-2 with an uneven vocabulary (257 rows: at tp=2 the padded shards hold
129 and 128 real rows) on a small text file, so the DTensor checkpoints cross uneven chunks.
Runs compared with another layout train in float64 (``train.precision = "fp64"``) and agree to
1e-10 (tests/exactness.py); the fp32 case compares the first step's loss within its derived bound.
Two spawns carry most cases (starting processes is the expensive part):

- 2 ranks, tp=2: 6 steps; 3 steps + stop + resume for 3 (equal losses and weights);
  a truncated and a garbled checkpoint fail with one line naming the path on every rank.
- 4 ranks, tp=2 x dp=2: 3 steps equal a tp=1 run on the same global batch, the first step's
  clipped grad norm equals the single-device model's, and its checkpoint holds the tp=1 run's
  weights; in fp32, the first step's loss equals the tp=1 run's within the derived bound.

The tp=1 runs happen in the test process (one rank, no process group).
"""

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from exactness import EXACT64, fp32_tol, to64
from oases.config import load_config
from oases.data.dataset import open_dataset, split_batches
from oases.model import build_model
from oases.train.checkpoint import latest_checkpoint, read_full_tensors

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny.toml"
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "red"]
FP64 = "--train.precision=fp64"


def write_text(path: Path) -> Path:
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(1500)]
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def tiny_cfg(root: Path, name: str, *overrides: str):
    """configs/tiny.toml on the text file in ``root``, its own run folder ``root/name``."""
    return load_config(
        TINY,
        [
            f"--data.source={root / 'text.txt'}",
            f"--train.run_dir={root / name}",
            "--model.vocab_size=257",
            "--train.eval_every=0",
            "--train.eval_batches=2",
            "--checkpoint.every=0",
            "--checkpoint.resume=never",
            *overrides,
        ],
    )


def run(cfg, **kw):
    import io

    from oases.train.loop import train

    return train(cfg, log=io.StringIO(), **kw)


def one_line_error(cfg):
    """The error train(cfg) raises on this rank: ("peer"|"own", its one line)."""
    from oases.train.agree import PeerError

    try:
        run(cfg)
    except PeerError as exc:
        return ("peer", str(exc))
    except ValueError as exc:
        return ("own", str(exc))
    return ("none", "")


# ---------------------------------------------------------------- tp=2 on 2 ranks


def _resume_rank(rank, world_size, root):
    root = Path(root)
    out = {}
    out["full"] = run(tiny_cfg(root, "full", FP64))
    out["first"] = run(tiny_cfg(root, "split", FP64), stop_after=3)
    out["rest"] = run(tiny_cfg(root, "split", FP64, "--checkpoint.resume=auto"))
    # a truncated data file (size check before any collective) and a garbled one of the same
    # size (found inside DCP's collective read): a one-line error on every rank, no hang
    from oases.parallel.comm import barrier
    from oases.parallel.context import init_distributed

    ctx = init_distributed(tp=2)
    for case in ("truncated", "garbled"):
        bad = root / case / "checkpoints" / "step_000006"
        if rank == 0:
            shutil.copytree(root / "split" / "checkpoints" / "step_000006", bad)
            data = sorted(bad.glob("*.distcp"))[-1]
            raw = data.read_bytes()
            if case == "truncated":
                data.write_bytes(raw[: len(raw) // 2])
            else:
                data.write_bytes(raw[:100] + bytes(len(raw) - 100))
        barrier(ctx.world_group)
        out[case] = one_line_error(tiny_cfg(root, case, FP64, "--checkpoint.resume=auto"))
    return out


@pytest.mark.exact
def test_resume_equals_uninterrupted_and_reshards_to_tp1(spawn_ranks, tmp_path):
    write_text(tmp_path / "text.txt")
    r0, r1 = spawn_ranks(_resume_rank, 2, str(tmp_path), timeout_s=150)

    # 6 steps == 3 steps, stop, resume 3: same losses, final loss and weights
    full, first, rest = r0["full"], r0["first"], r0["rest"]
    assert first["end_step"] == 3 and rest["start_step"] == 3 and rest["end_step"] == 6
    torch.testing.assert_close(first["losses"] + rest["losses"], full["losses"], **EXACT64)
    assert rest["loss"] == pytest.approx(full["loss"], rel=EXACT64["rtol"])
    a = read_full_tensors(tmp_path / "full" / "checkpoints" / "step_000006")
    b = read_full_tensors(tmp_path / "split" / "checkpoints" / "step_000006")
    assert a.keys() == b.keys()
    assert any(k.startswith("optim.") and k.endswith("exp_avg_sq/part0") for k in a)
    for k in a:
        if not k.startswith("rng."):
            torch.testing.assert_close(a[k], b[k], **EXACT64, msg=k)
    assert r1["full"]["losses"] == full["losses"]  # every rank reports the same DP-mean loss

    # metrics: one line per step (steps 1..3 kept from the first run), one per evaluation
    rows = [json.loads(x) for x in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert set(steps[0]) == {
        "step",
        "loss",
        "lr",
        "grad_norm",
        "step_time_s",
        "tokens_per_s",
        "peak_mem_mb",
        "live_peak_mb",
    }
    assert all(r["peak_mem_mb"] > 0 for r in steps)
    # the live-tensor peak: the run's first step and every log_every-th (tiny.toml: 2)
    assert [r["step"] for r in steps if "live_peak_mb" in r] == [1, 2, 4, 6]
    assert all(r["live_peak_mb"] > 0 for r in steps if "live_peak_mb" in r)
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6]

    # corrupt checkpoints: rank 0 reports the path in one line, rank 1 stops as a peer
    for case in ("truncated", "garbled"):
        kind, msg = r0[case]
        path = tmp_path / case / "checkpoints" / "step_000006"
        assert kind == "own" and str(path) in msg and "\n" not in msg, (case, msg)
        assert r1[case][0] in ("peer", "own"), r1[case]
    assert "truncated" in r0["truncated"][1] and "corrupt" in r0["garbled"][1]

    # the float64 run's checkpoint holds float64 tensors (the run's dtype)
    assert a["model.embed.weight/part0"].dtype == torch.float64

    # saved at tp=2 (step 3), resumed at tp=1: continues as an uninterrupted tp=1 run
    ref = run(tiny_cfg(tmp_path, "tp1", "--parallel.tp=1", FP64))
    torch.testing.assert_close(ref["losses"], full["losses"], **EXACT64)
    resumed = run(
        tiny_cfg(
            tmp_path,
            "tp1-resumed",
            "--parallel.tp=1",
            FP64,
            f"--checkpoint.resume={tmp_path / 'split' / 'checkpoints' / 'step_000003'}",
        )
    )
    assert resumed["start_step"] == 3
    torch.testing.assert_close(resumed["losses"], ref["losses"][3:], **EXACT64)


# ---------------------------------------------------------------- tp=2 x dp=2 on 4 ranks


def _tp2dp2_rank(rank, world_size, root):
    fp32 = run(tiny_cfg(Path(root), "tp2dp2-fp32", "--train.steps=1"))
    return fp32, run(tiny_cfg(Path(root), "tp2dp2", "--train.steps=3", FP64))


def single_device_grad_norm(cfg, run_dir):
    """The clipped-to-be gradient norm of step 1 on the plain float64 model over the global
    batch (the run's data, prepared into ``run_dir``)."""
    torch.manual_seed(cfg.train.seed)
    model = to64(build_model(cfg.model))
    data = split_batches(
        open_dataset(run_dir / "data"),
        "train",
        cfg.model.seq_len,
        cfg.train.global_batch,
        seed=cfg.train.seed,
    )
    tokens, targets = data.batch(0)
    model(tokens, targets).backward()
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip))


@pytest.mark.exact
def test_tp2_dp2_equals_tp1_and_single_device_grad_norm(spawn_ranks, tmp_path):
    write_text(tmp_path / "text.txt")
    results = spawn_ranks(_tp2dp2_rank, 4, str(tmp_path), timeout_s=150)
    ref = run(tiny_cfg(tmp_path, "tp1", "--parallel.tp=1", "--train.steps=3", FP64))
    for _, r in results:
        torch.testing.assert_close(r["losses"], ref["losses"], **EXACT64)
        torch.testing.assert_close(r["grad_norms"], ref["grad_norms"], **EXACT64)
    cfg = tiny_cfg(tmp_path, "unused")
    norm = single_device_grad_norm(cfg, tmp_path / "tp1")
    assert results[0][1]["grad_norms"][0] == pytest.approx(norm, rel=EXACT64["rtol"])
    # the tp=2 x dp=2 checkpoint holds the same full weights as the tp=1 run's, after 3 AdamW
    # steps (float64: the bound of exactness.py holds through AdamW)
    a = read_full_tensors(latest_checkpoint(tmp_path / "tp2dp2" / "checkpoints"), "model.")
    b = read_full_tensors(latest_checkpoint(tmp_path / "tp1" / "checkpoints"), "model.")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], **EXACT64, msg=k)
    # fp32, the training loop's one case: the first step's loss (equal weights; later steps
    # follow AdamW steps, which no fp32 rounding bound covers), global batch x seq_len tokens
    ref32 = run(tiny_cfg(tmp_path, "tp1-fp32", "--parallel.tp=1", "--train.steps=1"))
    want = torch.tensor(ref32["losses"][0])
    tol = fp32_tol(want, cfg.model, cfg.train.global_batch * cfg.model.seq_len, False)
    for r, _ in results:
        torch.testing.assert_close(torch.tensor(r["losses"][0]), want, **tol)


# ---------------------------------------------------------------- a mixed plan on 2 ranks

MIXED = (1, 2, 1, 2, 2, 1)  # embed, blocks.0.attn/mlp, blocks.1.attn/mlp, head (tied: 1 and 1)


def _mixed_rank(rank, world_size, root):
    root = Path(root)
    plan = f"--parallel.plan={root / 'plan.json'}"
    common = ("--schedule.name=oases", "--train.steps=4", "--train.sample_tokens=4", FP64)
    out = {"full": run(tiny_cfg(root, "mixed", plan, *common))}
    out["first"] = run(tiny_cfg(root, "split", plan, *common), stop_after=2)
    out["rest"] = run(tiny_cfg(root, "split", plan, *common, "--checkpoint.resume=auto"))
    # the mixed plan's checkpoint resumes into a uniform tp=2 run
    step2 = root / "split" / "checkpoints" / "step_000002"
    out["uniform"] = run(
        tiny_cfg(root, "uniform", *common, "--parallel.tp=2", f"--checkpoint.resume={step2}")
    )
    return out


@pytest.mark.exact
def test_mixed_plan_trains_like_tp1_and_resumes(spawn_ranks, tmp_path):
    from oases.plan import ParallelPlan, RegionPlan, region_names

    write_text(tmp_path / "text.txt")
    cfg = tiny_cfg(tmp_path, "unused")
    ParallelPlan([RegionPlan(n, t, 2 // t) for n, t in zip(region_names(cfg.model), MIXED)]).save(
        tmp_path / "plan.json"
    )
    r0, r1 = spawn_ranks(_mixed_rank, 2, str(tmp_path), timeout_s=150)
    ref = run(
        tiny_cfg(
            tmp_path,
            "tp1",
            "--parallel.tp=1",
            "--schedule.name=oases",
            "--train.steps=4",
            "--train.sample_tokens=4",
            FP64,
        )
    )
    for r in (r0, r1):  # every rank reports the global loss
        full = r["full"]
        torch.testing.assert_close(full["losses"], ref["losses"], **EXACT64)
        torch.testing.assert_close(full["grad_norms"], ref["grad_norms"], **EXACT64)
        assert full["val_loss"] == pytest.approx(ref["val_loss"], rel=EXACT64["rtol"])
        # stop after 2, resume with the same plan: the uninterrupted run's losses
        assert r["rest"]["start_step"] == 2
        torch.testing.assert_close(
            r["first"]["losses"] + r["rest"]["losses"], full["losses"], **EXACT64
        )
        assert r["uniform"]["start_step"] == 2
        torch.testing.assert_close(r["uniform"]["losses"], ref["losses"][2:], **EXACT64)
    # the mixed checkpoint holds the full weights of the tp=1 run
    a = read_full_tensors(latest_checkpoint(tmp_path / "mixed" / "checkpoints"), "model.")
    b = read_full_tensors(latest_checkpoint(tmp_path / "tp1" / "checkpoints"), "model.")
    assert a.keys() == b.keys()
    for k in a:  # after 4 AdamW steps, in float64
        torch.testing.assert_close(a[k], b[k], **EXACT64, msg=k)
