"""A run's data: a prepared dataset, or its source prepared on the fly into the run directory.

``data.source`` is either a folder of ``oases data prepare`` (a ``dataset.json`` in it) or a
source the in-memory path reads (``stdlib``, a file, a folder or a glob). Order of operations,
on every rank, after a resumed run's checkpoint has been checked (nothing is written before)::

    data_fingerprint(cfg)   what checkpoints record and a resume compares: the dataset's
                            fingerprint (shards and tokenizer) for a prepared folder; for a
                            source, its files' fingerprint as the in-memory path computes it
                            (names and sizes), so older checkpoints still resume
    open_run_data(cfg, ..)  prepared folder: opened (sizes and quick checksums of the shards),
                            its tokenizer checked against data.tokenizer / data.vocab_size;
                            source: prepared once into <run_dir>/data (``RUN_DATA``) under a
                            file lock (the first rank prepares, the others wait and open it);
                            a cache of another source or settings, or of changed files, is
                            prepared again. A resumed BPE run whose cache is gone prepares it
                            with the checkpoint's tokenizer.json, not a new one.

The shards hold exactly the token stream the in-memory path builds (``data.encode``), so a
source trains on the same tokens as before; the order of windows is ``data.order``'s
permutation, computed per batch.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from oases.config import Config
from oases.data.dataset import PreparedDataset, is_prepared, open_dataset
from oases.data.files import Fingerprint
from oases.data.plan import plan_source
from oases.data.prepare import MANIFEST, PrepareRequest, prepare, remove_dataset
from oases.train.tokenizer import TOKENIZER_FILE, Tokenizer

RUN_DATA = "data"
LOCK = ".data.lock"


@dataclass
class RunData:
    """The opened dataset, the fingerprint checkpoints record and the run's tokenizer."""

    dataset: PreparedDataset
    fingerprint: Fingerprint
    tokenizer: Tokenizer
    prepared_into: Path | None  # the run's own cache (a source), None for a prepared folder


def data_fingerprint(cfg: Config) -> Fingerprint:
    """The fingerprint of ``data.source`` (module docstring); cheap: a manifest read, or one
    ``stat`` per file (the stdlib's files are read once to skip those that are not UTF-8)."""
    if is_prepared(cfg.data.source):
        return open_dataset(cfg.data.source).fingerprint
    return plan_source(cfg.data.source, exclude=Path(cfg.train.run_dir) / RUN_DATA).fingerprint


def _request(cfg: Config, out: Path, resume_from: Path | None) -> PrepareRequest:
    given = None
    if (
        cfg.data.tokenizer == "bpe"
        and resume_from is not None
        and (resume_from / TOKENIZER_FILE).is_file()
    ):
        from oases.train.tokenizer import BPETokenizer

        given = BPETokenizer.load(resume_from)
    vocab = (cfg.data.vocab_size or cfg.model.vocab_size) if cfg.data.tokenizer == "bpe" else 0
    return PrepareRequest([cfg.data.source], out, cfg.data.tokenizer, vocab, given_tokenizer=given)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"train.run_dir: cannot create {path.parent} ({exc.strerror})") from None
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # released when the file closes
        yield


def _cache_is_stale(req: PrepareRequest, fingerprint: Fingerprint) -> bool:
    """Whether ``req.out`` holds another request's or older files' dataset (or an unfinished
    preparation of another request)."""
    from oases.data.prepare import REQUEST, _read_json

    manifest = _read_json(req.out / MANIFEST)
    if manifest is not None:
        return (
            manifest.get("request") != req.identity()
            or manifest["sources"][0]["fingerprint"] != fingerprint.to_dict()
        )
    request = _read_json(req.out / REQUEST)
    return request is not None and request != req.identity()


def check_tokenizer(cfg: Config, ds: PreparedDataset, tok: Tokenizer) -> None:
    """ValueError unless the run's data.tokenizer (and a BPE's data.vocab_size) is the one the
    dataset was prepared with, and the model's vocabulary holds it."""
    info, where = ds.manifest["tokenizer"], f"data.source={cfg.data.source!r}"
    want = info["spec"] if info["name"] != "bpe" else "bpe"
    flags = f"--data.tokenizer={want}" + (
        f" --data.vocab_size={info['requested_vocab']}" if info["name"] == "bpe" else ""
    )
    same = {
        "byte": cfg.data.tokenizer == "byte",
        "bpe": cfg.data.tokenizer == "bpe"
        and (cfg.data.vocab_size or cfg.model.vocab_size) == info.get("requested_vocab"),
        "hf": cfg.data.tokenizer.startswith("hf:"),
    }[info["name"]]
    if same and info["name"] == "hf":
        from oases.train.tokenizer import HFTokenizer

        same = HFTokenizer.load(cfg.data.tokenizer[3:]).to_json() == tok.to_json()
    if not same:
        raise ValueError(
            f"{where} was prepared with the {info['name']} tokenizer "
            f"({info['spec']}, {info['vocab_size']} tokens), not "
            f"data.tokenizer={cfg.data.tokenizer!r}: train with {flags}"
        )
    if cfg.model.vocab_size < tok.vocab_size:
        raise ValueError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the "
            f"{info['name']} tokenizer's vocabulary of {tok.vocab_size} ({where})"
        )


def open_run_data(
    cfg: Config, fingerprint: Fingerprint, resume_from: Path | None = None, log: Any = None
) -> RunData:
    """The run's dataset (module docstring); ``fingerprint`` from ``data_fingerprint``.
    Preparation lines go to ``log`` (default: nowhere)."""
    if is_prepared(cfg.data.source):
        ds = open_dataset(cfg.data.source)
        tok = ds.tokenizer()
        check_tokenizer(cfg, ds, tok)
        return RunData(ds, ds.fingerprint, tok, None)
    run_dir = Path(cfg.train.run_dir)
    req = _request(cfg, run_dir / RUN_DATA, resume_from)
    with _locked(run_dir / LOCK):
        if _cache_is_stale(req, fingerprint):
            remove_dataset(req.out)
        if not (req.out / MANIFEST).is_file():
            prepare(req, log=log or io.StringIO(), bar=False, quiet=True)
    ds = open_dataset(req.out)
    tok = ds.tokenizer()
    check_tokenizer(cfg, ds, tok)
    return RunData(ds, fingerprint, tok, req.out)


def default_log(is_main: bool, stream: TextIO | None = None) -> TextIO:
    """Where a rank's preparation lines go: rank 0's ``stream`` (the run's own lines:
    ``Console.stream``, stdout or ``train(log=...)``; stderr keeps only warnings and errors),
    the others' nowhere."""
    if not is_main:
        return io.StringIO()
    return sys.stdout if stream is None else stream
