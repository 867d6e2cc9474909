"""A step's batch in training's terms, and the cluster micro-batch the planner simulates: one
place for ``oases plan``, ``oases simulate`` and ``parallel.plan = "auto"``.

A micro-batch counts sequences per model replica (per DP rank) per forward/backward, as
``train.micro_batch`` and Megatron-LM's ``--micro-batch-size`` do, at a TP degree T
(``parallel.tp`` in training, ``--micro-batch-tp`` in ``oases simulate``): W ranks run
``micro_batch * W / T`` sequences per micro-batch across the cluster (a ``BatchShape``). T must
divide W, as ``parallel.tp`` must in training. ``oases plan`` and ``auto_plan`` keep that
cluster micro-batch for every plan: the activations of every region are the same sequences, so a
region at tp=t gives each of its replicas ``micro_batch * t / T``. ``oases simulate`` counts a
uniform row's micro-batch at the row's own degree, and keeps T's for auto rows (they mix
degrees)::

    spec = config_batch(cfg)                             # oases plan, parallel.plan = "auto"
    spec = simulate_batch(model, cluster, gb, mb, tp)    # oases simulate: flags, else the file
    shape = spec.shape(world, spec.global_batch)         # BatchShape(global_batch, micro_rows)
    rows = region_rows(plan, world, shape, n_sub)        # each region's sub-batch rows

``region_rows`` raises ``BatchSplitError`` where a plan's degrees and sub-batches do not divide
the micro-batch: that plan is not a candidate, rather than a mistake.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from oases.config import Config
    from oases.plan import ParallelPlan
    from oases.planner.clusters import Cluster

KEYS = ("global_batch", "micro_batch", "micro_batch_tp")
# how a user sets each number, "{}" for its value: in a run file (oases plan) or by flag
CONFIG_KNOBS = {
    "global_batch": "train.global_batch={}",
    "micro_batch": "train.micro_batch={}",
    "micro_batch_tp": "parallel.tp={}",
}
FLAG_KNOBS = {
    "global_batch": "--global-batch={}",
    "micro_batch": "--micro-batch={}",
    "micro_batch_tp": "--micro-batch-tp={}",
}


@dataclass(frozen=True)
class BatchShape:
    """How a step's batch is cut: ``global_batch`` sequences per optimizer step, fed
    ``micro_rows`` sequences at a time across the whole world (each rank sees
    ``micro_rows * t / world_size`` of them in a region of degree t)."""

    global_batch: int
    micro_rows: int

    def n_micro(self) -> int:
        return self.global_batch // self.micro_rows


class BatchSplitError(ValueError):
    """The batch does not split over a plan's degrees and sub-batches (the plan is not a
    candidate, rather than a mistake)."""


def region_rows(plan: ParallelPlan, world_size: int, batch: BatchShape, n_sub: int) -> list[int]:
    """Rows of one sub-batch in every region (BatchSplitError where they do not divide)."""
    if batch.global_batch % batch.micro_rows:
        raise BatchSplitError(
            f"global batch {batch.global_batch} is not a multiple of the "
            f"micro-batch {batch.micro_rows}"
        )
    rows = []
    for r in plan.regions:
        local, left = divmod(batch.micro_rows * r.tp, world_size)
        if left or local % n_sub or local == 0:
            raise BatchSplitError(
                f"region {r.name} at tp={r.tp}: a micro-batch of "
                f"{batch.micro_rows} "
                f"sequences over dp={r.dp} does not split into {n_sub} sub-batches"
            )
        rows.append(local // n_sub)
    return rows


@dataclass(frozen=True)
class BatchSpec:
    """``global_batch`` sequences per optimizer step (None: chosen by the caller);
    ``micro_batch`` sequences per model replica at tp=``micro_batch_tp`` (None: one sequence
    per rank, t per replica at tp=t). ``source``: where each number came from, for the
    header; ``knobs``: how a user sets each ("{}" for the value) and ``fix``: how a user passes
    another global batch, for the messages."""

    global_batch: int | None
    micro_batch: int | None
    micro_batch_tp: int
    source: dict[str, str] = field(default_factory=dict)
    knobs: dict[str, str] = field(default_factory=lambda: dict(FLAG_KNOBS))
    fix: str = "--global-batch {}"

    def __post_init__(self) -> None:
        for key in KEYS:
            value = getattr(self, key)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{self.named(key, value)} must be a whole number >= 1")

    def named(self, key: str, value: object) -> str:
        """How the user set ``key`` to ``value``: ``--micro-batch-tp=3``, ``parallel.tp=3``."""
        return self.knobs[key].format(value)

    def micro_rows(self, world: int, tp: int | None = None) -> int:
        """Sequences per micro-batch across ``world`` ranks for a uniform plan at ``tp``
        (None: the micro-batch counted at ``micro_batch_tp``, which every mixed plan keeps)."""
        t = tp or self.micro_batch_tp
        if world % t:
            raise ValueError(
                f"{self.named('micro_batch_tp', t)} does not divide the world size "
                f"{world}: the micro-batch counts sequences per model replica of "
                f"that many ranks, so a TP degree must divide the ranks"
            )
        return world if self.micro_batch is None else self.micro_batch * world // t

    def shape(
        self, world: int, global_batch: int | None = None, tp: int | None = None
    ) -> BatchShape:
        """The ``BatchShape`` of a plan at ``tp`` (None: a mixed or planned one) on ``world``
        ranks, for ``global_batch`` sequences per step (None: ``self.global_batch``)."""
        g = self.global_batch if global_batch is None else global_batch
        if g is None:
            raise ValueError("no global batch: give one")
        rows = self.micro_rows(world, tp)
        if g % rows:
            t = tp or self.micro_batch_tp
            at = f"of a plan at tp={tp}" if tp else f"at {self.named('micro_batch_tp', t)}"
            per = (
                f"{self.micro_batch} per model replica x {world} ranks / {t}"
                if self.micro_batch is not None
                else f"one sequence per rank x {world}"
            )
            raise ValueError(
                f"{self.named('global_batch', g)} is not a multiple of the cluster "
                f"micro-batch {at}: {rows} sequences ({per}); pass e.g. "
                + self.fix.format(rows * max(1, g // rows))
            )
        return BatchShape(g, rows)

    def describe(
        self,
        world: int,
        global_batch: int,
        every_plan: bool,
        auto_rows: bool = False,
        searched: bool = False,
    ) -> str:
        """One line: the step, the micro-batch and its unit, where each came from.
        ``every_plan``: every plan keeps the micro-batch counted at ``micro_batch_tp`` (``oases
        plan``); else a uniform plan counts it at its own degree (``oases simulate``), and
        ``auto_rows`` adds what the auto rows keep. ``searched`` (``oases plan``): the planner
        also tries other micro-batches of the same step."""
        src = self.source
        step = f"{global_batch} sequences per step ({src.get('global_batch', 'default')})"
        if self.micro_batch is None:
            return (
                f"{step}; micro-batch one sequence per rank ({world} across the cluster, t "
                "per model replica at tp=t)"
            )
        m, t = self.micro_batch, self.micro_batch_tp
        where = src.get("micro_batch", "--micro-batch")
        unit = (
            "(per DP rank"
            + ("" if where.startswith("train.micro_batch") else ", as train.micro_batch")
            + f"; {where})"
        )
        micro = f"micro-batch {m} {'sequence' if m == 1 else 'sequences'} per model replica {unit}"
        at = f"at tp={t} ({src.get('micro_batch_tp', 'micro_batch_tp')})"
        rows = self.micro_rows(world)
        if every_plan:
            n = global_batch // rows
            keeps = (
                "; the planner also tries 2^j times that micro-batch (|j| <= 3, dividing "
                "the step; --fixed-micro-batch keeps it)"
                if searched
                else ", which every plan keeps"
            )
            return (
                f"{step}; {micro} {at} = {rows} across the {world} ranks, {n} "
                f"micro-batch{'' if n == 1 else 'es'} per step{keeps} (a "
                f"region at tp=t gives each replica {rows}*t/{world})"
            )
        auto = (
            f"; auto plans keep that of tp={t}: {rows} sequences "
            f"({src.get('micro_batch_tp', 'micro_batch_tp')})"
            if auto_rows
            else ""
        )
        return f"{step}; {micro}: a plan at tp=t runs {m}*{world}/t across the cluster{auto}"


def config_batch(cfg: Config) -> BatchSpec:
    """The batch of a run file: ``train.global_batch``, ``train.micro_batch`` per model
    replica at ``parallel.tp``."""
    return BatchSpec(
        cfg.train.global_batch,
        cfg.train.micro_batch,
        cfg.parallel.tp,
        {k: v.removesuffix("={}") for k, v in CONFIG_KNOBS.items()},
        dict(CONFIG_KNOBS),
        "--train.global_batch={}",
    )


def simulate_batch(
    model: str,
    cluster: Cluster,
    global_batch: int | None,
    micro_batch: int | None,
    micro_batch_tp: int | None,
) -> BatchSpec:
    """The batch of ``oases simulate``: the flags where given; else, for ``--model`` a TOML run
    file, the ``train.global_batch``, ``train.micro_batch`` and ``parallel.tp`` the file sets
    (``micro_batch`` counts at ``parallel.tp``, as in training); else one sequence per GPU, one
    micro-batch per step. ``--micro-batch-tp`` only sets the unit of a micro-batch, so it needs
    one (the flag or the file's) and must divide the cluster's GPUs."""
    source: dict[str, str] = {}
    knobs = dict(FLAG_KNOBS)
    train: dict = {}
    parallel: dict = {}
    if Path(model).suffix == ".toml":
        import tomllib

        try:
            raw = tomllib.loads(Path(model).read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"cannot read {model}: {exc}") from None
        train, parallel = raw.get("train", {}), raw.get("parallel", {})
    for key, value in (("global_batch", global_batch), ("micro_batch", micro_batch)):
        if value is not None:
            source[key] = FLAG_KNOBS[key].removesuffix("={}")
        elif key in train:
            source[key] = f"train.{key} of {model}"
            knobs[key] = f"train.{key}={{}} in {model}"
    gb = global_batch if global_batch is not None else train.get("global_batch")
    mb = micro_batch if micro_batch is not None else train.get("micro_batch")
    if micro_batch_tp is not None:
        if mb is None:
            raise ValueError(
                f"--micro-batch-tp={micro_batch_tp} sets the TP degree at which "
                "--micro-batch counts sequences per model replica: give "
                "--micro-batch M too (without one every plan runs one sequence "
                "per GPU)"
            )
        tp, source["micro_batch_tp"] = micro_batch_tp, "--micro-batch-tp"
    elif micro_batch is None and "micro_batch" in train:  # the file's micro-batch, its unit
        tp = parallel.get("tp", 1)
        source["micro_batch_tp"] = f"parallel.tp of {model}"
        knobs["micro_batch_tp"] = f"parallel.tp={{}} in {model}"
    else:
        tp = cluster.server.gpus_per_server
        source["micro_batch_tp"] = "default: one server's GPUs"
    spec = BatchSpec(gb, mb, tp, source, knobs)
    spec.micro_rows(cluster.world_size)  # the unit's degree divides the GPUs
    return spec
