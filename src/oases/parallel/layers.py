"""Megatron's tensor-parallel layers, each built by sharding a full single-device layer.

Shape legend: N tokens (B*S), H hidden, O output features, V vocabulary, Vp padded vocabulary
(a multiple of tp), t the TP degree. Per rank:

    ColumnParallelLinear  x [.., H] --f--> W_r [O/t, H] --> y_r [.., O/t]   (optionally gathered)
    RowParallelLinear     x_r [.., I/t] --> W_r [O, I/t] --> partial [.., O] --g--> + bias
    VocabParallelEmbedding rows [r*Vp/t, (r+1)*Vp/t) of the table; other tokens give 0 --g-->
    vocab_parallel_cross_entropy  logits_r [N, Vp/t] -> loss [N], never gathering the vocabulary

A ``ShardSpec`` on every sharded parameter says how the full tensor maps to this rank's shard, so
tests, checkpoints and importers can shard or rebuild full tensors the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from oases.parallel import comm
from oases.parallel.context import Group
from oases.precision import to_activation, upcast


@dataclass(frozen=True)
class ShardSpec:
    """How a full tensor is split over t ranks: along ``dim`` it is a concatenation of fused
    ``parts`` (e.g. Q, K, V); each part is zero-padded to a multiple of t when ``pad`` is set
    (the vocabulary), cut into t equal chunks, and rank r keeps chunk r of every part."""

    dim: int
    parts: tuple[int, ...]
    pad: bool = False

    def padded_parts(self, tp: int) -> tuple[int, ...]:
        return tuple(-(-p // tp) * tp if self.pad else p for p in self.parts)


def shard_tensor(full: Tensor, spec: ShardSpec, rank: int, tp: int) -> Tensor:
    """This rank's shard of ``full`` (a new tensor)."""
    out = []
    for piece, padded in zip(full.split(spec.parts, dim=spec.dim), spec.padded_parts(tp)):
        extra = padded - piece.shape[spec.dim]
        if extra:
            pad_shape = list(piece.shape)
            pad_shape[spec.dim] = extra
            piece = torch.cat([piece, piece.new_zeros(pad_shape)], dim=spec.dim)
        if piece.shape[spec.dim] % tp:
            raise ValueError(f"a part of size {piece.shape[spec.dim]} does not split over tp={tp}")
        out.append(piece.chunk(tp, dim=spec.dim)[rank])
    return torch.cat(out, dim=spec.dim).clone()


def unshard_tensor(shards: list[Tensor], spec: ShardSpec) -> Tensor:
    """Rebuild the full tensor from every rank's shard (the inverse of ``shard_tensor``)."""
    tp = len(shards)
    local_sizes = [p // tp for p in spec.padded_parts(tp)]
    per_rank = [s.split(local_sizes, dim=spec.dim) for s in shards]
    parts = []
    for i, size in enumerate(spec.parts):
        part = torch.cat([pieces[i] for pieces in per_rank], dim=spec.dim)
        parts.append(part.narrow(spec.dim, 0, size))
    return torch.cat(parts, dim=spec.dim)


def shard_spec(param: Tensor) -> ShardSpec | None:
    """The parameter's ShardSpec, or None when it is replicated over the TP group."""
    return getattr(param, "_oases_shard", None)


def _sharded_param(full: Tensor, spec: ShardSpec, group: Group) -> nn.Parameter:
    p = nn.Parameter(shard_tensor(full.detach(), spec, group.rank, group.size))
    p._oases_shard = spec  # type: ignore[attr-defined]
    return p


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows (and b) split over the TP group.

    Forward: f (identity; all-reduce of dx in backward), local matmul, optional gather.
    ``reduce_input_grad = False`` drops f, for a schedule executor that all-reduces the input
    gradient itself (asynchronously); see ``input_grads_unreduced``.
    """

    reduce_input_grad = True

    def __init__(
        self,
        full: nn.Linear,
        group: Group,
        parts: tuple[int, ...] | None = None,
        *,
        gather_output: bool = False,
        pad: bool = False,
    ) -> None:
        super().__init__()
        self.group, self.gather_output = group, gather_output
        spec = ShardSpec(0, parts or (full.out_features,), pad)
        self.weight = _sharded_param(full.weight, spec, group)
        self.bias = None if full.bias is None else _sharded_param(full.bias, spec, group)
        self.in_features, self.out_features = full.in_features, self.weight.shape[0]

    defers_weight_grad = False  # set by an executor whose programs defer dW ("dw" pieces)

    def local(self, x: Tensor) -> Tensor:
        """The local matmul on an input already on every rank (no f): [.., H] -> [.., O/t]."""
        if self.defers_weight_grad and torch.is_grad_enabled():
            return _DeferrableLinear.apply(x, self.weight, self.bias, self)
        return F.linear(x, self.weight, self.bias)

    def accumulate_weight_grad(self, x: Tensor, grad_out: Tensor) -> None:
        """dW += dY^T x and db += sum dY: the weight gradients a backward inside
        ``deferred_weight_grads`` left for later. [.., O/t] x [.., H] -> [O/t, H]; computed in
        the gradient's dtype (bf16 under autocast) and accumulated in the weight's, as
        autograd's cast back would."""
        if self.weight.requires_grad:
            _accumulate(self.weight, _weight_grad(x, grad_out))
        if self.bias is not None and self.bias.requires_grad:
            _accumulate(self.bias, grad_out.flatten(0, -2).sum(0))

    def forward(self, x: Tensor) -> Tensor:
        if self.reduce_input_grad:
            x = comm.copy_to_tp(x, self.group)
        y = self.local(x)
        return comm.gather_from_tp(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split; the bias is replicated and added after g.

    ``partial(x_r)`` returns the un-reduced partial sum (no bias) so a schedule can start the
    all-reduce itself; ``forward`` = g(partial) + bias.
    """

    def __init__(self, full: nn.Linear, group: Group) -> None:
        super().__init__()
        self.group = group
        self.weight = _sharded_param(full.weight, ShardSpec(1, (full.in_features,)), group)
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())
        self.in_features, self.out_features = self.weight.shape[1], full.out_features

    def partial(self, x: Tensor, bias: bool = False) -> Tensor:
        """x_r W_r^T [.., O], the un-reduced partial sum; ``bias``: plus b (for a caller with
        no all-reduce to run, tp=1: the plain layer's one matmul)."""
        return F.linear(x, self.weight, self.bias if bias else None)

    def add_bias(self, y: Tensor) -> Tensor:
        """y + b in y's dtype (under bf16 autocast the reduced sum is bf16 and stays so)."""
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def backward_partial(self, x: Tensor, grad_partial: Tensor, weight_grad: bool = True) -> Tensor:
        """Backward of ``partial`` without its forward output: accumulates the weight gradient
        dW += dP^T x and returns dx = dP W. [.., O] x [.., I/t] -> [O, I/t]; [.., I/t].
        Lets recomputation skip the matmul whose output the backward never reads. Under
        autocast (bf16 activations, fp32 master weights) dW is accumulated in the weight's
        dtype and dx comes back in the activations' dtype. ``weight_grad=False`` leaves dW
        for ``accumulate_weight_grad`` (a deferred weight gradient)."""
        if weight_grad:
            self.accumulate_weight_grad(x, grad_partial)
        return (grad_partial @ self.weight.detach().to(grad_partial.dtype)).to(x.dtype)

    def accumulate_weight_grad(self, x: Tensor, grad_partial: Tensor) -> None:
        """dW += dP^T x ([.., O] x [.., I/t] -> [O, I/t]), in the weight's dtype."""
        if self.weight.requires_grad:
            _accumulate(self.weight, _weight_grad(x, grad_partial))

    def forward(self, x: Tensor) -> Tensor:
        return self.add_bias(comm.reduce_from_tp(self.partial(x), self.group))


def _weight_grad(x: Tensor, grad_out: Tensor) -> Tensor:
    """A linear layer's dW = dY^T x over all leading dims, in dY's dtype: [.., O] x [.., I] ->
    [O, I]."""
    g2 = grad_out.flatten(0, -2)
    return g2.t() @ x.detach().flatten(0, -2).to(g2.dtype)


def _accumulate(param: nn.Parameter, grad: Tensor) -> None:
    """param.grad += grad, in the parameter's dtype (the first gradient is kept as it is)."""
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


_WEIGHT_GRAD_STASH: list | None = None  # set inside ``deferred_weight_grads``


@contextlib.contextmanager
def deferred_weight_grads() -> Iterator[list]:
    """Inside the block, the backward of an armed ``ColumnParallelLinear`` (its
    ``defers_weight_grad``) computes only its input gradient and appends (layer, x, dY) to the
    list it yields; ``layer.accumulate_weight_grad(x, dY)`` adds the weight gradients later.
    A schedule uses it to start the input gradient's collective before the weight-gradient
    matmuls, which then run under it (Megatron-LM's and Zero Bubble's split of a backward
    into dX and dW)."""
    global _WEIGHT_GRAD_STASH
    outer, _WEIGHT_GRAD_STASH = _WEIGHT_GRAD_STASH, []
    try:
        yield _WEIGHT_GRAD_STASH
    finally:
        _WEIGHT_GRAD_STASH = outer


class _DeferrableLinear(torch.autograd.Function):
    """y = x W^T + b whose backward, inside ``deferred_weight_grads``, returns dx alone and
    leaves (x, dY) for the weight gradients; elsewhere it returns all three."""

    @staticmethod
    def forward(
        ctx,  # noqa: ANN001
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        layer: ColumnParallelLinear,
    ) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.layer, ctx.has_bias = layer, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple:  # noqa: ANN001
        x, weight = ctx.saved_tensors
        dx = (grad @ weight.to(grad.dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None
        if _WEIGHT_GRAD_STASH is not None:
            _WEIGHT_GRAD_STASH.append((ctx.layer, x, grad))
            return dx, None, None, None
        dw = _weight_grad(x, grad) if ctx.needs_input_grad[1] else None
        db = grad.flatten(0, -2).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by rows (vocabulary padded to a multiple of t); each rank looks up
    the tokens it owns, zeros the rest, and g sums the partial embeddings."""

    def __init__(self, full: nn.Embedding, group: Group) -> None:
        super().__init__()
        self.group = group
        self.vocab_size = full.num_embeddings
        self.weight = _sharded_param(full.weight, ShardSpec(0, (full.num_embeddings,), True), group)
        self.vocab_start = group.rank * self.weight.shape[0]

    def partial(self, tokens: Tensor) -> Tensor:
        """tokens [B, S] -> this rank's partial embedding [B, S, H]."""
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return to_activation(out.masked_fill(outside.unsqueeze(-1), 0.0))  # bf16 under autocast

    def forward(self, tokens: Tensor) -> Tensor:
        return comm.reduce_from_tp(self.partial(tokens), self.group)


class _VocabParallelCE(torch.autograd.Function):
    """Cross-entropy over vocabulary shards, in at least fp32: max, target logit and sum-exp are
    combined with two all-reduces of N floats; the gradient softmax - onehot stays local."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, group: Group, vocab_size: int) -> Tensor:  # noqa: ANN001
        n_local = logits.shape[-1]
        start = group.rank * n_local
        x = upcast(logits)  # [N, Vp/t], at least fp32
        n_valid = max(0, min(n_local, vocab_size - start))
        if n_valid < n_local:  # padded vocabulary rows are never predicted
            x = x.clone()
            x[:, n_valid:] = float("-inf")
        row_max = x.max(dim=-1).values
        comm.all_reduce_(row_max, group, op="max", tag="ce-max")
        x = x - row_max.unsqueeze(-1)
        local_t = targets - start
        mine = (local_t >= 0) & (local_t < n_local)
        local_t = local_t.clamp(0, n_local - 1)
        target_logit = torch.where(mine, x.gather(1, local_t.unsqueeze(1)).squeeze(1), 0.0)
        exp = x.exp()
        stats = torch.stack([target_logit, exp.sum(dim=-1)])  # [2, N]
        comm.all_reduce_(stats, group, tag="ce-stats")
        target_logit, sum_exp = stats[0], stats[1]
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), mine, local_t)
        ctx.logits_dtype = logits.dtype
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss: Tensor) -> tuple[Tensor, None, None, None]:  # noqa: ANN001
        softmax, mine, local_t = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_t] -= mine.to(grad.dtype)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor, targets: Tensor, group: Group, vocab_size: int
) -> Tensor:
    """Per-token loss [N] from local logits [N, Vp/t] and global target ids [N]."""
    return _VocabParallelCE.apply(logits, targets, group, vocab_size)


class VocabParallelCrossEntropy(nn.Module):
    """Mean token cross-entropy over local logits [B, S, Vp/t]; never gathers the vocabulary."""

    def __init__(self, group: Group, vocab_size: int) -> None:
        super().__init__()
        self.group, self.vocab_size = group, vocab_size

    def forward(self, logits: Tensor, targets: Tensor) -> Tensor:
        losses = vocab_parallel_cross_entropy(
            logits.flatten(0, 1), targets.flatten(), self.group, self.vocab_size
        )
        return losses.mean()


class GatherLogits(nn.Module):
    """Local logits [B, S, Vp/t] -> full logits [B, S, V] (gather, then drop the padding)."""

    def __init__(self, group: Group, vocab_size: int) -> None:
        super().__init__()
        self.group, self.vocab_size = group, vocab_size

    def forward(self, logits: Tensor) -> Tensor:
        return comm.gather_from_tp(logits, self.group, dim=-1)[..., : self.vocab_size]


@contextlib.contextmanager
def input_grads_unreduced(model: nn.Module) -> Iterator[None]:
    """Inside the block, column-parallel layers skip f: their input gradients stay partial sums,
    for an executor that all-reduces them itself. Restores the layers afterwards."""
    layers = [m for m in model.modules() if isinstance(m, ColumnParallelLinear)]
    for m in layers:
        m.reduce_input_grad = False
    try:
        yield
    finally:
        for m in layers:
            m.reduce_input_grad = True
