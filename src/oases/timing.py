"""Device time: one clock for measured steps, honest on CPU and on CUDA (``DeviceClock``).

The executor's timeline, the profile's pieces, collectives and optimizer step, the benchmark's
steps and ``oases plan --verify`` all read time through it::

    CPU    a stamp is ``time.perf_counter()`` (work is done when the call returns; a gloo
           collective's end comes from its completion callback, as before)
    CUDA   a stamp is a ``torch.cuda.Event(enable_timing=True)`` recorded on the current
           stream (the one that runs the compute). A collective's end is an event recorded on
           the clock's side stream after that stream waited for the collective (the work's
           CUDA-aware future: ``comm.Handle.wait_stream``), so the event completes when the
           collective does, while the compute stream runs on (a completion callback of an NCCL
           future fires at enqueue, and a device-wide synchronize waits for the NCCL streams
           too).
           Nothing synchronizes while stamps are taken; ``resolve()`` synchronizes once, after
           the measured step, and turns the stamps into seconds.

Seconds are absolute ``perf_counter`` seconds on both paths (timelines are normalized when drawn):
on CUDA, the host time at which the clock's origin event was recorded plus the device time
elapsed since that event: intervals are the device's; their place on the host clock is early by
whatever the device still had queued when the origin was recorded (nothing after a barrier or a
``resolve``), which shifts one rank's timeline against another's, never a piece's length.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from oases.parallel.comm import Handle

Stamp = float | torch.cuda.Event  # host seconds (CPU) or a recorded event (CUDA)


class DeviceClock:
    """Stamps on ``device``'s timeline; ``elapsed_s``/``seconds`` after ``resolve()``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._origin: torch.cuda.Event | None = None
        self._origin_s = 0.0
        self._side: torch.cuda.Stream | None = None
        self._resolved = True
        if self.cuda:
            self.restart()

    def restart(self) -> None:
        """A new origin now (CUDA: an event on the current stream; origin and host time agree
        when the device is idle, e.g. right after a barrier)."""
        if self.cuda:
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record()
            self._origin_s = time.perf_counter()
            self._resolved = False

    def now(self) -> Stamp:
        """A point on the current stream after everything queued so far (CPU: now)."""
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self._resolved = False
        return ev

    def after(self, handle: Handle) -> Stamp:
        """A point that completes when ``handle``'s collective does, without making the current
        stream wait (CUDA: the side stream waits; CPU: now, for a collective already waited
        for). The owner still ``wait()``s the handle as before."""
        if not self.cuda:
            return time.perf_counter()
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        ev = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._side):
            handle.wait_stream()
            ev.record(self._side)
        self._resolved = False
        return ev

    def resolve(self) -> None:
        """Wait once for every stamp taken so far (CUDA: one device synchronize; CPU: no-op)."""
        if self.cuda and not self._resolved:
            torch.cuda.synchronize(self.device)
            self._resolved = True

    def seconds(self, stamp: Stamp) -> float:
        """Absolute seconds of ``stamp`` on the ``perf_counter`` clock (after ``resolve``)."""
        if isinstance(stamp, float):
            return stamp
        if not self._resolved:
            raise RuntimeError(
                "DeviceClock.seconds before resolve(): the events may still be pending"
            )
        return self._origin_s + self._origin.elapsed_time(stamp) / 1e3

    def elapsed_s(self, start: Stamp, end: Stamp) -> float:
        """Seconds from ``start`` to ``end`` (after ``resolve``); never negative."""
        if isinstance(start, float) and isinstance(end, float):
            return max(0.0, end - start)
        if not self._resolved:
            raise RuntimeError(
                "DeviceClock.elapsed_s before resolve(): the events may still be pending"
            )
        return max(0.0, start.elapsed_time(end) / 1e3)

    def time_s(self, fn: Callable[[], object]) -> float:
        """Seconds ``fn()`` keeps the device busy: stamps around it, one ``resolve`` after."""
        start = self.now()
        fn()
        end = self.now()
        self.resolve()
        return self.elapsed_s(start, end)
