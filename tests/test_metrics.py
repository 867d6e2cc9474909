"""A run's record: metrics.jsonl cut back on resume, TensorBoard events read back with
TensorBoard's own reader, loss.png, and views that fail without stopping the run."""

import json
import sys

import pytest

from oases.config import load_config
from oases.train.metrics import MetricsLog, metrics_path
from oases.train.setup import check_config

PNG = b"\x89PNG\r\n\x1a\n"


def _rows(n, val_every=2, first=1):
    for step in range(first, n + 1):
        yield {
            "step": step,
            "loss": 5.0 - step / 10,
            "lr": 1e-3,
            "grad_norm": 1.0,
            "step_time_s": 0.1,
            "tokens_per_s": 1e4,
            "peak_mem_mb": 100.0,
        }
        if step % val_every == 0:
            yield {"step": step, "val_loss": 5.1 - step / 10}


def _scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_jsonl_tensorboard_and_loss_plot(tmp_path):
    pytest.importorskip("tensorboard")
    log = MetricsLog(
        tmp_path / "metrics.jsonl",
        0,
        plot_path=tmp_path / "loss.png",
        tensorboard_dir=tmp_path / "tb",
        title="test",
    )
    for row in _rows(4):
        log.write(row)
    assert log.plot() == tmp_path / "loss.png"
    log.close()
    assert (tmp_path / "loss.png").read_bytes()[:8] == PNG
    assert not list(tmp_path.glob("*.part"))
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and rows[-1] == {"step": 4, "val_loss": pytest.approx(4.7)}
    scalars = _scalars(tmp_path / "tb")
    assert {
        "loss/train",
        "loss/val",
        "train/lr",
        "train/grad_norm",
        "train/step_time_s",
        "train/tokens_per_s",
        "train/peak_mem_mb",
    } <= set(scalars)
    assert [s for s, _ in scalars["loss/train"]] == [1, 2, 3, 4]
    assert scalars["loss/val"] == [(2, pytest.approx(4.9)), (4, pytest.approx(4.7))]

    # a resumed run at step 2: the lines after it go, TensorBoard purges its events after it;
    # the old file is replaced, never truncated in place (a reader of it still sees every line)
    before = (tmp_path / "metrics.jsonl").read_text()
    with open(tmp_path / "metrics.jsonl", encoding="utf-8") as old_file:
        log = MetricsLog(
            tmp_path / "metrics.jsonl",
            2,
            plot_path=tmp_path / "loss.png",
            tensorboard_dir=tmp_path / "tb",
        )
        assert old_file.read() == before
    assert not list(tmp_path.glob("*.part"))
    assert [r["step"] for r in log.rows] == [1, 2, 2]
    for row in _rows(5, first=3):
        log.write({**row, "loss": row.get("loss", 0) - 1} if "loss" in row else row)
    log.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5]
    train = dict(_scalars(tmp_path / "tb")["loss/train"])
    assert sorted(train) == [1, 2, 3, 4, 5]
    assert train[2] == pytest.approx(4.8) and train[4] == pytest.approx(3.6)  # the new run's


def test_a_failing_view_warns_and_the_run_goes_on(tmp_path, capsys):
    log = MetricsLog(
        tmp_path / "metrics.jsonl", 0, plot_path=tmp_path / "no-such-folder" / "loss.png"
    )
    for row in _rows(2):
        log.write(row)
    assert log.plot() is None  # the folder is missing: a warning, no exception
    assert log.plot_path is None and log.plot() is None  # and no second try
    log.write({"step": 3, "loss": 1.0})  # the record goes on
    log.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: ") and "loss.png not written" in err[0]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4


def test_tensorboard_without_the_package_is_one_line(tmp_path, monkeypatch):
    cfg = load_config(None, ["--train.tensorboard=true"])
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if it were not installed
    with pytest.raises(ValueError) as info:
        check_config(cfg, 1)
    assert str(info.value) == (
        "train.tensorboard=true needs the tensorboard package: "
        "pip install -e '.[tensorboard]' in the oases clone "
        "(or --train.tensorboard=false)"
    )


def test_metrics_path_default_and_override(tmp_path):
    assert (
        metrics_path(load_config(None, [f"--train.run_dir={tmp_path}"]))
        == tmp_path / "metrics.jsonl"
    )
    assert (
        metrics_path(load_config(None, [f"--train.metrics_file={tmp_path / 'm.jsonl'}"]))
        == tmp_path / "m.jsonl"
    )
