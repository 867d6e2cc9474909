"""The measurements of this report (run.sh runs each step under the machine's CPU lock).

    bench.py corpora ROOT           synthetic corpora ROOT/text-{10M,100M,1G,5G} (see README)
    bench.py throughput ROOT OUT    prepare MB/s (byte, BPE; 1 and 2 workers) beside the
                                    tokenizers library's one encode_batch call on the same text
    bench.py startup ROOT OUT SRC   per corpus: prepare (byte), data open time, `oases train`
                                    time to the first step and resident memory per rank; SRC:
                                    the source tree of the commit before this work ("before")
    bench.py train OUT SRC ROOT     `oases train` (configs/default.toml) before and after
    bench.py bpe-sample ROOT OUT [MIB ...]
                                    BPE training time, memory, compression by sample size
Each step appends its rows to OUT/results.json.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
SIZES = {"10M": 10 * 10**6, "100M": 100 * 10**6, "1G": 10**9, "5G": 5 * 10**9}


def record(out: Path, kind: str, row: dict) -> None:
    path = out / "results.json"
    rows = json.loads(path.read_text()) if path.is_file() else []
    rows.append({"kind": kind, "load": os.getloadavg()[0], **row})
    path.write_text(json.dumps(rows, indent=1) + "\n")
    print(kind, json.dumps(row), flush=True)


def corpora(root: Path) -> None:
    """Text files made of this machine's Python standard library sources: every .py file under
    the interpreter's stdlib folder (tests and site-packages included), drawn at random with a
    fixed seed and concatenated into files of size/50 bytes (16 MB at most)."""
    import sysconfig

    lib = Path(sysconfig.get_paths()["stdlib"])
    pool = []
    for path in sorted(lib.rglob("*.py")):
        try:
            data = path.read_bytes()
            data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if data:
            pool.append(data)
    print(f"pool: {len(pool)} files, {sum(map(len, pool)) / 1e6:.1f} MB from {lib}")
    for name, total in SIZES.items():
        folder, done = root / f"text-{name}", root / f"text-{name}.done"
        if done.is_file():
            continue
        folder.mkdir(parents=True, exist_ok=True)
        rng = random.Random(name)
        per_file = min(max(total // 50, 256 << 10), 16 << 20)
        written, k = 0, 0
        while written < total:
            size = min(per_file, total - written)
            parts, n = [], 0
            while n < size:
                data = pool[rng.randrange(len(pool))]
                parts.append(data)
                n += len(data) + 1
            blob = b"\n".join(parts)[:size]
            (folder / f"part-{k:05d}.txt").write_bytes(blob)
            written += len(blob)
            k += 1
        done.write_text(f"{written} bytes in {k} files\n")
        print(f"{folder}: {written / 1e6:.0f} MB in {k} files", flush=True)


def _texts(folder: Path) -> list[str]:
    return [p.read_bytes().decode("utf-8", errors="replace")
            for p in sorted(folder.glob("*.txt"))]


def _baseline(tokenizer_json: str, folder: Path) -> dict:
    """The tokenizers library encoding every file of ``folder`` in one encode_batch call."""
    code = f"""
import json, sys, time, resource
from pathlib import Path
from tokenizers import Tokenizer
sys.path.insert(0, {str(Path(__file__).parent)!r})
from bench import _texts
tok = Tokenizer.from_str(Path({tokenizer_json!r}).read_text())
texts = _texts(Path({str(folder)!r}))
n = sum(len(t.encode()) for t in texts)
t0 = time.perf_counter()
enc = tok.encode_batch(texts, add_special_tokens=False)
dt = time.perf_counter() - t0
print(json.dumps({{"text_bytes": n, "seconds": dt, "tokens": sum(len(e.ids) for e in enc),
                  "threads": __import__("os").cpu_count()}}))
"""
    res = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def _prepare(src: Path, out: Path, *args: str) -> dict:
    subprocess.run(["rm", "-rf", str(out)], check=True)
    t0 = time.perf_counter()
    res = subprocess.run([PY, "-m", "oases", "data", "prepare", str(src), "--out", str(out),
                          "--no-progress", *args], capture_output=True, text=True,
                         env=_env(REPO / "src"))
    wall = time.perf_counter() - t0
    if res.returncode:
        raise SystemExit(res.stderr)
    manifest = json.loads((out / "dataset.json").read_text())
    p = manifest["prepared"]
    return {"wall_s": wall, "seconds": p["seconds"], "encode_s": p["encode_seconds"],
            "text_bytes": p["encoded_text_bytes"], "workers": p["workers"],
            "tokens": sum(s[k]["tokens"] for s in manifest["sources"] for k in ("train", "val")),
            "shards": sum(len(s[k]["shards"]) for s in manifest["sources"]
                          for k in ("train", "val")),
            "bpe_sample_bytes": manifest["tokenizer"].get("sample_bytes"),
            "log": res.stderr.strip().splitlines()[-3:]}


def _env(src: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(src)
    return env


def throughput(root: Path, out: Path) -> None:
    """Prepare MB/s against one encode_batch call of the library on the same text."""
    work = root / "prep"
    for name, tok in (("100M", "bpe"), ("100M", "byte"), ("10M", "byte"), ("1G", "byte")):
        args = ["--tokenizer", tok] + (["--vocab-size", "4096"] if tok == "bpe" else [])
        for workers in (2, 1):
            if name == "1G" and workers == 1:
                continue
            row = _prepare(root / f"text-{name}", work / f"{name}-{tok}-w{workers}", *args,
                           "--workers", str(workers))
            record(out, "prepare", {"corpus": name, "tokenizer": tok, "purpose": "throughput",
                                    **row})
        if name == "1G":
            continue
        tj = work / f"{name}-{tok}-w2" / "tokenizer.json"
        if tok == "byte":
            sys.path.insert(0, str(REPO / "src"))
            from oases.train.tokenizer import ByteTokenizer, tokenizer_json

            tj = work / "byte-tokenizer.json"
            tj.write_text(tokenizer_json(ByteTokenizer()))
        if tok == "byte" and name != "10M":
            continue  # the library holds ~110 bytes a token: 100 MB of bytes would need 11 GB
        record(out, "baseline", {"corpus": name, "tokenizer": tok,
                                 **_baseline(str(tj), root / f"text-{name}")})


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        out += [int(k) for k in kids]
        todo += [int(k) for k in kids]
    return out


def _status(pid: int) -> dict[str, int]:
    fields = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                fields[key] = int(value.split()[0])
    except OSError:
        pass
    return fields


def train_run(src: Path, run_dir: Path, *overrides: str) -> dict:
    """`oases train` (2 ranks, tp=2): wall time to the first step and every rank's peak
    resident memory (VmHWM, polled every 20 ms) and its file-backed part at the end."""
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    t0 = time.time()
    proc = subprocess.Popen([PY, "-m", "oases", "train", *overrides,
                             f"--train.run_dir={run_dir}"], env=_env(src),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks: dict[int, dict[str, int]] = {}
    while proc.poll() is None:
        for pid in _descendants(proc.pid):
            st = _status(pid)
            if st:
                peaks[pid] = st | {"VmHWM": max(st.get("VmHWM", 0),
                                                peaks.get(pid, {}).get("VmHWM", 0))}
        time.sleep(0.02)
    text = proc.stdout.read()
    if proc.returncode:
        raise SystemExit(text[-3000:])
    events = [json.loads(x) for x in (run_dir / "restarts.jsonl").read_text().splitlines()]
    first = next(e["time"] for e in events if e["event"] == "first_step")
    ranks = sorted((p for p in peaks.values() if p["VmHWM"] > 100_000),
                   key=lambda p: -p["VmHWM"])  # the rank processes (the launcher is smaller)
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"first_step_s": first - t0,
            "launch_to_first_step_s": first - next(e["time"] for e in events
                                                   if e["event"] == "launch"),
            "wall_s": time.time() - t0,
            "rank_peak_rss_mb": [round(p["VmHWM"] / 1024, 1) for p in ranks],
            "rank_rss_file_mb": [round(p.get("RssFile", 0) / 1024, 1) for p in ranks],
            "rank0_peak_mem_mb": max(m.get("peak_mem_mb", 0) for m in metrics),
            "val_loss": [m["val_loss"] for m in metrics if "val_loss" in m][-1:],
            "tail": text.strip().splitlines()[-1]}


def open_time(folder: Path) -> dict:
    """A fresh process: open the dataset, its batches and read one batch (the data's part of
    a rank's start), and that process's resident memory after."""
    code = f"""
import json, time
t0 = time.perf_counter()
from oases.data.dataset import open_dataset, split_batches
t1 = time.perf_counter()
ds = open_dataset({str(folder)!r})
b = split_batches(ds, "train", 128, 16, dp_rank=0, dp=1, seed=0)
x = b.batch(0)
t2 = time.perf_counter()
rss = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
print(json.dumps({{"import_s": t1 - t0, "open_and_first_batch_s": t2 - t1,
                  "process_peak_rss_mb": rss / 1024, "windows": b.n_windows}}))
"""
    res = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True,
                         env=_env(REPO / "src"))
    return json.loads(res.stdout.strip().splitlines()[-1])


STEPS = ["--train.steps=3", "--train.eval_every=0", "--checkpoint.every=0",
         "--train.sample_tokens=0", "--train.log_every=1"]


def startup(root: Path, out: Path, before_src: Path, repeats: int = 2) -> None:
    """Per corpus: prepare (byte), open time; then ``repeats`` rounds, interleaved, of
    `oases train` on each prepared folder and, up to 1 GB, the in-memory path of before (the
    1 GB one once: it takes a minute and 3 GB per rank)."""
    work = root / "prep"
    for name in SIZES:
        ds = work / f"start-{name}"
        if not (ds / "dataset.json").is_file():
            record(out, "prepare", {"corpus": name, "tokenizer": "byte",
                                    "purpose": "start-up corpora",
                                    **_prepare(root / f"text-{name}", ds)})
        record(out, "open", {"corpus": name, **open_time(ds)})
    for rep in range(repeats):
        for name in SIZES:
            ds = work / f"start-{name}"
            row = train_run(REPO / "src", root / "runs" / f"after-{name}",
                            f"--data.source={ds}", *STEPS)
            record(out, "startup", {"corpus": name, "code": "after (prepared folder)",
                                    "rep": rep, **row})
            if name in ("10M", "100M") or (name == "1G" and rep == 0):
                row = train_run(before_src, root / "runs" / f"before-{name}",
                                f"--data.source={root / f'text-{name}'}", *STEPS)
                record(out, "startup", {"corpus": name, "code": "before (in memory)",
                                        "rep": rep, **row})


def bpe_sample(root: Path, out: Path, sizes_mib: tuple[int, ...] = (4, 16, 64)) -> None:
    """A BPE of 4096 tokens trained on the first 4, 16 and 64 MiB of the 1 GB corpus (each in a
    fresh process): training time, the process's peak memory, and its tokens per byte on the
    10 MB corpus (other files, held out)."""
    for mib in sizes_mib:
        code = f"""
import json, resource, sys, time
from pathlib import Path
sys.path.insert(0, {str(Path(__file__).parent)!r})
from bench import _texts
from oases.train.tokenizer import train_bpe
texts, size = [], 0
for p in sorted(Path({str(root / "text-1G")!r}).glob("*.txt")):
    data = p.read_bytes()[: {mib} * 2**20 - size]
    texts.append(data.decode("utf-8", errors="replace"))
    size += len(data)
    if size >= {mib} * 2**20:
        break
t0 = time.perf_counter()
tok = train_bpe(texts, 4096)
dt = time.perf_counter() - t0
held = _texts(Path({str(root / "text-10M")!r}))
n = sum(len(t.encode()) for t in held)
ids = sum(len(x) for x in tok.encode_batch(held))
print(json.dumps({{"sample_mib": {mib}, "train_s": dt, "tokens_per_byte": ids / n,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""
        res = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True,
                             env=_env(REPO / "src"))
        record(out, "bpe_sample", json.loads(res.stdout.strip().splitlines()[-1]))


def make_train(out: Path, before_src: Path, root: Path) -> None:
    for code, src in (("before", before_src), ("after", REPO / "src")):
        row = train_run(src, root / "runs" / f"default-{code}")
        record(out, "make_train", {"code": code, **row})


if __name__ == "__main__":
    step, args = sys.argv[1], [Path(a) for a in sys.argv[2:]]
    if step == "corpora":
        corpora(args[0])
    elif step == "throughput":
        throughput(args[0], args[1])
    elif step == "startup":
        startup(args[0], args[1], args[2])
    elif step == "train":
        make_train(args[0], args[1], args[2])
    elif step == "bpe-sample":
        sizes = tuple(int(str(a)) for a in args[2:]) or (4, 16, 64)
        bpe_sample(args[0], args[1], sizes)
    else:
        raise SystemExit(__doc__)
