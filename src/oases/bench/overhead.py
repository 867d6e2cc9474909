"""``oases bench --overhead``: the executor's own host cost, schedule by schedule.

One process, tp=1, no communication: a schedule's ``step`` against one plain forward +
``loss.backward()`` of the same single-device model (a copy made before ``parallelize``), on
the same batch. Per model and schedule entry::

    for each of warmup + steps rounds:
        plain step   (zero_grad, model(tokens, targets).backward())        -> t_plain
        schedule     (zero_grad, schedule.step(parallel model, tokens, ...)) -> t_sched
        plain k      (k > 1: zero_grad, per sub-batch (model(t_j, y_j) / k).backward()) -> t_plain_k
    ratio = median(t_sched over the measured rounds) / median(t_plain over them)
    ratio_k = median(t_sched) / median(t_plain_k)          (k = 1: t_plain_k = t_plain)

The two alternate round by round, so a slow stretch of a shared machine hits both. With k > 1
sub-batches a third step joins the rotation: the plain model on the same k sub-batches one after
another (k forwards + ``backward()``s, each loss / k) -> t_plain_k, the floor an executor that
runs k sub-batches cannot go below when dispatch, not arithmetic, sets the time (k times the
kernels, each on 1/k of the rows); ``ratio_k`` = t_sched / t_plain_k is the executor's own share
(recompute schedules also rerun the forward, which the floor does not). The ratio
is the host cost the executor adds on top of the same kernels (the arithmetic is identical at
tp=1: ``tests/test_schedules.py`` proves the programs equal to the plain model), and
``host_per_piece_s`` = (t_sched - t_plain) / pieces spread it over the program's pieces:
in seconds, and ``executor_ops`` = that over this host's time to dispatch one eager op
(``kernel_profile.measure_launch``): the simulator's per-piece term of that name
(``planner.kernels.launch``). Recompute schedules run more kernels than the plain step, so
their per-piece figure is an upper bound; megatron's is the executor's alone.

Entries are ``NAME`` or ``NAME@k=K`` (sub-batches per micro-batch, overlapped schedules).
Default models: the issue's two GPT-2 shapes (24 layers x dim 64, 8 layers x dim 512), on
4 x 16 tokens.

On a GPU (the device ``init_distributed`` picks: CUDA where there is one) every step is timed
to its end (``torch.cuda.synchronize`` before the clock is read), and ``graphs=True``
(``--cuda-graphs``) adds a row per entry, ``NAME+graph``: the same step through
``schedule.graphed.GraphedStep`` (captured once in the warm-up, replayed after), a fourth step
in the rotation; its ratio is to the same eager plain step.
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch

from oases.config import ModelConfig

OVERHEAD_MODELS = {
    "gpt2-24x64": ModelConfig(arch="gpt2", n_layers=24, dim=64, n_heads=4, seq_len=16),
    "gpt2-8x512": ModelConfig(arch="gpt2", n_layers=8, dim=512, n_heads=8, seq_len=16),
}
OVERHEAD_ENTRIES = (
    "megatron",
    "megatron-recompute",
    "commfree-recompute@k=2",
    "overlap@k=2",
    "overlap-recompute@k=2",
    "oases@k=2",
    "oases@k=4",
)
ROWS = 4  # sequences per step (the 4 x 16 tokens)


def parse_overhead_entry(entry: str) -> tuple[str, int]:
    """``NAME`` -> (NAME, 1); ``NAME@k=K`` -> (NAME, K); ValueError otherwise."""
    name, _, option = entry.partition("@")
    if not option:
        return name, 1
    key, _, value = option.partition("=")
    if key != "k" or not value.isdigit() or int(value) < 1:
        raise ValueError(f"overhead entry {entry!r}: expected NAME or NAME@k=K with K >= 1")
    return name, int(value)


def _program_pieces(program: list) -> tuple[int, int]:
    """(compute instructions, pieces) of a program."""
    from oases.schedule.instructions import Compute

    computes = [ins for ins in program if isinstance(ins, Compute)]
    return len(computes), sum(len(ins.pieces) for ins in computes)


def measure_model(
    cfg: ModelConfig,
    entries: list[str],
    steps: int,
    warmup: int,
    rows: int = ROWS,
    graphs: bool = False,
) -> list[dict]:
    """One row per entry (two with ``graphs``): median seconds of the plain step and the
    schedule's, their ratio, and the program's size; see the module docstring for the loop."""
    from oases.model import Transformer
    from oases.parallel.apply import parallelize
    from oases.parallel.context import init_distributed
    from oases.schedule import build_schedule
    from oases.schedule.graphed import GraphedStep

    torch.manual_seed(0)
    plain = Transformer(cfg)
    ctx = init_distributed(tp=1)
    model = parallelize(copy.deepcopy(plain), ctx)
    device = ctx.device
    plain = plain.to(device)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len), generator=gen).to(device)
    targets = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len), generator=gen).to(device)
    if graphs and device.type != "cuda":
        raise ValueError(f"--cuda-graphs needs a CUDA device; this process runs on {device}")

    def done() -> None:  # a step's time is its device work's end
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def plain_step() -> None:
        plain.zero_grad(set_to_none=True)
        plain(tokens, targets).backward()

    def plain_k_step(k: int) -> None:
        plain.zero_grad(set_to_none=True)
        for t, y in zip(tokens.chunk(k), targets.chunk(k), strict=True):
            (plain(t, y) / k).backward()

    results = []
    for entry in entries:
        name, k = parse_overhead_entry(entry)
        schedule = build_schedule(name, n_sub=k)

        def sched_step(schedule=schedule) -> None:  # noqa: ANN001 (bound per entry)
            model.zero_grad(set_to_none=True)
            schedule.step(model, tokens, targets)

        times: dict[str, list[float]] = {"plain": [], "schedule": [], "plain_k": [], "graph": []}
        rotation = [("plain", plain_step), ("schedule", sched_step)]
        if k > 1:
            rotation.append(("plain_k", lambda k=k: plain_k_step(k)))
        graphed = GraphedStep(schedule, say=lambda _: None) if graphs else None
        if graphed is not None:
            rotation.append(("graph", lambda g=graphed: g.step(model, tokens, targets)))
        for round_ in range(warmup + steps):
            for key, fn in rotation:
                t0 = time.perf_counter()
                fn()
                done()
                if round_ >= warmup:
                    times[key].append(time.perf_counter() - t0)
        computes, pieces = _program_pieces(schedule.program(model, rows))
        t_plain, t_sched = statistics.median(times["plain"]), statistics.median(times["schedule"])
        t_plain_k = statistics.median(times["plain_k"]) if k > 1 else t_plain
        results.append(
            {
                "entry": entry,
                "plain_s": t_plain,
                "schedule_s": t_sched,
                "ratio": t_sched / t_plain,
                "plain_k_s": t_plain_k,
                "ratio_k": t_sched / t_plain_k,
                "computes": computes,
                "pieces": pieces,
                "host_per_piece_s": max(0.0, t_sched - t_plain) / pieces,
            }
        )
        if graphed is not None:
            t_graph = statistics.median(times["graph"])
            results.append(
                {
                    **results[-1],
                    "entry": f"{entry}+graph",
                    "schedule_s": t_graph,
                    "ratio": t_graph / t_plain,
                    "ratio_k": t_graph / t_plain_k,
                    "host_per_piece_s": max(0.0, t_graph - t_plain) / pieces,
                    "graphs": graphed.captured(model),
                    "eager_because": "; ".join(graphed.reasons),
                }
            )
    return results


def run_overhead(
    models: dict[str, ModelConfig],
    entries: list[str],
    steps: int,
    warmup: int,
    out: Path | None = None,
    graphs: bool = False,
) -> dict:
    """Measure every entry on every model; print the table, write ``overhead.json`` and
    ``overhead.md`` into ``out`` when given; return the result."""
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps={steps} must be >= 1 and warmup={warmup} >= 0")
    for entry in entries:
        parse_overhead_entry(entry)
    from oases.bench.kernel_profile import measure_launch
    from oases.parallel.context import init_distributed

    device = init_distributed(tp=1).device
    host_op_s = measure_launch(device)[1]
    result = {
        "rows": ROWS,
        "device": str(device),
        "host_op_s": host_op_s,
        "steps": steps,
        "warmup": warmup,
        "threads": torch.get_num_threads(),
        "models": {
            label: {
                "config": asdict(cfg),
                "entries": measure_model(cfg, entries, steps, warmup, graphs=graphs),
            }
            for label, cfg in models.items()
        },
    }
    for model in result["models"].values():
        for row in model["entries"]:
            row["executor_ops"] = row["host_per_piece_s"] / host_op_s
    text = format_overhead(result)
    print(text)
    if out is not None:
        from oases.bench.suite import machine_info

        out.mkdir(parents=True, exist_ok=True)
        result["machine"] = machine_info()
        (out / "overhead.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "overhead.md").write_text(text + "\n")
    return result


def format_overhead(result: dict) -> str:
    """A text table: per model, each entry's ratio to the plain step, the two medians, the
    program's computes/pieces and the host cost per piece."""
    lines = [
        f"tp=1, one process on {result.get('device', 'cpu')}, {result['rows']} x seq tokens, "
        f"medians of {result['steps']} "
        f"after {result['warmup']} warm-ups, {result['threads']} threads; one eager op "
        f"{result['host_op_s'] * 1e6:.1f} us"
    ]
    for label, model in result["models"].items():
        lines += [
            "",
            f"{label}",
            f"{'schedule':26} {'ratio':>6} {'plain ms':>9} {'step ms':>9} {'computes':>8} "
            f"{'pieces':>6} {'us/piece':>8} {'ops/piece':>9} {'k-plain ms':>10} {'vs k-plain':>10}",
        ]
        for r in model["entries"]:
            lines.append(
                f"{r['entry']:26} {r['ratio']:5.2f}x {r['plain_s'] * 1e3:9.2f} "
                f"{r['schedule_s'] * 1e3:9.2f} {r['computes']:8d} {r['pieces']:6d} "
                f"{r['host_per_piece_s'] * 1e6:8.1f} {r['executor_ops']:9.1f} "
                f"{r['plain_k_s'] * 1e3:10.2f} {r['ratio_k']:9.2f}x"
            )
    return "\n".join(lines)
