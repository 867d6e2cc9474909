"""``oases simulate``'s ``auto,pp=P``: the pipeline search (``planner.pipeline_search``) at one
depth, for one schedule inside the stages::

    SCHEDULE@auto,pp=P[,pps=ORDER][,zero=Z][,sp=MODE]
        search_pipelines(depth P only; schedule SCHEDULE; its sub-batch counts; every TP
                         degree up to max_tp (default a server's GPUs) per stage, mixed ones
                         included; ZeRO 0-2 or Z; sp off and MODE or both; pipeline order
                         ORDER or every one the search prices)
        -> the plan it chose (stages, order, degrees) and the stage micro-batch it ran

The row then prices that plan as any other (``whatif._make_row``); it is not reseeded with the
degrees other auto rows found (those are plans without a pipeline).
"""

from __future__ import annotations

from oases.config import ModelConfig
from oases.plan import ParallelPlan
from oases.planner.batch import BatchShape
from oases.planner.costs import Costs
from oases.planner.pipeline_search import PIPELINE_ZEROS, SEARCHED_ORDERS, search_pipelines
from oases.planner.sim_inputs import PlanSpec


def auto_pipeline(
    cfg: ModelConfig,
    costs: Costs,
    world: int,
    batch: BatchShape,
    budget_bytes: float,
    schedule: str,
    spec: PlanSpec,
    n_subs: tuple[int, ...],
    degrees: list[int],
    max_tp: int | None,
    max_inflight: int = 1,
) -> tuple[ParallelPlan, BatchShape]:
    """The fastest fitting plan of ``spec.pp`` stages running ``schedule`` inside them, and the
    micro-batch it was walked with (``batch``: the world's micro-batch; module docstring).
    ValueError with the numbers where the spec asks for a ZeRO stage the runtime does not run
    under a pipeline, or no plan fits (``spec.pps``: checked by the spec's parser)."""
    where = f"{schedule}@{spec}"
    if spec.zero is not None and spec.zero not in PIPELINE_ZEROS:
        raise ValueError(
            f"{where}: zero={spec.zero}: under a pipeline the runtime runs ZeRO "
            f"{max(PIPELINE_ZEROS)} at most"
        )
    cluster = getattr(costs, "cluster", None)
    cap = max_tp or (cluster.server.gpus_per_server if cluster is not None else world)
    found = search_pipelines(
        cfg,
        costs,
        world,
        batch,
        budget_bytes,
        schedules=(schedule,),
        degrees=[t for t in degrees if t <= cap],
        n_subs=n_subs,
        zeros=PIPELINE_ZEROS if spec.zero is None else (spec.zero,),
        sps=("", *spec.sp_modes()),
        pp_options=(spec.pp,),
        pp_schedules=SEARCHED_ORDERS if spec.pps is None else (spec.pps,),
        max_inflight=max_inflight,
    )
    if found.best is None:
        why = "; ".join(found.notes) or (
            f"{found.walked} plans walked, none under {budget_bytes / 2**30:.2f} GiB per GPU"
            if found.walked
            else f"a micro-batch of {batch.micro_rows} sequences does not split into "
            f"{spec.pp} stages' micro-batches at any degree up to tp={cap}"
        )
        raise ValueError(f"{where}: no pipeline plan of {spec.pp} stages: {why}")
    assert found.best.batch is not None
    return found.best.plan, found.best.batch
