"""The run configuration's sections besides ``[model]`` and :class:`Config`, their union.

Each section is a dataclass whose ``__post_init__`` checks its own values; checks that involve the
world size or several sections live in :meth:`Config.validate`, which every rank runs before any
collective. ``SECTIONS`` (name -> dataclass, in TOML order) is what loading, dumping and the CLI's
key list walk. No ``from __future__ import annotations`` here: ``SECTIONS`` takes each section's
class from ``Config``'s field types, which must stay classes, not strings.
"""

import dataclasses
from dataclasses import dataclass, field

from oases.config.checks import _check, _divisible, _positive, check_sequence_split
from oases.config.model import ModelConfig

# the names of oases.precision.PRECISIONS (a test keeps them equal), without importing torch:
# the launcher loads and checks the config before its ranks start
PRECISION_NAMES = ("auto", "fp32", "bf16", "fp64")


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
    ``sp_recompute``: what a TP region keeps of its gathered input under it: "gathered" (keep
    it whole: no collective beyond the forward's and backward's four) or "shards" (keep
    norm:i's slice, as Megatron-LM, sbh(1 - 1/t) less a region, and gather it again: in the
    backward without recompute, "gh", ``schedule.regather``; in the communication-free
    recompute, "gr"). On a slow link the extra gather shows in the step time; the planner
    prices both. Block recompute keeps the block input's slice either way. Every TP
    degree must divide ``model.seq_len``; works with every ZeRO stage. The overlapped schedules
    hide every collective with ``schedule.n_sub >= 3`` (``schedule.program._staggered``).

    ``pp``: pipeline stages (1: none); the world is ``pp`` stages of ``tp x dp`` ranks, TP
    innermost, then DP, then PP (``parallel/context.py``); each stage holds a contiguous range
    of blocks (the first the embedding, the last the head; balanced by blocks, or a plan file's
    ``stage_starts``). ``pp_schedule``: the order of the stages' micro-batch passes, "gpipe",
    "1f1b", "1f1b-pair" (1F1B whose steady state overlaps a forward's collectives with
    another micro-batch's backward, at twice the activations in flight) or "zb-h1" (1F1B with
    the weight gradients held back to where it waits) or "interleaved" (Megatron-LM's
    interleaved 1F1B over ``pp_chunks`` >= 2 model chunks per stage: stage s holds chunks s,
    s + pp, ...; a multiple of ``pp`` micro-batches a step); see ``schedule/pipeline_order.py``.
    ``train.micro_batch`` is then a pipeline micro-batch.
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
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_chunks: int = 1

    def __post_init__(self) -> None:
        _check(
            self.backend in ("auto", "gloo", "nccl"),
            f"parallel.backend={self.backend!r} must be one of auto, gloo, nccl",
        )
        _positive("parallel", self, "tp", "timeout_s", "pp", "pp_chunks")
        from oases.stages import check_pipeline_schedule  # (pure: no torch)

        check_pipeline_schedule(self.pp_schedule)
        _check(self.memory_gb >= 0, f"parallel.memory_gb={self.memory_gb} must be >= 0")
        _check(self.zero in (0, 1, 2, 3), f"parallel.zero={self.zero} must be 0, 1, 2 or 3")
        _check(
            self.grad_reduce_dtype in ("fp32", "bf16"),
            f"parallel.grad_reduce_dtype={self.grad_reduce_dtype!r} must be fp32 or bf16",
        )
        for key in ("profile", "memory_gb"):  # surely a mistake: no planner runs without auto
            _check(
                self.plan == "auto" or not getattr(self, key),
                f'parallel.{key}={getattr(self, key)!r} is used only with parallel.plan = "auto"'
                " (the planner's costs and budget; no planner runs otherwise)",
            )
        _check(
            self.sp_recompute in ("gathered", "shards"),
            f"parallel.sp_recompute={self.sp_recompute!r} must be gathered or shards",
        )

    def sp(self) -> str | None:
        """The schedules' sequence-parallel mode (``build_schedule(sp=...)``): None when off."""
        return self.sp_recompute if self.sequence_parallel else None


@dataclass
class ScheduleConfig:
    """Which schedule runs a step; ``name`` is checked against the schedule registry elsewhere."""

    name: str = "megatron"
    n_sub: int = 2
    max_inflight: int = 1
    cuda_graphs: bool = False  # a step captured once and replayed (``schedule.graphed``)

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
        for name in (
            "min_lr",
            "warmup_steps",
            "weight_decay",
            "grad_clip",
            "seed",
            "eval_every",
            "sample_tokens",
        ):
            value = getattr(self, name)
            _check(value >= 0, f"train.{name}={value} must be >= 0")
        _check(self.min_lr <= self.lr, f"train.min_lr={self.min_lr} exceeds train.lr={self.lr}")
        _check(self.run_dir != "", "train.run_dir must not be empty")
        _check(
            self.precision in PRECISION_NAMES,
            f"train.precision={self.precision!r} must be one of {', '.join(PRECISION_NAMES)}",
        )


DEFAULT_BPE_VOCAB = 4096  # a BPE's vocabulary when no section gives one (resolve_vocab)


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
        _check(
            self.vocab_size == 0 or self.vocab_size > 256,
            f"data.vocab_size={self.vocab_size} must be 0 (= model.vocab_size) or more than "
            "the 256 bytes a BPE starts from",
        )
        _check(
            self.vocab_size == 0 or self.tokenizer == "bpe",
            f"data.vocab_size={self.vocab_size} is the size of a trained BPE; "
            f"data.tokenizer={self.tokenizer!r} has its own",
        )


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
        pp = self.parallel.pp
        _check(world_size >= 1, f"world_size={world_size} must be >= 1")
        _divisible("world_size", world_size, "parallel.pp", pp)
        _check(
            m.n_layers >= pp,
            f"model.n_layers={m.n_layers} blocks do not fill "
            f"parallel.pp={pp} pipeline stages (each holds at least one block)",
        )
        stage = world_size // pp  # ranks of one pipeline stage (the world without one)
        if degrees is None:
            _divisible(
                "world_size / parallel.pp" if pp > 1 else "world_size", stage, "parallel.tp", tp
            )
            for name in ("n_heads", "n_kv_heads", "ffn_dim"):
                _divisible(f"model.{name}", getattr(m, name), "parallel.tp", tp)
        else:
            for d in sorted(set(degrees)):
                _divisible(
                    "world_size / parallel.pp" if pp > 1 else "world_size",
                    stage,
                    "a tp degree of parallel.plan",
                    d,
                )
            tp = degrees[0]
        _divisible("train.micro_batch", t.micro_batch, "schedule.n_sub", n_sub)
        sub = t.micro_batch // n_sub  # a sub-batch's rows in the embedding's layout
        for d in sorted(set(degrees or ())):  # where the degree shrinks, reshards slice it
            _check(
                sub * d % tp == 0,
                f"a sub-batch of train.micro_batch / schedule.n_sub = {sub} rows at the "
                f"embedding's tp={tp} has no whole share at the plan's tp={d}",
            )
        if self.parallel.sequence_parallel:
            check_sequence_split(m.seq_len, degrees or (tp,))
        dp = stage // tp
        _check(
            t.global_batch % (t.micro_batch * dp) == 0,
            f"train.global_batch={t.global_batch} is not divisible by train.micro_batch * dp"
            f" = {t.micro_batch} * {dp} = {t.micro_batch * dp}",
        )


SECTIONS: dict[str, type] = {f.name: f.type for f in dataclasses.fields(Config)}
