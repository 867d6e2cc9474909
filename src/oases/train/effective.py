"""What a run does, resolved once: ``EffectiveRun``, the one record every report of a run reads.

A run's settings come from three places: the config (file and overrides), the plan
(``parallel.plan``: degrees, schedule, sub-batches, sequence parallelism, ZeRO stages, a
micro-batch) and the machine (the dtypes ``train.precision = "auto"`` resolves to). They are
put together once, on every rank, before any weight exists::

    config ─► setup.resolve_setup        the plan's knobs replace the config's; what a schedule
              (setup.py)                 implies (megatron-sp is sequence-parallel; one
                                         sub-batch where a schedule runs micro-batches whole;
                                         the plan's one ZeRO stage); warnings for settings that
                                         do nothing (no_effect.py)
           ─► EffectiveRun.build         + the world size and the resolved precision
           ─► describe()   the start-up lines (the one place a run's layout is logged)
              toml_header()              the same lines atop config.toml (the resolved config)
              record()     the checkpoint manifest's "run" (oases.json)
              changes()    on resume, every field that differs from the checkpoint's record,
                           named in the resume line

A new setting of the layout (a pipeline degree ``pp``, say) is one field here: its value in
``build``, its key in ``record`` (so ``changes`` compares it) and its part of ``describe``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from oases.config import Config
from oases.plan import ParallelPlan
from oases.precision import Precision


@dataclass(frozen=True)
class EffectiveRun:
    """The effective configuration of one run (see the module docstring).

    ``tp``: the embedding's degree (``parallel.tp``; a plan's regions may differ: ``degrees``
    draws them); ``zero``: every region's ZeRO stage in chain order; ``sequence_parallel``:
    "" (off), "gathered" or "shards"; ``micro_batch``: sequences per model replica at ``tp``;
    ``accumulation``: micro-batches per step on each DP rank; ``plan``: ``parallel.plan``
    ("" none); ``plan_precision``: the dtypes the plan was priced in (None: not recorded);
    ``pp``: pipeline stages (``dp`` counts the replicas inside one stage), ``pp_schedule``
    their order of passes."""

    world_size: int
    tp: int
    dp: int
    degrees: str
    zero: tuple[int, ...]
    schedule: str
    n_sub: int
    sequence_parallel: str
    precision: str
    compute: str
    master: str
    grad_reduce: str
    micro_batch: int
    accumulation: int
    global_batch: int
    plan: str = ""
    plan_precision: dict[str, str] | None = None
    pp: int = 1
    pp_schedule: str = "1f1b"

    @staticmethod
    def build(
        cfg: Config, plan: ParallelPlan, world_size: int, precision: Precision
    ) -> EffectiveRun:
        """The record of ``cfg`` as resolved by ``setup.resolve_setup``, running ``plan`` (a
        uniform one where the config gives none) on ``world_size`` ranks in ``precision``."""
        tp = plan.tp_of("embed")
        dp = world_size // (tp * plan.pp)
        dtypes = precision.describe()
        t = cfg.train
        return EffectiveRun(
            world_size=world_size,
            tp=tp,
            dp=dp,
            degrees=plan.degree_runs(),
            zero=plan.zero_stages(cfg.parallel.zero),
            schedule=cfg.schedule.name,
            n_sub=cfg.schedule.n_sub,
            sequence_parallel=cfg.parallel.sp() or "",
            precision=t.precision,
            compute=dtypes["compute"],
            master=dtypes["master"],
            grad_reduce=dtypes["grad_reduce"],
            micro_batch=t.micro_batch,
            accumulation=t.global_batch // (t.micro_batch * dp),
            global_batch=t.global_batch,
            plan=cfg.parallel.plan,
            plan_precision=plan.precision,
            pp=plan.pp,
            pp_schedule=plan.pp_schedule,
        )

    # ------------------------------------------------------------------------------ the record
    def record(self) -> dict[str, Any]:
        """The manifest's ``run``: plain JSON values, one key per field (``zero`` an int when
        every region has one stage, else the list)."""
        zero = self.zero[0] if len(set(self.zero)) == 1 else list(self.zero)
        stages = {"pp": self.pp} | ({"pp_schedule": self.pp_schedule} if self.pp > 1 else {})
        return {
            "world_size": self.world_size,
            **stages,
            "tp": self.tp,
            "dp": self.dp,
            "degrees": self.degrees,
            "zero": zero,
            "schedule": self.schedule,
            "n_sub": self.n_sub,
            "sequence_parallel": self.sequence_parallel or "off",
            "precision": self.precision,
            "compute_dtype": self.compute,
            "master_dtype": self.master,
            "grad_reduce_dtype": self.grad_reduce,
            "micro_batch": self.micro_batch,
            "accumulation": self.accumulation,
            "global_batch": self.global_batch,
            "plan": self.plan or "none",
        }

    def changes(self, saved: dict[str, Any]) -> list[str]:
        """``key old -> new`` for every field of ``saved`` (a checkpoint's record) that differs
        from this run's, in record order."""
        now = self.record()
        uniform = all(str(r.get("degrees", "")).startswith("every region") for r in (saved, now))
        return [
            f"{key} {_text(saved[key])} -> {_text(value)}"
            for key, value in now.items()
            if key in saved and saved[key] != value and not (key == "degrees" and uniform)
        ]  # uniform: tp says it

    # ------------------------------------------------------------------------------ the lines
    def zero_text(self) -> str:
        """``stage 1 over dp=2``, ``stage 3 (no effect at dp=1)``, ``off``, or the stages of a
        plan that mixes them."""
        stages = sorted(set(self.zero))
        if stages == [0]:
            return "off"
        if len(stages) > 1:
            return "stages " + ", ".join(map(str, self.zero)) + " (by region, in chain order)"
        if self.dp == 1 and self.degrees.startswith("every region"):
            return f"stage {stages[0]} (no effect at dp=1)"
        return (
            f"stage {stages[0]} over dp={self.dp}"
            if self.degrees.startswith("every region")
            else f"stage {stages[0]} over each region's DP group"
        )

    def precision_text(self) -> str:
        return (
            f"{self.precision} = {self.compute} compute and activations, {self.master} "
            f"weights, gradients and optimizer state, gradients reduced in "
            f"{self.grad_reduce}"
        )

    def plan_line(self) -> str:
        """``plan (plan.json): megatron, n_sub=1, zero=1; every region tp=1; priced in ...``"""
        zero = (
            f", zero={self.zero[0]}"
            if len(set(self.zero)) == 1 and self.zero[0]
            else f", zero {'/'.join(map(str, sorted(set(self.zero))))} by region"
            if len(set(self.zero)) > 1
            else ""
        )
        sp = f", sequence-parallel ({self.sequence_parallel})" if self.sequence_parallel else ""
        priced = (
            "priced in " + _dtypes(self.plan_precision)
            if self.plan_precision
            else "its precision not recorded (a plan from before plans recorded it)"
        )
        return (
            f"plan ({self.plan}): {self.schedule}, n_sub={self.n_sub}{zero}{sp}; "
            f"{self.degrees}; {priced}"
        )

    def describe(self) -> list[str]:
        """The run's layout, schedule, memory levers, precision and batch, a line each."""
        sp = (
            f"sequence parallelism ({self.sequence_parallel})"
            if self.sequence_parallel
            else "no sequence parallelism"
        )
        ranks = f"{self.world_size} rank{'s' if self.world_size > 1 else ''}"
        stages = f"pp={self.pp} ({self.pp_schedule}) x " if self.pp > 1 else ""
        lines = [f"layout:    {ranks} = {stages}tp={self.tp} x dp={self.dp}; {self.degrees}"]
        if self.plan:
            lines.append(self.plan_line())
        lines += [
            f"schedule:  {self.schedule}, n_sub={self.n_sub}; {sp}",
            f"ZeRO:      {self.zero_text()}",
            f"precision: {self.precision_text()}",
            f"batch:     {self.global_batch} sequences a step = {self.accumulation} "
            f"micro-batch{'es' if self.accumulation > 1 else ''} x {self.micro_batch} "
            f"sequences (per model replica) x dp={self.dp}",
        ]
        return lines

    def toml_header(self) -> str:
        """``describe``'s lines as TOML comments: config.toml's head."""
        lines = [
            "# What this run did (resolved once at its start; the keys below load back):",
            *(f"#   {line}" for line in self.describe()),
        ]
        return "\n".join(lines) + "\n"

    def precision_mismatch(self) -> str | None:
        """One line when the plan was priced in other compute or grad-reduce dtypes than this
        run's; None when they agree or the plan recorded none."""
        want = self.plan_precision
        if not want or (want.get("compute"), want.get("grad_reduce")) == (
            self.compute,
            self.grad_reduce,
        ):
            return None
        return (
            f"the plan ({self.plan}) was priced in {_dtypes(want)}, this run computes in "
            f"{self.compute} with gradients reduced in {self.grad_reduce} "
            f"(train.precision={self.precision}): its predicted step time and memory are "
            f"for the other dtypes; plan again with --train.precision={self.compute}, or "
            f"train with --train.precision={want.get('compute')}"
        )


def _dtypes(record: dict[str, str]) -> str:
    return f"{record.get('compute', '?')} compute, {record.get('grad_reduce', '?')} grad reduce"


def _text(value: Any) -> str:
    if isinstance(value, list):
        return "/".join(map(str, value))
    return str(value)


def saved_record(manifest: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's ``run`` record; for a checkpoint saved before manifests held one, the
    fields its manifest and saved config give (world size, tp, dp, ZeRO, schedule, precision,
    micro-batch)."""
    if "run" in manifest:
        return manifest["run"]
    config = manifest.get("config", {})
    old: dict[str, Any] = {k: manifest[k] for k in ("world_size", "tp", "dp") if k in manifest}
    for key, (section, name) in {
        "zero": ("parallel", "zero"),
        "schedule": ("schedule", "name"),
        "precision": ("train", "precision"),
        "micro_batch": ("train", "micro_batch"),
    }.items():
        if name in config.get(section, {}):
            old[key] = config[section][name]
    return old
