"""Pipeline schedules as program orders: per stage, the order of its micro-batches' passes.

A *pass* is ("F", m), micro-batch m's forward through the stage's regions, or ("B", m), its
recompute and backward. A *unit* is what the list scheduler places as one: a single pass, or a
forward and a backward paired at task granularity. One generator per schedule
(``PIPELINE_SCHEDULES``); ``pipeline_program`` turns the units into a stage's instructions.
With P stages, stage s, M micro-batches::

    gpipe      F0 F1 ... F(M-1)  B0 B1 ... B(M-1)              (M micro-batches in flight)

    1f1b       warm-up: w = min(P - s - 1, M) forwards          (at most P - s in flight)
               steady:  F(w) B0, F(w+1) B1, ..., F(M-1) B(M-1-w)
               cool-down: B(M-w) ... B(M-1)

    P = 4, M = 6:   stage 0   F0 F1 F2 | F3 B0 | F4 B1 | F5 B2 | B3 B4 B5
                    stage 1   F0 F1    | F2 B0 | F3 B1 | F4 B2 | F5 B3 | B4 B5
                    stage 3            | F0 B0 | F1 B1 | ...

    1f1b-pair  warm-up: w = min(2(P - s) - 1, M) forwards      (at most 2(P - s) in flight)
               steady:  (F(w) | B0), (F(w+1) | B1), ...: a forward and a backward of another
               micro-batch as one unit, their tasks alternating, the forward first
               cool-down: B(M-w) ... B(M-1)

1f1b-pair overlaps at any micro-batch size: the TP collective that ends a task of one
micro-batch flies while the next task of the other computes (as DeepSeek's DualPipe pairs a
forward and a backward chunk), so an overlapped inner schedule hides its collectives even with
one sub-batch of one sequence::

    compute:  [F m+w: epi+body i]  [B m: norm+epi+tp j]  [F m+w: epi+body i+1]  [B m: ...]
    comm:     ................... fwd AR(i, m+w) ....... bwd AR(j, m) ......... fwd AR ...

Why the deeper warm-up: inside a paired unit the forward's output leaves the stage only at the
unit's end (its tasks alternate with the backward's) and the backward's input must be there at
its start. So the forward a stage pairs must come from a unit its previous stage has finished,
and the backward from a unit its next stage has finished: a whole unit of lag each way per
stage where 1F1B has less (pairing 1F1B's own F(m+w) and B(m) would make every unit wait for
its neighbours' whole units, about twice the steady-state period, and on the last stage, where
w = 0, pair a backward with its own forward). With 2(P - s) - 1 warm-up forwards (the last
stage: 1) every pair is independent of its neighbours' current units; the price is twice 1F1B's
activations in flight, which the simulator (next round) weighs against the collectives hidden.

zb-h1 (after Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, its ZB-H1) cuts a
backward in two passes: ("B", m), the input gradients the previous stage waits for, and ("W",
m), the weight gradients of the block regions' TP matmuls (the executor's deferred "dw"
pieces), which nothing waits for. It keeps 1F1B's order of F and B and runs W(m) right after
B(m + s) on stage s (the last s W's after the last B): the later a stage, the more W's it
holds back, so a B crosses every stage at the cost of its input gradients alone, and the W's
run where 1F1B's stages wait for one::

    P = 4, M = 6:  stage 0   F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 B3 W3 B4 W4 B5 W5
                   stage 3   F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 W3 W4 W5

The F's in flight are 1F1B's (at most P - s on stage s); a held-back W keeps its linears'
inputs and output gradients (part of a micro-batch's activations), s of them on stage s, so
the first stage's peak (P micro-batches in flight) stays the peak. On unit costs (a forward 1,
input and weight gradients 1 each) the walk of ``tests/test_pipeline_program.py`` finds the
step 6-15% shorter than 1F1B's at P = 2-4 (lagging W by P - s - 1 instead gained nothing: the
first stage's held-back W's ended up after its last B).

interleaved (Megatron-LM's interleaved 1F1B, after Narayanan et al., SC 2021): stage s holds v
model chunks (``oases.stages.StageLayout``: virtual stages s, s + P, ...), and its passes are
("F", m, c) and ("B", m, c), chunk c (0 .. v-1, local) of micro-batch m. The k-th forward of a
stage runs chunk (k // P) % v of micro-batch (k // Pv) P + k % P: P micro-batches through one
chunk, then the same P through the next; the k-th backward the same with the chunks reversed.
Warm-up: 2(P - s - 1) + (v - 1) P forwards (all of them when M = P), then one forward and one
backward in turn, then the last backwards. M must be a multiple of P::

    P = 2, v = 2, M = 4 (Fm.c):  stage 0  F0.0 F1.0 F0.1 F1.1 | F2.0 B0.1 F3.0 B1.1 F2.1 B0.0
                                          F3.1 B1.0 | B2.1 B3.1 B2.0 B3.0
                                 stage 1  F0.0 F1.0 | F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0
                                          F2.1 B2.1 F3.1 B3.1 | B2.0 B3.0

A micro-batch crosses P v virtual stages instead of P, each 1/v of a stage's work, so the
bubble shrinks about v times (warm-up and cool-down are chunks, not stages), for v times
the point-to-point messages; the first stage holds up to 2(P - 1) + (v - 1) P + 1 chunk passes'
activations, each 1/v of a micro-batch's there (P = 2, v = 2: 2.5 micro-batches', 1F1B's 2).
"""

from __future__ import annotations

from oases.stages import (
    PIPELINE_SCHEDULES,
    PLANNED_SCHEDULES,
    check_chunks,
    check_interleaved_micro,
    check_pipeline_schedule,
)

__all__ = [
    "PIPELINE_SCHEDULES",
    "PLANNED_SCHEDULES",
    "check_pipeline_schedule",
    "gpipe_order",
    "in_flight",
    "interleaved_order",
    "one_f_one_b_order",
    "pipeline_order",
    "warmup_forwards",
    "zb_h1_order",
]

Pass = tuple  # ("F" | "B" | "W", micro-batch), or ("F" | "B", micro-batch, chunk)
Unit = tuple[Pass, ...]


def warmup_forwards(pp: int, stage: int, n_micro: int, pair: bool = False) -> int:
    """The warm-up forwards of ``stage`` before its steady state: 1F1B's ``P - s - 1``,
    1f1b-pair's ``2(P - s) - 1`` (module docstring), at most ``n_micro``."""
    return min(2 * (pp - stage) - 1 if pair else pp - stage - 1, n_micro)


def gpipe_order(n_micro: int) -> list[Unit]:
    """Every forward, then every backward."""
    return [(("F", m),) for m in range(n_micro)] + [(("B", m),) for m in range(n_micro)]


def one_f_one_b_order(pp: int, stage: int, n_micro: int, pair: bool = False) -> list[Unit]:
    """Warm-up forwards, then one forward and one backward in turn, then the last backwards;
    ``pair``: 1f1b-pair, the deeper warm-up and each steady-state forward and backward as one
    unit (module docstring)."""
    w = warmup_forwards(pp, stage, n_micro, pair)
    units: list[Unit] = [(("F", m),) for m in range(w)]
    for m in range(n_micro - w):
        steady = (("F", m + w), ("B", m))
        units += [steady] if pair else [(p,) for p in steady]
    units += [(("B", m),) for m in range(n_micro - w, n_micro)]
    return units


def zb_h1_order(pp: int, stage: int, n_micro: int) -> list[Unit]:
    """1F1B's F and B, each W(m) right after B(m + stage), the last ones after the last B
    (module docstring)."""
    lag = min(stage, n_micro)
    units: list[Unit] = []
    for unit in one_f_one_b_order(pp, stage, n_micro):
        units.append(unit)
        ((kind, m),) = unit
        if kind == "B" and m >= lag:
            units.append((("W", m - lag),))
    return units + [(("W", m),) for m in range(n_micro - lag, n_micro)]


def interleaved_order(pp: int, stage: int, n_micro: int, chunks: int) -> list[Unit]:
    """Megatron-LM's interleaved 1F1B over ``chunks`` model chunks (module docstring)."""
    check_interleaved_micro(pp, chunks, n_micro)
    total = n_micro * chunks

    def nth(k: int, forward: bool) -> Pass:
        c = (k // pp) % chunks
        m = (k // (pp * chunks)) * pp + k % pp
        return ("F", m, c) if forward else ("B", m, chunks - 1 - c)

    warm = 2 * (pp - stage - 1) + (chunks - 1) * pp
    w = total if n_micro == pp else min(warm, total)  # (M = P: every forward first)
    units: list[Unit] = [(nth(k, True),) for k in range(w)]
    for k in range(total - w):
        units += [(nth(w + k, True),), (nth(k, False),)]
    return units + [(nth(k, False),) for k in range(total - w, total)]


def pipeline_order(name: str, pp: int, stage: int, n_micro: int, chunks: int = 1) -> list[Unit]:
    """The units of ``stage`` under pipeline schedule ``name`` (``chunks``: per stage, the
    interleaved schedule's)."""
    check_pipeline_schedule(name)
    if not 0 <= stage < pp or n_micro < 1:
        raise ValueError(f"stage {stage} of pp={pp}, n_micro={n_micro}")
    check_chunks(name, chunks, pp * chunks, pp)
    if name == "interleaved":
        return interleaved_order(pp, stage, n_micro, chunks)
    if name == "gpipe":
        return gpipe_order(n_micro)
    if name == "zb-h1":
        return zb_h1_order(pp, stage, n_micro)
    return one_f_one_b_order(pp, stage, n_micro, pair=name == "1f1b-pair")


def in_flight(units: list[Unit]) -> int:
    """The most micro-batches whose forward has started and backward not finished."""
    started = finished = most = 0
    for unit in units:  # (a micro-batch of several chunks: counted by its first F, last B)
        for p in unit:
            if p[0] == "F" and (len(p) == 2 or p[2] == 0):
                started += 1
                most = max(most, started - finished)
        finished += sum(1 for p in unit if p[0] == "B" and (len(p) == 2 or p[2] == 0))
    return most
