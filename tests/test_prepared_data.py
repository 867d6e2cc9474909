"""Prepared datasets (``oases data prepare``): the same tokens as the in-memory path, exact
resume, disjoint DP rows, blending, resumable preparation and one-line errors for bad inputs.

Everything is small data made in ``tmp_path``; task and block sizes are shrunk so that files
are cut into several shards and blocks (the cuts must not change a token).
"""

import gzip
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from oases.cli import main
from oases.data import formats
from oases.data import plan as plan_mod
from oases.data.dataset import ShardBatches, open_dataset, split_batches
from oases.data.order import WindowPermutation
from oases.data.prepare import PrepareRequest, prepare
from oases.train.data import load_corpus, tokenize_corpus
from oases.train.tokenizer import build_tokenizer, train_bpe

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "délta",
    "εψιλον",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "(x)",
    "=",
    "+",
    "\t",
    "0123",
    "'s",
    "don't",
    "€",
]


def _text(rng: random.Random, lines: int) -> str:
    out = []
    for _ in range(lines):
        indent = " " * rng.choice([0, 0, 4, 8])
        out.append(indent + " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 12))))
    return "\n".join(out) + rng.choice(["", "\n", "\n\n"])


def make_tree(root: Path, n_files: int, seed: int = 0) -> Path:
    """``n_files`` text files, one empty, one with bytes that are not UTF-8, one large."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        path = root / f"doc{i:03d}.txt"
        if i == 3:
            path.write_bytes(b"")
        elif i == 5:
            path.write_bytes(_text(rng, 20).encode() + b"\xff\xfe broken \xc3" + b" end\n")
        else:
            path.write_text(_text(rng, 400 if i == 1 else rng.randint(5, 60)), encoding="utf-8")
    return root


@pytest.fixture
def small_tasks(monkeypatch):
    """Tasks of 4 KB and blocks of 2 KB: files cut into several shards and blocks."""
    monkeypatch.setattr(plan_mod, "MIN_TASK_BYTES", 4096)
    monkeypatch.setattr(plan_mod, "MAX_TASK_BYTES", 4096)
    monkeypatch.setattr(formats, "BLOCK_BYTES", 2048)


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    """A tokenizer.json file (a byte-level BPE with the GPT-2 pre-tokenizer) made here."""
    rng = random.Random(1)
    tok = train_bpe([_text(rng, 50) for _ in range(40)], 600)
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tok.save(path)
    return f"hf:{path}"


def _prepare(src, out, tokenizer="byte", **kw):
    return prepare(
        PrepareRequest([str(s) for s in np.atleast_1d(src)], Path(out), tokenizer, **kw),
        log=open(os.devnull, "w"),
    )


def _in_memory(src, tokenizer):
    tok = build_tokenizer(tokenizer)
    corpus = tokenize_corpus(load_corpus(str(src)), tok)
    return corpus.train.numpy().astype(np.int64), corpus.val.numpy().astype(np.int64)


def _jsonl_tree(root: Path) -> Path:
    rng = random.Random(2)
    root.mkdir()
    rows = [{"text": _text(rng, rng.randint(0, 8)), "id": i} for i in range(300)]
    rows[7]["text"] = ""
    (root / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:200]) + "\n\n")
    (root / "b.jsonl").write_text("\r\n".join(json.dumps(r) for r in rows[200:]))
    (root / "c.txt").write_text(_text(rng, 100))
    (root / "d.jsonl").write_text(json.dumps({"text": ""}) + "\n")  # one empty text: no document
    return root


@pytest.mark.parametrize("tokenizer", ["byte", "hf"])
@pytest.mark.parametrize("corpus", ["by-file", "one-file", "jsonl-tail"])
def test_prepared_tokens_equal_the_in_memory_path(
    tmp_path, small_tasks, hf_tokenizer, tokenizer, corpus
):
    tokenizer = hf_tokenizer if tokenizer == "hf" else tokenizer
    if corpus == "by-file":  # 25 files: every 20th held out
        src = make_tree(tmp_path / "src", 25)
    elif corpus == "one-file":  # the last 5% of one file held out, cut inside it
        src = make_tree(tmp_path / "src", 2) / "doc001.txt"
    else:  # jsonl and text, 4 files: the tail cut falls inside a jsonl file's stream
        src = _jsonl_tree(tmp_path / "src")
    manifest = _prepare(src, tmp_path / "ds", tokenizer)
    ds = open_dataset(tmp_path / "ds")
    train, val = _in_memory(src, tokenizer)
    assert np.array_equal(ds.train[0].read_all(), train)
    assert np.array_equal(ds.val[0].read_all(), val)
    assert len(manifest["sources"][0]["train"]["shards"]) > 2  # really cut into shards
    assert ds.source_fingerprint == load_corpus(str(src)).fingerprint  # checkpoints' as before
    # document ends: just after every separator token
    sep = ds.tokenizer().doc_sep_id
    for shard in manifest["sources"][0]["train"]["shards"]:
        ends = np.fromfile(tmp_path / "ds" / shard["file"].replace(".bin", ".idx"), "<i8")
        toks = np.fromfile(tmp_path / "ds" / shard["file"], ds.train[0].dtype)
        assert np.array_equal(ends, np.flatnonzero(toks == sep) + 1) or tokenizer != "byte"
        assert all(toks[e - 1] == sep for e in ends)


def test_worker_processes_write_the_same_shards(tmp_path, hf_tokenizer):
    src = make_tree(tmp_path / "src", 25)
    one = _prepare(src, tmp_path / "one", hf_tokenizer, workers=1)
    two = _prepare(src, tmp_path / "two", hf_tokenizer, workers=2)
    assert one["fingerprint"] == two["fingerprint"] and two["prepared"]["workers"] == 2


def test_bpe_trains_on_a_bounded_seeded_sample(tmp_path, small_tasks):
    src = make_tree(tmp_path / "src", 25)
    whole = _prepare(src, tmp_path / "whole", "bpe", vocab_size=400)
    corpus = load_corpus(str(src))  # small corpus: the in-memory path's tokenizer
    from oases.train.data import stream_documents

    assert open_dataset(tmp_path / "whole").tokenizer() == train_bpe(
        stream_documents(corpus.train), 400
    )
    assert whole["tokenizer"]["sample_bytes"] == len(corpus.train)
    a = _prepare(src, tmp_path / "a", "bpe", vocab_size=400, bpe_sample_bytes=9000, seed=1)
    b = _prepare(src, tmp_path / "b", "bpe", vocab_size=400, bpe_sample_bytes=9000, seed=1)
    assert a["tokenizer"]["hash"] == b["tokenizer"]["hash"]  # seeded: the same sample
    assert a["tokenizer"]["sample_bytes"] <= 9000
    assert a["tokenizer"]["hash"] != whole["tokenizer"]["hash"]


def _batches(root, seq_len=15, global_batch=4, **kw):
    return split_batches(open_dataset(root), "train", seq_len, global_batch, **kw)


def test_resume_mid_epoch_equals_uninterrupted(tmp_path):
    _prepare(make_tree(tmp_path / "src", 25), tmp_path / "ds")
    full = _batches(tmp_path / "ds", seed=3)
    epoch = full.n_windows // full.global_batch
    assert epoch > 20
    want = [full.next_batch()[0] for _ in range(epoch + 5)]  # into the second epoch
    resumed = _batches(tmp_path / "ds", seed=3)
    resumed.load_state_dict({"position": 11})  # mid-epoch
    for i in range(11, epoch + 5):
        assert torch.equal(resumed.next_batch()[0], want[i])
    assert resumed.state_dict() == {"position": epoch + 5}


def test_training_resumed_mid_epoch_equals_uninterrupted(tmp_path):
    """One rank trains 6 steps on a prepared folder; 3 steps, stop, resume 3: same losses."""
    import io

    from oases.config import load_config
    from oases.train.loop import train

    _prepare(make_tree(tmp_path / "src", 25), tmp_path / "ds")
    tiny = Path(__file__).resolve().parent.parent / "configs" / "tiny.toml"

    def cfg(name, *more):
        return load_config(
            tiny,
            [
                f"--data.source={tmp_path / 'ds'}",
                "--parallel.tp=1",
                f"--train.run_dir={tmp_path / name}",
                "--train.eval_every=0",
                "--checkpoint.every=0",
                "--train.precision=fp64",
                "--train.sample_tokens=0",
                *more,
            ],
        )

    full = train(cfg("full"), log=io.StringIO())
    first = train(cfg("split"), log=io.StringIO(), stop_after=3)
    rest = train(cfg("split", "--checkpoint.resume=auto"), log=io.StringIO())
    assert first["end_step"] == 3 and rest["start_step"] == 3
    torch.testing.assert_close(first["losses"] + rest["losses"], full["losses"], rtol=1e-10, atol=0)
    manifest = json.loads((Path(rest["checkpoint"]) / "oases.json").read_text())
    assert manifest["extras"]["data"] == {"position": 6}
    assert manifest["extras"]["corpus"] == open_dataset(tmp_path / "ds").manifest["fingerprint"]


def test_two_dp_ranks_never_read_the_same_row(tmp_path, monkeypatch):
    _prepare(make_tree(tmp_path / "src", 25), tmp_path / "ds")
    ranks = [_batches(tmp_path / "ds", global_batch=8, dp_rank=r, dp=2, seed=5) for r in (0, 1)]
    n = ranks[0].n_windows
    read: dict[int, list[int]] = {0: [], 1: []}
    for r, batches in enumerate(ranks):  # record every window a rank reads from the shards
        stream = batches.streams[0]

        def spy(start, length, _r=r, _read=stream.read):
            read[_r].append(start // 16)
            return _read(start, length)

        monkeypatch.setattr(stream, "read", spy)
        for i in range(n // 8):  # one epoch of whole batches
            batches.batch(i)
    assert len(read[0]) == len(read[1]) == (n // 8) * 4
    assert not set(read[0]) & set(read[1])  # never the same row
    assert len(set(read[0])) == len(read[0])  # and no row twice within the epoch
    assert read[0] + read[1] != list(range(len(read[0]) * 2))  # shuffled


def test_window_permutation_is_a_seeded_bijection():
    for n in (1, 2, 7, 64, 1000, 4099):
        p = WindowPermutation(n, 0, 0)(np.arange(n))
        assert sorted(p) == list(range(n))
    a = WindowPermutation(1000, 0, 0)(np.arange(1000))
    assert not np.array_equal(a, WindowPermutation(1000, 0, 1)(np.arange(1000)))
    assert not np.array_equal(a, WindowPermutation(1000, 1, 0)(np.arange(1000)))
    assert np.array_equal(a, WindowPermutation(1000, 0, 0)(np.arange(1000)))
    with pytest.raises(IndexError):
        WindowPermutation(10, 0, 0)(np.array([10]))


def test_blend_weights_hold_within_one_percent(tmp_path):
    srcs = [make_tree(tmp_path / f"s{i}", 21, seed=i) for i in range(3)]
    (srcs[2] / "doc000.txt").write_text("short " * 50)
    manifest = _prepare(srcs, tmp_path / "ds", weights=[5, 3, 2])
    assert [s["weight"] for s in manifest["sources"]] == pytest.approx([0.5, 0.3, 0.2])
    batches = _batches(tmp_path / "ds")
    source, window = batches.sample_windows(np.arange(10_000))
    share = np.bincount(source, minlength=3) / 10_000
    assert np.abs(share - [0.5, 0.3, 0.2]).max() <= 0.01
    for c in range(3):  # within an epoch of a source, no window twice
        w = window[source == c][: batches.windows[c]]
        assert len(set(w.tolist())) == len(w)
    default = _prepare(srcs, tmp_path / "ds2")  # no weights: each source's size
    tokens = [s["train"]["tokens"] for s in default["sources"]]
    assert [s["weight"] for s in default["sources"]] == pytest.approx(
        [t / sum(tokens) for t in tokens]
    )


# ---------------------------------------------------------------- resumable preparation


def test_an_interrupted_preparation_resumes_and_keeps_finished_shards(tmp_path, small_tasks):
    src = make_tree(tmp_path / "src", 25)
    rows = [json.dumps({"text": f"row {i} " * 20}) for i in range(100)]
    good = "\n".join(rows).encode()
    rows[60] = '{"body": "no text field"}'
    (src / "doc021.jsonl").write_text("\n".join(rows))  # a late file: earlier shards finish
    with pytest.raises(
        ValueError,
        match=r"doc021\.jsonl:61: expected an object with a string "
        "'text'",
    ):
        _prepare(src, tmp_path / "ds")
    finished = sorted((tmp_path / "ds").glob("source-0/*.json"))
    assert finished and not (tmp_path / "ds" / "dataset.json").exists()
    with pytest.raises(ValueError, match="did not finish"):
        open_dataset(tmp_path / "ds")
    kept = {p: p.stat().st_mtime_ns for p in (tmp_path / "ds").glob("source-0/train-0000[01].*")}
    (src / "doc021.jsonl").write_bytes(good)  # fixed: the same command resumes
    manifest = _prepare(src, tmp_path / "ds")
    assert manifest["prepared"]["reused_shards"] >= len(kept) // 3 == 2  # not encoded again
    assert kept == {p: p.stat().st_mtime_ns for p in kept}
    clean = _prepare(src, tmp_path / "clean")
    assert manifest["fingerprint"] == clean["fingerprint"]
    again = _prepare(src, tmp_path / "ds")  # finished: nothing to do
    assert again == manifest
    inside = _prepare(src, src / "prepared")  # DIR inside SOURCE: its own files left out
    assert inside["fingerprint"] == _prepare(src, src / "prepared")["fingerprint"]
    assert inside["sources"][0]["fingerprint"] == clean["sources"][0]["fingerprint"]
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "ds").rglob("*")}
    with pytest.raises(ValueError, match="already holds a prepared dataset"):
        _prepare(src, tmp_path / "ds", "bpe", vocab_size=300)
    assert before == {p: p.stat().st_mtime_ns for p in (tmp_path / "ds").rglob("*")}


# ---------------------------------------------------------------- bad inputs: one line each


def _one_line(excinfo, *names):
    msg = str(excinfo.value)
    assert "\n" not in msg and all(str(n) in msg for n in names), msg


def test_unreadable_files_are_one_line_errors(tmp_path, monkeypatch):
    bad = tmp_path / "src" / "notes.txt.gz"
    make_tree(tmp_path / "src", 3)
    bad.write_bytes(b"this is not gzip")
    with pytest.raises(ValueError, match="not a valid gzip file") as e:
        _prepare(tmp_path / "src", tmp_path / "ds")
    _one_line(e, bad)
    bad.write_bytes(gzip.compress(b"fine text\n"))
    target = str(tmp_path / "src" / "doc001.txt")
    real_open = open

    def failing_open(path, *a, **kw):
        if str(path) == target:
            raise PermissionError(13, "Permission denied", target)
        return real_open(path, *a, **kw)

    monkeypatch.setattr(formats, "open", failing_open, raising=False)
    with pytest.raises(ValueError, match="cannot read .Permission denied") as e:
        _prepare(tmp_path / "src", tmp_path / "ds2")
    _one_line(e, target)


def test_empty_corpus_and_missing_field_are_one_line_errors(tmp_path, small_tasks):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    with pytest.raises(ValueError, match="the data is empty") as e:
        _prepare(tmp_path / "empty", tmp_path / "ds")
    _one_line(e, tmp_path / "empty")
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n  \n")
    with pytest.raises(ValueError, match="the data is empty") as e:
        _prepare(blank, tmp_path / "ds2")
    _one_line(e, blank)
    rows = tmp_path / "rows.jsonl"  # the missing field far into the file: its own shard
    rows.write_text(
        "".join(json.dumps({"body": "x " * 50}) + "\n" for _ in range(400))
        + '{"text": "no body"}\n'
    )
    with pytest.raises(ValueError, match="expected an object with a string 'body'") as e:
        _prepare(rows, tmp_path / "ds3", text_field="body")
    _one_line(e, f"{rows}:401:")


def test_vocabulary_too_large_for_the_dtype(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(70_000)} | {"[UNK]": 70_000}
    lib = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    lib.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "big" / "tokenizer.json"
    path.parent.mkdir()
    lib.save(str(path))
    make_tree(tmp_path / "src", 2)
    with pytest.raises(ValueError, match="70001 tokens, more than uint16 holds .65536") as e:
        _prepare(tmp_path / "src", tmp_path / "ds", f"hf:{path}", dtype="uint16")
    _one_line(e, path)
    manifest = _prepare(tmp_path / "src", tmp_path / "ds2", f"hf:{path}")  # auto: uint32
    assert manifest["dtype"] == "uint32"


def test_truncated_or_changed_shards_are_one_line_errors(tmp_path):
    _prepare(make_tree(tmp_path / "src", 25), tmp_path / "ds")
    shard = sorted((tmp_path / "ds").glob("source-0/train-*.bin"))[0]
    raw = shard.read_bytes()
    shard.write_bytes(raw[:-7])
    with pytest.raises(ValueError, match="truncated or changed since it was prepared") as e:
        open_dataset(tmp_path / "ds")
    _one_line(e, shard)
    shard.write_bytes(b"Z" + raw[1:])  # same size, first byte changed
    with pytest.raises(ValueError, match="content changed") as e:
        open_dataset(tmp_path / "ds")
    _one_line(e, shard)
    mid = len(raw) // 2  # a change in the middle: found by --verify
    shard.write_bytes(raw[:mid] + bytes([raw[mid] ^ 1]) + raw[mid + 1 :])
    if len(raw) > 4 * 65536:
        open_dataset(tmp_path / "ds")
    with pytest.raises(ValueError, match="content changed"):
        open_dataset(tmp_path / "ds", verify=True)
    shard.unlink()
    with pytest.raises(ValueError, match="missing") as e:
        open_dataset(tmp_path / "ds")
    _one_line(e, shard)


def test_parquet_source(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rng = random.Random(4)
    texts = [_text(rng, rng.randint(1, 5)) for _ in range(500)]
    pq.write_table(
        pa.table({"text": texts, "n": list(range(500))}), tmp_path / "a.parquet", row_group_size=64
    )
    manifest = _prepare(tmp_path / "a.parquet", tmp_path / "ds")
    ds = open_dataset(tmp_path / "ds")
    stream = b"".join(t.encode() + b"\0" for t in texts)
    cut = len(stream) - len(stream) // 20
    assert bytes(ds.train[0].read_all().astype(np.uint8)) == stream[:cut]
    assert bytes(ds.val[0].read_all().astype(np.uint8)) == stream[cut:]
    assert manifest["sources"][0]["train"]["documents"] >= 470
    pq.write_table(pa.table({"text": ["a", None]}), tmp_path / "null.parquet")
    with pytest.raises(ValueError, match=r"null.parquet: row 1: the 'text' field is null"):
        _prepare(tmp_path / "null.parquet", tmp_path / "ds2")


def test_saved_hf_dataset_source(tmp_path):
    datasets = pytest.importorskip("datasets")
    rng = random.Random(5)
    texts = [_text(rng, rng.randint(1, 5)) for _ in range(300)]
    datasets.Dataset.from_dict({"content": texts}).save_to_disk(str(tmp_path / "hfds"))
    _prepare(tmp_path / "hfds", tmp_path / "ds", text_field="content")
    ds = open_dataset(tmp_path / "ds")
    stream = b"".join(t.encode() + b"\0" for t in texts)
    got = np.concatenate([ds.train[0].read_all(), ds.val[0].read_all()])
    assert bytes(got.astype(np.uint8)) == stream
    folder = tmp_path / "jsonl"  # hfds:NAME goes through load_dataset (offline, the cache)
    folder.mkdir()
    (folder / "part.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    _prepare(f"hfds:{folder}", tmp_path / "ds2")
    assert open_dataset(tmp_path / "ds2").fingerprint.files == 1
    got = np.concatenate(
        [
            open_dataset(tmp_path / "ds2").train[0].read_all(),
            open_dataset(tmp_path / "ds2").val[0].read_all(),
        ]
    )
    assert bytes(got.astype(np.uint8)) == stream


def test_cli_prepare_and_inspect(tmp_path, capsys):
    src = make_tree(tmp_path / "src", 25)
    out = tmp_path / "ds"
    assert main(["data", "prepare", str(src), "--out", str(out), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "MB/s with 1 worker" in err and "M tokens (uint8)" in err
    assert main(["data", "inspect", str(out), "--samples", "2", "--verify"]) == 0
    text = capsys.readouterr().out
    assert "tokenizer: byte, 256 tokens" in text and "sample 2" in text and "verified" in text
    assert main(["data", "prepare", str(src), "--out", str(out) + "2", "--tokenizer", "bpe"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "--vocab-size" in err
    assert main(["data", "inspect", str(tmp_path / "src")]) == 2
    assert "not a prepared dataset" in capsys.readouterr().err


def test_run_prepares_the_embedded_default_once_and_checks_a_folder(tmp_path):
    from oases.config import load_config
    from oases.train.run_data import data_fingerprint, open_run_data

    cfg = load_config(None, [f"--train.run_dir={tmp_path / 'run'}"])
    fp = data_fingerprint(cfg)
    assert fp == load_corpus("stdlib").fingerprint  # as checkpoints recorded it before
    data = open_run_data(cfg, fp)
    assert data.prepared_into == tmp_path / "run" / "data" and data.fingerprint == fp
    stamp = (tmp_path / "run" / "data" / "dataset.json").stat().st_mtime_ns
    again = open_run_data(cfg, fp)  # prepared once
    assert (tmp_path / "run" / "data" / "dataset.json").stat().st_mtime_ns == stamp
    corpus = load_corpus("stdlib")
    assert np.array_equal(again.dataset.train[0].read_all(), corpus.train.numpy())
    _prepare(make_tree(tmp_path / "src", 25), tmp_path / "bpe", "bpe", vocab_size=300)
    bad = load_config(None, [f"--data.source={tmp_path / 'bpe'}"])
    with pytest.raises(ValueError, match="--data.tokenizer=bpe --data.vocab_size=300"):
        open_run_data(bad, data_fingerprint(bad))
    assert isinstance(
        split_batches(
            open_run_data(
                load_config(
                    None,
                    [
                        f"--data.source={tmp_path / 'bpe'}",
                        "--data.tokenizer=bpe",
                        "--data.vocab_size=300",
                    ],
                ),
                fp,
            ).dataset,
            "val",
            8,
            2,
        ),
        ShardBatches,
    )
