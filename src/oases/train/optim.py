"""The optimizer side of a training step: AdamW with its parameter groups, the LR schedule, and
gradient clipping by the global norm of a model sharded over one or several TP degrees.

Under ZeRO (``parallel/shard.py``) the optimizer is ``ZeroAdamW``: torch's AdamW over the pieces
of parameters that lie in this rank's shards (AdamW is element-wise, so this is AdamW on whole
parameters, with moments for 1/d of them), and the clipping norm adds the gradient shards."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor, nn

from oases.config import TrainConfig
from oases.parallel import comm
from oases.parallel.apply import shard_spec
from oases.parallel.context import Group
from oases.parallel.shard import Segment, ZeroShards, ZeroUnit, zero_shards
from oases.precision import accum_dtype

BETAS, EPS = (0.9, 0.95), 1e-8


def lr_at(step: int, t: TrainConfig) -> float:
    """Learning rate of 0-based ``step``: linear warmup to ``lr``, cosine decay to ``min_lr``."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _decays(name: str) -> bool:
    """Biases, norms and embeddings (by name) get no weight decay."""
    return not (name.endswith("bias") or "norm" in name or "embed" in name)


def build_optimizer(model: nn.Module, t: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; biases, norms and embeddings (by name) get no weight decay. A model with ZeRO
    shards (``shard_model``) gets ``ZeroAdamW``."""
    if zero_shards(model) is not None:
        return ZeroAdamW(model, t.weight_decay, lr_at(0, t))
    decay, no_decay = [], []
    for name, p in model.named_parameters():  # a tied weight appears once, as embed.weight
        if not p.requires_grad:
            continue
        (decay if _decays(name) else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": t.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr_at(0, t), betas=BETAS, eps=EPS)


class ZeroAdamW:
    """AdamW for a model with ZeRO shards: the moments of sharded regions exist only for this
    rank's shard; unsharded regions' parameters are stepped whole.

    The optimizer's tensors for a sharded region are views of the rank's shard, one per
    parameter piece in it (``Segment``), with the parameter's weight decay; their gradients are
    the matching views of ``grad_shard``. ``step`` updates the shards in place; at stages 1-2
    the next step's program all-gathers them into every rank's full weights (read them between
    steps inside ``shard.materialized``); at stage 3 the shard is the weight.
    ``param_groups`` (the learning rate) and ``zero_grad`` behave as torch's.
    """

    def __init__(self, model: nn.Module, weight_decay: float, lr: float) -> None:
        shards = zero_shards(model)
        assert shards is not None
        self.shards: ZeroShards = shards
        decays = {id(p): _decays(n) for n, p in model.named_parameters()}
        self.pieces: list[tuple[Tensor, ZeroUnit, Segment]] = []  # (view of the shard, ...)
        groups: dict[bool, list[Tensor]] = {True: [], False: []}
        for u in shards.units.values():
            for seg in u.segments:
                view = u.shard[seg.offset : seg.offset + seg.size]
                self.pieces.append((view, u, seg))
                groups[decays[id(seg.param)]].append(view)
        for _, p in model.named_parameters():
            if p.requires_grad and not shards.is_sharded(p):
                groups[decays[id(p)]].append(p)
        self.inner = torch.optim.AdamW(
            [
                {"params": groups[True], "weight_decay": weight_decay},
                {"params": groups[False], "weight_decay": 0.0},
            ],
            lr=lr,
            betas=BETAS,
            eps=EPS,
        )
        self.steps = 0
        self._full: dict[nn.Parameter, dict[str, Tensor]] | None = None

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self) -> dict:
        """AdamW's state per parameter; whole parameters' only inside ``full_state()``."""
        return self.inner.state if self._full is None else self._full

    def step(self) -> None:
        for view, u, seg in self.pieces:
            view.grad = (
                None if u.grad_shard is None else u.grad_shard[seg.offset : seg.offset + seg.size]
            )
        self.inner.step()
        self.steps += 1
        self.shards.mark_updated()  # the next step's program gathers them (shard.py)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        for view, *_ in self.pieces:
            view.grad = None
        self.shards.zero_grad()

    @contextlib.contextmanager
    def full_state(self, write_back: bool = False) -> Iterator[None]:
        """Inside the block, ``state[p]`` is AdamW's state of every whole parameter ``p``
        (``step``, ``exp_avg``, ``exp_avg_sq``), the moments of sharded regions all-gathered
        over their DP groups: what a checkpoint saves, in the layout of an unsharded run.
        ``write_back``: the block loaded new values (a checkpoint), which each rank then copies
        into its shard's state."""
        full: dict = {}
        for u in self.shards.units.values():
            flats = {}
            for key in ("exp_avg", "exp_avg_sq"):
                buf = u.shard.new_zeros(u.shard_numel)
                for view, unit, seg in self.pieces:
                    state = self.inner.state.get(view)
                    if unit is u and state:
                        buf[seg.offset : seg.offset + seg.size].copy_(state[key])
                flats[key] = u.shard.new_empty(u.shard_numel * u.group.size)
                comm.all_gather_into_async(flats[key], buf, u.group, tag="optim-state").wait()
            for p, off in zip(u.params, u.offsets):
                full[p] = {"step": torch.tensor(float(self.steps), dtype=torch.float32)}
                for key, flat in flats.items():
                    full[p][key] = flat[off : off + p.numel()].view_as(p)
        views = {id(view) for view, *_ in self.pieces}
        for group in self.inner.param_groups:  # unsharded parameters: AdamW's own state
            for p in group["params"]:
                if id(p) not in views:
                    full[p] = self.inner.state[p]
        self._full = full
        try:
            yield
        finally:
            self._full = None
        if write_back:
            self._load_full(full)

    def _load_full(self, full: dict) -> None:
        steps = {float(st["step"]) for p, st in full.items() if self.shards.is_sharded(p)}
        if steps:
            self.steps = int(max(steps))
        for view, _, seg in self.pieces:
            src = full[seg.param]
            self.inner.state[view] = {
                "step": torch.tensor(float(self.steps), dtype=torch.float32),
                "exp_avg": src["exp_avg"].reshape(-1)[seg.start : seg.stop].clone(),
                "exp_avg_sq": src["exp_avg_sq"].reshape(-1)[seg.start : seg.stop].clone(),
            }


def clip_grad_norm_(
    params: Iterable[nn.Parameter],
    max_norm: float,
    tp_group: Group,
    tp_groups: dict[int, Group] | None = None,
    shards: ZeroShards | None = None,
    world_group: Group | None = None,
    pp_group: Group | None = None,
    uncounted: frozenset[int] = frozenset(),
) -> float:
    """Clip ``.grad`` in place by the global norm of the full (unsharded) model's gradient.

    Sharded parameters contribute their local sum of squares, summed over their TP group by one
    all-reduce per group (``tp_groups``: id(parameter) -> its TP group where that is not
    ``tp_group``, as under a mixed-degree plan); replicated parameters hold the same gradient on
    every rank of their TP group and are counted once. Gradients must already be averaged over
    DP. ``max_norm <= 0`` only measures. Returns the norm before clipping.

    ``shards`` (ZeRO): the gradient shards of sharded regions count too (their parameters have
    no ``.grad``): every element lies in exactly one DP shard of one TP rank, so their sums of
    squares add up over ``world_group`` (the ranks of the model: a pipeline stage's) in one
    all-reduce, a TP-replicated element counted once per TP rank of its region, which is
    divided out.

    Pipeline stages: each stage sums its own parameters' squares as above, and ``pp_group``
    (this stage rank in every stage) adds the stages' sums; ``uncounted`` (ids) are clipped but
    not counted: the last stage's copy of a tied embedding (``stage_model.tied_copy``), which
    the first stage counts.
    """
    params = [p for p in {id(p): p for p in params}.values() if p.grad is not None]
    zero_part = None if shards is None else _shard_sum_of_squares(shards, world_group, uncounted)
    across = pp_group is not None and pp_group.size > 1
    if not params and zero_part is None and not across:
        return 0.0
    if not params:
        total = zero_part if zero_part is not None else torch.zeros(())
        return _apply_clip([], shards, max_norm, _stages_norm(total, pp_group))
    # sums of squares in at least fp32 (float64 gradients: float64)
    zero = params[0].grad.new_zeros((), dtype=accum_dtype(params[0].grad.dtype))
    groups = tp_groups or {}
    counted = [p for p in params if id(p) not in uncounted]
    sharded = {tp_group.ranks: (tp_group, zero.clone())}  # ranks -> (group, sum of squares)
    for p in counted:
        if shard_spec(p) is not None:
            group = groups.get(id(p), tp_group)
            _, acc = sharded.get(group.ranks, (group, zero))
            sharded[group.ranks] = (group, acc + p.grad.to(zero.dtype).pow(2).sum())
    replicated = sum(
        (p.grad.to(zero.dtype).pow(2).sum() for p in counted if shard_spec(p) is None), zero
    )
    total = replicated
    for _, (group, acc) in sorted(sharded.items(), key=lambda kv: len(kv[0])):  # same order on
        # every rank: one TP group per degree
        total = (
            total
            + comm.all_reduce_(acc.reshape(1), group, direction="backward", tag="grad-norm")[0]
        )
    if zero_part is not None:
        total = total + zero_part.to(total.dtype)
    return _apply_clip(params, shards, max_norm, _stages_norm(total, pp_group))


def _stages_norm(total: Tensor, pp_group: Group | None) -> float:
    """The norm from this stage's sum of squares, summed over the pipeline's stages."""
    if pp_group is not None and pp_group.size > 1:
        total = comm.all_reduce_(
            total.reshape(1).clone(), pp_group, direction="backward", tag="grad-norm"
        )[0]
    return float(total.sqrt())


def _shard_sum_of_squares(
    shards: ZeroShards, world_group: Group | None, uncounted: frozenset[int] = frozenset()
) -> Tensor:
    """The sum of squares of every sharded region's gradient, over all ranks (one all-reduce
    over ``world_group``), without the parameters in ``uncounted``."""
    if world_group is None:
        raise ValueError("clip_grad_norm_ with ZeRO shards needs the world group")
    units = list(shards.units.values())
    ref = units[0].shard
    acc = ref.new_zeros((1,), dtype=accum_dtype(ref.dtype))
    for u in units:
        if u.grad_shard is None:
            continue
        tp = world_group.size // u.group.size  # the region's TP degree
        for seg in u.segments:
            if id(seg.param) in uncounted:
                continue
            sq = u.grad_shard[seg.offset : seg.offset + seg.size].to(acc.dtype).pow(2).sum()
            acc += sq if shard_spec(seg.param) is not None else sq / tp
    return comm.all_reduce_(acc, world_group, direction="backward", tag="grad-norm")[0]


def _apply_clip(
    params: list[nn.Parameter], shards: ZeroShards | None, max_norm: float, norm: float
) -> float:
    if max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for p in params:
            p.grad.mul_(coef)
        for u in shards.units.values() if shards is not None else ():
            if u.grad_shard is not None:
                u.grad_shard.mul_(coef)
    return norm


@contextlib.contextmanager
def whole_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | ZeroAdamW, write_back: bool = False
) -> Iterator[None]:
    """Whole weights, and AdamW's state per whole parameter, inside the block: what checkpoints
    save and load. Under ZeRO both are all-gathered over the DP groups (``write_back``: the
    block loaded new values, which each rank then keeps its shard of); otherwise a no-op."""
    from oases.parallel.shard import materialized

    if not isinstance(optimizer, ZeroAdamW):
        yield
        return
    with materialized(model, write_back), optimizer.full_state(write_back):
        yield


def model_state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer | ZeroAdamW
) -> dict[str, int]:
    """Bytes of model state this rank holds, by kind, from the tensors themselves: weights as
    kept between steps (a stage-3 region: its shard), gradients as the optimizer sees them
    (whole ``.grad``, or a sharded region's gradient shard), and AdamW's moments (whole, or a
    shard's). Call after the backward, before ``zero_grad``, to count the gradients."""
    shards = zero_shards(model)
    out = {"weights": 0, "gradients": 0, "optimizer": 0}
    for p in {id(p): p for p in model.parameters()}.values():
        if shards is not None and shards.is_sharded(p):
            continue
        out["weights"] += p.numel() * p.element_size()
        if p.grad is not None:
            out["gradients"] += p.grad.numel() * p.grad.element_size()
    if shards is not None:
        for u in shards.units.values():
            size = u.shard.element_size()
            out["weights"] += (u.shard_numel if u.stage == 3 else u.flat.numel()) * size
            if u.grad_shard is not None:
                out["gradients"] += u.grad_shard.numel() * size
    inner = optimizer.inner if isinstance(optimizer, ZeroAdamW) else optimizer
    for state in inner.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                out["optimizer"] += state[key].numel() * state[key].element_size()
    return out
