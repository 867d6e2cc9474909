"""Tokenizers: the byte tokenizer and the byte-level BPE trained with ``tokenizers``."""

import json
import os
import subprocess
import sys

import pytest
import torch

from oases.train.data import (
    DOC_SEP,
    Corpus,
    list_stdlib_files,
    stream_documents,
    tokenize_corpus,
    tokenize_stream,
)
from oases.train.tokenizer import (
    TOKENIZER_FILE,
    BPETokenizer,
    ByteTokenizer,
    build_tokenizer,
    check_tokenizer_name,
    load_tokenizer,
    save_tokenizer,
    train_bpe,
)

pytest.importorskip("tokenizers")

SAMPLES = [
    "",
    "def f(x):\n    return x ** 2  # square\n",
    "héllo wörld ñ — “quotes” ‘single’ …",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 🙂🚀👩‍👩‍👧 flags 🇫🇷 and combining e\u0301",
    "\t\ttabs\r\nCRLF\n\n\n   trailing spaces   ",
    "control \x01\x02\x1b[31m red \x7f and \x00 nul",
    "".join(chr(c) for c in range(1, 0x250)),
    "\ufeffBOM \u200b zero width \U0010fffd private",
]


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [p.read_text(encoding="utf-8") for p in list_stdlib_files()[:12]]


@pytest.fixture(scope="module")
def bpe(texts) -> BPETokenizer:
    return train_bpe(texts, 600)


def test_training_is_deterministic(texts, bpe):
    again = train_bpe(texts, 600)
    assert again == bpe and again.to_json() == bpe.to_json()
    # a fresh interpreter (other hash seeds) trains the same merges
    code = (
        "import json, sys; from oases.train.tokenizer import train_bpe;"
        "sys.stdout.write(train_bpe(json.load(sys.stdin), 600).to_json())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(texts),
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "123"},
    ).stdout
    assert out == bpe.to_json()


def test_vocab_size_respected(texts, bpe):
    assert bpe.vocab_size == 600
    assert max(max(bpe.encode(t), default=0) for t in texts) < 600
    small = train_bpe(["ab ab ab"], 10_000)  # runs out of pairs: smaller than asked
    assert 256 <= small.vocab_size < 10_000
    with pytest.raises(ValueError, match="data.vocab_size=100 .* at least 256"):
        train_bpe(texts, 100)


def test_bpe_compresses_and_round_trips(texts, bpe):
    for t in texts[:3]:
        ids = bpe.encode(t)
        assert bpe.decode(ids) == t
        assert len(ids) < 0.7 * len(t.encode("utf-8"))  # merges do something
    for s in SAMPLES:
        assert bpe.decode(bpe.encode(s)) == s, repr(s)
        assert ByteTokenizer().decode(ByteTokenizer().encode(s)) == s
    # text made of arbitrary bytes (as Latin-1 code points) and random code points
    g = torch.Generator().manual_seed(0)
    raw = bytes(torch.randint(0, 256, (2000,), generator=g).tolist()).decode("latin-1")
    assert bpe.decode(bpe.encode(raw)) == raw
    cps = torch.randint(1, 0x30000, (500,), generator=g).tolist()
    rnd = "".join(chr(c) for c in cps if not 0xD800 <= c < 0xE000)
    assert bpe.decode(bpe.encode(rnd)) == rnd
    assert bpe.encode_batch(SAMPLES) == [bpe.encode(s) for s in SAMPLES]
    # ids the tokenizer does not know (a padded model vocabulary) are dropped
    assert bpe.decode(bpe.encode("abc") + [bpe.vocab_size, 10**6]) == "abc"


def test_doc_sep_is_one_token(bpe):
    assert bpe.encode("\x00") == [bpe.doc_sep_id]
    assert ByteTokenizer().doc_sep_id == DOC_SEP == 0


def test_save_load(tmp_path, bpe):
    path = save_tokenizer(bpe, tmp_path / "run")
    assert path == tmp_path / "run" / TOKENIZER_FILE and path.is_file()
    for where in (tmp_path / "run", path):
        loaded = load_tokenizer(where)
        assert loaded == bpe and loaded.vocab_size == bpe.vocab_size
        assert loaded.encode(SAMPLES[2]) == bpe.encode(SAMPLES[2])
    assert bpe.save(tmp_path / "x.json") == tmp_path / "x.json"
    assert BPETokenizer.load(tmp_path / "x.json") == bpe
    assert save_tokenizer(ByteTokenizer(), tmp_path / "byte") is None
    # the file is the library's own format
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(path)).encode("def f").ids == bpe.encode("def f")
    with pytest.raises(FileNotFoundError, match="no saved tokenizer"):
        load_tokenizer(tmp_path / "nowhere")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        load_tokenizer(tmp_path / "bad.json")


def test_build_tokenizer(tmp_path, texts, bpe):
    assert isinstance(build_tokenizer("byte"), ByteTokenizer)
    assert build_tokenizer("bpe", train_texts=texts, vocab_size=600) == bpe
    bpe.save(tmp_path)
    # a saved one wins over training (resume); too large for the config is an error
    assert build_tokenizer("bpe", train_texts=["zz"], vocab_size=600, path=tmp_path) == bpe
    with pytest.raises(ValueError, match="600 tokens, more than data.vocab_size=300"):
        build_tokenizer("bpe", vocab_size=300, path=tmp_path)
    with pytest.raises(ValueError, match="needs training texts"):
        build_tokenizer("bpe", vocab_size=600)
    with pytest.raises(ValueError, match="needs data.vocab_size"):
        build_tokenizer("bpe", train_texts=texts)


def test_unknown_tokenizer_name():
    with pytest.raises(ValueError, match=r"data.tokenizer='wordpiece' .*valid: byte, bpe"):
        build_tokenizer("wordpiece")
    with pytest.raises(ValueError, match="needs a path"):
        check_tokenizer_name("hf:")
    check_tokenizer_name("hf:gpt2")  # existence is checked when it is built
    check_tokenizer_name("bpe")


def test_tokenize_corpus(bpe):
    docs = ["def a():\n    pass\n", "x = 'é'\n", "import os\n"]
    stream = torch.frombuffer(
        bytearray(b"\x00".join(d.encode() for d in docs) + b"\x00"), dtype=torch.uint8
    )
    assert stream_documents(stream) == docs
    ids = tokenize_stream(stream, bpe)
    assert ids.dtype == torch.int32
    assert (ids == bpe.doc_sep_id).sum() == 3 and int(ids[-1]) == bpe.doc_sep_id
    assert bpe.decode(ids.tolist()) == "\x00".join(docs) + "\x00"
    corpus = Corpus(stream, stream[:5], ["a"], [])
    assert tokenize_corpus(corpus, ByteTokenizer()) is corpus
    encoded = tokenize_corpus(corpus, bpe)
    assert torch.equal(encoded.train, ids) and encoded.train_files == ["a"]
