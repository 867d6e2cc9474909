"""``ParallelPlan``: the TP degree of every region of the chain, as a serializable dataclass.

A plan lists the regions in chain order (``embed``, ``blocks.{l}.attn``, ``blocks.{l}.mlp``,
``head``) with their TP degree ``tp`` and data-parallel degree ``dp = world_size / tp``. Where two
consecutive regions differ, the activations are resharded along the batch between them (see
``oases.parallel.comm.reshard_batch``). JSON keys: ``regions`` (a list of ``{name, tp, dp}``),
``n_sub``, ``schedule``, ``predicted_step_s``, ``predicted_peak_mem_bytes``; a region may add
``zero`` (its ZeRO stage, 0-3; absent: the run's ``parallel.zero``). ``sequence_parallel``
("" off; "gathered" or "shards": Megatron's sequence parallelism, naming what a TP
region keeps of its gathered input, ``schedule.program.build_program``) is per plan: every degree
must divide the sequence. ``precision`` (``{compute, grad_reduce, master}`` dtype names,
``planner.precision.PlanPrecision.describe``) is what the planner priced the plan in; a run in
other dtypes says so in one line (``train.effective``); absent in plans from before it was
recorded.

Pipeline (``pp`` > 1, written only then): ``pp`` stages of ``world_size / pp`` ranks each, every
region's ``dp = world_size / (pp * tp)``; ``stage_starts`` the first region of each stage after
the first (empty: ``oases.stages.default_stage_starts``, balanced by blocks); ``pp_schedule``
the order of the stages' passes (``schedule.pipeline_order``); ``pp_chunks`` the model chunks
per stage of the "interleaved" schedule (written only above 1; ``stage_starts`` then gives the
first region of each of the ``pp * pp_chunks`` virtual stages after the first).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from oases.config import ModelConfig
from oases.config.checks import check_sequence_split
from oases.stages import (
    StageLayout,
    check_chunks,
    check_pipeline_schedule,
    check_stage_starts,
    default_stage_starts,
)


@dataclass(frozen=True)
class RegionPlan:
    name: str
    tp: int
    dp: int
    zero: int | None = None  # ZeRO stage of the region's parameters (None: parallel.zero)


def region_names(cfg: ModelConfig) -> list[str]:
    """The chain's region names in forward order."""
    blocks = [f"blocks.{i}.{kind}" for i in range(cfg.n_layers) for kind in ("attn", "mlp")]
    return ["embed", *blocks, "head"]


@dataclass
class ParallelPlan:
    regions: list[RegionPlan]
    n_sub: int = 2
    schedule: str = "oases"
    predicted_step_s: float | None = None
    predicted_peak_mem_bytes: int | None = None
    notes: dict = field(default_factory=dict)
    sequence_parallel: str = ""  # "" | "gathered" | "shards"
    precision: dict[str, str] | None = None  # the dtypes it was priced in (None: unknown)
    pp: int = 1  # pipeline stages
    pp_schedule: str = "1f1b"  # schedule.pipeline_order.PIPELINE_SCHEDULES
    stage_starts: list[int] = field(default_factory=list)  # [] = default_stage_starts
    pp_chunks: int = 1  # model chunks per stage (the interleaved schedule)

    def sp(self) -> str | None:
        """``build_schedule``'s ``sp``: None when off (a schedule that is always
        sequence-parallel, megatron-sp, is "gathered" without it)."""
        from oases.schedule.specs import SPECS

        spec = SPECS.get(self.schedule)
        return self.sequence_parallel or (
            "gathered" if spec is not None and spec.sequence_parallel else None
        )

    @staticmethod
    def uniform(cfg: ModelConfig, world_size: int, tp: int, **kw: object) -> ParallelPlan:
        """Every region at ``tp`` (``kw``: the other fields, e.g. ``pp=2``)."""
        pp = int(kw.get("pp", 1))  # type: ignore[call-overload]
        dp = world_size // (pp * tp) if pp >= 1 else 0
        return ParallelPlan([RegionPlan(n, tp, dp) for n in region_names(cfg)], **kw)

    def stage_layout(self) -> StageLayout:
        """Which regions each pipeline stage holds (one stage when ``pp`` is 1)."""
        n_layers = (len(self.regions) - 2) // 2
        starts = (
            tuple(self.stage_starts)
            if self.stage_starts
            else default_stage_starts(n_layers, self.pp * self.pp_chunks)
        )
        return StageLayout(len(self.regions), starts, self.pp_chunks)

    def tp_of(self, name: str) -> int:
        for r in self.regions:
            if r.name == name:
                return r.tp
        raise ValueError(f"plan has no region {name!r}")

    def degrees(self) -> tuple[int, ...]:
        return tuple(sorted({r.tp for r in self.regions}))

    def degree_runs(self) -> str:
        """The degrees along the chain, consecutive blocks of the same degrees merged::

            embed tp=4; blocks 0-5 tp=2; blocks 6-9 attn tp=2, mlp tp=8; head tp=4

        (a uniform plan reads ``every region tp=2``)."""
        if self.is_uniform():
            return f"every region tp={self.regions[0].tp}"
        tp = {r.name: r.tp for r in self.regions}
        n_blocks = sum(1 for r in self.regions if r.name.endswith(".attn"))
        runs: list[list] = []  # [first block, last block, (attn tp, mlp tp)]
        for b in range(n_blocks):
            pair = (tp[f"blocks.{b}.attn"], tp[f"blocks.{b}.mlp"])
            if runs and runs[-1][2] == pair:
                runs[-1][1] = b
            else:
                runs.append([b, b, pair])
        parts = [f"embed tp={tp['embed']}"]
        for first, last, (attn, mlp) in runs:
            where = f"block {first}" if first == last else f"blocks {first}-{last}"
            parts.append(
                f"{where} tp={attn}" if attn == mlp else f"{where} attn tp={attn}, mlp tp={mlp}"
            )
        return "; ".join([*parts, f"head tp={tp['head']}"])

    def is_uniform(self) -> bool:
        return len(self.degrees()) == 1

    def check(self, cfg: ModelConfig, world_size: int) -> None:
        """ValueError (with the numbers) unless the plan fits this model and world."""
        names = [r.name for r in self.regions]
        if names != region_names(cfg):
            raise ValueError(
                f"plan regions {names[:3]}... do not match the model's chain "
                f"{region_names(cfg)[:3]}... ({len(names)} vs "
                f"{len(region_names(cfg))} regions)"
            )
        made_for = {r.tp * r.dp * self.pp for r in self.regions}
        if len(made_for) == 1 and made_for != {world_size}:
            (planned,) = made_for
            first = self.regions[0]
            raise ValueError(
                f"the plan was made for {planned} ranks ({first.name}: tp={first.tp}"
                f" x dp={first.dp}), this run has {world_size}: run it on "
                f"{planned} ranks (--nproc-per-node {planned}), or plan again for "
                f"{world_size}"
            )
        if self.pp < 1 or world_size % self.pp:
            raise ValueError(
                f"plan pp={self.pp} must be a positive divisor of the world size {world_size}"
            )
        stage = world_size // self.pp  # ranks per pipeline stage
        where = f"world size {world_size}" + (f" over pp={self.pp} stages" if self.pp > 1 else "")
        for r in self.regions:
            if r.tp < 1 or stage % r.tp or r.dp != stage // r.tp:
                raise ValueError(f"plan region {r.name}: tp={r.tp}, dp={r.dp} do not fit {where}")
            kind = r.name.rsplit(".", 1)[-1]
            checks = {
                "attn": (("n_heads", cfg.n_heads), ("n_kv_heads", cfg.n_kv_heads)),
                "mlp": (("ffn_dim", cfg.ffn_dim),),
            }.get(kind, ())
            for key, value in checks:
                if value % r.tp:
                    raise ValueError(
                        f"plan region {r.name}: model.{key}={value} is not divisible by tp={r.tp}"
                    )
        for a, b in zip(self.regions, self.regions[1:]):  # a reshard gathers or slices
            if max(a.tp, b.tp) % min(a.tp, b.tp):
                raise ValueError(
                    f"plan regions {a.name} (tp={a.tp}) and {b.name} (tp={b.tp}): "
                    "neighbouring degrees must divide one another"
                )
        if self.sp():
            if self.sp() not in ("gathered", "shards"):
                raise ValueError(
                    f"plan sequence_parallel={self.sequence_parallel!r} must be "
                    '"", "gathered" or "shards"'
                )
            check_sequence_split(cfg.seq_len, self.degrees())
        if cfg.tie_embeddings and self.tp_of("embed") != self.tp_of("head"):
            raise ValueError(
                f"tied embeddings need one degree for embed and head, got "
                f"{self.tp_of('embed')} and {self.tp_of('head')}"
            )
        if self.pp > 1:
            self._check_pipeline(cfg)

    def _check_pipeline(self, cfg: ModelConfig) -> None:
        check_pipeline_schedule(self.pp_schedule)
        check_chunks(self.pp_schedule, self.pp_chunks, cfg.n_layers, self.pp)
        if self.stage_starts:
            check_stage_starts(tuple(self.stage_starts), cfg.n_layers, self.pp * self.pp_chunks)
        layout = self.stage_layout()
        for b in layout.starts:
            before, after = self.regions[b - 1], self.regions[b]
            if before.tp != after.tp:
                raise ValueError(
                    f"plan regions {before.name} (tp={before.tp}) and {after.name} "
                    f"(tp={after.tp}) sit on either side of a pipeline stage "
                    "boundary, which needs one TP degree on both sides"
                )

    def zero_stages(self, default: int = 0) -> tuple[int, ...]:
        """The ZeRO stage of every region (``default`` where the plan gives none)."""
        return tuple(default if r.zero is None else r.zero for r in self.regions)

    def to_json(self) -> str:
        raw = asdict(self)
        if raw["precision"] is None:
            del raw["precision"]
        for r in raw["regions"]:
            if r["zero"] is None:
                del r["zero"]
        if self.pp == 1:  # a plan without a pipeline reads as before
            for key in ("pp", "pp_schedule", "stage_starts"):
                del raw[key]
        if self.pp_chunks == 1:
            del raw["pp_chunks"]
        return json.dumps(raw, indent=1)

    @staticmethod
    def from_json(text: str) -> ParallelPlan:
        try:
            raw = json.loads(text)
            regions = [
                RegionPlan(
                    str(r["name"]),
                    int(r["tp"]),
                    int(r["dp"]),
                    None if r.get("zero") is None else int(r["zero"]),
                )
                for r in raw.pop("regions")
            ]
            for r in regions:
                if r.zero not in (None, 0, 1, 2, 3):
                    raise ValueError(f"region {r.name}: zero={r.zero} must be 0, 1, 2 or 3")
            return ParallelPlan(regions, **raw)
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"not a plan: {exc}") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(self.to_json())

    @staticmethod
    def load(path: str | os.PathLike[str]) -> ParallelPlan:
        try:
            return ParallelPlan.from_json(Path(path).read_text())
        except OSError as exc:
            raise ValueError(f"cannot read plan {path}: {exc.strerror}") from None
