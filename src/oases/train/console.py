"""What rank 0 prints while it trains: messages, and each step's progress as lines or a bar.

On a terminal the steps are a ``tqdm`` bar, rewritten in place, and every message (a validation
loss, a checkpoint, a warning) is printed above it (``tqdm.write``), so the bar stays whole::

    step 120/200 |██████████████▍         | 60%, loss 2.512 | 5.10k tok/s [00:32<00:21]

Anywhere else (a log file, a pipe, CI, a terminal of unknown size) there is no bar: every
``log_every`` steps, and at the first and last step, one plain line gives the step's own loss
(the one ``metrics.jsonl`` records, so a resumed run prints the same number at the same step),
the mean loss over the steps since the previous line (named: after a restart that window is
shorter) and tokens/s over those steps::

    step   120/200  loss 2.5123  mean 2.5310 over steps 111-120  lr 1.20e-03  grad_norm 0.512
      5,100 tok/s  elapsed 32.1s

(one line). A step's time excludes drawing the timeline picture (``train.loop``); the step
that recorded it says so in a line of its own.

Every rank builds one; only rank 0's is enabled, the others' calls do nothing. tqdm (a
dependency of transformers and huggingface_hub too) owns the terminal handling: width, rate,
time left, and redrawing the bar below a message.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO


def terminal_has_room(stream: TextIO) -> bool:
    """True when ``stream`` is a terminal with a known size: a pseudo-terminal of 0 x 0 (some
    containers and recorders) would make tqdm hide its bar, so it gets plain lines."""
    try:
        if not stream.isatty():
            return False
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):  # no fileno (a StringIO), a closed stream
        return False
    return size.columns > 0 and size.lines > 0


class Console:
    """Rank 0's output (see the module docstring). ``stream`` defaults to stdout, and warnings
    then go to stderr (a given ``stream``, a log, gets both); ``tty`` overrides
    ``terminal_has_room(stream)`` (a bar is drawn only on a terminal)."""

    def __init__(
        self, enabled: bool, stream: TextIO | None = None, *, tty: bool | None = None
    ) -> None:
        self.enabled = enabled
        self.stream = sys.stdout if stream is None else stream
        self.err_stream = sys.stderr if stream is None else stream
        self.tty = terminal_has_room(self.stream) if tty is None else tty
        self._bar: Any = None  # tqdm.tqdm while the steps run on a terminal
        self._window: list[tuple[int, float, float]] = []  # (step, loss, step_time_s) since
        # the last line
        self._start = time.perf_counter()
        self._first = self._end = self._steps = 0
        self._log_every, self._tokens_per_step = 1, 0

    def say(self, msg: str) -> None:
        """Print ``msg`` (above the bar while there is one)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(msg, file=self.stream)
        else:
            print(msg, file=self.stream, flush=True)

    def warn(self, msg: str) -> None:
        """Print ``warning: msg`` on the warnings' stream (above the bar while there is one)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(f"warning: {msg}", file=self.err_stream)
        else:
            print(f"warning: {msg}", file=self.err_stream, flush=True)

    def start(self, first: int, end: int, steps: int, log_every: int, tokens_per_step: int) -> None:
        """The steps ``first+1 .. end`` of a run of ``steps`` are about to run."""
        self._first, self._end, self._steps = first, end, steps
        self._log_every, self._tokens_per_step = log_every, tokens_per_step
        self._start = time.perf_counter()
        if self.enabled and self.tty and end > first:
            from tqdm import tqdm

            self._bar = tqdm(
                total=end,
                initial=first,
                file=self.stream,
                desc="step",
                unit="step",
                dynamic_ncols=True,
                leave=True,
                bar_format="{desc} {n_fmt}/{total_fmt} |{bar}| "
                "{percentage:3.0f}%{postfix} [{elapsed}<{remaining}]",
            )

    def step(self, step: int, loss: float, lr: float, grad_norm: float, dt: float) -> None:
        """Step ``step`` (1-based) finished in ``dt`` seconds with this (DP-mean) loss."""
        if not self.enabled:
            return
        if self._bar is not None:
            from tqdm import tqdm

            rate = tqdm.format_sizeof(self._tokens_per_step / dt, divisor=1000)
            self._bar.set_postfix_str(f"loss {loss:.3f} | {rate} tok/s", refresh=False)
            self._bar.update(1)
            return
        self._window.append((step, loss, dt))
        if step % self._log_every and step != self._first + 1 and step != self._end:
            return
        window = self._window
        mean = ""
        if len(window) > 1:
            mean_loss = sum(x for _, x, _ in window) / len(window)
            mean = f"  mean {mean_loss:.4f} over steps {window[0][0]}-{window[-1][0]}"
        rate = self._tokens_per_step * len(window) / sum(d for _, _, d in window)
        self.say(
            f"step {step:5d}/{self._steps}  loss {loss:.4f}{mean}  lr {lr:.2e}"
            f"  grad_norm {grad_norm:.3f}  {rate:,.0f} tok/s"
            f"  elapsed {time.perf_counter() - self._start:.1f}s"
        )
        self._window = []

    def close(self) -> None:
        """End the bar (later messages are plain lines)."""
        if self._bar is not None:
            bar, self._bar = self._bar, None
            bar.close()
