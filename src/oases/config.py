"""Run configuration: typed dataclasses, TOML loading, CLI overrides and cross-field checks.

Precedence is CLI overrides > TOML file > dataclass defaults. Overrides are written
``--section.key=value`` (the leading ``--`` is optional). Unknown sections or keys, values of the
wrong type and malformed overrides raise :class:`ConfigError` (a ``ValueError``) with a one-line
message that names the key and lists the valid names. Checks that involve the world size or
several sections live in :meth:`Config.validate`, which every rank runs before any collective.
"""

import dataclasses
import math
import os
import tomllib
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration file, override or value is invalid."""


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _positive(section: str, obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _check(value > 0, f"{section}.{name}={value} must be > 0")


def _divisible(a_name: str, a: int, b_name: str, b: int) -> None:
    _check(a % b == 0, f"{a_name}={a} is not divisible by {b_name}={b}")


@dataclass
class ModelConfig:
    """Transformer shape; ``n_kv_heads`` and ``ffn_dim`` default from the other fields."""

    arch: str = "gpt2"
    n_layers: int = 2
    dim: int = 64
    n_heads: int = 4
    n_kv_heads: int | None = None
    ffn_dim: int | None = None
    vocab_size: int = 256
    seq_len: int = 64
    dropout: float = 0.0
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02
    init_from: str = ""  # "" or "hf:PATH": shape and weights from a Hugging Face directory

    def __post_init__(self) -> None:
        _check(self.init_from == "" or (self.init_from.startswith("hf:")
                                        and len(self.init_from) > 3),
               f"model.init_from={self.init_from!r} must be '' or hf:PATH")
        _check(self.arch in ("gpt2", "llama"), f"model.arch={self.arch!r} must be gpt2 or llama")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.ffn_dim is None:
            if self.arch == "gpt2":
                self.ffn_dim = 4 * self.dim
            else:
                self.ffn_dim = math.ceil(8 * self.dim / 3 / 64) * 64
        _positive("model", self, "n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim")
        _positive("model", self, "vocab_size", "seq_len", "norm_eps", "rope_theta", "init_std")
        _divisible("model.dim", self.dim, "model.n_heads", self.n_heads)
        _divisible("model.n_heads", self.n_heads, "model.n_kv_heads", self.n_kv_heads)
        _check(0.0 <= self.dropout < 1.0, f"model.dropout={self.dropout} must be in [0, 1)")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads

    def block_params(self) -> int:
        """Parameters of one transformer block (attention, MLP and their two norms)."""
        d, f, gpt2 = self.dim, self.ffn_dim, self.arch == "gpt2"
        qkv_out = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        if gpt2:  # biases everywhere; LayerNorm has weight and bias
            return (d * qkv_out + qkv_out) + (d * d + d) + (d * f + f) + (f * d + d) + 2 * (2 * d)
        # llama: no biases, fc1 rows are [gate | up], RMSNorm has a weight only
        return d * qkv_out + d * d + d * 2 * f + f * d + 2 * d

    def non_embedding_params(self) -> int:
        """Parameters outside the token/position embeddings and the head: blocks + final norm."""
        final_norm = 2 * self.dim if self.arch == "gpt2" else self.dim
        return self.n_layers * self.block_params() + final_norm

    def num_params(self) -> int:
        """Total distinct parameters of the unsharded model (a tied head is counted once)."""
        total = self.non_embedding_params() + self.vocab_size * self.dim  # embed.weight
        if self.arch == "gpt2":
            total += self.seq_len * self.dim  # pos_embed.weight
        if not self.tie_embeddings:
            total += self.vocab_size * self.dim  # head.weight, no bias
        return total

    def flops_per_token(self) -> float:
        """Training (forward + backward) FLOPs per token, Kaplan et al. (2020) style.

        ``6 * N`` for the matmuls, where N is the block and final-norm parameters plus the
        ``vocab_size * dim`` head matmul (counted even when tied; embedding lookups are free),
        plus ``6 * n_layers * seq_len * dim`` for the attention score and value products (the
        Kaplan estimate: the causal average of the full ``12 * n_layers * seq_len * dim``).
        """
        n = self.non_embedding_params() + self.vocab_size * self.dim
        return float(6 * n + 6 * self.n_layers * self.seq_len * self.dim)


@dataclass
class ParallelConfig:
    """Tensor-parallel degree and process-group settings.

    ``plan``: "" = every region at ``tp``; a path to a plan JSON (``ParallelPlan.save``, e.g.
    from ``oases plan``) giving every region its own degree, which then replaces ``tp``;
    "auto" = the planner picks one for this world size (``oases.planner.auto_plan``) with the
    costs of ``profile`` (a file from ``oases profile``, or ``hw:PRESET`` / ``hw:CLUSTER.toml``)
    under ``memory_gb`` GB (10^9 bytes) per device (0: the planner's default, 95% of a hardware
    preset's GPU, none for a profile of CPU ranks; ``oases.planner.budget``).

    ``zero``: sharded data parallelism (0: off; 1: Adam moments sharded over each region's DP
    group; 2: gradients too; 3: weights too, gathered before each pass); a plan file's regions
    may give their own (``"zero"``; absent: this value). ``reshard_after_forward`` (stage 3):
    free gathered weights between forward and backward (else keep them: fewer gathers, more
    memory). See ``oases.parallel.shard``.

    ``grad_reduce_dtype``: the dtype of the data-parallel gradient reduction (the gradient
    all-reduces and ZeRO's reduce-scatters): "fp32" (the master weights' dtype; default) or
    "bf16" (half the bytes). See ``oases.precision``.

    ``high_priority_tp``: on NCCL, the TP groups' collectives run on high-priority CUDA
    streams (``ProcessGroupNCCL.Options.is_high_priority_stream``), so a TP all-reduce's
    kernels are scheduled ahead of the compute kernels queued beside it; off by default
    (whether it helps depends on the GPU and the model: measure it); gloo ignores it.

    ``sequence_parallel``: Megatron-LM's sequence parallelism inside every schedule: norms,
    dropout and residuals run on this rank's 1/tp slice of the sequence, each TP all-reduce
    becomes a reduce-scatter plus a gather along the sequence (the same bytes).
    ``sp_recompute``: what a communication-free recompute (oases, commfree-recompute) keeps
    under it: "gathered" (each region's gathered input: no collective in the recompute) or
    "shards" (only slices: one gather per region in the recompute, less memory). Every TP
    degree must divide ``model.seq_len``; works with every ZeRO stage. The overlapped schedules
    hide every collective with ``schedule.n_sub >= 3`` (``schedule.program._staggered``).
    """

    tp: int = 1
    timeout_s: float = 60.0
    backend: str = "auto"
    plan: str = ""
    profile: str = ""
    memory_gb: float = 0.0
    zero: int = 0
    reshard_after_forward: bool = True
    grad_reduce_dtype: str = "fp32"
    high_priority_tp: bool = False
    sequence_parallel: bool = False
    sp_recompute: str = "gathered"

    def __post_init__(self) -> None:
        _check(
            self.backend in ("auto", "gloo", "nccl"),
            f"parallel.backend={self.backend!r} must be one of auto, gloo, nccl",
        )
        _positive("parallel", self, "tp", "timeout_s")
        _check(self.memory_gb >= 0, f"parallel.memory_gb={self.memory_gb} must be >= 0")
        _check(self.zero in (0, 1, 2, 3), f"parallel.zero={self.zero} must be 0, 1, 2 or 3")
        _check(self.grad_reduce_dtype in ("fp32", "bf16"),
               f"parallel.grad_reduce_dtype={self.grad_reduce_dtype!r} must be fp32 or bf16")
        _check(self.plan == "auto" or not self.profile,
               'parallel.profile is used only with parallel.plan = "auto"')
        _check(self.sp_recompute in ("gathered", "shards"),
               f"parallel.sp_recompute={self.sp_recompute!r} must be gathered or shards")

    def sp(self) -> str | None:
        """The schedules' sequence-parallel mode (``build_schedule(sp=...)``): None when off."""
        return self.sp_recompute if self.sequence_parallel else None


@dataclass
class ScheduleConfig:
    """Which schedule runs a step; ``name`` is checked against the schedule registry elsewhere."""

    name: str = "megatron"
    n_sub: int = 2
    max_inflight: int = 1

    def __post_init__(self) -> None:
        _check(self.name != "", "schedule.name must not be empty")
        _positive("schedule", self, "n_sub", "max_inflight")


@dataclass
class TrainConfig:
    """Optimiser, batch and logging settings.

    Batch sizes are in sequences of ``model.seq_len`` tokens. ``global_batch``: sequences per
    optimizer step, over the whole job. ``micro_batch``: sequences one model replica (one TP
    group at ``parallel.tp``, i.e. one DP rank) runs through one forward and backward; each DP
    rank accumulates ``global_batch / (micro_batch * dp)`` of them per step, with
    ``dp = world_size / parallel.tp``, and the schedule cuts each into ``schedule.n_sub``
    sub-batches. Under ``parallel.plan`` both are in the embedding region's layout (its degree
    replaces ``parallel.tp``).

    ``tensorboard``: also write every metric to ``<run_dir>/tensorboard`` (needs the
    ``tensorboard`` package: ``pip install -e '.[tensorboard]'`` in a clone); ``metrics.jsonl``
    stays the record.
    """

    steps: int = 40
    global_batch: int = 8
    micro_batch: int = 4
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 5
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 5
    run_dir: str = "runs/default"
    metrics_file: str = ""  # "" = <run_dir>/metrics.jsonl
    eval_every: int = 50  # steps between validation losses; 0 = only at the end
    eval_batches: int = 4  # validation global batches per evaluation
    sample_tokens: int = 200  # tokens sampled from the model at the end of a run; 0 = none
    tensorboard: bool = False  # also write the metrics as TensorBoard events
    # oases.precision.PRECISIONS: auto (bf16 on CUDA, fp32 on CPU), fp32, bf16, fp64
    precision: str = "auto"

    def __post_init__(self) -> None:
        _positive("train", self, "steps", "global_batch", "micro_batch", "lr", "log_every")
        _positive("train", self, "eval_batches")
        for name in ("min_lr", "warmup_steps", "weight_decay", "grad_clip", "seed", "eval_every",
                     "sample_tokens"):
            value = getattr(self, name)
            _check(value >= 0, f"train.{name}={value} must be >= 0")
        _check(self.min_lr <= self.lr, f"train.min_lr={self.min_lr} exceeds train.lr={self.lr}")
        _check(self.run_dir != "", "train.run_dir must not be empty")
        from oases.precision import PRECISIONS  # (torch, so imported where it is used)

        _check(self.precision in PRECISIONS,
               f"train.precision={self.precision!r} must be one of {', '.join(PRECISIONS)}")


@dataclass
class DataConfig:
    """Where the training text comes from and how it is tokenised.

    ``vocab_size``: the vocabulary of the ``bpe`` tokenizer to train (0 = ``model.vocab_size``).
    Loading a run file resolves one size for both (``resolve_vocab``): give either; with
    neither, a BPE gets ``DEFAULT_BPE_VOCAB`` tokens.
    """

    source: str = "stdlib"
    tokenizer: str = "byte"  # "byte" | "bpe" (trained on the training split) | "hf:PATH"
    vocab_size: int = 0  # BPE vocabulary to train; 0 = model.vocab_size

    def __post_init__(self) -> None:
        _check(self.source != "", "data.source must not be empty")
        _check(self.tokenizer != "", "data.tokenizer must not be empty")
        _check(self.vocab_size == 0 or self.vocab_size > 256,
               f"data.vocab_size={self.vocab_size} must be 0 (= model.vocab_size) or more than "
               "the 256 bytes a BPE starts from")
        _check(self.vocab_size == 0 or self.tokenizer == "bpe",
               f"data.vocab_size={self.vocab_size} is the size of a trained BPE; "
               f"data.tokenizer={self.tokenizer!r} has its own")


@dataclass
class CheckpointConfig:
    """When checkpoints are written, how many are kept and where a run resumes from.

    ``dir = ""`` means ``<run_dir>/checkpoints``; ``every = 0`` saves only at the end; ``keep``
    is the number of newest complete checkpoints kept; ``resume`` is ``"never"`` (a new run from
    step 0: refused where ``dir`` already holds checkpoints, which it would mix with and prune;
    start it in another ``train.run_dir``), ``"auto"`` (the newest complete checkpoint in
    ``dir``, or a fresh start when there is none) or the path of a checkpoint
    (``.../step_000123``) or of a folder of checkpoints (its newest one).

    ``allow_data_change``: resume on data other than the checkpoint's (another ``data.source``,
    or files whose names or sizes changed: ``oases.train.resume``) with a warning instead of an
    error.
    """

    dir: str = ""
    every: int = 0
    keep: int = 2
    resume: str = "auto"
    allow_data_change: bool = False

    def __post_init__(self) -> None:
        _check(self.every >= 0, f"checkpoint.every={self.every} must be >= 0")
        _check(self.keep >= 1, f"checkpoint.keep={self.keep} must be >= 1")
        _check(self.resume != "", 'checkpoint.resume must be "never", "auto" or a path')


@dataclass
class Config:
    """The whole run configuration, one dataclass per TOML section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def validate(self, world_size: int, degrees: tuple[int, ...] | None = None) -> None:
        """Cross-field checks for a job of ``world_size`` ranks; raises ValueError.

        ``degrees``: a plan's TP degree of every region in chain order (the embedding's first),
        replacing ``parallel.tp``; the batch is then split over the embedding's DP degree (the
        plan's own checks, ``ParallelPlan.check``, cover heads and ffn)."""
        m, tp, t, n_sub = self.model, self.parallel.tp, self.train, self.schedule.n_sub
        _check(world_size >= 1, f"world_size={world_size} must be >= 1")
        if degrees is None:
            _divisible("world_size", world_size, "parallel.tp", tp)
            for name in ("n_heads", "n_kv_heads", "ffn_dim"):
                _divisible(f"model.{name}", getattr(m, name), "parallel.tp", tp)
        else:
            for d in sorted(set(degrees)):
                _divisible("world_size", world_size, "a tp degree of parallel.plan", d)
            tp = degrees[0]
        _divisible("train.micro_batch", t.micro_batch, "schedule.n_sub", n_sub)
        sub = t.micro_batch // n_sub  # a sub-batch's rows in the embedding's layout
        for d in sorted(set(degrees or ())):  # where the degree shrinks, reshards slice it
            _check(sub * d % tp == 0,
                   f"a sub-batch of train.micro_batch / schedule.n_sub = {sub} rows at the "
                   f"embedding's tp={tp} has no whole share at the plan's tp={d}")
        if self.parallel.sequence_parallel:
            for d in sorted(set(degrees or (tp,))):
                _divisible("model.seq_len", m.seq_len, "a TP degree (sequence parallelism)", d)
        dp = world_size // tp
        _check(
            t.global_batch % (t.micro_batch * dp) == 0,
            f"train.global_batch={t.global_batch} is not divisible by train.micro_batch * dp"
            f" = {t.micro_batch} * {dp} = {t.micro_batch * dp}",
        )


SECTIONS: dict[str, type] = {f.name: f.type for f in dataclasses.fields(Config)}


def _field_types(section: str) -> dict[str, Any]:
    """Declared field types of a section; ConfigError listing the valid sections if unknown."""
    if section not in SECTIONS:
        raise ConfigError(f"unknown section '{section}'; valid sections: {', '.join(SECTIONS)}")
    return typing.get_type_hints(SECTIONS[section])


def _type_name(tp: Any) -> str:
    return "int or none" if tp == int | None else tp.__name__


def _check_toml_value(key: str, tp: Any, value: Any) -> Any:
    """Type-check a value read from TOML; ints are accepted (and converted) for float fields."""
    ok = {
        bool: isinstance(value, bool),
        str: isinstance(value, str),
        float: isinstance(value, int | float) and not isinstance(value, bool),
    }.get(tp, isinstance(value, int) and not isinstance(value, bool))
    if not ok:
        got = f"{value!r} ({type(value).__name__})"
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {got}")
    return float(value) if tp is float else value


def _parse_override_value(key: str, tp: Any, text: str) -> Any:
    """Parse a CLI override string according to the field's type."""
    low = text.strip().lower()
    if tp is str:
        return text
    if tp is bool and low in ("true", "false"):
        return low == "true"
    if tp == int | None and low in ("none", "null"):
        return None
    try:
        if tp is float:
            return float(text)
        if tp is not bool:
            return int(text)
    except ValueError:
        pass
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {text!r}")


def _field_type(section: str, key: str) -> Any:
    """The declared type of ``section.key``; ConfigError listing the valid keys if unknown."""
    types = _field_types(section)
    if key not in types:
        valid = ", ".join(types)
        raise ConfigError(f"unknown key '{section}.{key}'; valid keys in [{section}]: {valid}")
    return types[key]


def _read_toml(path: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    p = Path(path)
    try:
        with p.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {p}") from None
    except OSError as exc:  # a directory, no permission, ...
        raise ConfigError(f"cannot read config file {p}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"invalid TOML in {p}: {exc}") from None
    values: dict[str, dict[str, Any]] = {}
    for section, table in data.items():
        _field_types(section)
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}] must be a table, got {table!r}")
        for key, value in table.items():
            tp = _field_type(section, key)
            values.setdefault(section, {})[key] = _check_toml_value(f"{section}.{key}", tp, value)
    return values


def _apply_override(values: dict[str, dict[str, Any]], override: str) -> None:
    name, eq, text = override.removeprefix("--").partition("=")
    parts = name.strip().split(".")
    if not eq or len(parts) != 2 or not all(parts):
        raise ConfigError(f"malformed override {override!r}; expected --section.key=value")
    section, key = parts
    tp = _field_type(section, key)
    values.setdefault(section, {})[key] = _parse_override_value(f"{section}.{key}", tp, text)


DEFAULT_BPE_VOCAB = 4096


def resolve_vocab(values: dict[str, dict[str, Any]]) -> None:
    """One vocabulary size for a BPE and the model, from what the user gave (in place): the
    size given for either one is the other's; with neither, ``DEFAULT_BPE_VOCAB``. A larger
    ``model.vocab_size`` than ``data.vocab_size`` pads the embedding."""
    data, model = values.get("data", {}), values.get("model", {})
    if data.get("tokenizer") != "bpe":
        return
    if not data.get("vocab_size"):
        data["vocab_size"] = model.get("vocab_size", DEFAULT_BPE_VOCAB)
    model.setdefault("vocab_size", data["vocab_size"])
    values["data"], values["model"] = data, model


def load_config(
    path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()
) -> Config:
    """Build a Config from defaults, an optional TOML file and ``--section.key=value`` overrides."""
    if isinstance(overrides, str):
        overrides = [overrides]
    values = _read_toml(path) if path is not None else {}
    for override in overrides:
        _apply_override(values, override)
    resolve_vocab(values)
    try:
        return Config(**{name: cls(**values.get(name, {})) for name, cls in SECTIONS.items()})
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def config_to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """The config as ``{section: {key: value}}`` (plain Python scalars)."""
    return dataclasses.asdict(cfg)


# TOML basic strings must escape '"', '\\' and control characters other than tab.
_TOML_ESCAPES = {c: f"\\u{c:04x}" for c in [*range(0x20), 0x7F] if c != 0x09}
_TOML_ESCAPES |= {ord('"'): '\\"', ord("\\"): "\\\\"}


def _toml_scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # shortest round-tripping form; 'inf'/'nan' are valid TOML too
    if isinstance(value, str):
        return '"' + value.translate(_TOML_ESCAPES) + '"'
    raise TypeError(f"cannot write {type(value).__name__} value {value!r} as TOML")


def dump_toml(cfg: Config) -> str:
    """Render the config as TOML that :func:`load_config` reads back to an equal Config."""
    lines: list[str] = []
    for section, table in config_to_dict(cfg).items():
        lines.append(f"[{section}]")
        lines.extend(f"{k} = {_toml_scalar(v)}" for k, v in table.items() if v is not None)
        lines.append("")
    return "\n".join(lines)


def save_config(cfg: Config, path: str | os.PathLike[str]) -> None:
    """Write ``dump_toml(cfg)`` to ``path``, creating parent directories."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(dump_toml(cfg), encoding="utf-8")
