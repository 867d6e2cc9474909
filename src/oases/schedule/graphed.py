"""CUDA graphs of a whole step (``schedule.cuda_graphs``, default off).

On a fast GPU a small piece's kernels end before Python has issued the next ones: the host,
not the device, sets the step time (``oases bench --overhead``). A step whose shapes are static
is captured once and replayed after: one launch per step, no Python per piece::

    first call for a batch shape   warm-up: the eager step ``warmup`` times on a side stream
                                   (lazy initializations happen outside the capture)
                                   capture: gradients set to None, the step recorded into a
                                   CUDA graph (its tensors, the gradients among them, live in the
                                   graph's private memory pool from then on)
                                   replay once (a capture runs nothing)
    every later call               tokens/targets copied into the graph's inputs, replay, each
                                   parameter's ``.grad`` bound to its gradient in the pool, the
                                   loss returned (a copy: the next replay overwrites the pool)

A replay *sets* the gradients, as an eager step after ``zero_grad(set_to_none=True)``: it never
adds to gradients held before the call, and a gradient tensor kept across calls is overwritten
by the next one. The pool holds the step's peak of activations for as long as the graph lives.

Where a capture cannot work the step runs eagerly and the reason is said once
(``capture_reason``): not a CUDA device; more than one rank (the program's collectives would
sit inside the graph: not built, and untestable on one GPU); sequence parallelism or a recompute
under dropout (both save and restore a generator's state, which a capture cannot); ZeRO (it
frees and gathers weights per step); and, for one call only, a timeline being recorded (its
device events) or the executor counting saved memory. A capture that fails anyway (an op that
synchronizes with the host, say) is said once, and every later step runs eagerly.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from oases.model import Transformer, check_batch
from oases.schedule.timeline import active_timelines

WARMUP = 3  # eager steps before a capture (PyTorch's whole-network example uses 3)


def capture_reason(schedule, model: Transformer) -> str | None:  # noqa: ANN001 (Schedule)
    """Why a step of ``schedule`` on ``model`` cannot be captured for good, or None."""
    ctx = model.parallel_ctx
    if ctx is None:
        return None  # (the eager step says what is wrong)
    if ctx.device.type != "cuda":
        return f"the model is on {ctx.device.type}: CUDA graphs need a CUDA device"
    if ctx.world_size > 1:
        return (
            f"{ctx.world_size} ranks: a graph holding the program's collectives is not built "
            "(one GPU could not test it)"
        )
    ex = schedule.executor(model)
    if schedule.sp is not None:
        return "sequence parallelism keeps a dropout generator's state, which a capture cannot"
    if ex.spec.recompute != "none" and any(r.dropout > 0 for r in ex.chain):
        return (
            f"{schedule.name} restores dropout's RNG state for its recompute "
            "(torch.cuda.set_rng_state), which a capture cannot"
        )
    if ex.zero is not None:
        return "ZeRO frees and gathers weights within the step"
    return None


def _call_reason(schedule, model: Transformer) -> str | None:  # noqa: ANN001
    """Why this one call runs eagerly (the next may be captured), or None."""
    if list(active_timelines()):
        return "a timeline is recorded (its device events)"
    if schedule.executor(model).track_memory:
        return "the executor counts saved memory"
    return None


def _uncached_autocast() -> contextlib.AbstractContextManager:
    """The caller's autocast without its cache: a cast cached during a capture would be freed
    when the autocast context ends, under the graph (PyTorch's CUDA graphs notes)."""
    if not torch.is_autocast_enabled("cuda"):
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    tokens: Tensor  # the graph's inputs: each call copies its batch into them
    targets: Tensor
    loss: Tensor
    grads: list[tuple[torch.nn.Parameter, Tensor]]  # each parameter's gradient in the pool

    def replay(self, tokens: Tensor, targets: Tensor) -> Tensor:
        self.tokens.copy_(tokens)
        self.targets.copy_(targets)
        self.graph.replay()
        for p, g in self.grads:
            p.grad = g
        return self.loss.clone()


class GraphedStep:
    """``step(model, tokens, targets)`` as ``schedule.step``, captured as a CUDA graph per
    (model, batch shape, autocast) where it can be, eager where not (see the module docstring).
    ``reasons``: what ran eagerly and why, each said once through ``say``."""

    def __init__(
        self,
        schedule,  # noqa: ANN001 (a Schedule: its module imports this one's users)
        warmup: int = WARMUP,
        say: Callable[[str], None] = print,
    ) -> None:
        if warmup < 1:
            raise ValueError(f"warmup={warmup}: a capture needs at least one eager step before")
        self.schedule, self.warmup, self.say = schedule, warmup, say
        self.reasons: list[str] = []
        self._failed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> why
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {}

    def _eager(self, why: str, model: Transformer, tokens: Tensor, targets: Tensor) -> Tensor:
        if why not in self.reasons:
            self.reasons.append(why)
            self.say(f"cuda graphs: this step runs eagerly: {why}")
        return self.schedule.step(model, tokens, targets)

    def captured(self, model: Transformer) -> int:
        """How many graphs are held for ``model`` (one per batch shape and autocast)."""
        return len(self._graphs.get(model, {}))

    def step(self, model: Transformer, tokens: Tensor, targets: Tensor) -> Tensor:
        why = self._failed.get(model) or capture_reason(self.schedule, model)
        why = why or _call_reason(self.schedule, model)
        if why is not None:
            return self._eager(why, model, tokens, targets)
        check_batch(model.cfg, tokens, targets)  # (shapes: a replay would not)
        cast = torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda")
        key = (tuple(tokens.shape), tokens.dtype, cast)  # (targets: tokens' shape, checked)
        graphs = self._graphs.setdefault(model, {})
        if key not in graphs:
            try:
                graphs[key] = self._capture(model, tokens, targets)
            except RuntimeError as e:  # a capture that cannot be made: eager from now on
                torch.cuda.synchronize(model.parallel_ctx.device)
                model.zero_grad(set_to_none=True)
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                self._failed[model] = f"the capture failed ({first})"
                return self._eager(self._failed[model], model, tokens, targets)
        return graphs[key].replay(tokens, targets)

    def _capture(self, model: Transformer, tokens: Tensor, targets: Tensor) -> _Captured:
        device = model.parallel_ctx.device
        static_t, static_y = tokens.clone(), targets.clone()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), _uncached_autocast():
            for _ in range(self.warmup):
                model.zero_grad(set_to_none=True)
                self.schedule.step(model, static_t, static_y)
        torch.cuda.current_stream(device).wait_stream(side)
        model.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        with _uncached_autocast(), torch.cuda.graph(graph):
            loss = self.schedule.step(model, static_t, static_y)
        grads = [(p, p.grad) for p in model.parameters() if p.grad is not None]
        return _Captured(graph, static_t, static_y, loss, grads)
