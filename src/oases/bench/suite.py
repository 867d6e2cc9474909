"""``oases bench``: launch the ranks (on a shaped link), collect, compare, report.

    oases bench [CONFIG] --schedules megatron,oases,... --link none|RATE|auto:PRESET
                --steps N --out DIR [--nproc-per-node N] [--section.key=value ...]

RATE is a tbf rate such as ``200mbit`` or ``25MB`` (bytes/s). ``auto:PRESET`` first measures,
unshaped, one TP region's forward compute for this model on this machine, then picks the rate at
which that region's all-reduce takes the preset's multiple of it (``link.LINK_PRESETS``).
Outputs in DIR: ``bench.json``, ``raw.json``, ``bench.png`` (bars), ``STEM_timeline.png`` and
``STEM_trace.json`` for the entries ``bench.draws_timeline`` names (``oases_sp-gathered``...),
``report.md`` (command, machine, versions, table).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from oases.bench import PEERS, draws_timeline, parse_entry
from oases.bench.link import (
    LINK_PRESETS,
    SHAPED_ENV,
    LinkPreset,
    rate_for_ratio,
    run_shaped,
    shaping_unavailable,
)

DEFAULT_SCHEDULES = (
    "megatron",
    "megatron-recompute",
    "commfree-recompute",
    "overlap",
    "overlap-recompute",
    "oases",
    "torch-tp",
)
_UNITS = {
    "bit": 1 / 8,
    "kbit": 1e3 / 8,
    "mbit": 1e6 / 8,
    "gbit": 1e9 / 8,
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
}


def parse_rate(text: str) -> float:
    """'200mbit' -> bytes/s; '25MB' -> 25e6 bytes/s; a bare number is bytes/s."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)(/s)?\s*", text)
    if not m or m.group(2).lower() not in _UNITS | {"": 1}:
        raise ValueError(
            f"--link {text!r}: expected none, auto:PRESET or a rate like 200mbit "
            f"or 25MB (presets: {', '.join(LINK_PRESETS)})"
        )
    return float(m.group(1)) * _UNITS.get(m.group(2).lower(), 1)


def launch_ranks(
    module: str,
    spec: dict,
    nproc: int,
    rate: float | None,
    workdir: Path,
    *,
    measures_memory: bool = True,
) -> None:
    """``torchrun`` ``nproc`` local ranks of ``python -m module SPEC.json`` (on a loopback
    shaped to ``rate`` bytes/s when given); RuntimeError if any rank fails.

    ``measures_memory``: the ranks read their peak resident set (``--memory``, the profile,
    ``plan --verify``), so glibc is told to give every freed buffer over 128 KiB back to the
    system (``MALLOC_MMAP_THRESHOLD_``) and the peak is the tensors', not the heap's high
    water mark. Each such buffer is then a fresh mapping whose pages fault in on first touch:
    a step runs 5-20% slower than ``oases train``'s, the more the more buffers it allocates.
    The timing launches of ``oases bench`` pass False and run under the allocator training
    runs under."""
    spec_path = workdir / f"spec-{len(list(workdir.glob('spec-*')))}.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--log-dir={workdir / 'torchrun-logs'}",  # not /tmp
        "-m",
        module,
        str(spec_path),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if measures_memory:
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    proc = run_shaped(cmd, rate, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{module} ranks failed (exit {proc.returncode}); see output above")


def _launch(spec: dict, nproc: int, rate: float | None, workdir: Path) -> None:
    launch_ranks("oases.bench.runner", spec, nproc, rate, workdir, measures_memory=False)


def run_bench(
    config: str | None,
    overrides: list[str],
    schedules: list[str],
    link: str,
    steps: int,
    out: Path,
    nproc: int = 2,
    warmup: int = 2,
    with_optimizer: bool = False,
) -> dict:
    from oases.config import load_config
    from oases.schedule import SCHEDULES
    from oases.schedule.specs import BASELINES

    cfg = load_config(config, overrides)  # fail fast, before any rank starts
    cfg.validate(nproc)
    valid = (*SCHEDULES, *BASELINES, *PEERS)
    unknown = [s for s in schedules if parse_entry(s).name not in valid]
    if unknown:
        raise ValueError(f"unknown schedule(s) {unknown}; valid: {', '.join(valid)}")
    warn_no_effect(schedules, nproc // cfg.parallel.tp)
    if any(parse_entry(s).name == "fsdp2" for s in schedules):
        from oases.bench.runner import fsdp2_rows

        fsdp2_rows(cfg.train.micro_batch, cfg.parallel.tp, 0)  # the batch splits over all ranks
    out.mkdir(parents=True, exist_ok=True)
    base = {"config": config, "overrides": overrides, "out": str(out)}
    rate, label, preset = resolve_link(link, config, overrides, nproc, cfg.parallel.tp)
    with tempfile.TemporaryDirectory() as tmp:
        _launch(
            {
                **base,
                "schedules": schedules,
                "steps": steps,
                "warmup": warmup,
                "link_label": label,
                "timeline": any(draws_timeline(s) for s in schedules),
                "with_optimizer": with_optimizer,
            },
            nproc,
            rate,
            Path(tmp),
        )
    raw = json.loads((out / "raw.json").read_text())
    result = summarize(raw, schedules, label, rate, preset.name if preset else None)
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    print(format_table(result), flush=True)
    plot_bars(result, out / "bench.png")
    write_report(result, out, sys.argv)
    return result


def warn_no_effect(entries: list[str], dp: int) -> None:
    """A warning line per entry whose setting does nothing on this layout (``train.no_effect``:
    a ZeRO stage at dp=1)."""
    from oases.train.no_effect import bench_entry_warnings

    pairs = [(e, parse_entry(e).zero) for e in entries]
    for line in bench_entry_warnings(pairs, dp):
        print(f"warning: {line}", file=sys.stderr, flush=True)


def resolve_link(
    link: str, config: str | None, overrides: list[str], nproc: int, tp: int
) -> tuple[float | None, str, LinkPreset | None]:
    """``--link`` -> (tbf rate in bytes/s or None, a label, the preset used). ``auto:PRESET``
    launches the ranks once, unshaped, to measure this model's region forward time."""
    base = {"config": config, "overrides": overrides}
    rate, label, preset = None, "unshaped loopback", None
    if link.startswith("auto:") and link[5:] not in LINK_PRESETS:
        raise ValueError(f"unknown link preset {link[5:]!r}; valid: {', '.join(LINK_PRESETS)}")
    if link != "none" and not link.startswith("auto:"):
        parse_rate(link)  # a bad rate fails here, even where shaping is unavailable
    if link != "none":
        reason = shaping_unavailable()
        if os.environ.get(SHAPED_ENV):
            reason = "already inside a shaped namespace"
        if reason:
            print(f"oases bench: {reason}; running on the unshaped loopback", flush=True)
        elif link.startswith("auto:"):
            preset = LINK_PRESETS[link[5:]]
            with tempfile.TemporaryDirectory() as tmp:
                _launch(
                    {**base, "schedules": [], "steps": 0, "calibrate_only": True, "out": tmp},
                    nproc,
                    None,
                    Path(tmp),
                )
                calib = json.loads((Path(tmp) / "calibration.json").read_text())
            # every TP group's all-reduce crosses the one shaped loopback at the same time
            groups = nproc // tp
            rate = groups * rate_for_ratio(
                calib["allreduce_bytes"],
                calib["region_forward_s"],
                preset.comm_to_compute,
                world=tp,
            )
            print(
                f"oases bench: preset {preset.name}: all-reduce = {preset.comm_to_compute}x "
                f"region forward ({preset.source}); region forward here "
                f"{calib['region_forward_s'] * 1e3:.1f} ms, all-reduce "
                f"{calib['allreduce_bytes'] / 2**20:.2f} MiB -> tbf rate "
                f"{rate * 8 / 1e6:.1f} Mbit/s",
                flush=True,
            )
        else:
            rate = parse_rate(link)
        if rate is not None:
            label = f"loopback shaped to {rate * 8 / 1e6:.1f} Mbit/s"
    return rate, label, preset


def summarize(
    raw: dict, schedules: list[str], label: str, rate: float | None, preset: str | None
) -> dict:
    per = {}
    for name in schedules:
        med = statistics.median(raw["times_s"][name])
        row = {
            "median_step_s": med,
            "tokens_per_s": raw["tokens_per_step"] / med,
            "peak_mem_mb": raw["peak_mem_mb"][name],
            "steps_s": raw["times_s"][name],
        }
        if name in raw.get("predicted_s", {}):
            row["predicted_step_s"] = raw["predicted_s"][name]
            row["prediction_error"] = raw["predicted_s"][name] / med - 1.0
        if name in raw["compute_only_s"]:
            row["compute_only_s"] = raw["compute_only_s"][name]
            row["comm_only_s"] = raw["comm_only_s"][name]
            row["exposed_comm_s"] = max(0.0, med - raw["compute_only_s"][name])
        per[name] = row

    def ratios(base: str) -> dict:
        if base not in per:
            return {}
        return {n: per[base]["median_step_s"] / r["median_step_s"] for n, r in per.items()}

    result = {
        "link": {
            "label": label,
            "rate_bytes_per_s": rate,
            "preset": preset,
            "calibration": raw.get("calibration"),
        },
        "world_size": raw["world_size"],
        "tp": raw["tp"],
        "dp": raw["dp"],
        "schedules": per,
        "speedup_vs_megatron": ratios("megatron"),
        "speedup_vs_megatron_recompute": ratios("megatron-recompute"),
        "speedup_vs_torch_tp": ratios("torch-tp"),
    }
    if "oases" in per:
        o = per["oases"]
        limit = max(o["compute_only_s"], o["comm_only_s"])
        result["limit_s"] = limit
        result["limit_ratio"] = limit / o["median_step_s"]
    return result


def format_table(result: dict) -> str:
    w = max([20, *(len(n) + 1 for n in result["schedules"])])  # the entry column
    lines = [
        f"link: {result['link']['label']}   tp={result['tp']} dp={result['dp']}",
        f"{'schedule':<{w}}{'step s':>9}{'tok/s':>10}{'peak MB':>9}{'compute s':>10}"
        f"{'comm s':>9}{'exposed':>9}{'vs meg':>8}{'vs m-rc':>8}{'vs t-tp':>8}"
        f"{'predict':>9}{'err':>7}",
    ]
    for name, r in result["schedules"].items():

        def fmt(key: str, r: dict = r) -> str:
            return f"{r[key]:.3f}" if key in r else "-"

        def sp(table: str, name: str = name) -> str:
            v = result[table].get(name)
            return f"{v:.2f}x" if v is not None else "-"

        lines.append(
            f"{name:<{w}}{r['median_step_s']:>9.3f}{r['tokens_per_s']:>10.0f}"
            f"{r['peak_mem_mb']:>9.0f}{fmt('compute_only_s'):>10}{fmt('comm_only_s'):>9}"
            f"{fmt('exposed_comm_s'):>9}{sp('speedup_vs_megatron'):>8}"
            f"{sp('speedup_vs_megatron_recompute'):>8}{sp('speedup_vs_torch_tp'):>8}"
            f"{fmt('predicted_step_s'):>9}"
            + (f"{r['prediction_error']:>+7.0%}" if "prediction_error" in r else f"{'-':>7}")
        )
    if "limit_ratio" in result:
        lines.append(
            f"limit = max(compute-only, comm-only) of oases = {result['limit_s']:.3f} s; "
            f"limit_ratio = {result['limit_ratio']:.2f}"
        )
    lines.append(
        "peak MB: the process's peak resident set while the entry stepped (the entries "
        "share one process and its heap; per entry: oases bench --memory)"
    )
    return "\n".join(lines)


def plot_bars(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["schedules"])
    steps = [result["schedules"][n]["median_step_s"] for n in names]
    comp = [result["schedules"][n].get("compute_only_s", 0.0) for n in names]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar(names, steps, color="tab:blue", label="median step")
    ax.bar(names, comp, color="tab:gray", alpha=0.6, width=0.4, label="compute only")
    if "limit_s" in result:
        ax.axhline(result["limit_s"], color="tab:red", ls="--", label="limit (oases)")
    ax.set_ylabel("seconds per step")
    ax.set_title(f"tp={result['tp']}, {result['link']['label']}")
    ax.legend()
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine_info() -> dict:
    import torch

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "git": source_revision(),
    }


def source_revision() -> str:
    """The commit of the oases source that ran (``git`` in the package's own folder, wherever
    the command ran from), ``+dirty`` with uncommitted changes; outside a checkout (an
    installed copy), the package version and that no commit is known."""
    from oases import __version__

    here = Path(__file__).resolve().parents[1]  # the oases package
    try:
        head = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        dirty = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--", "."],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        head = dirty = None
    if head is None or head.returncode != 0 or not head.stdout.strip():
        return f"none (oases {__version__}, not run from a git checkout)"
    return head.stdout.strip() + ("+dirty" if dirty is not None and dirty.stdout.strip() else "")


def write_report(result: dict, out: Path, argv: list[str]) -> None:
    info = machine_info()
    text = [
        f"# oases bench, {datetime.date.today().isoformat()}",
        "",
        "Command: `" + " ".join(["oases", *argv[1:]]) + "`",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in info.items()),
        "",
        "```",
        format_table(result),
        "```",
        "",
    ]
    (out / "report.md").write_text("\n".join(text))
