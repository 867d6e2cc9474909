"""What a run records: ``metrics.jsonl`` (the record), TensorBoard events and ``loss.png``.

Rank 0 alone holds a ``MetricsLog``; nothing here is collective, so nothing here can make the
other ranks wait. Rows are JSON objects: one per step ``{step, loss, lr, grad_norm,
step_time_s, tokens_per_s, peak_mem_mb, live_peak_mb}`` (the resident peak; the peak of live
tensor bytes in the step, ``oases.memory.peak_live_bytes``, with the model and optimizer state
it starts from: every step on a GPU, on a CPU the run's first and every ``log_every``-th) and
one per evaluation ``{step, val_loss}``, appended and flushed one line at a time. A resumed run
cuts the file back to its step (the lines after it came from a run that went further before it
stopped) and keeps the lines before: it writes them
to ``metrics.jsonl.part`` and renames that over the old file, so a kill meanwhile loses nothing.

- TensorBoard (``train.tensorboard``): ``torch.utils.tensorboard.SummaryWriter`` into
  ``<run_dir>/tensorboard``, one scalar per field (``loss/train``, ``loss/val``, ``train/lr``,
  ``train/grad_norm``, ``train/step_time_s``, ``train/tokens_per_s``, ``train/peak_mem_mb``,
  ``train/live_peak_mb``);
  a resumed run purges the events after its step.
- ``loss.png``: train and validation loss against step (matplotlib, no pyplot state), drawn by
  ``plot`` at every evaluation and at the end, written beside and then renamed over the old one.

The JSONL is the record: a failure to write it is an error. TensorBoard and the picture are
views: a failure of either prints one warning and stops that view, never the run.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from oases.config import Config

TENSORBOARD_DIR = "tensorboard"
LOSS_PLOT = "loss.png"
# JSONL field -> TensorBoard tag
TB_TAGS = {
    "loss": "loss/train",
    "val_loss": "loss/val",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "step_time_s": "train/step_time_s",
    "tokens_per_s": "train/tokens_per_s",
    "peak_mem_mb": "train/peak_mem_mb",  # the resident peak (CUDA: the allocator's)
    "live_peak_mb": "train/live_peak_mb",  # live tensors: state + the step's peak above it
}


def metrics_path(cfg: Config) -> Path:
    """``train.metrics_file``, or ``<run_dir>/metrics.jsonl`` when it is empty."""
    return Path(cfg.train.metrics_file or Path(cfg.train.run_dir) / "metrics.jsonl")


def _warn(what: str, exc: BaseException) -> None:
    print(
        f"warning: {what} ({type(exc).__name__}: {exc}); the run goes on without it",
        file=sys.stderr,
        flush=True,
    )


class MetricsLog:
    """Rank 0's record of a run (see the module docstring).

    ``start_step``: the step the run starts from (0 for a fresh run); ``plot_path``: where
    ``plot`` draws the loss curve (None: no picture); ``tensorboard_dir``: where the events go
    (None: no TensorBoard).
    """

    def __init__(
        self,
        path: Path,
        start_step: int,
        *,
        plot_path: Path | None = None,
        tensorboard_dir: Path | None = None,
        title: str = "",
    ) -> None:
        self.path, self.plot_path, self.title = path, plot_path, title
        self.rows: list[dict[str, Any]] = []
        kept: list[str] = []
        if start_step > 0 and path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict) and row.get("step", 0) <= start_step:
                    kept.append(line + "\n")
                    self.rows.append(row)
        # the kept lines go to a new file renamed over the old one: a kill mid-rewrite leaves
        # the old record whole, never a truncated one
        part = path.with_name(path.name + ".part")
        with part.open("w", encoding="utf-8") as fh:
            fh.writelines(kept)
        os.replace(part, path)
        self._fh: TextIO | None = path.open("a", encoding="utf-8")
        self._tb: Any = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            self._tb = SummaryWriter(
                str(tensorboard_dir), purge_step=start_step + 1 if start_step > 0 else None
            )

    def write(self, row: dict[str, Any]) -> None:
        """Append ``row`` (it has a ``step``) to the JSONL and to TensorBoard."""
        assert self._fh is not None, "write after close"
        self._fh.write(json.dumps(row) + "\n")
        self._fh.flush()
        self.rows.append(row)
        if self._tb is not None:
            try:
                for key, tag in TB_TAGS.items():
                    if key in row:
                        self._tb.add_scalar(tag, row[key], row["step"])
            except Exception as exc:  # a view: it may fail, the run may not
                _warn("TensorBoard events not written", exc)
                self._close_tb()

    def plot(self) -> Path | None:
        """Draw ``loss.png`` from the rows so far; the path, or None when nothing was drawn."""
        if self.plot_path is None:
            return None
        train = [(r["step"], r["loss"]) for r in self.rows if "loss" in r]
        val = [(r["step"], r["val_loss"]) for r in self.rows if "val_loss" in r]
        if not train and not val:
            return None
        try:
            save_loss_plot(self.plot_path, train, val, self.title)
        except Exception as exc:  # a view: it may fail, the run may not
            _warn(f"{self.plot_path} not written", exc)
            self.plot_path = None
            return None
        return self.plot_path

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        self._close_tb()

    def _close_tb(self) -> None:
        if self._tb is not None:
            tb, self._tb = self._tb, None
            try:
                tb.close()
            except Exception as exc:
                _warn("TensorBoard events not flushed", exc)


def save_loss_plot(
    path: Path, train: list[tuple[int, float]], val: list[tuple[int, float]], title: str = ""
) -> None:
    """Train (a line) and validation (points) loss against step, as a PNG at ``path``
    (written to ``path.part`` first, then renamed: a reader never sees half a picture)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    if train:
        ax.plot(*zip(*train), lw=1.0, color="tab:blue", label="train")
    if val:
        ax.plot(*zip(*val), "o-", ms=4, color="tab:orange", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (cross-entropy, nats per token)")
    ax.set_title(title or "loss")
    ax.grid(alpha=0.3)
    ax.legend()
    tmp = path.with_name(path.name + ".part")
    fig.savefig(tmp, format="png", dpi=100)
    os.replace(tmp, path)
