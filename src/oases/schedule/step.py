"""``Schedule``: a named schedule that steps a parallelized model through the executor (the
package docstring, ``oases.schedule``, says what a step does); ``build_schedule`` makes one."""

from __future__ import annotations

import math
import weakref

import torch
from torch import Tensor

from oases.model import Transformer, check_batch
from oases.parallel import comm
from oases.precision import accum_dtype
from oases.schedule.executor import Executor
from oases.schedule.instructions import Instr
from oases.schedule.pipeline_program import build_stage_program
from oases.schedule.program import build_program
from oases.schedule.specs import SP_MODES, SPECS, sub_batches


class Schedule:
    """A named schedule, ready to step any parallelized model (one executor per model)."""

    def __init__(
        self,
        name: str,
        n_sub: int = 2,
        micro_batch: int | None = None,
        max_inflight: int = 1,
        grad_reduce_dtype: torch.dtype | None = None,
        sp: str | None = None,
        defer_weight_grads: bool = True,
    ) -> None:
        if name not in SPECS:
            raise ValueError(f"unknown schedule {name!r}; valid: {', '.join(SPECS)}")
        if n_sub < 1 or max_inflight < 1 or (micro_batch is not None and micro_batch < 1):
            raise ValueError(
                f"schedule.n_sub={n_sub}, schedule.max_inflight={max_inflight} and "
                f"train.micro_batch={micro_batch} must be at least 1"
            )
        self.name, self.spec = name, SPECS[name]
        self.spec.check_n_sub(n_sub)
        if sp is None and self.spec.sequence_parallel:
            sp = "gathered"
        if sp is not None and sp not in SP_MODES:
            raise ValueError(f"sequence-parallel mode {sp!r}; valid: {', '.join(SP_MODES)}")
        self.sp = sp  # sequence parallelism: what a region keeps of its gathered input; None: off
        self.defer_weight_grads = defer_weight_grads  # under sp (``sp_tasks.sp_chain``)
        self.n_sub, self.micro_batch, self.max_inflight = n_sub, micro_batch, max_inflight
        self.grad_reduce_dtype = grad_reduce_dtype  # None: the gradients' own dtype
        # per model, dropped with the model
        self._executors: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._programs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __repr__(self) -> str:
        return (
            f"Schedule({self.name!r}, n_sub={self.n_sub}, micro_batch={self.micro_batch}, "
            f"max_inflight={self.max_inflight}, sp={self.sp!r})"
        )

    def executor(self, model: Transformer) -> Executor:
        if model.parallel_ctx is None:
            raise ValueError("a schedule steps a parallelized model: call oases.parallelize first")
        if model not in self._executors:
            self._executors[model] = Executor(model, self.spec, self.grad_reduce_dtype, sp=self.sp)
        return self._executors[model]

    def program(self, model: Transformer, rows: int) -> list[Instr]:
        """The instruction list of one step over ``rows`` local sequences."""
        n_micro, _ = self.split(rows)
        ex = self.executor(model)
        programs = self._programs.setdefault(model, {})
        plan = model.parallel_plan
        if n_micro not in programs and plan.pp > 1:
            programs[n_micro] = build_stage_program(
                self.name,
                self.n_sub,
                ex.layout,
                ex.stage,
                n_micro=n_micro,
                pp_schedule=plan.pp_schedule,
                max_inflight=self.max_inflight,
                dp_tasks=tuple(sorted(ex.buckets)),
                degrees=ex.degrees,
                zero=ex.zero_layout,
                sp=self.sp,
                defer_weight_grads=self.defer_weight_grads,
                tied=model.cfg.tie_embeddings,
            )
        if n_micro not in programs:
            programs[n_micro] = build_program(
                self.name,
                len(ex.chain),
                self.n_sub,
                n_micro=n_micro,
                max_inflight=self.max_inflight,
                dp_tasks=tuple(sorted(ex.buckets)),
                degrees=ex.degrees,
                zero=ex.zero_layout,
                sp=self.sp,
                defer_weight_grads=self.defer_weight_grads,
            )
        return programs[n_micro]

    def split(self, rows: int) -> tuple[int, int]:
        """(micro-batches, sub-batches per micro-batch) for ``rows`` local sequences."""
        mb = self.micro_batch or rows
        k = sub_batches(self.name, self.n_sub)
        if rows % mb or mb % k:
            raise ValueError(
                f"local batch of {rows} rows must split into micro-batches of "
                f"train.micro_batch={mb} rows, each into schedule.n_sub={k} "
                "sub-batches"
            )
        return rows // mb, k

    def step(self, model: Transformer, tokens: Tensor, targets: Tensor) -> Tensor:
        """Forward + backward of tokens/targets [rows, S]; returns the mean loss (detached)."""
        check_batch(model.cfg, tokens, targets)
        n_micro, k = self.split(tokens.shape[0])
        rows, degrees = tokens.shape[0] // (n_micro * k), self.executor(model).degrees
        for t in degrees:  # a reshard that shrinks the degree slices the sub-batch
            if rows * t % degrees[0]:
                raise ValueError(
                    f"a sub-batch of {rows} rows at the embedding's tp={degrees[0]} "
                    f"has no whole share at tp={t}: use a multiple of "
                    f"{degrees[0] // math.gcd(degrees[0], t)} rows per sub-batch"
                )
        program = self.program(model, tokens.shape[0])
        subs_t = list(tokens.chunk(n_micro * k))  # [rows / (n_micro k), S] each
        subs_y = list(targets.chunk(n_micro * k))
        losses = self.executor(model).run(program, subs_t, subs_y, 1.0 / (n_micro * k))
        if model.parallel_plan.pp == 1:
            return torch.stack(losses).mean()
        ctx = model.parallel_ctx  # the last stage's loss, to every stage
        dtype = accum_dtype(next(model.parameters()).dtype)
        loss = (
            torch.stack(losses).mean().to(dtype)
            if losses
            else torch.zeros((), dtype=dtype, device=ctx.device)
        )
        return comm.all_reduce_(loss.reshape(1), ctx.pp_group, tag="pp-loss")[0]


def build_schedule(
    name: str,
    n_sub: int = 2,
    micro_batch: int | None = None,
    max_inflight: int = 1,
    grad_reduce_dtype: torch.dtype | None = None,
    sp: str | None = None,
    defer_weight_grads: bool = True,
) -> Schedule:
    """The schedule called ``name`` (ValueError listing the valid names otherwise).
    ``grad_reduce_dtype``: the dtype of the data-parallel gradient reduction (None: the
    gradients' own; ``Precision.grad_reduce_dtype``). ``sp``: sequence parallelism ("gathered"
    or "shards": what a TP region keeps of its gathered input, ``program.build_program``;
    None: off, except for megatron-sp); ``defer_weight_grads``: under it, a block region's weight
    gradients run after its reduce-scatter and the next gather have started (False: inline,
    for comparison)."""
    return Schedule(
        name, n_sub, micro_batch, max_inflight, grad_reduce_dtype, sp, defer_weight_grads
    )
