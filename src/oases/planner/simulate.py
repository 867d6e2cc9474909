"""Run a schedule program on costs instead of tensors: the planner's cost model.

The simulator consumes the very instruction lists the executor runs (``schedule.program``), with
one compute stream and two communication streams per rank (TP collectives, and data-parallel
gradient all-reduces on their own group), and returns a ``Timeline`` in the executor's format::

    Compute(c)   compute stream:  start = now;  now += cost(c)
    Start(k)     comm stream:     begins at max(stream free, now); ends after cost(k)
    Wait(k)      compute stream:  now = max(now, end of k)

So the same question (how long is a step under this schedule?) is answered by a measurement
and by a prediction, and the two timelines can be compared number by number.

Costs come from a ``StepCosts``: per-piece (or per-instruction) compute times and per-collective
times, e.g. from a profile measured on this machine (``oases.bench.runner.predict_step``).
Memory is not simulated yet.
Shape legend: b sub-batch rows, S sequence, H hidden, F ffn, V vocabulary, t TP degree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from oases.schedule.program import Compute, Instr, Start, Wait, comm_name, label
from oases.schedule.timeline import Event, Timeline


@dataclass(frozen=True)
class StepCosts:
    """Seconds for every instruction of a program.

    ``piece_s(phase, kind, region)``: one sub-batch's piece ("epi" | "body" | "norm" | "tp") of a
    region in a phase ("forward" | "recompute" | "backward"); ``recompute_body_s(region)`` is the
    body's recompute when its last (row-parallel) matmul is skipped (communication-free mode);
    ``collective_s(kind, index)``: one sub-batch's TP all-reduce ("fwd" | "bwd") after region
    ``index``, or the DP all-reduce of gradient bucket ``index`` ("dp").
    ``compute_s(instruction)``, when given, prices a whole Compute instruction directly (a
    profile measured per instruction) and overrides the per-piece costs.
    """

    piece_s: Callable[[str, str, int], float]
    collective_s: Callable[[str, int], float]
    recompute_body_s: Callable[[int], float] | None = None
    compute_s: Callable[[Compute], float] | None = None


@dataclass(frozen=True)
class SimResult:
    step_s: float
    compute_busy_s: float
    comm_busy_s: float
    timeline: Timeline


def simulate_program(program: list[Instr], costs: StepCosts, *, commfree: bool = False,
                     rank: int = 0) -> SimResult:
    """Predict one step of ``program``. ``commfree``: recomputed bodies skip their last matmul
    (as the executor does for communication-free recomputation)."""
    timeline = Timeline()
    now = 0.0
    free = {"tp": 0.0, "dp": 0.0}
    ends: dict[tuple[str, int, int], float] = {}
    compute_busy = comm_busy = 0.0
    for ins in program:
        if isinstance(ins, Compute):
            cost = 0.0 if costs.compute_s is None else costs.compute_s(ins)
            for kind, region in ins.pieces if costs.compute_s is None else ():
                if (ins.phase == "recompute" and kind == "body" and commfree
                        and costs.recompute_body_s is not None):
                    cost += costs.recompute_body_s(region)
                else:
                    cost += costs.piece_s(ins.phase, kind, region)
            timeline.add(Event(rank, "compute", label(ins), ins.phase, ins.sub, now, now + cost))
            now += cost
            compute_busy += cost
        elif isinstance(ins, Start):
            stream = "dp" if ins.kind == "dp" else "tp"
            begin = max(free[stream], now)
            cost = costs.collective_s(ins.kind, ins.index)
            free[stream] = ends[ins.kind, ins.index, ins.sub] = begin + cost
            timeline.add(Event(rank, "comm", comm_name(ins.kind, ins.index), ins.kind, ins.sub,
                               begin, begin + cost))
            comm_busy += cost
        elif isinstance(ins, Wait):
            now = max(now, ends.pop((ins.kind, ins.index, ins.sub)))
    if ends:
        raise ValueError(f"program leaves collectives unwaited: {sorted(ends)}")
    return SimResult(max([now, *free.values()]), compute_busy, comm_busy, timeline)
