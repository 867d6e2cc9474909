"""Tests for oases.config: defaults, TOML + override precedence, errors, round trip, validate."""

import math

import pytest
import torch
from torch import nn

from oases.config import (
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    ScheduleConfig,
    TrainConfig,
    config_to_dict,
    dump_toml,
    load_config,
    save_config,
)


def write(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


# ---------------------------------------------------------------- defaults and resolution


def test_defaults_match_contract():
    cfg = load_config()
    assert cfg == Config()
    m = cfg.model
    shape = (m.arch, m.n_layers, m.dim, m.n_heads, m.vocab_size, m.seq_len)
    assert shape == ("gpt2", 2, 64, 4, 256, 64)
    assert m.n_kv_heads == 4 and m.ffn_dim == 256 and m.head_dim == 16
    assert cfg.parallel == ParallelConfig(tp=1, timeout_s=60.0, backend="auto")
    assert cfg.schedule == ScheduleConfig(name="megatron", n_sub=2, max_inflight=1)
    assert cfg.train.steps == 40 and cfg.train.global_batch == 8 and cfg.train.micro_batch == 4
    assert cfg.train.lr == 3e-3 and cfg.train.run_dir == "runs/default"
    assert cfg.data == DataConfig(source="stdlib", tokenizer="byte")


@pytest.mark.parametrize(
    ("arch", "dim", "ffn"),
    [("gpt2", 64, 256), ("gpt2", 96, 384), ("llama", 64, 192), ("llama", 96, 256)],
)
def test_ffn_dim_resolution(arch, dim, ffn):
    m = ModelConfig(arch=arch, dim=dim)
    assert m.ffn_dim == ffn
    if arch == "llama":
        assert m.ffn_dim % 64 == 0 and m.ffn_dim >= 8 * dim / 3
    assert ModelConfig(arch=arch, dim=dim, ffn_dim=100).ffn_dim == 100


def test_n_kv_heads_resolution():
    assert ModelConfig(n_heads=8).n_kv_heads == 8
    assert ModelConfig(arch="llama", n_heads=8, n_kv_heads=2).n_kv_heads == 2


# ---------------------------------------------------------------- parameter counts and FLOPs


def reference_param_count(m: ModelConfig) -> int:
    """Build the contract's parameter layout with plain torch modules and count it."""
    gpt2 = m.arch == "gpt2"

    def norm():
        return nn.LayerNorm(m.dim) if gpt2 else nn.Parameter(torch.ones(m.dim))

    root = nn.Module()
    root.embed = nn.Embedding(m.vocab_size, m.dim)
    if gpt2:
        root.pos_embed = nn.Embedding(m.seq_len, m.dim)
    blocks = []
    for _ in range(m.n_layers):
        b = nn.Module()
        b.attn_norm, b.mlp_norm = norm(), norm()
        qkv_out = (m.n_heads + 2 * m.n_kv_heads) * m.head_dim
        b.qkv = nn.Linear(m.dim, qkv_out, bias=gpt2)
        b.proj = nn.Linear(m.dim, m.dim, bias=gpt2)
        b.fc1 = nn.Linear(m.dim, m.ffn_dim * (1 if gpt2 else 2), bias=gpt2)
        b.fc2 = nn.Linear(m.ffn_dim, m.dim, bias=gpt2)
        blocks.append(b)
    root.blocks = nn.ModuleList(blocks)
    root.norm = norm()
    root.head = nn.Linear(m.dim, m.vocab_size, bias=False)
    if m.tie_embeddings:
        root.head.weight = root.embed.weight
    return sum(p.numel() for p in root.parameters())  # parameters() de-duplicates tied tensors


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"tie_embeddings": True},
        {"arch": "llama"},
        {"arch": "llama", "tie_embeddings": True, "n_heads": 8, "n_kv_heads": 2},
        {"arch": "gpt2", "n_layers": 3, "dim": 96, "n_heads": 6, "n_kv_heads": 3},
        {"arch": "llama", "dim": 128, "ffn_dim": 300, "vocab_size": 1000, "seq_len": 17},
    ],
)
def test_num_params_matches_module_layout(kwargs):
    m = ModelConfig(**kwargs)
    assert m.num_params() == reference_param_count(m)


def test_num_params_by_hand_gpt2_default():
    d, f, v, s = 64, 256, 256, 64
    block = (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d) + 4 * d
    assert ModelConfig().num_params() == 2 * block + 2 * d + v * d + s * d + v * d


def test_flops_per_token():
    m = ModelConfig(arch="llama", tie_embeddings=True)
    n = m.non_embedding_params() + m.vocab_size * m.dim
    expected = 6 * n + 6 * m.n_layers * m.seq_len * m.dim
    assert isinstance(m.flops_per_token(), float)
    assert m.flops_per_token() == pytest.approx(expected)
    bigger = ModelConfig(arch="llama", tie_embeddings=True, seq_len=128)
    assert bigger.flops_per_token() > m.flops_per_token()


# ---------------------------------------------------------------- file and override precedence


def test_file_then_override_precedence(tmp_path):
    path = write(
        tmp_path,
        '[model]\ndim = 128\nn_heads = 8\narch = "llama"\n[train]\nlr = 1\nsteps = 7\n',
    )
    cfg = load_config(path)
    assert cfg.model.dim == 128 and cfg.model.arch == "llama" and cfg.train.steps == 7
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.model.ffn_dim == math.ceil(8 * 128 / 3 / 64) * 64
    assert cfg.parallel.tp == 1  # untouched default

    cfg = load_config(str(path), ["--train.steps=9", "model.dim=256", "--parallel.backend=gloo"])
    assert cfg.train.steps == 9 and cfg.model.dim == 256 and cfg.model.n_heads == 8
    assert cfg.parallel.backend == "gloo"
    assert cfg.model.ffn_dim == math.ceil(8 * 256 / 3 / 64) * 64  # re-resolved from the override


def test_override_value_parsing():
    cfg = load_config(
        overrides=[
            "--model.tie_embeddings=true",
            "--model.dropout=0.25",
            "--model.n_kv_heads=2",
            "--parallel.timeout_s=5",
            "--train.run_dir=runs/a=b",
            "--schedule.name=oases",
        ]
    )
    assert cfg.model.tie_embeddings is True and cfg.model.dropout == 0.25
    assert cfg.model.n_kv_heads == 2 and cfg.parallel.timeout_s == 5.0
    assert cfg.train.run_dir == "runs/a=b" and cfg.schedule.name == "oases"
    cfg = load_config(overrides=["--model.tie_embeddings=False", "--model.n_kv_heads=none"])
    assert cfg.model.tie_embeddings is False and cfg.model.n_kv_heads == cfg.model.n_heads


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        ("--model.dim=abc", ["model.dim: expected int", "'abc'"]),
        ("--model.dim=1.5", ["model.dim: expected int", "'1.5'"]),
        ("--train.lr=fast", ["train.lr: expected float", "'fast'"]),
        ("--model.tie_embeddings=yes", ["model.tie_embeddings: expected bool", "'yes'"]),
        ("--model.n_kv_heads=two", ["model.n_kv_heads: expected int or none", "'two'"]),
        ("--model.dim", ["malformed override", "model.dim"]),
        ("--dim=3", ["malformed override", "dim=3"]),
        ("--model.a.b=3", ["malformed override"]),
        ("--modle.dim=3", ["unknown section 'modle'", "model, parallel, schedule, train, data"]),
    ],
)
def test_override_errors(override, fragments):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    for fragment in fragments:
        assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_key_lists_valid_keys(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["--model.dimm=3"])
    msg = str(info.value)
    assert msg.startswith("unknown key 'model.dimm'; valid keys in [model]: arch, n_layers, dim")
    assert "init_std" in msg and "\n" not in msg
    with pytest.raises(ConfigError, match=r"unknown key 'train.stepz'.*valid keys in \[train\]"):
        load_config(write(tmp_path, "[train]\nstepz = 3\n"))
    with pytest.raises(ConfigError, match="unknown section 'optim'; valid sections: model"):
        load_config(write(tmp_path, "[optim]\nlr = 3\n"))
    with pytest.raises(ConfigError, match="unknown section 'dim'"):
        load_config(write(tmp_path, "dim = 3\n"))


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("[model]\ndim = 64.0\n", "model.dim: expected int, got 64.0"),
        ('[model]\ndim = "64"\n', "model.dim: expected int, got '64'"),
        ("[model]\ndim = true\n", "model.dim: expected int, got True"),
        ('[train]\nlr = "0.1"\n', "train.lr: expected float"),
        ("[train]\nlr = false\n", "train.lr: expected float"),
        ("[model]\ntie_embeddings = 1\n", "model.tie_embeddings: expected bool, got 1"),
        ("[data]\nsource = 3\n", "data.source: expected str, got 3"),
        ("[model]\nn_kv_heads = 1.0\n", "model.n_kv_heads: expected int or none"),
        ("model = 3\n", "[model] must be a table"),
    ],
)
def test_toml_type_errors(tmp_path, text, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert fragment in str(info.value)


def test_missing_file_and_invalid_toml(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="nope.toml"):
        load_config(missing)
    bad = write(tmp_path, "[model\ndim = 3\n")
    with pytest.raises(ConfigError, match=r"invalid TOML in .*run.toml: .*line 1"):
        load_config(bad)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (
            ["--model.dim=100", "--model.n_heads=3"],
            "model.dim=100 is not divisible by model.n_heads=3",
        ),
        (
            ["--model.n_heads=4", "--model.n_kv_heads=3"],
            "model.n_heads=4 is not divisible by model.n_kv_heads=3",
        ),
        (["--model.arch=bert"], "model.arch='bert'"),
        (["--model.n_layers=0"], "model.n_layers=0 must be > 0"),
        (["--model.vocab_size=-1"], "model.vocab_size=-1 must be > 0"),
        (["--model.ffn_dim=0"], "model.ffn_dim=0 must be > 0"),
        (["--model.dropout=1.0"], "model.dropout=1.0 must be in [0, 1)"),
        (["--model.dropout=-0.1"], "model.dropout=-0.1"),
        (["--parallel.tp=0"], "parallel.tp=0 must be > 0"),
        (["--parallel.timeout_s=0"], "parallel.timeout_s=0.0 must be > 0"),
        (["--parallel.backend=mpi"], "parallel.backend='mpi'"),
        (["--schedule.n_sub=0"], "schedule.n_sub=0 must be > 0"),
        (["--schedule.max_inflight=0"], "schedule.max_inflight=0 must be > 0"),
        (["--train.lr=0"], "train.lr=0.0 must be > 0"),
        (["--train.steps=-3"], "train.steps=-3 must be > 0"),
        (["--train.micro_batch=0"], "train.micro_batch=0 must be > 0"),
        (["--train.weight_decay=-1"], "train.weight_decay=-1.0 must be >= 0"),
        (["--train.min_lr=1"], "train.min_lr=1.0 exceeds train.lr=0.003"),
    ],
)
def test_post_init_errors_become_config_errors(overrides, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_direct_construction_raises_value_error():
    with pytest.raises(ValueError, match="model.dim=100 is not divisible by model.n_heads=3"):
        ModelConfig(dim=100, n_heads=3)
    with pytest.raises(ValueError, match="train.log_every=0"):
        TrainConfig(log_every=0)
    assert issubclass(ConfigError, ValueError)


# ---------------------------------------------------------------- round trip


def test_round_trip(tmp_path):
    cfg = load_config(
        overrides=[
            "--model.arch=llama",
            "--model.n_heads=8",
            "--model.n_kv_heads=2",
            "--model.norm_eps=1e-6",
            "--model.rope_theta=500000",
            "--model.tie_embeddings=true",
            "--train.lr=0.0003",
            "--train.min_lr=1e-05",
            '--train.run_dir=runs/odd "name"\\with\ttab',
            "--data.source=/tmp/some file.txt",
        ]
    )
    text = dump_toml(cfg)
    assert "[model]" in text and "[data]" in text
    path = tmp_path / "sub" / "config.toml"
    save_config(cfg, path)
    assert path.read_text() == text
    back = load_config(path)
    assert back == cfg
    assert config_to_dict(back) == config_to_dict(cfg)
    assert config_to_dict(cfg)["model"]["n_kv_heads"] == 2
    default_path = tmp_path / "default.toml"
    save_config(Config(), default_path)
    assert load_config(default_path) == Config()


def test_dump_omits_none(tmp_path):
    cfg = Config()
    cfg.model.n_kv_heads = None  # as if unresolved: the key is left out, the loader re-resolves
    text = dump_toml(cfg)
    assert "n_kv_heads" not in text
    assert load_config(write(tmp_path, text)).model.n_kv_heads == cfg.model.n_heads


# ---------------------------------------------------------------- validate


def test_validate_ok():
    Config().validate(1)
    cfg = load_config(overrides=["--parallel.tp=2", "--train.global_batch=16"])
    cfg.validate(4)  # dp=2, 16 % (4*2) == 0


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        (["--parallel.tp=4"], 6, "world_size=6 is not divisible by parallel.tp=4"),
        (
            ["--parallel.tp=4", "--model.n_heads=6", "--model.dim=96"],
            4,
            "model.n_heads=6 is not divisible by parallel.tp=4",
        ),
        (
            ["--parallel.tp=2", "--model.n_heads=6", "--model.n_kv_heads=3", "--model.dim=96"],
            2,
            "model.n_kv_heads=3 is not divisible by parallel.tp=2",
        ),
        (
            ["--parallel.tp=4", "--model.ffn_dim=90"],
            4,
            "model.ffn_dim=90 is not divisible by parallel.tp=4",
        ),
        (
            ["--train.micro_batch=5", "--train.global_batch=10"],
            1,
            "train.micro_batch=5 is not divisible by schedule.n_sub=2",
        ),
        (
            ["--train.global_batch=12"],
            2,
            "train.global_batch=12 is not divisible by train.micro_batch * dp = 4 * 2 = 8",
        ),
        ([], 0, "world_size=0 must be >= 1"),
    ],
)
def test_validate_errors(overrides, world, message):
    cfg = load_config(overrides=overrides)
    with pytest.raises(ValueError) as info:
        cfg.validate(world)
    assert str(info.value) == message


def test_a_directory_as_config_is_a_one_line_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path)


def test_a_plan_replaces_parallel_tp(tmp_path):
    """parallel.plan: the plan's degrees are checked instead of parallel.tp, before any
    collective; the batch splits over the embedding's DP degree."""
    from oases.plan import ParallelPlan, RegionPlan, region_names
    from oases.train.setup import check_config

    def plan_cfg(degrees, world, *overrides):
        cfg = load_config(overrides=[f"--parallel.plan={tmp_path / 'plan.json'}", *overrides])
        names = region_names(cfg.model)
        ParallelPlan([RegionPlan(n, t, world // t) for n, t in zip(names, degrees)]).save(
            tmp_path / "plan.json"
        )
        return cfg

    cfg = plan_cfg((1, 2, 1, 2, 2, 1), 2, "--parallel.tp=3")  # tp is not used with a plan
    assert [r.tp for r in check_config(cfg, 2).regions] == [1, 2, 1, 2, 2, 1]
    assert check_config(load_config(), 1) is None
    for degrees, world, overrides, message in [
        (
            (1, 2, 1, 2, 2, 1),
            2,
            ("--train.global_batch=6",),
            "train.global_batch=6 is not divisible by train.micro_batch * dp = 4 * 2 = 8",
        ),
        (
            (2, 2, 1, 1, 2, 2),
            2,
            ("--train.micro_batch=2", "--train.global_batch=4"),
            "a sub-batch of train.micro_batch / schedule.n_sub = 1 rows at the embedding's tp=2 "
            "has no whole share at the plan's tp=1",
        ),
        ((1, 2, 2, 2, 2, 2), 2, ("--model.tie_embeddings=true",), "tied embeddings need one"),
        (
            (2, 4, 3, 4, 4, 2),
            12,
            ("--model.n_heads=12", "--model.dim=96", "--model.ffn_dim=384"),
            "neighbouring degrees must divide one another",
        ),
    ]:
        cfg = plan_cfg(degrees, world, *overrides)
        with pytest.raises(ValueError, match=message.replace("*", r"\*")):
            check_config(cfg, world)
    with pytest.raises(ValueError, match="the plan was made for 2 ranks"):  # on 4
        check_config(plan_cfg((1, 2, 1, 2, 2, 1), 2), 4)
    cfg = load_config(overrides=[f"--parallel.plan={tmp_path / 'missing.json'}"])
    with pytest.raises(ValueError, match="cannot read plan"):
        check_config(cfg, 2)
