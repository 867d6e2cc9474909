"""Training data: the embedded corpus, user files, the byte tokenizer, DP-sharded batches of
windows (``ShardBatches`` over a token stream in memory)."""

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from oases.data.dataset import ShardBatches
from oases.train.data import (
    DOC_SEP,
    STDLIB_CAP_BYTES,
    VAL_EVERY,
    ByteTokenizer,
    check_source,
    list_stdlib_files,
    load_corpus,
    resolve_source,
)


class _ArrayStream:
    """A token stream held in memory, read as ``data.shards.TokenStream`` is."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def read(self, start: int, length: int) -> np.ndarray:
        return self.tokens[start : start + length].astype(np.int64)


def _batches(n: int, seq_len: int, global_batch: int, **kw) -> ShardBatches:
    stream = _ArrayStream((np.arange(n) % 251).astype(np.uint8))
    return ShardBatches([stream], [1.0], seq_len, global_batch, **kw)


def test_windows_are_shifted_token_target_pairs():
    data = _batches(1000, seq_len=8, global_batch=4, seed=0)
    tokens, targets = data.next_batch()
    assert tokens.shape == targets.shape == (4, 8) and tokens.dtype == torch.int64
    assert torch.equal(tokens[:, 1:], targets[:, :-1])
    assert data.position == 1


def test_order_is_deterministic_from_seed():
    a = _batches(5000, seq_len=16, global_batch=8, seed=3)
    b = _batches(5000, seq_len=16, global_batch=8, seed=3)
    c = _batches(5000, seq_len=16, global_batch=8, seed=4)
    for _ in range(5):
        (ta, _), (tb, _), (tc, _) = a.next_batch(), b.next_batch(), c.next_batch()
        assert torch.equal(ta, tb)
    assert not torch.equal(ta, tc)
    # batch(i) is a pure function: resuming from a saved position gives the same batches
    d = _batches(5000, seq_len=16, global_batch=8, seed=3)
    d.load_state_dict({"position": 2})
    assert d.state_dict() == {"position": 2}
    assert torch.equal(d.next_batch()[0], a.batch(2)[0])


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_dp_shards_are_disjoint_contiguous_and_cover_an_epoch(dp):
    S, G = 16, 8  # 40 windows of 17 tokens: 5 global batches
    full = _batches(17 * 40, S, G, seed=1)
    shards = [_batches(17 * 40, S, G, dp_rank=r, dp=dp, seed=1) for r in range(dp)]
    seen = []
    for i in range(full.n_windows // G):
        ids = [shard.window_ids(i) for shard in shards]
        assert all(len(x) == G // dp for x in ids)
        assert sum(ids, []) == full.window_ids(i)  # rank r holds rows [r*B, (r+1)*B)
        tokens = torch.cat([shard.batch(i)[0] for shard in shards])
        assert torch.equal(tokens, full.batch(i)[0])
        seen += sum(ids, [])
    assert sorted(seen) == list(range(full.n_windows))  # one epoch: every window exactly once


def test_epochs_reshuffle_and_keep_going():
    data = _batches(17 * 6, 16, 4, seed=0)  # 6 windows, batches wrap epochs
    ids = [data.window_ids(i) for i in range(3)]
    flat = sum(ids, [])
    assert sorted(flat[:6]) == list(range(6)) and sorted(flat[6:12]) == list(range(6))
    assert flat[:6] != flat[6:12]  # each epoch its own order


def test_validation_windows_come_in_stream_order():
    data = _batches(17 * 6, 16, 2, shuffle=False)
    assert [data.window_ids(i) for i in range(4)] == [[0, 1], [2, 3], [4, 5], [0, 1]]


def test_bad_batch_arguments():
    with pytest.raises(ValueError, match="global_batch=6 is not divisible by dp=4"):
        _batches(1000, 8, 6, dp_rank=0, dp=4)
    with pytest.raises(ValueError, match="10 tokens, fewer than one window.*= 17"):
        _batches(10, 16, 4)


def test_stdlib_corpus_files_and_split():
    files = list_stdlib_files()
    assert files == list_stdlib_files() == sorted(files)  # deterministic
    root = Path(sysconfig.get_paths()["stdlib"])
    assert files and sum(f.stat().st_size for f in files) <= STDLIB_CAP_BYTES
    for f in files:
        parts = f.relative_to(root).parts
        assert f.suffix == ".py"
        assert not {"site-packages", "dist-packages", "test", "tests"} & set(parts[:-1])
    corpus = load_corpus("stdlib")
    assert corpus.val_files and not set(corpus.val_files) & set(corpus.train_files)
    all_files = sorted(corpus.train_files + corpus.val_files)
    assert corpus.val_files == all_files[VAL_EVERY - 1 :: VAL_EVERY]  # every 20th file
    assert len(corpus.train) > 1_000_000 and len(corpus.val) > 10_000
    text = bytes(corpus.train[:200_000].tolist()).decode("utf-8")
    assert "def " in text and "import " in text


def test_user_text_files_split_by_file(tmp_path):
    for i in range(25):
        (tmp_path / f"doc{i:02d}.txt").write_text(f"document number {i}\n" * 3)
    corpus = load_corpus(str(tmp_path))  # a directory: every file below it
    assert [Path(f).name for f in corpus.val_files] == ["doc19.txt"]
    assert b"document number 19" in bytes(corpus.val.tolist())
    assert b"document number 19" not in bytes(corpus.train.tolist())
    glob_corpus = load_corpus(str(tmp_path / "doc1*.txt"))
    assert len(glob_corpus.train_files) == 10 and not glob_corpus.val_files
    assert resolve_source(str(tmp_path / "doc00.txt")) == [tmp_path / "doc00.txt"]


def test_single_file_holds_out_its_tail(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("".join(f"line {i}\n" for i in range(1000)))
    corpus = load_corpus(str(path))
    stream = corpus.train.tolist() + corpus.val.tolist()
    assert bytes(stream) == path.read_bytes() + bytes([DOC_SEP])
    assert len(corpus.val) == len(stream) // VAL_EVERY


def test_jsonl_text_field(tmp_path):
    path = tmp_path / "data.jsonl"
    rows = [{"text": "first doc"}, {"text": "second doc", "id": 2}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    corpus = load_corpus(str(path))
    stream = bytes(corpus.train.tolist() + corpus.val.tolist())
    assert stream == b"first doc\x00second doc\x00"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*\"text\""):
        load_corpus(str(bad))


def test_missing_and_empty_sources_are_one_line_errors(tmp_path):
    missing = str(tmp_path / "nope" / "*.txt")
    for fn in (check_source, load_corpus):
        with pytest.raises(ValueError, match="no such file, or no files match") as info:
            fn(missing)
        assert missing in str(info.value) and "\n" not in str(info.value)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    for fn in (check_source, load_corpus):
        with pytest.raises(ValueError, match="empty"):
            fn(str(empty))
    assert isinstance(ByteTokenizer().encode(""), list)
