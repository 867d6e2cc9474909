"""``oases bench --memory``: each entry's model state, saved activations and peak per rank,
measured (``bench.memory_runner``) beside the simulator's count of the same plan.

    run_memory -> launch_ranks("oases.bench.memory_runner") per entry -> predicted_peak_bytes
               -> memory.json, report.md (format_memory_table + format_saved_table)
"""

from __future__ import annotations

import datetime
import json
import sys
import tempfile
from pathlib import Path

from oases.bench import PEERS, parse_entry
from oases.bench.suite import launch_ranks, machine_info, warn_no_effect


def run_memory(
    config: str | None,
    overrides: list[str],
    entries: list[str],
    steps: int,
    out: Path,
    nproc: int = 2,
    warmup: int = 1,
    profile: str | None = None,
) -> dict:
    """``oases bench --memory``: every entry in a launch of its own (``bench.memory_runner``),
    unshaped; per entry the model-state bytes per rank by kind, the measured peak over the
    process's baseline, and, for Oases entries, the simulator's predicted peak
    (``predicted_peak_bytes``, from ``profile`` where given). Writes ``memory.json`` and
    ``memory.md`` in ``out``."""
    from oases.config import load_config

    cfg = load_config(config, overrides)
    cfg.validate(nproc)
    for e in entries:
        parse_entry(e)
    warn_no_effect(entries, nproc // cfg.parallel.tp)
    costs = None
    if profile:
        from oases.planner import load_costs

        costs = load_costs(profile, cfg.model)
    out.mkdir(parents=True, exist_ok=True)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for e in entries:
            launch_ranks(
                "oases.bench.memory_runner",
                {
                    "config": config,
                    "overrides": overrides,
                    "out": str(out),
                    "entry": e,
                    "steps": steps,
                    "warmup": warmup,
                },
                nproc,
                None,
                Path(tmp),
            )
            entry = parse_entry(e)
            raw = json.loads((out / f"memory-{entry.stem()}.json").read_text())
            row = {"tp": raw["tp"], "dp": raw["dp"], "ranks": raw["ranks"]}
            if entry.name not in PEERS:
                row["predicted"] = predicted_peak_bytes(
                    cfg, entry.name, entry.zero, nproc, costs, entry.sp
                )
                row["analytic_saved_per_block"] = analytic_saved_per_block(
                    cfg, entry, raw["rows"], raw["tp"]
                )
            rows[e] = row
    result = {"world_size": nproc, "tp": cfg.parallel.tp, "entries": rows}
    (out / "memory.json").write_text(json.dumps(result, indent=1))
    table = format_memory_table(result) + "\n\n" + format_saved_table(result)
    print(table, flush=True)
    info = machine_info()
    (out / "memory.md").write_text(
        "\n".join(
            [
                f"# oases bench --memory, {datetime.date.today().isoformat()}",
                "",
                "Command: `" + " ".join(["oases", *sys.argv[1:]]) + "`",
                "",
                "Machine: " + ", ".join(f"{k} {v}" for k, v in info.items()),
                "",
                "```",
                table,
                "```",
                "",
            ]
        )
    )
    return result


def predicted_peak_bytes(
    cfg,  # noqa: ANN001
    schedule: str,
    zero: int,
    world: int,
    costs: object | None = None,
    sp: str = "",
) -> dict:
    """The simulator's memory walk (``planner.peak_memory``) of ``schedule`` at ZeRO stage
    ``zero`` on this config's uniform layout, for the batch ``bench.memory_runner`` feeds (one
    micro-batch of ``train.micro_batch`` sequences per model replica), with ``costs``' measured
    activation sizes (a profile of this machine, ``oases profile``), else the analytic ones;
    ``sp``: sequence parallelism's mode ("" off): {"model_state": bytes by kind, "peak": bytes
    over the baseline}."""
    from oases.plan import ParallelPlan
    from oases.planner.batch import BatchShape
    from oases.planner.layout import model_state
    from oases.planner.search import with_zero
    from oases.planner.simulate import simulate_plan

    tp = cfg.parallel.tp
    plan = with_zero(
        ParallelPlan.uniform(
            cfg.model, world, tp, schedule=schedule, n_sub=cfg.schedule.n_sub, sequence_parallel=sp
        ),
        zero,
    )
    rows = cfg.train.micro_batch * world // tp
    res = simulate_plan(
        cfg.model,
        plan,
        _NoTime(costs),
        world,
        BatchShape(rows, rows),
        max_inflight=cfg.schedule.max_inflight,
        timeline=False,
        reshard_after_forward=cfg.parallel.reshard_after_forward,
    )
    return {
        "model_state": model_state(cfg.model, plan, world).bytes_by_kind(),
        "peak": res.peak_mem_bytes - res.breakdown["baseline_bytes"],
    }


class _NoTime:
    """Costs for a memory-only simulation: every piece and collective takes no time; the memory
    terms (measured activations, baseline, workspace, collective copies) are ``costs``' where
    given (a profile of this machine, whatever world size it was made at), else analytic."""

    def __init__(self, costs: object | None = None) -> None:
        self._costs = costs

    def __getattr__(self, name: str) -> object:
        if (
            name
            in (
                "saved_bytes",
                "baseline_bytes",
                "workspace_bytes",
                "reduce_scatter_copies_input",
                "all_gather_copies_output",
            )
            and self._costs is not None
        ):
            return getattr(self._costs, name)
        raise AttributeError(name)

    def compute_s(self, *args: object) -> float:
        return 0.0

    def collective_s(self, *args: object) -> float:
        return 0.0


CODE_SHARE = 0.25  # a row whose measured peak is at least this much code pages gets a note


def analytic_saved_per_block(cfg, entry: object, rows: int, tp: int) -> int:  # noqa: ANN001
    """``planner.activation_terms``' bytes per block for a memory entry's schedule, sp mode
    and precision (bf16: 2-byte activations, else the float32 default)."""
    from oases.planner.activation_terms import schedule_block_bytes
    from oases.schedule import SPECS

    spec = SPECS[entry.name]
    sp = entry.sp or ("gathered" if spec.sequence_parallel else None)
    precision = entry.precision or cfg.train.precision
    elt = 2 if precision == "bf16" else 4
    return schedule_block_bytes(cfg.model, spec.recompute, rows, tp, sp, elt)


def format_saved_table(result: dict) -> str:
    """Rank 0's saved bytes per block (the last block; ``bench.activation_memory``) against
    ``planner.activation_terms``, and its peak of live tensor bytes in one step (MiB)."""
    mib = 2**20
    lines = [
        f"{'entry':<24}{'saved/blk':>10}{'analytic':>10}{'meas/anal':>10}"
        f"{'live peak':>10}{'resident':>10}"
    ]
    for e, row in result["entries"].items():
        r = row["ranks"][0]
        if not r.get("saved_per_block"):
            continue
        meas, anal = r["saved_per_block"][-1], row.get("analytic_saved_per_block")
        ratio = f"{meas / anal:>10.3f}" if anal else f"{'-':>10}"
        lines.append(
            f"{e:<24}{meas / mib:>10.2f}{(anal or 0) / mib:>10.2f}{ratio}"
            f"{r['peak_live'] / mib:>10.1f}{r['peak_over_base_mb']:>10.1f}"
        )
    return "\n".join(lines)


def format_memory_table(result: dict) -> str:
    """Rank 0's row per entry (MiB): model state by kind, its sum, measured peak over the
    baseline, the simulator's predicted peak and its error. A row whose measured peak is
    mostly code pages (``code_pages_mb``: kernels torch ran for the first time in the entry,
    paged in from its libraries: resident, in no tensor, not in the simulator's count) is
    marked ``*`` and a note below says how much, and the peak and error without them."""
    mib = 2**20
    lines = [
        f"tp={result['tp']} world={result['world_size']} (MiB per rank, rank 0)",
        f"{'entry':<16}{'weights':>9}{'grads':>9}{'adam':>9}{'state':>9}{'sim state':>10}"
        f"{'peak':>9}{'sim peak':>10}{'err':>7}",
    ]
    notes = []
    for e, row in result["entries"].items():
        r = row["ranks"][0]
        state = r["weights"] + r["gradients"] + r["optimizer"]
        pred = row.get("predicted")
        sim_state = f"{sum(pred['model_state'].values()) / mib:>10.1f}" if pred else f"{'-':>10}"
        sim_peak = f"{pred['peak'] / mib:>10.1f}" if pred else f"{'-':>10}"
        err = f"{pred['peak'] / mib / r['peak_over_base_mb'] - 1:>+7.0%}" if pred else f"{'-':>7}"
        code = r.get("code_pages_mb", 0.0)
        mark = ""
        if code >= CODE_SHARE * r["peak_over_base_mb"]:
            mark = "*"
            rest = r["peak_over_base_mb"] - code
            without = f", err {pred['peak'] / mib / rest - 1:+.0%}" if pred and rest > 0 else ""
            notes.append(
                f"  {e}: {code:.1f} of its {r['peak_over_base_mb']:.1f} MiB peak are "
                f"code pages; without them {rest:.1f} MiB{without}"
            )
        lines.append(
            f"{e:<16}{r['weights'] / mib:>9.1f}{r['gradients'] / mib:>9.1f}"
            f"{r['optimizer'] / mib:>9.1f}{state / mib:>9.1f}{sim_state}"
            f"{r['peak_over_base_mb']:>9.1f}{sim_peak}{err}{mark}"
        )
    if notes:
        lines += [
            "* peak is the process's resident set over its baseline; on a CPU it also "
            "holds the code of every kernel torch first runs in the entry (paged in from "
            "its libraries, RssFile), which no tensor holds, so the simulator (a count of "
            "tensors) does not see it; in these rows it is a quarter of the peak or more:",
            *notes,
        ]
    return "\n".join(lines)
