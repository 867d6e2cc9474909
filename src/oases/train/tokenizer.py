"""Tokenizers: raw UTF-8 bytes (``byte``, the default) and a byte-level BPE (``bpe``).

``bpe`` is trained with the Hugging Face ``tokenizers`` library on the training split: the
GPT-2 byte-level pre-tokenizer maps every byte to one of 256 printable characters, all 256 are in
the initial alphabet, and the byte-level decoder maps them back, so any text round-trips exactly
and no token is ever unknown. Training is deterministic: the same texts and ``vocab_size`` give
the same merges and ids (ties between equally frequent pairs are broken by pair ids, not by
hash order). A trained tokenizer is saved as ``tokenizer.json`` (the library's own format, so
``tokenizers.Tokenizer.from_file`` reads it too) in the run directory and with checkpoints.

``doc_sep_id`` is the id of the text ``"\\x00"`` (``data.DOC_SEP``, absent from real text) in
both tokenizers: the token that separates documents in a packed stream.

``hf:PATH`` reads an existing Hugging Face tokenizer, ``PATH/tokenizer.json`` (or PATH itself when
it is a ``.json`` file), with ``tokenizers.Tokenizer.from_file``: no training, and its ids are the
model's (for ``model.init_from = "hf:PATH"``). Its ``doc_sep_id`` is the end-of-text token: the
``eos_token`` of ``PATH/tokenizer_config.json``, else its ``bos_token``, else the first of
``<|endoftext|>``, ``</s>``, ``<|end_of_text|>``, ``<eos>``, ``<s>`` in the vocabulary, else 0.

``tokenizers`` is imported inside the functions that need it, so ``import oases`` stays light.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

TOKENIZERS = ("byte", "bpe")
TOKENIZER_FILE = "tokenizer.json"
DOC_SEP_TEXT = "\x00"
BYTE_VOCAB = 256


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, no training, lossless."""

    name = "byte"
    vocab_size = BYTE_VOCAB
    doc_sep_id = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes -> text; ids outside [0, 256) are dropped, broken UTF-8 becomes U+FFFD."""
        return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")


class BPETokenizer:
    """A byte-level BPE: a thin wrapper of a ``tokenizers.Tokenizer`` (see ``train_bpe``)."""

    name = "bpe"

    def __init__(self, tokenizer: Any) -> None:  # tokenizers.Tokenizer, imported lazily
        self.tokenizer = tokenizer
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.doc_sep_id: int = self.encode(DOC_SEP_TEXT)[0]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many texts at once (in parallel inside the library)."""
        encs = self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [e.ids for e in encs]

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text; ids outside [0, vocab_size) are dropped (a model's vocabulary may be
        larger than the tokenizer's), a cut multi-byte character becomes U+FFFD."""
        kept = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        return self.tokenizer.decode(kept, skip_special_tokens=False)

    def to_json(self) -> str:
        """The tokenizer in the library's ``tokenizer.json`` format (canonical, so two equal
        tokenizers give equal strings)."""
        return self.tokenizer.to_str(pretty=False)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BPETokenizer) and self.to_json() == other.to_json()

    def __hash__(self) -> int:
        return hash(self.to_json())

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write ``tokenizer.json``: to ``path`` if it ends in ``.json``, else into the directory
        ``path`` (created). Atomic (write then rename). Returns the file written."""
        p = Path(path)
        if p.suffix != ".json":
            p.mkdir(parents=True, exist_ok=True)
            p = p / TOKENIZER_FILE
        else:
            p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".part")
        tmp.write_text(self.to_json(), encoding="utf-8")
        os.replace(tmp, p)
        return p

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> BPETokenizer:
        """Read a ``tokenizer.json`` (a file, or a directory holding one)."""
        from tokenizers import Tokenizer

        p = _tokenizer_file(path)
        try:
            return cls(Tokenizer.from_str(p.read_text(encoding="utf-8")))
        except Exception as exc:  # the library raises its own exception type
            raise ValueError(f"{p}: not a valid tokenizer.json ({exc})") from None


def _tokenizer_file(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / TOKENIZER_FILE
    if not p.is_file():
        raise FileNotFoundError(f"no saved tokenizer at {p}")
    return p


def train_bpe(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2) -> BPETokenizer:
    """Train a byte-level BPE of at most ``vocab_size`` tokens (256 bytes + merges) on ``texts``.

    Deterministic: the same texts in the same order give the same tokenizer. The vocabulary can
    come out smaller than ``vocab_size`` when the texts run out of pairs seen ``min_frequency``
    times; ``BPETokenizer.vocab_size`` is the real size.
    """
    if not isinstance(vocab_size, int) or vocab_size < BYTE_VOCAB:
        raise ValueError(
            f"data.vocab_size={vocab_size} must be an integer of at least {BYTE_VOCAB}"
            " (the byte alphabet) for the bpe tokenizer"
        )
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(iter(texts), trainer=trainer)
    return BPETokenizer(tok)


HF_PREFIX = "hf:"
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<s>")


class HFTokenizer(BPETokenizer):
    """A Hugging Face ``tokenizer.json`` used as it is (``data.tokenizer = "hf:PATH"``).

    Same interface as ``BPETokenizer``; ``doc_sep_id`` is the end-of-text token (module
    docstring), not the id of ``"\\x00"``, and ``encode`` adds no special tokens."""

    name = "hf"

    def __init__(self, tokenizer: Any, doc_sep_id: int = 0) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.doc_sep_id = doc_sep_id

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HFTokenizer) and self.to_json() == other.to_json()

    def __hash__(self) -> int:
        return hash(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> HFTokenizer:
        """Read ``PATH/tokenizer.json`` (or a ``.json`` file); ValueError naming what is missing."""
        from tokenizers import Tokenizer

        p = Path(path)
        file = p if p.suffix == ".json" else p / TOKENIZER_FILE
        if not file.is_file():
            raise ValueError(f"data.tokenizer='hf:{path}': missing {file}")
        try:
            tok = Tokenizer.from_file(str(file))
        except Exception as exc:  # the library raises its own exception type
            raise ValueError(f"{file}: not a valid tokenizer.json ({exc})") from None
        return cls(tok, _end_of_text_id(tok, file.parent / "tokenizer_config.json"))


def _end_of_text_id(tok: Any, config_file: Path) -> int:
    """The eos (else bos) token of tokenizer_config.json, else a usual end-of-text name, else 0."""
    names: list[str] = []
    if config_file.is_file():
        import json

        conf = json.loads(config_file.read_text(encoding="utf-8"))
        for key in ("eos_token", "bos_token"):
            value = conf.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                names.append(value)
    for name in (*names, *EOS_CANDIDATES):
        token_id = tok.token_to_id(name)
        if token_id is not None:
            return int(token_id)
    return 0


Tokenizer = ByteTokenizer | BPETokenizer | HFTokenizer


def check_tokenizer_name(name: str) -> None:
    """ValueError unless ``name`` is a tokenizer this version can build (no training, no I/O):
    ``byte``, ``bpe`` or ``hf:PATH``."""
    if name.startswith(HF_PREFIX):
        if not name[len(HF_PREFIX) :]:
            raise ValueError(f"data.tokenizer={name!r} needs a path: hf:PATH")
        return
    if name not in TOKENIZERS:
        raise ValueError(
            f"data.tokenizer={name!r} is not supported; valid: {', '.join(TOKENIZERS)}, hf:PATH"
        )


def build_tokenizer(
    name: str,
    train_texts: Iterable[str] | None = None,
    vocab_size: int | None = None,
    path: str | os.PathLike[str] | None = None,
) -> Tokenizer:
    """The tokenizer called ``name`` (``"byte"``, ``"bpe"`` or ``"hf:PATH"``).

    ``hf:PATH``: ``PATH/tokenizer.json`` as it is; larger than ``vocab_size`` is an error.

    ``bpe``: loaded from ``path`` (a ``tokenizer.json`` or a directory holding one) when one is
    there, else trained on ``train_texts`` with ``vocab_size``. A loaded tokenizer larger than
    ``vocab_size`` is an error. ``byte`` ignores the other arguments.
    """
    check_tokenizer_name(name)
    if name == "byte":
        return ByteTokenizer()
    if name.startswith(HF_PREFIX):
        hf_tok = HFTokenizer.load(name[len(HF_PREFIX) :])
        if vocab_size is not None and hf_tok.vocab_size > vocab_size:
            raise ValueError(
                f"data.tokenizer={name!r} has {hf_tok.vocab_size} tokens, more "
                f"than the model's vocab_size={vocab_size}"
            )
        return hf_tok
    if path is not None and (Path(path).is_file() or (Path(path) / TOKENIZER_FILE).is_file()):
        tok = BPETokenizer.load(path)
        if vocab_size is not None and tok.vocab_size > vocab_size:
            raise ValueError(
                f"the tokenizer saved at {path} has {tok.vocab_size} tokens, more than"
                f" data.vocab_size={vocab_size}"
            )
        return tok
    if train_texts is None:
        where = f" and none is saved at {path}" if path is not None else ""
        raise ValueError(
            f"data.tokenizer={name!r} needs training texts{where} (tokenizers valid: "
            f"{', '.join(TOKENIZERS)})"
        )
    if vocab_size is None:
        raise ValueError("data.tokenizer='bpe' needs data.vocab_size")
    return train_bpe(train_texts, vocab_size)


def save_tokenizer(tok: Tokenizer, directory: str | os.PathLike[str]) -> Path | None:
    """Save ``tok`` into ``directory`` as ``tokenizer.json``; the byte tokenizer has nothing to
    save (returns None)."""
    if isinstance(tok, BPETokenizer):
        return tok.save(directory)
    return None


def load_tokenizer(path: str | os.PathLike[str]) -> BPETokenizer:
    """Reload a saved tokenizer: a ``tokenizer.json`` or a run/checkpoint directory holding one.

    FileNotFoundError when there is none (a ``byte`` run saves nothing: build it by name)."""
    return BPETokenizer.load(path)


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table (the ``ByteLevel`` pre-tokenizer's): byte b
    is ``_byte_chars()[b]``; printable bytes stand for themselves, the others are shifted past
    255."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(BYTE_VOCAB):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(BYTE_VOCAB + extra)
            extra += 1
    return [chars[b] for b in range(BYTE_VOCAB)]


def tokenizer_json(tok: Tokenizer) -> str:
    """``tok`` in the ``tokenizers`` JSON format that transformers loads: the byte tokenizer as
    a byte-level BPE without merges (token b is byte b, so ids and text agree with
    ``ByteTokenizer``), a BPE or HF tokenizer as it is."""
    if not isinstance(tok, ByteTokenizer):
        return tok.to_json()
    from tokenizers import Tokenizer as HFLibTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {c: b for b, c in enumerate(_byte_chars())}
    lib = HFLibTokenizer(models.BPE(vocab=vocab, merges=[]))
    lib.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    lib.decoder = decoders.ByteLevel()
    return lib.to_str(pretty=False)


def token_text(tok: Tokenizer, token_id: int) -> str:
    """The vocabulary entry of ``token_id`` (as ``tokenizer.json`` spells it)."""
    if isinstance(tok, ByteTokenizer):
        return _byte_chars()[token_id]
    return str(tok.tokenizer.id_to_token(token_id))


def tokenizer_info(tok: Tokenizer) -> dict[str, Any]:
    """A small JSON-able summary (for logs and metadata)."""
    return {"name": tok.name, "vocab_size": tok.vocab_size, "doc_sep_id": tok.doc_sep_id}


__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "DOC_SEP_TEXT",
    "HFTokenizer",
    "HF_PREFIX",
    "TOKENIZERS",
    "TOKENIZER_FILE",
    "Tokenizer",
    "build_tokenizer",
    "check_tokenizer_name",
    "load_tokenizer",
    "save_tokenizer",
    "token_text",
    "tokenizer_info",
    "tokenizer_json",
    "train_bpe",
]
