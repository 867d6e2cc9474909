"""``oases data``: prepare a corpus into memory-mapped token shards, and inspect one.

    oases data prepare SOURCE [SOURCE ...] --out DIR [--tokenizer byte|bpe|hf:PATH]
                       [--vocab-size N] [--weights W,W,...] [--text-field NAME]
                       [--workers N] [--dtype auto|uint8|uint16|uint32]
                       [--bpe-sample-mb M] [--seed S]
    oases data inspect DIR [--samples N] [--verify]

Wiring only: the work lives in ``oases.data``. ``DATA`` is the subcommand (``oases.cli``
lists it): ``_data_arguments`` adds its two sub-subcommands, ``_data`` runs one (user errors
are ValueErrors: one ``error:`` line).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from oases.cli.command import HelpFormatter, SubCommand

DESCRIPTION = """\
Tokenize text once into DIR: memory-mapped token shards (the smallest of uint8, uint16 and
uint32 that holds the vocabulary), an index of document boundaries, the tokenizer, the
corpus fingerprint and a manifest (dataset.json). Training reads it with
--data.source=DIR: every rank memory-maps the shards and reads only its rows.

SOURCE: stdlib, a file, a folder (every file below it) or a glob; .jsonl (one JSON object a
line, --text-field), .parquet (pyarrow), .gz (gzip'd text or jsonl), a Hugging Face
`datasets` folder (save_to_disk) or hfds:NAME[:SPLIT] from the local cache (datasets).
Several SOURCEs are blended by --weights (default: their sizes). Interrupted, the same
command resumes where it stopped."""


def _data_arguments(data: argparse.ArgumentParser) -> None:
    """``prepare`` and ``inspect`` under ``oases data``, with their arguments."""
    from oases.data.sample import BPE_SAMPLE_BYTES  # numpy: only with its parser

    sub = data.add_subparsers(dest="data_command", required=True)
    prep = sub.add_parser(
        "prepare",
        allow_abbrev=False,
        help="tokenize sources into DIR",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    prep.add_argument("sources", nargs="+", metavar="SOURCE", help="what to tokenize")
    prep.add_argument("--out", required=True, metavar="DIR", help="the dataset folder")
    prep.add_argument(
        "--tokenizer",
        default="byte",
        metavar="byte|bpe|hf:PATH",
        help="bytes, a byte-level BPE trained here, or a tokenizer.json (default: byte)",
    )
    prep.add_argument(
        "--vocab-size", type=int, default=0, metavar="N", help="the BPE's size (bpe; e.g. 4096)"
    )
    prep.add_argument(
        "--weights",
        default=None,
        metavar="W,W,...",
        help="blend weights, one per SOURCE (default: their training tokens)",
    )
    prep.add_argument(
        "--text-field",
        default="text",
        metavar="NAME",
        help="the text field of .jsonl, .parquet and datasets rows (default: text)",
    )
    prep.add_argument(
        "--workers",
        type=int,
        default=0,
        metavar="N",
        help="worker processes (default: one per core; small corpora: this one)",
    )
    prep.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "uint8", "uint16", "uint32"),
        help="token dtype (default: auto, the smallest that holds the vocabulary)",
    )
    prep.add_argument(
        "--bpe-sample-mb",
        type=float,
        default=BPE_SAMPLE_BYTES / 2**20,
        metavar="M",
        help="text the BPE is trained on, at most (default: "
        f"{BPE_SAMPLE_BYTES / 2**20:.0f} MiB; the whole corpus when smaller)",
    )
    prep.add_argument("--seed", type=int, default=0, help="the BPE sample's seed (default: 0)")
    prep.add_argument(
        "--no-progress",
        action="store_true",
        help="progress lines instead of a bar, even on a terminal",
    )
    ins = sub.add_parser(
        "inspect",
        allow_abbrev=False,
        help="what a dataset holds",
        description="Tokens, documents, shards, the tokenizer and a few "
        "decoded samples of a prepared dataset.",
        formatter_class=HelpFormatter,
    )
    ins.add_argument("dir", metavar="DIR")
    ins.add_argument("--samples", type=int, default=3, help="decoded windows (default: 3)")
    ins.add_argument(
        "--verify",
        action="store_true",
        help="read every shard and compare its checksum with the manifest",
    )


def _weights(text: str | None) -> list[float] | None:
    if text is None:
        return None
    try:
        return [float(w) for w in text.split(",")]
    except ValueError:
        raise ValueError(f"--weights={text!r}: expected numbers separated by commas") from None


def _data(ns: argparse.Namespace, overrides: list[str]) -> int:
    """Run ``oases data prepare`` or ``oases data inspect`` (``overrides``: none, ``main``
    refuses them)."""
    if ns.data_command == "inspect":
        from oases.data.inspect import inspect_dataset

        if ns.samples < 0:
            raise ValueError(f"--samples={ns.samples} must be >= 0")
        print(inspect_dataset(ns.dir, ns.samples, ns.verify))
        return 0
    from oases.data.prepare import PrepareRequest, prepare

    if ns.workers < 0:
        raise ValueError(f"--workers={ns.workers} must be >= 0 (0: one per core)")
    if ns.bpe_sample_mb <= 0:
        raise ValueError(f"--bpe-sample-mb={ns.bpe_sample_mb} must be > 0")
    if ns.tokenizer != "bpe" and ns.vocab_size:
        raise ValueError(
            f"--vocab-size={ns.vocab_size} is the size of a trained BPE; "
            f"--tokenizer={ns.tokenizer} has its own"
        )
    req = PrepareRequest(
        list(ns.sources),
        Path(ns.out).expanduser(),
        ns.tokenizer,
        ns.vocab_size,
        _weights(ns.weights),
        ns.text_field,
        ns.dtype,
        int(ns.bpe_sample_mb * 2**20),
        ns.seed,
        ns.workers,
    )
    prepare(req, bar=False if ns.no_progress else None)
    return 0


DATA = SubCommand(
    name="data",
    help="prepare or inspect a tokenized dataset (memory-mapped token shards)",
    description="Prepare or inspect a tokenized dataset: oases data prepare SOURCE ... --out "
    "DIR, then train with --data.source=DIR; oases data inspect DIR.",
    add_arguments=_data_arguments,
    run=_data,
)
