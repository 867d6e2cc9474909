"""The executor's forward and recompute pieces: body, norm, core, epi on real tensors.

A mixin of ``executor.Executor`` (which owns the state these methods read and write: the
per-step dicts ``_reset`` makes, the chain, the spec). Per region i and sub-batch j::

    body:i   x_i -(norm)-> h_i | h_leaf -(TP core)-> y_i ; p_i = row.partial(y_i)   (or the loss)
    norm:i   (sp) x_i slice -> h_i slice, gathered next ("gf"/"gr")
    core:i   (sp) gathered h_i [b, S, H] -> y_i ; p_i
    epi:i    (x_i, r_i) -> x_{i+1}                    (dropout: RNG state kept for the recompute)

Each piece runs on detached inputs (leaves) under ``torch.set_grad_enabled(grad)``, where
``grad`` is false for a piece in a recompute segment (``_in_segment``) during the forward.
What a piece keeps for the backward or its recompute:

    bg[i, j]      (xl, h, hl, out): body's (or norm's + core's) graph, for the backward
    eg[i, j]      (xl, rl, out): epi's graph (rl's storage freed: the glue reads only its grad)
    saved[i, j]   (x_i, r_i): commfree, epi:i's post-collective inputs
    inputs[i, j]  x_i: a block's input, or a commfree input that arrived through a reshard
    hkeep[i, j]   a gathered h_i (sp="gathered" commfree recompute)
    (sp, no recompute: core:i's graph keeps no gathered h_i; its saved uses are tokens that
    tp:i resolves to h_i gathered again from norm:i's slice, "gh": ``regather``)
    rng[i, j]     epi:i's RNG state before its dropout (recomputed glue)

and what the next piece or collective reads: p[i, j] (partial sums, reduced in place),
hs[i, j] (sp: norm:i's slice, to gather), x[i+1, j] (epi:i's output), losses[j] (the head).

``track_memory`` counts the storages kept from the forward per region (``saved_bytes``:
autograd's saved tensors through a ``saved_tensors_hooks`` pack, plus the tensors the pieces
keep themselves), once each, never a parameter.

Shape legend: b sub-batch rows, S sequence, H hidden, I/t this rank's TP width.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from oases.schedule.regather import swapping_pack

_NO_CONTEXT = contextlib.nullcontext()  # one, reused (it keeps no state)


class ForwardPieces:
    """Forward and recompute pieces of ``Executor`` (see the module docstring)."""

    # ------------------------------------------------------------------- what the forward keeps
    def _in_segment(self, kind: str, i: int) -> bool:
        """Does piece (kind, i) run without a graph in the forward (it is recomputed)?
        (``_segment_rule``, read once per executor into ``_segments``.)"""
        return (kind, i) in self._segments

    def _segment_rule(self, kind: str, i: int) -> bool:
        mode, last = self.spec.recompute, len(self.chain) - 1
        if mode == "commfree":  # segments [epi:i-1, body:i] for 0 < i < last (not the head,
            # whose recompute would repeat the cross-entropy's collectives); [body:i] alone
            # after a reshard; under sp body:i is norm:i and core:i
            return (kind in ("body", "norm", "core") and 0 < i < last) or (
                kind == "epi" and i < last - 1 and i + 1 not in self.changes
            )
        if mode == "block":
            return 0 < i < last
        return False

    def _saves_input(self, i: int) -> bool:
        """Does body:i keep its input x_i for its recompute (a block's input; in commfree mode,
        an input that arrived through a reshard)?"""
        mode = self.spec.recompute
        if mode == "block":
            return self.chain[i].kind == "attn"
        return mode == "commfree" and i in self.changes and self._in_segment("body", i)

    def _track(self, i: int, recompute: bool, swap: tuple | None = None):  # noqa: ANN202
        """Count storages autograd keeps from the forward for region i (not parameters, not
        the transient graphs of a recompute). ``swap`` (gathered h_i, sub-batch j): its saved
        uses are packed as tokens resolved to the "gh" result in the backward (``regather``)."""
        track = self.track_memory and not recompute

        def count(t: Tensor) -> Tensor:
            ptr = t.untyped_storage().data_ptr()
            if track and ptr not in self._param_ptrs and ptr not in self._seen:
                self._seen.add(ptr)
                self.saved_bytes[i] = self.saved_bytes.get(i, 0) + t.untyped_storage().nbytes()
            return t

        if swap is not None:
            gathered, j = swap
            return torch.autograd.graph.saved_tensors_hooks(
                *swapping_pack(gathered, lambda: self.hagain[i, j], count)
            )
        if not track:
            return _NO_CONTEXT
        return torch.autograd.graph.saved_tensors_hooks(count, lambda t: t)

    def _count_saved(self, i: int, *tensors: Tensor | None) -> None:
        if self.track_memory:
            for t in tensors:
                if t is not None and t.untyped_storage().data_ptr() not in self._seen:
                    self._seen.add(t.untyped_storage().data_ptr())
                    self.saved_bytes[i] = self.saved_bytes.get(i, 0) + t.numel() * t.element_size()

    # --------------------------------------------------------------------------------- pieces
    def _body(
        self,
        i: int,
        j: int,
        grad: bool,
        recompute: bool,
        need_p: bool,
        linked: Tensor | None = None,
    ) -> None:
        """``linked``: epi:i-1's output with its graph (an x-link, ``links``): norm:i reads it
        itself instead of a detached leaf (not where x_i is a block's saved input)."""
        region, model = self.chain[i], self.model
        if region.kind == "embed":
            with _grad_mode(grad), self._track(i, recompute):
                p = model.embed.partial(self.tokens[j])  # [b, S, H] partial sums
            p_link = grad and i in self._links.p
            if p_link:  # reduced in place; epi:0 reads it with its graph (a p-link)
                self.p[i, j], self.pg[i, j] = p.detach(), p
            else:
                self.p[i, j] = p.detach().clone() if grad else p  # all-reduced in place
            if grad:
                self.bg[i, j] = p
                if not p_link:  # only the graph's root to the backward: the lookup's backward
                    # reads the token ids, never p's values (the collective has its clone)
                    p.untyped_storage().resize_(0)
            return
        if linked is not None and recompute and self._saves_input(i):
            linked = None  # x_i is the block's saved input, not epi:i-1's output
        x = self._norm_input(i, j, recompute)
        with _grad_mode(grad), self._track(i, recompute):
            # (linked: a view, so the norm's own uses of x_i sum before the residual part
            # joins them in epi:i-1's output, in the order of the unlinked pieces: bit for bit,
            # so a schedule and its recompute twin sum every gradient in one order)
            xl = linked.view_as(linked) if linked is not None else x.detach().requires_grad_(grad)
            h = region.norm(xl)
            # (an h-link: the TP core reads h_i itself, no collective in its backward)
            hl = h if grad and i in self._links.h else h.detach().requires_grad_(grad)
            out = self._tp_core(i, j, hl)
        self._after_core(i, j, grad, recompute, need_p, (xl, h, hl, out))

    def _norm_input(self, i: int, j: int, recompute: bool) -> Tensor:
        """x_i for norm:i (in body:i, or sequence parallelism's norm:i): a block's saved input
        (kept here in the forward, taken back in the recompute), else the glue's output,
        taken where nothing else reads it after (a recompute segment, the head)."""
        commfree_recompute = recompute and self.spec.recompute == "commfree"
        if recompute and self._saves_input(i):
            x = self.inputs.pop((i, j))
            if not commfree_recompute:  # the block's recompute re-runs epi:i too
                self.x[i, j] = x
        elif commfree_recompute or self.chain[i].kind == "head":
            x = self.x.pop((i, j))
        else:
            x = self.x[i, j]
        if not recompute and self._saves_input(i):
            self.inputs[i, j] = x
            self._count_saved(i, x)
        return x

    def _tp_core(self, i: int, j: int, hl: Tensor) -> Tensor:
        """Region i's TP matmuls on its (gathered) norm output: y [b, S, I/t], or the head's
        loss (kept in ``losses``)."""
        region = self.chain[i]
        if region.kind == "head":
            out = self.model.loss_fn(self.model.head.local(hl), self.targets[j])
            self.losses[j] = out.detach()
            return out
        return region.core(hl)

    def _after_core(
        self, i: int, j: int, grad: bool, recompute: bool, need_p: bool, graph: tuple
    ) -> None:
        """p_i from y (unless a communication-free recompute skips it), and the graph (xl, h,
        hl, out) kept for the backward, y counted as kept."""
        out = graph[-1]
        if self.chain[i].kind != "head" and need_p and grad and i in self._links.p:
            with torch.enable_grad(), self._track(i, recompute):  # a p-link: epi:i reads pg
                # [b, S, H] partial sums, with its graph (an h-link, outside autocast: with the
                # bias, one matmul as the plain layer's, since no all-reduce comes between)
                pg = self.chain[i].row.partial(out, bias=self._biased(i))
            self.p[i, j], self.pg[i, j] = pg.detach(), pg  # all-reduced in place
        elif self.chain[i].kind != "head" and need_p:
            with torch.no_grad():  # [b, S, H] partial sums (a block recompute's forward: with
                # the bias where its recompute adds it, ``_biased``: epi:i reads either)
                self.p[i, j] = self.chain[i].row.partial(out, bias=self._biased(i))
        if grad:
            self.bg[i, j] = graph
            if not recompute and self.chain[i].kind != "head":  # y, for the row-parallel bwd
                self._count_saved(i, out)

    def _biased(self, i: int) -> bool:
        """Does p_i carry region i's row-parallel bias (added by its matmul, not by epi:i)?
        Where the region is h-linked (at tp=1 its "fwd" all-reduce is no collective) and the
        step runs outside autocast (whose bf16 sum then adds the bias as before)."""
        return self._fuse_bias and i in self._links.h and i in self._links.p

    def _norm(self, i: int, j: int, grad: bool, recompute: bool) -> None:
        """Sequence parallelism's norm:i on this rank's slice x_i -> h_i (gathered next)."""
        x = self._norm_input(i, j, recompute)
        with _grad_mode(grad), self._track(i, recompute):
            xl = x.detach().requires_grad_(grad)
            h = self.chain[i].norm(xl)
        commfree_recompute = recompute and self.spec.recompute == "commfree"
        if not (commfree_recompute and self.sp == "gathered"):  # core:i reads the kept h
            self.hs[i, j] = h.detach()
        if grad:
            self.bg[i, j] = (xl, h, None, None)
            if not recompute:  # kept to the norm's backward (and gathered again: "gh")
                self._count_saved(i, h)

    def _core(self, i: int, j: int, grad: bool, recompute: bool, need_p: bool) -> None:
        """Sequence parallelism's core:i on the gathered h_i [b, S, H] -> p_i (or the loss)."""
        commfree_recompute = recompute and self.spec.recompute == "commfree"
        if commfree_recompute and self.sp == "gathered":
            h = self.hkeep.pop((i, j))
        else:
            h = self.hfull.pop((i, j))
        if (
            not recompute
            and self.sp == "gathered"
            and self.spec.recompute == "commfree"
            and self._in_segment("core", i)
        ):
            self.hkeep[i, j] = h
            self._count_saved(i, h)
        # (at degree 1 the "gathered" h_i is norm:i's output itself: nothing to save on)
        regather = grad and not recompute and i in self._regathering and self.chain[i].tp > 1
        hl = h.detach().requires_grad_(grad)
        with _grad_mode(grad), self._track(i, recompute, (hl, j) if regather else None):
            out = self._tp_core(i, j, hl)
        if regather:  # nothing reads the gathered h_i again: tp:i reads "gh"'s (hl: its grad)
            hl.untyped_storage().resize_(0)
        xl, h_slice = self.bg[i, j][:2] if grad else (None, None)
        self._after_core(i, j, grad, recompute, need_p, (xl, h_slice, hl, out))

    def _epi(self, i: int, j: int, grad: bool, recompute: bool) -> Tensor | None:
        """Returns x_{i+1} with its graph when it keeps one (for an x-linked body:i+1)."""
        region = self.chain[i]
        if recompute and self.spec.recompute == "commfree":
            x, r = self.saved.pop((i, j))
        else:
            x, r = self.x.pop((i, j), None), self.p.pop((i, j))
        pg = self.pg.pop((i, j), None)  # p_i with its graph (a p-link), r_i its storage
        if pg is not None and not (grad and pg.data_ptr() == r.data_ptr() and pg.shape == r.shape):
            pg = None  # not reduced in place: tp:i runs on its own
        if not recompute and self.spec.recompute == "commfree" and self._in_segment("epi", i):
            self.saved[i, j] = (x, r)
            self._count_saved(i + 1, x, r)
        use_rng = region.dropout > 0 and self._in_segment("epi", i)
        own = self.sp is not None and region.dropout > 0  # this rank's own stream (a slice)
        forks = (recompute and use_rng) or own  # (else no fork: a context of its own costs)
        with torch.random.fork_rng(devices=self._rng_devices()) if forks else _NO_CONTEXT:
            if own and not recompute:
                _set_rng(self._sp_rng, self.ctx.device)
            if use_rng:
                if recompute:
                    _set_rng(self.rng.pop((i, j)), self.ctx.device)
                else:
                    self.rng[i, j] = _get_rng(self.ctx.device)
            with _grad_mode(grad), self._track(i + 1, recompute):
                xl = self.xg.pop((i, j), None)  # an h-link: x_i with its graph
                if xl is None and x is not None:
                    xl = x.detach().requires_grad_(grad)
                rl = pg if pg is not None else r.detach().requires_grad_(grad)
                if region.kind == "embed" and self.sp is not None:  # its slice's positions
                    out = region.epilogue(
                        xl, rl, start=region.tp_group.rank * rl.shape[1], pos_grad=False
                    )  # (their gradient: _bwd_tp)
                elif self._biased(i):  # r_i holds the bias already (``_after_core``)
                    out = region.epilogue(xl, rl, biased=True)
                else:
                    out = region.epilogue(xl, rl)  # x_{i+1} [b, S, H] (a slice under sp)
            if own and not recompute:
                self._sp_rng = _get_rng(self.ctx.device)
        if not (recompute and self.spec.recompute == "block" and region.kind == "mlp"):
            # (a block's recompute ends at its MLP glue: the next block's input is not needed)
            self.x[i + 1, j] = out.detach()
        if grad:
            self.eg[i, j] = (xl, rl, out)
            ptr = rl.untyped_storage().data_ptr()
            if (
                not recompute
                and (i, j) not in self.saved
                and out.untyped_storage().data_ptr() != ptr
            ):  # (an identity glue: r is x')
                # r_i = the reduced p_i: the glue's backward reads none of its values (bias add
                # and residual add keep nothing, dropout keeps its mask), only rl.grad is
                # wanted, yet the leaf rl would keep its [b, S, H] alive until the backward
                # (one activation per region that plain autograd frees at once)
                rl.untyped_storage().resize_(0)
            return out
        return None

    def _rng_devices(self) -> list:
        return [self.ctx.device] if self.ctx.device.type == "cuda" else []


def _grad_mode(grad: bool) -> contextlib.AbstractContextManager:
    """``torch.set_grad_enabled(grad)``, or no context where the mode already is ``grad`` (the
    forward's usual case: a context of its own costs a few microseconds a piece)."""
    return _NO_CONTEXT if torch.is_grad_enabled() == grad else torch.set_grad_enabled(grad)


def _get_rng(device: torch.device) -> Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_rng(state: Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)
