"""A dependency-free progress line for rank 0::

    step 120/200 [=================>            ] 60% loss 2.512 | 5.1k tok/s | 0:32 left

On a terminal the line is rewritten in place (``'\\r'``) at every update. Elsewhere (CI, pipes,
log files) a plain line is printed only at the first and last step, every ``every_steps`` steps
or when ``every_s`` seconds have passed since the last one, so logs stay readable. The time left
is the remaining steps times the mean step time over the last ``window`` updates.

``message(text)`` prints a line (a validation loss, say) without tearing the bar on a terminal.
Construct it on every rank with ``enabled=(rank == 0)`` and call it unconditionally.
"""

from __future__ import annotations

import math
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import TextIO


def format_duration(seconds: float) -> str:
    """``0:32``, ``12:05``, ``1:02:03``; ``-:--`` when unknown."""
    if not math.isfinite(seconds) or seconds < 0:
        return "-:--"
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def format_rate(per_s: float) -> str:
    """``950``, ``5.1k``, ``12.3M``."""
    if not math.isfinite(per_s):
        return "?"
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(per_s) >= scale:
            return f"{per_s / scale:.1f}{suffix}"
    return f"{per_s:.0f}"


class Progress:
    """Progress of a run of ``total_steps`` steps on ``stream`` (see the module docstring).

    ``clock`` is injectable for tests (``time.monotonic`` by default); ``tty`` overrides
    ``stream.isatty()``.
    """

    def __init__(
        self,
        total_steps: int,
        stream: TextIO | None = None,
        *,
        enabled: bool = True,
        every_steps: int | None = None,
        every_s: float = 10.0,
        width: int = 30,
        window: int = 20,
        clock: Callable[[], float] = time.monotonic,
        tty: bool | None = None,
    ) -> None:
        if total_steps < 1:
            raise ValueError(f"total_steps={total_steps} must be >= 1")
        self.total_steps = total_steps
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self.every_steps = every_steps if every_steps is not None else max(1, total_steps // 20)
        self.every_s, self.width, self.clock = every_s, width, clock
        if tty is None:
            isatty = getattr(self.stream, "isatty", None)
            tty = bool(isatty()) if isatty is not None else False
        self.tty = tty
        self._times: deque[tuple[int, float]] = deque(maxlen=max(2, window + 1))
        self._start = clock()
        self._line = ""  # last rendered line
        self._shown = 0  # length of the line now on the terminal (tty)
        self._last_print: tuple[int, float] | None = None  # (step, time) of the last plain line
        self._pending = False  # non-tty: the last update has not been printed
        self._closed = False

    # ------------------------------------------------------------------ estimates and text

    def seconds_per_step(self) -> float:
        """Mean step time over the recent updates (from the start for the first one)."""
        if len(self._times) >= 2:
            (s0, t0), (s1, t1) = self._times[0], self._times[-1]
            if s1 > s0:
                return (t1 - t0) / (s1 - s0)
        if self._times:
            s1, t1 = self._times[-1]
            if s1 > 0:
                return (t1 - self._start) / s1
        return math.nan

    def render(self, step: int, loss: float, tokens_per_s: float) -> str:
        """The progress line for ``step`` (no clock reads, no output)."""
        frac = min(1.0, max(0.0, step / self.total_steps))
        filled = int(frac * self.width)
        if filled >= self.width:
            bar = "=" * self.width
        else:
            bar = "=" * filled + ">" + " " * (self.width - filled - 1)
        left = (self.total_steps - step) * self.seconds_per_step()
        return (
            f"step {step}/{self.total_steps} [{bar}] {frac * 100:.0f}%"
            f" loss {loss:.3f} | {format_rate(tokens_per_s)} tok/s | {format_duration(left)} left"
        )

    # ------------------------------------------------------------------ output

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        """Record that ``step`` (1-based, of ``total_steps``) finished; show it as due."""
        if not self.enabled or self._closed:
            return
        now = self.clock()
        self._times.append((step, now))
        self._line = self.render(step, float(loss), float(tokens_per_s))
        if self.tty:
            self._draw()
            return
        due = (
            self._last_print is None
            or step >= self.total_steps
            or step - self._last_print[0] >= self.every_steps
            or now - self._last_print[1] >= self.every_s
        )
        if due:
            self._write(self._line + "\n")
            self._last_print = (step, now)
        self._pending = not due

    def message(self, text: str) -> None:
        """Print ``text`` on its own line; on a terminal the bar is redrawn below it."""
        if not self.enabled:
            return
        if self.tty and self._shown:
            self._write("\r" + " " * self._shown + "\r" + text + "\n")
            self._shown = 0
            if not self._closed:
                self._draw()
        else:
            self._write(text + "\n")

    def close(self) -> None:
        """End the display: finish the terminal line, or print the last unprinted update."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        if self.tty:
            if self._shown:
                self._write("\n")
                self._shown = 0
        elif self._pending:
            self._write(self._line + "\n")
            self._pending = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _draw(self) -> None:
        pad = " " * max(0, self._shown - len(self._line))  # erase a longer previous line
        self._write("\r" + self._line + pad)
        self._shown = len(self._line)

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()
