"""The executor's backward pieces: norm, epi, tp and dw of each region, on real tensors.

A mixin of ``executor.Executor`` (which owns the state: ``bg``/``eg`` graphs kept by the
forward pieces, gradients ``gx``, ``gres``, ``dr``, ``dh``, deferred ``wg``). Per region i and
sub-batch j, in the order a backward task runs them (and what each writes)::

    norm:i+1  dh_{i+1} (reduced) -> norm backward -> dx_{i+1} (+ residual part)    gx
    epi:i     dx_{i+1} -> dr_i (= dp_i), residual part of dx_i                    dr, gres
    tp:i      dr_i -> row.backward_partial (no forward matmul needed) -> dy -> dh_i
              (partial sums; the head: from the scaled loss; the embedding: the lookup's
              backward, no dh)                                                  dh (wg)
    dw:i      (sp) the weight gradients tp:i left in wg: it computed dh_i alone

Under sequence parallelism a deferring region's column-parallel layers record (x, dY) instead
of computing dW inside tp:i (``_armed_for_deferral``, ``layers.deferred_weight_grads``), and
GPT-2's position table's gradient comes from the gathered dr_0 (``_position_grad``).

Every engine call goes through ``run_backward``: the engine's entry below
``torch.autograd.backward``, whose Python front cost as much as the engine's own set-up on a
small graph (``benchmarks/2026-12-04-overhead``, round 3).

Shape legend: b sub-batch rows, S sequence, H hidden, I/t this rank's TP width.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from oases.parallel.layers import ColumnParallelLinear, deferred_weight_grads


class BackwardPieces:
    """Backward pieces of ``Executor`` (see the module docstring)."""

    def _defers(self, i: int) -> bool:
        """Does region i's backward leave its weight gradients to a "dw" piece (the program
        running has one: ``dw_tasks.defers_weight_grad``)?"""
        return i in self._deferring

    @contextlib.contextmanager
    def _armed_for_deferral(self):  # noqa: ANN202
        """Under sequence parallelism, a block's column-parallel layers record what their
        weight gradients need instead of computing them, inside ``_bwd_tp``; disarmed after."""
        layers = [
            m
            for r in self.chain
            if self._defers(r.index) and r.module is not None
            for m in r.module.modules()
            if isinstance(m, ColumnParallelLinear)
        ]
        for m in layers:
            m.defers_weight_grad = True
        try:
            yield
        finally:
            for m in layers:
                m.defers_weight_grad = False

    # -------------------------------------------------------------------------------- pieces
    def _bwd_norm(self, i: int, j: int) -> None:
        xl, h, _, _ = self.bg.pop((i, j))
        res = self.gres.pop((i, j), None)
        if i in self._links.h:  # h-linked: tp:i's roots, handed on to here, run through norm:i
            if xl.grad_fn is not None:  # x-linked: epi:i-1's call runs them, and the residual
                # part where epi:i read the saved x_i (communication-free recompute)
                self._roots += [] if res is None else [(xl._base, res)]
                return
            _backward(self._roots)  # x_i a leaf (the glue before was an identity): run here
            self._roots = []
            self.gx[i, j] = xl.grad if res is None else xl.grad + res
            return
        if xl.grad_fn is not None:  # x-linked: xl views epi:i-1's output, whose call runs these
            self._roots += [(h, self.dh.pop((i, j)))] + ([] if res is None else [(xl._base, res)])
            return
        run_backward((h,), (self.dh.pop((i, j)),))
        self.gx[i, j] = xl.grad if res is None else xl.grad + res

    def _bwd_epi(self, i: int, j: int) -> None:
        xl, rl, out = self.eg.pop((i, j))
        roots, self._roots = self._roots or [(out, self.gx.pop((i + 1, j)))], []
        if rl.grad_fn is not None:  # p-linked: rl is p_i itself, tp:i runs the call
            self._roots, self._epi_leaf[i, j] = roots, xl
            return
        _backward(roots)
        self.dr[i, j] = rl.grad
        if xl is not None:
            self.gres[i, j] = xl.grad

    def _bwd_linked_tp(self, i: int, j: int) -> None:
        """tp:i p-linked to epi:i (and maybe norm:i+1): one engine call from their roots runs
        through the glue and the TP matmuls, row-parallel included, down to dh_i."""
        if i in self._links.h:  # h-linked: norm:i's Compute goes on from the same roots
            self._epi_leaf.pop((i, j))  # (x_i with its graph, not a leaf)
            self.bg[i, j] = self.bg[i, j][:2] + (None, None)
            return
        roots, self._roots = self._roots, []
        _backward(roots)
        xl = self._epi_leaf.pop((i, j))
        if xl is not None:
            self.gres[i, j] = xl.grad
        if self.chain[i].kind == "embed":
            self.bg.pop((i, j))
            return
        xl, h, hl, _ = self.bg[i, j]
        self.bg[i, j] = (xl, h, None, None)  # (sp: hl, the gathered h_i, is let go here)
        self.dh[i, j] = hl.grad  # partial sums of dL/dh over the TP group

    def _bwd_tp(self, i: int, j: int) -> None:
        if self._roots:
            self._bwd_linked_tp(i, j)
            return
        region = self.chain[i]
        if region.kind == "embed":
            dr = self.dr.pop((i, j))
            run_backward((self.bg.pop((i, j)),), (dr,))
            if self.sp is not None and self.model.pos_embed is not None:
                self._position_grad(dr)
            return
        xl, h, hl, out = self.bg[i, j]
        if region.kind == "head":
            if self._head_root(out, i):  # h-linked: norm:i's Compute goes on from the loss
                self.bg[i, j] = (xl, h, None, None)
                return
        elif self._defers(i):  # dh_i now, the weight gradients in dw:i
            dr = self.dr.pop((i, j))
            dy = region.row.backward_partial(out, dr, weight_grad=False)  # [b, S, I/t]
            with deferred_weight_grads() as stash:
                run_backward((out,), (dy,))
            self.wg[i, j] = (out, dr, stash)
        else:
            dy = region.row.backward_partial(out, self.dr.pop((i, j)))  # [b, S, I/t]
            if i in self._links.h:  # (communication-free recompute) norm:i's Compute goes on
                self._roots = [(out, dy)]
            else:
                run_backward((out,), (dy,))
        self.bg[i, j] = (xl, h, None, None)  # (sp: hl, the gathered h_i, is let go here)
        self.hagain.pop((i, j), None)  # (dw:i's stash keeps what it still reads)
        if not self._roots:  # (handed on: no dh_i, hl is h_i itself)
            self.dh[i, j] = hl.grad  # partial sums of dL/dh over the TP group

    def _head_root(self, loss: Tensor, i: int) -> bool:
        """The head's backward from its loss, scaled: run now, or handed on (h-linked: the
        loss is the first root of one call that norm:i's Compute goes on with). The scale in
        the loss's dtype (a float64 run's 1/3 is not rounded to fp32), filled on the device (a
        fill kernel: no host-to-device copy, no sync), once a run. True if handed on."""
        key = (loss.dtype, loss.device)
        if key not in self._scale_grads:
            self._scale_grads[key] = torch.full(
                (), self.scale, dtype=loss.dtype, device=loss.device
            )
        if i in self._links.h:
            self._roots = [(loss, self._scale_grads[key])]
            return True
        run_backward((loss,), (self._scale_grads[key],))
        return False

    def _bwd_dw(self, i: int, j: int) -> None:
        """Region i's weight gradients, which ``_bwd_tp`` left: the row-parallel layer's from
        (y_i, dr_i), the column-parallel layers' from their inputs and output gradients."""
        out, dr, stash = self.wg.pop((i, j))
        self.chain[i].row.accumulate_weight_grad(out, dr)
        for layer, x, grad in stash:
            layer.accumulate_weight_grad(x, grad)

    def _position_grad(self, dr: Tensor) -> None:
        """Sequence parallelism: GPT-2's position table's gradient from the gathered dr_0
        [b, S, H] (gb(0), which the lookup's backward needs anyway): every rank of the TP group
        holds the same whole, so each computes the whole table's gradient, equal on all of
        them, and the table is not in the glue's sum ("sg"), which would otherwise move S x H
        (most of its bytes) to add up the zeros of the other ranks' positions. Accumulated in
        the weight's dtype, as autograd's cast back would."""
        w = self.model.pos_embed.weight
        g = dr.sum(0).to(w.dtype)  # [S, H]
        if w.grad is None:
            w.grad = torch.zeros_like(w)
        w.grad[: g.shape[0]].add_(g)


def _backward(roots: list[tuple[Tensor, Tensor]]) -> None:
    """One engine call from every (tensor, gradient) root."""
    run_backward(tuple(t for t, _ in roots), tuple(g for _, g in roots))


def run_backward(tensors: tuple[Tensor, ...], grads: tuple[Tensor, ...]) -> None:
    """``torch.autograd.backward(tensors, grads)`` without its Python front (about half of a
    small call's host cost: argument forms, ``_make_grads``' per-root shape checks): the
    engine's own entry, which checks each root gradient's shape and casts its dtype itself.
    Every root here has its gradient (a tensor), never None; the graph is freed."""
    _ENGINE_RUN(tensors, grads, False, False, (), allow_unreachable=True, accumulate_grad=True)


def _engine_entry():  # noqa: ANN202 (the engine's callable)
    """The engine's entry below ``torch.autograd.backward`` (torch >= 2.3), else the public
    call itself (same arguments, positional)."""
    entry = getattr(torch.autograd.graph, "_engine_run_backward", None)
    if entry is not None:
        return entry

    def public(tensors, grads, retain, create, inputs, **_) -> None:  # noqa: ANN001
        torch.autograd.backward(tensors, grads, retain_graph=retain, create_graph=create)

    return public


_ENGINE_RUN = _engine_entry()
