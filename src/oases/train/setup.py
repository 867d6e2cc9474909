"""A run's setup before any weight exists: the config resolved into what the run does and
checked against the world size, the plan, the model of ``model.init_from`` and the tokenizer's
name and size (the tokenizer itself comes with the run's data: ``run_data``).
Local work only (no collective): every rank runs it, and ``oases train`` runs ``check_config``
once (on a copy) before it starts any rank.

    resolve_setup(cfg, world)
      resolve_init_from            the model's shape from a Hugging Face directory
      resolve_plan                 parallel.plan: a file or "auto", checked, its knobs applied
      apply_schedule_implications  megatron-sp is sequence-parallel; n_sub 1 where micro-batches
                                   run whole
      cfg.validate + the checks    ValueError with the numbers
      no_effect_warnings           a line per setting that does nothing in this layout

The resolved config is the run's effective configuration (``train.effective``), logged, saved in
config.toml and in every checkpoint.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

from oases.config import DEFAULT_BPE_VOCAB, Config
from oases.plan import ParallelPlan
from oases.schedule import build_schedule
from oases.schedule.program import SPECS, sub_batches
from oases.train.no_effect import no_effect_warnings
from oases.train.pipeline_run import check_pipeline_run
from oases.train.tokenizer import BYTE_VOCAB, TOKENIZER_FILE, check_tokenizer_name


def resolve_init_from(cfg: Config) -> None:
    """``model.init_from = "hf:PATH"``: the model's shape comes from PATH/config.json (seq_len
    capped by model.seq_len; dropout and init_std kept). Idempotent."""
    if cfg.model.init_from:
        from oases.hf import hf_model_config

        m = hf_model_config(
            cfg.model.init_from[3:], max_seq_len=cfg.model.seq_len, dropout=cfg.model.dropout
        )
        cfg.model = dataclasses.replace(
            m, init_from=cfg.model.init_from, init_std=cfg.model.init_std
        )


def resolve_plan(cfg: Config, world_size: int) -> ParallelPlan | None:
    """``parallel.plan``: None for "" (every region at ``parallel.tp``; with ``parallel.pp`` >
    1 the uniform plan of those stages), the planner's choice for "auto", else the plan file;
    checked against the model and the world size."""
    source = cfg.parallel.plan
    if not source and cfg.parallel.pp > 1:
        p = cfg.parallel
        plan = ParallelPlan.uniform(
            cfg.model,
            world_size,
            p.tp,
            pp=p.pp,
            pp_schedule=p.pp_schedule,
            pp_chunks=p.pp_chunks,
            schedule=cfg.schedule.name,
            n_sub=cfg.schedule.n_sub,
            sequence_parallel=p.sp() or "",
        )
        plan.check(cfg.model, world_size)
        return plan
    if not source:
        return None
    if source == "auto":
        if cfg.parallel.pp > 1:
            raise ValueError(
                f'parallel.plan="auto" with parallel.pp={cfg.parallel.pp}: the '
                "planner does not plan pipeline stages yet"
            )
        from oases.planner import auto_plan

        plan = auto_plan(cfg, world_size)
    else:
        plan = ParallelPlan.load(source)
    plan.check(cfg.model, world_size)
    apply_plan_knobs(cfg, plan, world_size)
    return plan


def apply_plan_knobs(cfg: Config, plan: ParallelPlan, world_size: int) -> None:
    """A plan carries the schedule it was chosen with: its ``schedule``, ``n_sub``, sequence
    parallelism and (where every region gives the same) ZeRO stage replace the config's, its
    embedding's degree is ``parallel.tp``, and a planned world micro-batch (``notes.micro_rows``:
    sequences across all ranks) sets ``train.micro_batch`` to the embedding layout's share of
    it. The effective config is the one logged and saved with the run."""
    cfg.schedule.name, cfg.schedule.n_sub = plan.schedule, plan.n_sub
    cfg.parallel.pp, cfg.parallel.pp_schedule = plan.pp, plan.pp_schedule
    cfg.parallel.pp_chunks = plan.pp_chunks
    cfg.parallel.sequence_parallel = plan.sp() is not None
    if plan.sp() is not None:
        cfg.parallel.sp_recompute = plan.sp()
    stages = {r.zero for r in plan.regions}
    if len(stages) == 1 and None not in stages:
        cfg.parallel.zero = stages.pop()
    micro_rows = plan.notes.get("micro_rows")  # across the world (a pipeline: one stage)
    if micro_rows:
        stage = world_size // plan.pp
        local, left = divmod(int(micro_rows) * plan.tp_of("embed"), stage)
        if left or local < 1:
            raise ValueError(
                f"the plan's micro-batch of {micro_rows} sequences does not split "
                f"over dp={stage // plan.tp_of('embed')} ranks"
            )
        # micro_batch is per rank at parallel.tp: both in the embedding's layout, so planning
        # this config again (every rank does) sees the same world micro-batch
        cfg.train.micro_batch = local
    cfg.parallel.tp = plan.tp_of("embed")


def apply_schedule_implications(cfg: Config) -> None:
    """What the schedule implies, written into the config so that it says what runs: a
    schedule that is always sequence-parallel (megatron-sp) turns ``sequence_parallel`` on, and
    one that runs micro-batches whole has one sub-batch (``schedule.n_sub = 1``)."""
    spec = SPECS.get(cfg.schedule.name)
    if spec is None:
        return  # build_schedule names the valid ones
    if spec.sequence_parallel:
        cfg.parallel.sequence_parallel = True
    cfg.schedule.n_sub = sub_batches(cfg.schedule.name, cfg.schedule.n_sub)


@dataclass
class Setup:
    """A checked, resolved config's plan (None: uniform at ``parallel.tp``) and the warnings
    for the settings that have no effect in its layout (``no_effect``)."""

    plan: ParallelPlan | None
    warnings: list[str] = field(default_factory=list)


def check_config(cfg: Config, world_size: int) -> ParallelPlan | None:
    """``resolve_setup``'s plan (the warnings dropped): every user-input check that needs no
    data and no collective."""
    return resolve_setup(cfg, world_size).plan


def resolve_setup(cfg: Config, world_size: int) -> Setup:
    """Resolve ``cfg`` in place into what the run does (``init_from``'s shape, the plan's
    knobs, the schedule's implications) and run every user-input check that needs no data and
    no collective (ValueError with numbers); the settings that do nothing become warnings."""
    resolve_init_from(cfg)
    given = copy.deepcopy(cfg)
    plan = resolve_plan(cfg, world_size)
    apply_schedule_implications(cfg)
    cfg.validate(world_size, None if plan is None else tuple(r.tp for r in plan.regions))
    check_pipeline_run(cfg, plan)
    hf_dir = cfg.model.init_from[3:]
    own_tokenizer = hf_dir and (Path(hf_dir) / TOKENIZER_FILE).is_file()
    if own_tokenizer and cfg.data.tokenizer != f"hf:{hf_dir}":
        raise ValueError(
            f"model.init_from={cfg.model.init_from!r} has its own {TOKENIZER_FILE}: "
            f"train with it, --data.tokenizer=hf:{hf_dir}"
        )
    build_schedule(
        cfg.schedule.name,
        n_sub=cfg.schedule.n_sub,
        micro_batch=cfg.train.micro_batch,
        max_inflight=cfg.schedule.max_inflight,
        sp=cfg.parallel.sp(),
    )
    check_tokenizer_name(cfg.data.tokenizer)
    want = {"byte": BYTE_VOCAB, "bpe": cfg.data.vocab_size or cfg.model.vocab_size}.get(
        cfg.data.tokenizer, 0
    )  # hf:PATH is checked against its file when it is built
    if cfg.data.tokenizer == "bpe" and want <= BYTE_VOCAB:
        raise ValueError(
            f"a BPE of {want} tokens has no merges beyond the {BYTE_VOCAB} bytes: "
            f"give --data.vocab_size (e.g. {DEFAULT_BPE_VOCAB})"
        )
    if cfg.model.vocab_size < want:
        raise ValueError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the {cfg.data.tokenizer}"
            f" tokenizer's vocabulary of {want}"
        )
    if cfg.train.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ValueError(
            "train.tensorboard=true needs the tensorboard package: "
            "pip install -e '.[tensorboard]' in the oases clone "
            "(or --train.tensorboard=false)"
        )
    return Setup(plan, no_effect_warnings(given, cfg, plan, world_size))
