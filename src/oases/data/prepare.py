"""``oases data prepare``: tokenize sources once into a folder of memory-mapped token shards.

Order of operations (``prepare``)::

    DIR/dataset.json there?  same request and sources -> nothing to do; else refused (kept)
    DIR/prepare.json         the request (written first; a second run with the same request
                             resumes, another request is refused: nothing prepared is lost)
    plan                     every SOURCE's files, split, tasks (``plan.py``)
    tokenizer                byte | bpe trained on a bounded seeded sample (``sample.py``) |
                             hf:PATH copied -> DIR/tokenizer.json; token dtype from its size
    encode                   every task without a finished shard, in worker processes (one a
                             core) or here for small corpora, with progress and a throughput
                             line (``encode.py``, ``shards.py``)
    DIR/dataset.json         the manifest, written last: tokenizer, dtype, per source its
                             weight, split rule, fingerprint and shards; the dataset's
                             fingerprint (checkpoints record it)

A folder with a ``dataset.json`` is complete; ``dataset.open_dataset`` reads it. Blending:
several SOURCEs, each its own shards and validation split, sampled by ``weights`` (default:
in proportion to their training tokens, so every window is seen once an epoch).
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from oases.data.encode import Encoder, EncoderSpec, init_worker, run_task, worker_task
from oases.data.formats import stream_length
from oases.data.plan import SourcePlan, Task, plan_source, plan_tasks, split_source, task_size
from oases.data.progress import Progress
from oases.data.sample import BPE_SAMPLE_BYTES, sample_texts
from oases.data.shards import (
    DTYPES,
    dtype_limit,
    read_done,
    smallest_dtype,
    write_json_atomic,
)

MANIFEST = "dataset.json"
REQUEST = "prepare.json"
FORMAT = "oases-tokens/1"
SMALL_BYTES = 16 << 20  # below this, encode in this process (no worker start-up)


@dataclass
class PrepareRequest:
    """What to prepare (the CLI's arguments); ``identity`` is what a resume must repeat."""

    sources: list[str]
    out: Path
    tokenizer: str = "byte"
    vocab_size: int = 0  # the BPE's size (bpe only)
    weights: list[float] | None = None
    text_field: str = "text"
    dtype: str = "auto"
    bpe_sample_bytes: int = BPE_SAMPLE_BYTES
    seed: int = 0
    workers: int = 0  # 0: one per core
    given_tokenizer: Any = field(default=None, repr=False)  # a BPE to use instead of training

    def identity(self) -> dict[str, Any]:
        ident = asdict(self)
        for key in ("out", "workers", "given_tokenizer"):
            ident.pop(key)
        if self.tokenizer.startswith("hf:"):  # the file's content, not only its path
            from oases.train.tokenizer import HFTokenizer

            ident["tokenizer_hash"] = _text_hash(HFTokenizer.load(self.tokenizer[3:]).to_json())
        return ident


def check_request(req: PrepareRequest) -> None:
    """The request's own errors, before any file is read or written (one line each)."""
    from oases.train.tokenizer import check_tokenizer_name

    check_tokenizer_name(req.tokenizer)
    if req.tokenizer == "bpe" and req.vocab_size <= 256:
        raise ValueError(
            f"--tokenizer bpe needs --vocab-size N above the 256 bytes (e.g. 4096), "
            f"got {req.vocab_size}"
        )
    if req.weights is not None and len(req.weights) != len(req.sources):
        raise ValueError(f"--weights has {len(req.weights)} values for {len(req.sources)} sources")
    if req.weights is not None and (any(not w >= 0 for w in req.weights) or sum(req.weights) <= 0):
        raise ValueError(f"--weights {req.weights} must be non-negative with a positive sum")
    if req.dtype != "auto" and req.dtype not in DTYPES:
        raise ValueError(f"--dtype={req.dtype!r}: valid are auto, {', '.join(DTYPES)}")


def _text_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _check_folder(req: PrepareRequest, plans_now: Any) -> dict[str, Any] | None:
    """The existing manifest when DIR already holds this dataset; ValueError (nothing changed)
    when DIR holds something else; None when there is work to do."""
    out, ident = req.out, req.identity()
    manifest = _read_json(out / MANIFEST)
    if manifest is not None:
        if manifest.get("request") != ident:
            was = ", ".join(manifest.get("request", {}).get("sources", []))
            raise ValueError(
                f"{out} already holds a prepared dataset of other sources or "
                f"settings ({was}): prepare into another --out (this one is kept "
                "as it is)"
            )
        now = [p.fingerprint.to_dict() for p in plans_now()]
        if now == [s["fingerprint"] for s in manifest["sources"]]:
            return manifest
        raise ValueError(
            f"{out} was prepared from files that have changed since (fingerprint "
            f"{manifest['sources'][0]['fingerprint']['digest']}, now "
            f"{now[0]['digest']}): prepare into another --out (this one is kept)"
        )
    request = _read_json(out / REQUEST)
    if request is not None and request != ident:
        raise ValueError(
            f"{out} holds an unfinished preparation of other sources or settings: "
            "finish it with its own command, or prepare into another --out"
        )
    if request is None and out.is_dir() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty and holds no dataset: prepare into a new folder")
    return None


def _read_json(path: Path) -> Any:
    import json

    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable ({exc})") from None


def _tokenizer(
    req: PrepareRequest, train_tasks: list[Task], log: TextIO
) -> tuple[Any, dict[str, Any]]:
    """The tokenizer (saved into DIR) and its manifest entry."""
    from oases.train.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer, train_bpe

    out, info = req.out, {"spec": req.tokenizer}
    file = out / "tokenizer.json"
    if req.tokenizer == "byte":
        tok: Any = ByteTokenizer()
    elif req.tokenizer.startswith("hf:"):
        tok = HFTokenizer.load(req.tokenizer[3:])
        tok.save(file)
    elif req.tokenizer == "bpe":
        if file.is_file():  # an interrupted preparation trained it already
            tok = build_tokenizer("bpe", vocab_size=req.vocab_size, path=file)
        elif req.given_tokenizer is not None:
            tok = req.given_tokenizer
            tok.save(file)
        else:
            t0 = time.perf_counter()
            texts, size = sample_texts(train_tasks, req.bpe_sample_bytes, req.seed)
            tok = train_bpe(texts, req.vocab_size)
            tok.save(file)
            info["sample_bytes"] = size
            print(
                f"prepare: trained a BPE of {tok.vocab_size} tokens on {size / 1e6:.1f} MB "
                f"of text in {time.perf_counter() - t0:.1f}s",
                file=log,
                flush=True,
            )
        info["requested_vocab"] = req.vocab_size
    else:
        raise AssertionError(req.tokenizer)  # check_request allows no other name
    has_file = not isinstance(tok, ByteTokenizer)
    info.update(
        name=tok.name,
        vocab_size=tok.vocab_size,
        doc_sep_id=tok.doc_sep_id,
        file=file.name if has_file else None,
        hash=_text_hash(tok.to_json()) if has_file else "byte",
    )
    return tok, info


def _dtype(req: PrepareRequest, vocab_size: int) -> str:
    if req.dtype == "auto":
        return smallest_dtype(vocab_size)
    if vocab_size > dtype_limit(req.dtype):
        raise ValueError(
            f"the tokenizer {req.tokenizer} has {vocab_size} tokens, more than "
            f"{req.dtype} holds ({dtype_limit(req.dtype)} ids): use --dtype "
            "uint32 (or auto)"
        )
    return req.dtype


def _encode(
    todo: list[Task],
    spec: EncoderSpec,
    extra: dict[str, Any],
    workers: int,
    out: Path,
    progress: Progress,
) -> None:
    """Run ``todo`` here (one worker) or in ``workers`` spawned processes; finished shards
    stay on an error or an interrupt."""
    if workers <= 1:
        encoder = Encoder(spec)
        for task in todo:
            progress.done(task, run_task(task, out, encoder, extra))
        return
    by_name = {t.name: t for t in todo}
    ctx = multiprocessing.get_context("spawn")  # no forked tokenizer threads or torch state
    pool = ctx.Pool(workers, initializer=init_worker, initargs=(spec, str(out), extra))
    try:
        for record in pool.imap_unordered(worker_task, todo):
            progress.done(by_name[record["name"]], record)
        pool.close()
    finally:
        pool.terminate()  # on an error: the running tasks' unfinished files are redone later
        pool.join()


def _remove_stale(out: Path, tasks: list[Task]) -> None:
    """Shard files of an earlier plan of the same request that this plan does not use."""
    names = {t.name for t in tasks}
    for folder in out.glob("source-*"):
        for path in folder.iterdir():
            stem = path.name.split(".", 1)[0]
            if f"{folder.name}/{stem}" not in names:
                path.unlink()


def _fingerprint(
    sources: list[dict[str, Any]], tok_info: dict[str, Any], dtype: str
) -> dict[str, Any]:
    import json

    blob = json.dumps(
        [
            tok_info["hash"],
            dtype,
            [
                [
                    s["weight"],
                    s["split"],
                    s["fingerprint"]["digest"],
                    [
                        [sh["file"], sh["tokens"], sh["checksum"]]
                        for sh in s["train"]["shards"] + s["val"]["shards"]
                    ],
                ]
                for s in sources
            ],
        ],
        sort_keys=True,
    )
    return {
        "digest": hashlib.sha256(blob.encode()).hexdigest()[:16],
        "files": sum(s["fingerprint"]["files"] for s in sources),
        "bytes": sum(s["train"]["text_bytes"] + s["val"]["text_bytes"] for s in sources),
    }


def _split_entry(tasks: list[Task], records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    shards = [
        {
            "file": f"{t.name}.bin",
            **{
                k: records[t.name][k]
                for k in ("tokens", "documents", "text_bytes", "checksum", "quick")
            },
        }
        for t in tasks
    ]
    return {
        "tokens": sum(s["tokens"] for s in shards),
        "documents": sum(s["documents"] for s in shards),
        "text_bytes": sum(s["text_bytes"] for s in shards),
        "shards": shards,
    }


def prepare(
    req: PrepareRequest, log: TextIO | None = None, bar: bool | None = None, quiet: bool = False
) -> dict[str, Any]:
    """Prepare ``req`` into ``req.out`` (module docstring); returns the manifest. ``bar``: a
    progress bar (None: on a terminal), else lines; ``quiet``: only the summary lines."""
    log = log or sys.stderr
    start = time.perf_counter()
    check_request(req)
    plans: list[SourcePlan] = []

    def plan_all() -> list[SourcePlan]:
        if not plans:
            plans.extend(plan_source(s, req.text_field, req.out) for s in req.sources)
        return plans

    done = _check_folder(req, plan_all)
    if done is not None:
        print(
            f"prepare: {req.out} already holds this dataset (fingerprint "
            f"{done['fingerprint']['digest']}): nothing to do",
            file=log,
            flush=True,
        )
        return done
    req.out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(req.out / REQUEST, req.identity())
    tasks: list[Task] = []
    task_bytes = task_size(sum(p.input_bytes for p in plan_all()))
    for plan in plans:
        split_source(plan, task_bytes, lambda pieces: [stream_length(p) for p in pieces])
    for i, plan in enumerate(plans):
        for split, pieces in (("train", plan.train), ("val", plan.val)):
            tasks += plan_tasks(i, split, pieces, task_bytes)
    tok, tok_info = _tokenizer(req, [t for t in tasks if t.split == "train"], log)
    dtype = _dtype(req, tok.vocab_size)
    extra = {"tokenizer": tok_info["hash"], "dtype": dtype}
    records: dict[str, dict[str, Any]] = {}
    for task in tasks:
        record = read_done(req.out, task.name)
        if (
            record is not None
            and record.get("key") == task.key()
            and all(record.get(k) == v for k, v in extra.items())
        ):
            records[task.name] = record
    todo = [t for t in tasks if t.name not in records]
    _remove_stale(req.out, tasks)
    spec = EncoderSpec(
        None if tok_info["file"] is None else str(req.out / tok_info["file"]),
        tok.doc_sep_id,
        tok.vocab_size,
        dtype,
    )
    todo_bytes = sum(t.input_bytes for t in todo)
    workers = req.workers or (1 if todo_bytes < SMALL_BYTES else os.cpu_count() or 1)
    progress = Progress(todo_bytes, len(todo), log, bar, len(records), quiet)
    try:
        _encode(todo, spec, extra, min(workers, max(len(todo), 1)), req.out, progress)
    finally:
        progress.close()  # stops the encode clock
    for task in todo:
        records[task.name] = read_done(req.out, task.name) or {}
    sources = []
    for i, plan in enumerate(plans):
        mine = [t for t in tasks if t.source == i]
        sources.append(
            {
                "spec": plan.spec,
                "split": plan.split_rule,
                "fingerprint": plan.fingerprint.to_dict(),
                "train": _split_entry([t for t in mine if t.split == "train"], records),
                "val": _split_entry([t for t in mine if t.split == "val"], records),
            }
        )
    train_tokens = [s["train"]["tokens"] for s in sources]
    if sum(train_tokens) + sum(s["val"]["tokens"] for s in sources) == 0:
        raise ValueError(
            f"{', '.join(req.sources)}: the data is empty (no text in "
            f"{sum(len(p.files) for p in plans)} files)"
        )
    weights = req.weights or [float(t) for t in train_tokens]
    total_w = sum(weights)
    for s, w in zip(sources, weights):
        s["weight"] = w / total_w
    elapsed = time.perf_counter() - start
    manifest = {
        "format": FORMAT,
        "request": req.identity(),
        "tokenizer": tok_info,
        "dtype": dtype,
        "sources": sources,
        "fingerprint": _fingerprint(sources, tok_info, dtype),
        "prepared": {
            "seconds": round(elapsed, 3),
            "workers": workers,
            "encode_seconds": round(progress.seconds_done, 3),
            "encoded_text_bytes": progress.text,
            "encoded_shards": len(todo),
            "reused_shards": len(tasks) - len(todo),
        },
    }
    write_json_atomic(req.out / MANIFEST, manifest)
    (req.out / REQUEST).unlink(missing_ok=True)
    progress.summary(manifest, elapsed, workers, req.out)
    return manifest


def remove_dataset(path: Path) -> None:
    """Delete a prepared dataset folder (a run's own cache only)."""
    shutil.rmtree(path, ignore_errors=True)
