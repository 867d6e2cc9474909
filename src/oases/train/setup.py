"""A run's setup before any weight exists: the config checked against the world size, the plan,
the model of ``model.init_from`` and the tokenizer's name and size (the tokenizer itself comes
with the run's data: ``run_data``). Local work only (no collective): every rank
runs it, and ``oases train`` runs ``check_config`` once before it starts any rank.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from oases.config import DEFAULT_BPE_VOCAB, Config
from oases.plan import ParallelPlan
from oases.schedule import build_schedule
from oases.train.tokenizer import BYTE_VOCAB, TOKENIZER_FILE, check_tokenizer_name


def resolve_init_from(cfg: Config) -> None:
    """``model.init_from = "hf:PATH"``: the model's shape comes from PATH/config.json (seq_len
    capped by model.seq_len; dropout and init_std kept). Idempotent."""
    if cfg.model.init_from:
        from oases.hf import hf_model_config

        m = hf_model_config(cfg.model.init_from[3:], max_seq_len=cfg.model.seq_len,
                            dropout=cfg.model.dropout)
        cfg.model = dataclasses.replace(m, init_from=cfg.model.init_from,
                                        init_std=cfg.model.init_std)


def resolve_plan(cfg: Config, world_size: int) -> ParallelPlan | None:
    """``parallel.plan``: None for "" (every region at ``parallel.tp``), the planner's choice
    for "auto", else the plan file; checked against the model and the world size."""
    source = cfg.parallel.plan
    if not source:
        return None
    if source == "auto":
        from oases.planner import auto_plan

        plan = auto_plan(cfg, world_size)
    else:
        plan = ParallelPlan.load(source)
    plan.check(cfg.model, world_size)
    apply_plan_knobs(cfg, plan, world_size)
    return plan


def apply_plan_knobs(cfg: Config, plan: ParallelPlan, world_size: int) -> None:
    """A plan carries the schedule it was chosen with: its ``schedule``, ``n_sub`` and
    ``sequence_parallel`` replace the config's, and a planned world micro-batch
    ranks) sets ``train.micro_batch`` to the embedding layout's share of it. The effective
    config is the one logged and saved with the run."""
    cfg.schedule.name, cfg.schedule.n_sub = plan.schedule, plan.n_sub
    cfg.parallel.sequence_parallel = bool(plan.sequence_parallel)
    if plan.sequence_parallel:
        cfg.parallel.sp_recompute = plan.sequence_parallel
    micro_rows = plan.notes.get("micro_rows")
    if micro_rows:
        local, left = divmod(int(micro_rows) * plan.tp_of("embed"), world_size)
        if left or local < 1:
            raise ValueError(f"the plan's micro-batch of {micro_rows} sequences does not split "
                             f"over dp={world_size // plan.tp_of('embed')} ranks")
        # micro_batch is per rank at parallel.tp: both in the embedding's layout, so planning
        # this config again (every rank does) sees the same world micro-batch
        cfg.train.micro_batch, cfg.parallel.tp = local, plan.tp_of("embed")


def check_config(cfg: Config, world_size: int) -> ParallelPlan | None:
    """Every user-input check that needs no data and no collective; ValueError with numbers.
    Returns the plan of ``parallel.plan`` (None: uniform at ``parallel.tp``)."""
    resolve_init_from(cfg)
    plan = resolve_plan(cfg, world_size)
    cfg.validate(world_size, None if plan is None else tuple(r.tp for r in plan.regions))
    hf_dir = cfg.model.init_from[3:]
    own_tokenizer = hf_dir and (Path(hf_dir) / TOKENIZER_FILE).is_file()
    if own_tokenizer and cfg.data.tokenizer != f"hf:{hf_dir}":
        raise ValueError(f"model.init_from={cfg.model.init_from!r} has its own {TOKENIZER_FILE}: "
                         f"train with it, --data.tokenizer=hf:{hf_dir}")
    build_schedule(
        cfg.schedule.name,
        n_sub=cfg.schedule.n_sub,
        micro_batch=cfg.train.micro_batch,
        max_inflight=cfg.schedule.max_inflight,
        sp=cfg.parallel.sp(),
    )
    check_tokenizer_name(cfg.data.tokenizer)
    want = {"byte": BYTE_VOCAB, "bpe": cfg.data.vocab_size or cfg.model.vocab_size}.get(
        cfg.data.tokenizer, 0)  # hf:PATH is checked against its file when it is built
    if cfg.data.tokenizer == "bpe" and want <= BYTE_VOCAB:
        raise ValueError(f"a BPE of {want} tokens has no merges beyond the {BYTE_VOCAB} bytes: "
                         f"give --data.vocab_size (e.g. {DEFAULT_BPE_VOCAB})")
    if cfg.model.vocab_size < want:
        raise ValueError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the {cfg.data.tokenizer}"
            f" tokenizer's vocabulary of {want}"
        )
    if cfg.train.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ValueError("train.tensorboard=true needs the tensorboard package: "
                         "pip install -e '.[tensorboard]' in the oases clone "
                         "(or --train.tensorboard=false)")
    return plan
