"""What ``oases data prepare`` prints while it encodes: a tqdm bar on a terminal (else a line
at every tenth of the input; ``quiet``: none), and one throughput line at the end::

    prepare: 1073.7 MB of text in 8.12s: 132.3 MB/s with 2 workers (66.1 MB/s per worker);
             1073.7 M tokens (uint8) in 64 shards, 52 documents -> DIR (fingerprint 3f2a...)
"""

from __future__ import annotations

import time
from typing import Any, TextIO

from oases.data.plan import Task


class Progress:
    """Counts finished tasks' input bytes, text bytes and tokens (encode time only)."""

    def __init__(
        self,
        total_bytes: int,
        n_tasks: int,
        log: TextIO,
        bar: bool | None,
        reused: int,
        quiet: bool = False,
    ) -> None:
        self.total, self.n_tasks, self.log = max(total_bytes, 1), n_tasks, log
        self.read = self.text = self.tokens = 0
        self.start = time.perf_counter()
        self.stopped: float | None = None
        self.next_line = 0.1
        if reused:
            print(
                f"prepare: resuming: {reused} shards already finished, {n_tasks} to go",
                file=log,
                flush=True,
            )
        use_bar = log.isatty() if bar is None else bar
        self.quiet = quiet
        self.bar = None
        if use_bar and n_tasks:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total_bytes,
                unit="B",
                unit_scale=True,
                file=log,
                desc="prepare",
                smoothing=0.1,
            )

    def done(self, task: Task, record: dict[str, Any]) -> None:
        self.read += task.input_bytes
        self.text += int(record.get("text_bytes", 0))
        self.tokens += int(record.get("tokens", 0))
        if self.bar is not None:
            self.bar.update(task.input_bytes)
            return
        if self.quiet:
            return
        frac = self.read / self.total
        if frac >= self.next_line or self.read >= self.total:
            dt = max(time.perf_counter() - self.start, 1e-9)
            eta = dt * (1 - frac) / max(frac, 1e-9)
            print(
                f"prepare: {100 * frac:3.0f}%  {self.read / 1e6:.1f} / {self.total / 1e6:.1f} "
                f"MB read, {self.text / dt / 1e6:.1f} MB/s of text, eta {eta:.0f}s",
                file=self.log,
                flush=True,
            )
            while self.next_line <= frac:
                self.next_line += 0.1

    @property
    def seconds_done(self) -> float:
        """Seconds from the start of encoding (worker start-up included) to ``close``."""
        return (self.stopped or time.perf_counter()) - self.start

    def close(self) -> None:
        self.stopped = self.stopped or time.perf_counter()
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def summary(self, manifest: dict[str, Any], elapsed: float, workers: int, out: Any) -> None:
        """The throughput line (this run's encoding) and what the dataset holds."""
        dt = max(self.seconds_done, 1e-9)
        sources = manifest["sources"]
        tokens = sum(s[k]["tokens"] for s in sources for k in ("train", "val"))
        docs = sum(s[k]["documents"] for s in sources for k in ("train", "val"))
        shards = sum(len(s[k]["shards"]) for s in sources for k in ("train", "val"))
        rate = self.text / dt / 1e6
        print(
            f"prepare: {self.text / 1e6:.1f} MB of text in {dt:.2f}s: {rate:.1f} MB/s with "
            f"{workers} worker{'s' * (workers > 1)} ({rate / workers:.1f} MB/s per worker); "
            f"{elapsed:.2f}s in all",
            file=self.log,
            flush=True,
        )
        print(
            f"prepare: {tokens / 1e6:.2f} M tokens ({manifest['dtype']}) in {shards} shards, "
            f"{docs} documents -> {out} (fingerprint {manifest['fingerprint']['digest']})",
            file=self.log,
            flush=True,
        )
