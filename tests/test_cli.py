"""The ``oases`` command in-process: overrides with ``=`` or a space, one ``error:`` line and
exit code 2 from every subcommand, defaults shown by ``--help``, one vocabulary size for a BPE
and the model, the training timeline's title."""

import pytest

from oases.cli import COMMANDS, EXIT_USER_ERROR, main, split_overrides
from oases.config import DEFAULT_BPE_VOCAB, load_config
from oases.plan import ParallelPlan
from oases.train.loop import timeline_title
from oases.train.setup import check_config
from test_train_loop import TINY


def _error_line(capsys, *argv):
    assert main(list(argv)) == EXIT_USER_ERROR
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    return lines[0]


def test_overrides_with_a_space_or_an_equals_sign():
    assert split_overrides(
        [
            "train",
            "--train.steps",
            "20",
            "cfg.toml",
            "--model.dim=64",
            "--nproc-per-node",
            "2",
            "--train.seed",
            "-1",
        ]
    ) == (
        ["--train.steps=20", "--model.dim=64", "--train.seed=-1"],
        ["train", "cfg.toml", "--nproc-per-node", "2"],
    )
    # a key followed by another option, or last, stays as it is (and is reported malformed)
    assert split_overrides(["--train.steps", "--x"]) == (["--train.steps"], ["--x"])


def test_space_separated_override_reaches_the_config(capsys):
    # the space form is parsed: the error is about the value, not a config file named "0"
    line = _error_line(capsys, "train", str(TINY), "--train.steps", "0")
    assert line == "error: train.steps=0 must be > 0"
    line = _error_line(capsys, "train", str(TINY), "--train.steps")
    assert line == "error: malformed override '--train.steps'; expected --section.key=value"


def test_every_subcommand_reports_user_errors_in_one_line(capsys, tmp_path):
    missing = tmp_path / "missing"
    assert "no such checkpoint, folder of checkpoints or run directory" in _error_line(
        capsys, "export", "--checkpoint", str(missing), "--out", str(tmp_path / "hf")
    )
    assert "config file not found" in _error_line(
        capsys, "plan", str(missing), "--world-size", "2", "--hardware", "x"
    )
    assert "config file not found" in _error_line(capsys, "bench", str(missing))
    assert "config file not found" in _error_line(capsys, "profile", str(missing))
    assert "--global-batch" in _error_line(
        capsys,
        "simulate",
        "--model",
        "paper-h1024-l24",
        "--cluster",
        "rtx3090-pcie",
        "--global-batch",
        "3",
        "--micro-batch",
        "2",
    )
    assert "unknown key 'train.stepz'" in _error_line(capsys, "train", str(TINY), "--train.stepz=3")
    assert _error_line(capsys, "export", "--checkpoint", "x", "--out", "y", "--a.b=1") == (
        "error: oases export takes no --section.key=value overrides (got --a.b=1)"
    )


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_shows_defaults(command, capsys):
    words = [command, "prepare"] if command == "data" else [command]  # data's options: prepare's
    with pytest.raises(SystemExit) as info:
        main([*words, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "(default:" in text or command == "export"  # export has only required options
    if command == "train":  # every config key with its default, and what micro_batch counts
        assert "steps=40 global_batch=8 micro_batch=4" in text
        assert "train.micro_batch: sequences per model replica" in text
        assert "resume='auto' allow_data_change=False" in text
    if command == "bench":
        assert "warm-up steps per schedule (default: 2)" in text


def test_one_vocabulary_size_for_a_bpe_and_the_model():
    def sizes(*overrides):
        cfg = load_config(None, ["--data.tokenizer=bpe", *overrides])
        return cfg.data.vocab_size, cfg.model.vocab_size

    assert sizes() == (DEFAULT_BPE_VOCAB, DEFAULT_BPE_VOCAB) == (4096, 4096)
    assert sizes("--data.vocab_size=1000") == (1000, 1000)
    assert sizes("--model.vocab_size=384") == (384, 384)
    assert sizes("--data.vocab_size=1000", "--model.vocab_size=1024") == (1000, 1024)  # padded
    byte = load_config(None, [])
    assert (byte.data.vocab_size, byte.model.vocab_size) == (0, 256)
    with pytest.raises(
        ValueError,
        match=r"^data.vocab_size=256 must be 0 \(= model.vocab_size\) "
        "or more than the 256 bytes a BPE starts from$",
    ):
        load_config(None, ["--data.tokenizer=bpe", "--model.vocab_size=256"])
    with pytest.raises(
        ValueError,
        match=r"^data.vocab_size=4096 is the size of a trained BPE; "
        "data.tokenizer='byte' has its own$",
    ):
        load_config(None, ["--data.vocab_size=4096"])
    with pytest.raises(
        ValueError,
        match=r"^model.vocab_size=512 is smaller than the bpe "
        "tokenizer's vocabulary of 1000$",
    ):
        check_config(
            load_config(
                None, ["--data.tokenizer=bpe", "--data.vocab_size=1000", "--model.vocab_size=512"]
            ),
            1,
        )
    built = load_config(None, [])
    built.data.tokenizer = "bpe"  # a Config built in Python: 0 means the model's 256
    with pytest.raises(
        ValueError,
        match=r"^a BPE of 256 tokens has no merges beyond the 256 "
        r"bytes: give --data.vocab_size \(e.g. 4096\)$",
    ):
        check_config(built, 1)


def test_timeline_title_names_the_layout_and_the_ranks_drawn():
    cfg = load_config(TINY, ["--schedule.name=oases"])
    plan = ParallelPlan.uniform(cfg.model, 2, 2)
    assert timeline_title(cfg, plan, 2, 2) == "oases (n_sub=2), step 2, tp=2 x dp=1: ranks 0-1"
    plan = ParallelPlan.uniform(cfg.model, 4, 2)
    assert timeline_title(cfg, plan, 4, 7) == "oases (n_sub=2), step 7, tp=2 x dp=2: ranks 0-3"
    one = ParallelPlan.uniform(cfg.model, 1, 1)
    assert timeline_title(cfg, one, 1, 2) == "oases (n_sub=2), step 2, tp=1 x dp=1: rank 0"
