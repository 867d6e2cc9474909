"""The fault report: inject each fault of tests/test_recovery.py into a 2-rank run and time the
recovery; then what torchrun's own agent does with the same faults on gloo.

usage: measure.py OUT [--torchrun-tries N]

Every run is `oases train` of the tests' config (configs/tiny.toml, the oases schedule with two
sub-batches and two collectives in flight, 8 steps, a checkpoint every 2, all kept; the
collective timeout 30 s) on 2 local ranks with --max-restarts 2. Times come from the run's
`restarts.jsonl` (wall clock, written by the rank as it faults and by the supervisor, which
polls every 50 ms): detect = fault -> the supervisor ends the attempt on it (for a stopped rank:
seen stopped for 2 s); resume = that -> the first step of the next attempt logged (spawn,
imports, rendezvous, checkpoint load and one step). torchrun's runs keep a 10 s collective
timeout for SIGSTOP (its agent waits for the peer's timeout).
Writes OUT/results.json (raw), OUT/results.md (the tables) and OUT/loss.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))

from oases.train import checkpoint as ckpt  # noqa: E402
from oases.train.restart_events import read_events  # noqa: E402

STEPS = 8
CONFIG = [str(REPO / "configs" / "tiny.toml"), "--schedule.name=oases", "--schedule.n_sub=2",
          "--schedule.max_inflight=2", f"--train.steps={STEPS}", "--checkpoint.every=2",
          "--checkpoint.keep=10", "--train.eval_every=4", "--train.sample_tokens=0"]
STOP_TIMEOUT = "--parallel.timeout_s=10"  # torchrun's SIGSTOP run: the peer's timeout
LOCAL = ["--nproc-per-node", "2", "--max-restarts", "2"]
FAULTS = [  # (name, OASES_FAULT, damage of the newest checkpoint between runs)
    ("kill -9 mid-step", "kill:rank=1:step=6:at=step", None),
    ("kill -9 mid-save", "kill:rank=0:step=6:at=save", None),
    ("kill -9 mid-collective", "kill:rank=1:step=3:at=collective:n=5", None),
    ("SIGSTOP mid-step", "stop:rank=1:step=7:at=step", None),
    ("truncated shard", "", "truncate"),
    ("deleted shard", "", "delete"),
]


def _env(fault: str, tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "OASES_"))
           and k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    env["TMPDIR"] = str(tmp)
    if fault:
        env["OASES_FAULT"] = fault
    return env


def run(cmd: list[str], fault: str, tmp: Path, timeout_s: float = 600,
        env: dict[str, str] | None = None) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    # a new session, killed as a whole past the timeout (a stopped rank included)
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(fault, tmp) | (env or {}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n[measure.py: killed after {timeout_s} s]"
    left = sorted(p.name for p in tmp.iterdir() if p.name.startswith(("torchelastic_",
                                                                      "oases-")))
    return {"cmd": cmd, "fault": fault, "rc": proc.returncode, "wall_s": time.time() - t0,
            "stdout": out, "stderr": err, "tmp_left": left}


def oases_train(run_dir: Path, fault: str, tmp: Path) -> dict:
    cmd = [sys.executable, "-m", "oases", "train", *CONFIG, *LOCAL,
           f"--train.run_dir={run_dir}"]
    return run(cmd, fault, tmp)


def metrics(run_dir: Path) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def complete(run_dir: Path) -> list[str]:
    return [p.name for _, p in ckpt.complete_checkpoints(run_dir / "checkpoints")]


def damage(run_dir: Path, how: str) -> str:
    """Damage the newest checkpoint (step 8) of a copy of the reference run."""
    shard = run_dir / "checkpoints" / ckpt.step_dir_name(STEPS) / "__1_0.distcp"
    if how == "truncate":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    else:
        shard.unlink()
    return f"{how} {shard.relative_to(run_dir)}"


def row_of(name: str, fault: str, result: dict, run_dir: Path, ref: dict) -> dict:
    events = read_events(run_dir)
    by = {k: [e for e in events if e["event"] == k] for k in
          ("launch", "attempt", "fault", "failure", "first_step", "finished")}
    losses = metrics(run_dir)
    last_attempt = by["attempt"][-1] if by["attempt"] else {}
    resume = last_attempt.get("resume_step", 0)
    after = [s for s in losses if s > resume]
    diffs = [abs(losses[s] - ref["losses"][s]) for s in after if s in ref["losses"]]
    row = {"name": name, "fault": fault, "rc": result["rc"], "wall_s": result["wall_s"],
           "resume_step": resume, "steps_logged": sorted(losses),
           "checkpoints": complete(run_dir),
           "checkpoints_lost": sorted(set(ref["checkpoints"]) - set(complete(run_dir))),
           "max_abs_loss_diff_after_resume": max(diffs) if diffs else None,
           "loss_equal": bool(diffs) and max(diffs) <= 1e-6
           and sorted(losses) == list(range(1, STEPS + 1)),
           "restart_lines": [ln for ln in result["stderr"].splitlines()
                             if ln.startswith("attempt ")],
           "warnings": [ln for ln in result["stderr"].splitlines()
                        if ln.startswith("warning:")],
           "tmp_left": result["tmp_left"], "losses": losses, "events": events}
    if by["fault"] and by["failure"]:
        f, fail = by["fault"][0], by["failure"][0]
        cause = next(r for r in fail["ranks"] if r["rank"] == fail["cause"])
        first = [e for e in by["first_step"] if e["attempt"] == fail["attempt"] + 1]
        row |= {"detect_s": cause["seen"] - f["time"],
                "resume_s": first[0]["time"] - cause["seen"] if first else None,
                "steps_recomputed": f["steps_done"] - resume}
    elif by["launch"] and by["first_step"]:  # damaged between runs: found when the run starts
        row |= {"detect_s": None, "resume_s": by["first_step"][0]["time"] - by["launch"][0]["time"],
                "steps_recomputed": STEPS - resume}
    return row


def torchrun(run_dir: Path, fault: str, tmp: Path, extra: tuple[str, ...] = (),
             own_store: bool = False) -> dict:
    """torchrun's agent restarting the group (--max-restarts 1), logs inside ``tmp``;
    ``own_store``: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (rank 0 hosts each round's store)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--max-restarts=1", f"--log-dir={tmp / 'torchrun-logs'}", "-m", "oases", "train",
           *CONFIG, f"--train.run_dir={run_dir}", *extra,
           *([STOP_TIMEOUT] if fault.startswith("stop") else [])]
    result = run(cmd, fault, tmp, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
                 if own_store else {})
    shutil.rmtree(tmp / "torchrun-logs", ignore_errors=True)
    losses = metrics(run_dir)
    result |= {"steps_logged": sorted(losses), "losses": losses,
               "recovered": result["rc"] == 0 and sorted(losses) == list(range(1, STEPS + 1)),
               "error_lines": [ln for ln in result["stderr"].splitlines()
                               if "error" in ln.lower() and ("Error" in ln or "error:" in ln)][:6]}
    return result


def plot(rows: list[dict], ref: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(12, 6.5), sharex=True, sharey=True)
    steps = sorted(ref["losses"])
    for ax, row in zip(axes.flat, rows):
        ax.plot(steps, [ref["losses"][s] for s in steps], "-", color="0.6", lw=4,
                label="uninterrupted")
        got = sorted(row["losses"])
        ax.plot(got, [row["losses"][s] for s in got], "o--", color="C3", ms=4,
                label="faulted run (final log)")
        ax.axvline(row["resume_step"], color="C0", ls=":", label="resume point")
        done = row.get("steps_recomputed", 0) + row["resume_step"]
        ax.axvline(done + 0.5, color="C3", ls="-", lw=0.8, alpha=0.6,
                   label="fault (damaged checkpoint)" if "shard" in row["name"] else "fault")
        ax.set_title(f"{row['name']}\nresumed from step {row['resume_step']}", fontsize=9)
        ax.set_xlabel("step")
    axes[0, 0].set_ylabel("training loss")
    axes[1, 0].set_ylabel("training loss")
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def fmt(x: float | None, unit: str = " s") -> str:
    return "at start" if x is None else f"{x:.2f}{unit}"


def markdown(res: dict) -> str:
    out = ["| fault | OASES_FAULT / damage | time to detect | time to resume | steps "
           "recomputed | checkpoints lost | loss after resume = uninterrupted (max abs diff) |",
           "|---|---|---|---|---|---|---|"]
    for r in res["faults"]:
        diff = r["max_abs_loss_diff_after_resume"]
        out.append(f"| {r['name']} | `{r['fault']}` | {fmt(r.get('detect_s'))} | "
                   f"{fmt(r.get('resume_s'))} | {r.get('steps_recomputed')} | "
                   f"{len(r['checkpoints_lost'])} | {'yes' if r['loss_equal'] else 'NO'} "
                   f"({diff:.1e}) |")
    out += ["", "Restart lines as printed:", "", "```"]
    for r in res["faults"]:
        out += r["restart_lines"] + r["warnings"][:2]
    out += ["```", ""]
    if res.get("torchrun"):
        out += ["torchrun --standalone --nproc-per-node=2 --max-restarts=1 (gloo), the same "
                "config and faults:", "",
                "| TORCH_DISABLE_SHARE_RDZV_TCP_STORE | fault | exit | recovered (8 steps) "
                "| restart failed in connectFullMesh | error line printed | wall |",
                "|---|---|---|---|---|---|---|"]
        for t in res["torchrun"]:
            out.append(f"| {'1' if t['own_store'] else 'unset'} | `{t['label']}` | {t['rc']} | "
                       f"{'yes' if t['recovered'] else 'no'} | "
                       f"{'yes' if t['gloo_connect_refused'] else 'no'} | "
                       f"{t['user_error_lines'] if 'user' in t['label'] else '-'} | "
                       f"{t['wall_s']:.1f} s |")
    return "\n".join(out) + "\n"


BEGIN, END = "<!-- results: written by measure.py -->", "<!-- end of results -->"


def machine_line(res: dict) -> str:
    m, after = res["machine_before"], res["machine_after"]["loadavg"]
    busy = m.get("cpu_busy_before")  # share of the CPUs used by anything in the 2 s before
    idle = busy < 0.1 if busy is not None else float(m["loadavg"][0]) <= 0.3
    seen = "" if busy is None else f"CPUs {100 * busy:.0f}% busy in the 2 s before the start; "
    return (f"Measured {res['date']} on {m['cpu']} ({m['cores']} cores), Python {m['python']}, "
            f"torch {m['torch']}; {seen}load average (1, 5, 15 min) {' '.join(m['loadavg'])} "
            f"before, {' '.join(after)} after: " + ("the machine was idle (nothing else ran)."
            if idle else "**the machine was busy** (other work running): the times are longer "
            "than an idle machine's; re-run `run.sh` on an idle one for those."))


def cpu_busy(seconds: float = 2.0) -> float:
    """Share of all CPUs' time spent on anything but idle over ``seconds`` (/proc/stat)."""
    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    (t0, i0), _ = sample(), time.sleep(seconds)
    t1, i1 = sample()
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def machine() -> dict:
    import torch

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text()
                .splitlines() if ln.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform(),
            "loadavg": Path("/proc/loadavg").read_text().split()[:3]}


def machine_before() -> dict:
    return machine() | {"cpu_busy_before": cpu_busy()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--torchrun-tries", type=int, default=3)
    ap.add_argument("--from-json", action="store_true",
                    help="only rewrite the tables, README section and plot from results.json")
    ns = ap.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    if ns.from_json:
        write(json.loads((ns.out / "results.json").read_text(), object_hook=_int_keys), ns.out)
        return
    res: dict = {"machine_before": machine_before(), "config": CONFIG + LOCAL, "faults": [],
                 "date": time.strftime("%Y-%m-%d %H:%M")}
    with tempfile.TemporaryDirectory(prefix="faults-report-") as work_dir:
        work = Path(work_dir)
        ref_dir = work / "reference"
        ref_run = oases_train(ref_dir, "", work / "tmp")
        assert ref_run["rc"] == 0, ref_run["stderr"]
        ref = {"losses": metrics(ref_dir), "checkpoints": complete(ref_dir),
               "wall_s": ref_run["wall_s"]}
        res["reference"] = ref
        print(f"reference: {ref_run['wall_s']:.1f} s, checkpoints {ref['checkpoints']}",
              flush=True)
        for i, (name, fault, how) in enumerate(FAULTS):
            run_dir = work / f"fault{i}"
            if how:
                shutil.copytree(ref_dir, run_dir)
                fault = damage(run_dir, how)
                result = oases_train(run_dir, "", work / "tmp")
            else:
                result = oases_train(run_dir, fault, work / "tmp")
            row = row_of(name, fault, result, run_dir, ref)
            res["faults"].append(row)
            print(f"{name}: rc {row['rc']}, detect {fmt(row.get('detect_s'))}, resume "
                  f"{fmt(row.get('resume_s'))}, recomputed {row.get('steps_recomputed')}, lost "
                  f"{len(row['checkpoints_lost'])}, loss equal {row['loss_equal']}", flush=True)
            for line in row["restart_lines"] + row["warnings"][:2]:
                print(f"    {line}", flush=True)
        res["torchrun"] = []
        short = work / "short.txt"
        short.write_text("too short for one window\n")
        kill, stop = "kill:rank=1:step=6:at=step", "stop:rank=1:step=7:at=step"
        tries = [(kill, (), False)] * ns.torchrun_tries + [(kill, (), True)] * ns.torchrun_tries
        tries += [(stop, (), True), ("", (f"--data.source={short}",), True)]  # + a user error
        for n, (fault, extra, own_store) in enumerate(tries):
            t = torchrun(work / f"torchrun{n}", fault, work / "tmp", extra, own_store)
            t["label"] = "user error (data too short)" if extra else fault
            t["own_store"] = own_store
            t["user_error_lines"] = t["stderr"].count("error: data.source=")
            t["gloo_connect_refused"] = "connectFullMesh failed" in t["stderr"]
            t["sigterm_ignored"] = "Unable to shutdown process" in t["stderr"]
            t["stdout"], t["stderr"] = t["stdout"][-2000:], t["stderr"][-4000:]
            res["torchrun"].append(t)
            print(f"torchrun{' (own store)' if own_store else ''} {t['label']}: rc {t['rc']}, "
                  f"recovered {t['recovered']}, {t['wall_s']:.1f} s, connectFullMesh refused "
                  f"{t['gloo_connect_refused']}, user error printed {t['user_error_lines']}x",
                  flush=True)
    res["machine_after"] = machine()
    (ns.out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    write(res, ns.out)
    print(markdown(res))


def _int_keys(d: dict) -> dict:
    """JSON turned the loss dicts' step keys into strings; back to ints."""
    return {int(k) if k.isdigit() else k: v for k, v in d.items()}


def write(res: dict, out: Path) -> None:
    """results.md, the README's results section (between the markers) and loss.png."""
    (out / "results.md").write_text(markdown(res))
    readme = out / "README.md"
    if readme.is_file() and BEGIN in readme.read_text():
        text = readme.read_text()
        head, rest = text.split(BEGIN, 1)
        readme.write_text(head + BEGIN + "\n" + machine_line(res) + "\n\n" + markdown(res)
                          + END + rest.split(END, 1)[1])
    plot(res["faults"], res["reference"], out / "loss.png")


if __name__ == "__main__":
    main()
