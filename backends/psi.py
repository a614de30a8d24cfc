"""The fast PSI-SGD(M) step of torch tensors: every normalised weight of a model in a few
multi-tensor operations, in place.

:func:`gsgd_core.psi_update` per row ``i`` (Yi et al., Algorithm 1)::

    u_i <- momentum * u_i + ||w_i||^2 g_i,   w_i <- w_i - lr * u_i,
    rows with ||w_i|| > max_norm divided by their norm (and u_i with them)

Here: one row-norm reduction per weight, then ``torch._foreach_*`` updates of all buffers
and weights (torch.optim.SGD's multi-tensor style), and one host synchronisation for the
check that decides whether the step can be taken this way. That check bounds every new
value through whole-tensor norms (``||x||_2 >= max |x|``): if no gradient is non-finite,
no buffer or weight can overflow and no row can pass ``max_norm``, the per-row guards of
the core would change nothing and the fast step is the core's step (to rounding). Otherwise
it hands the step back, before anything is written; a bound that only says some row may
pass ``max_norm`` is settled by the renormalisation itself (no further synchronisation).

:class:`PSIPlan` is the compiled step (``compile=True`` of the torch optimizers). PSI-SGD:
each row's norm, update, checks and renormalisation in one ``torch.compile`` loop while the
row is in cache, by the core's per-row rules, with no host read and nothing handed back but
what it cannot take (half precision, mixed dtypes or devices, weights not contiguous): the
weights and gradients are read once, as by SGD, where the eager step's norms and check read
them once more. PSI-SGDM: this module's step with one compiled loop in place of its three
multi-tensor updates of the buffers and weights.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

__all__ = ["PSIPlan", "psi_step_"]


def psi_step_(weights, grads, buffers, *, lr: float, momentum: float, max_norm: float,
              update: Callable | None = None) -> bool:
    """One PSI-SGD(M) step in place of torch ``weights`` and ``buffers``; ``False`` (nothing
    written) when the core must take it: half precision, mixed dtypes or devices,
    non-contiguous weights or buffers, a non-finite gradient, or a possible overflow.
    ``update(W, G, U, sq)``, if given, takes the momentum step's update of the ``(rows,
    rest)`` buffers and weights from the rows' squared norms (:class:`PSIPlan`'s compiled
    loop)."""
    if not weights:
        return True
    rows = _rows(weights, grads, buffers, momentum)
    if rows is None:
        return False
    W, G, U = rows
    with torch.no_grad():
        sq = [torch.linalg.vector_norm(w, dim=1, keepdim=True).square_() for w in W]
        top = torch.stack([s.max() if s.numel() else s.new_zeros(()) for s in sq])
        ok, may_pass = _bounds(W, G, U, top, lr=lr, momentum=momentum, max_norm=max_norm)
        if not ok:
            return False
        if momentum and update is not None:
            update(W, G, U, sq)
        elif momentum:
            torch._foreach_mul_(U, momentum)
            torch._foreach_addcmul_(U, G, sq)
            torch._foreach_add_(W, U, alpha=-lr)
        else:  # PSI-SGD keeps no buffer (the core's rule): one pass, as SGD's
            torch._foreach_addcmul_(W, G, sq, value=-lr)
        if may_pass:
            _renormalise_(W, U, max_norm)
    return True


def _rows(weights, grads, buffers, momentum):
    """``(W, G, U)``: each weight, gradient and buffer as ``(rows, rest)`` (``U`` is
    ``None`` without momentum), or ``None`` when the fast steps cannot take them (half
    precision, mixed dtypes or devices, a weight or a read buffer not contiguous)."""
    dtype, device = weights[0].dtype, weights[0].device
    # PSI-SGD (momentum 0) neither reads nor writes the buffers: any will do
    if dtype not in (torch.float32, torch.float64) or any(
            a.dtype != dtype or a.device != device or (a is not g and not a.is_contiguous())
            for w, g, u in zip(weights, grads, buffers)
            for a in ((w, g, u) if momentum else (w, g))):
        return None
    rows = [(w.shape[0], math.prod(w.shape[1:])) for w in weights]
    W = [w.detach().view(r) for w, r in zip(weights, rows)]
    G = [g.detach().reshape(r) for g, r in zip(grads, rows)]
    U = [u.detach().view(r) for u, r in zip(buffers, rows)] if momentum else None
    return W, G, U


def _bounds(W, G, U, top, *, lr, momentum, max_norm) -> tuple[bool, bool]:
    """Whether every gradient is finite and no new value can overflow, and whether a row
    might end above ``max_norm`` (one host synchronisation for both), from ``top``: per
    weight, at least its largest squared row norm."""
    big = torch.finfo(W[0].dtype).max / 4
    g = _norms(G)
    u = _norms(U) if momentum else torch.zeros_like(g)
    new_u = momentum * u + top * g          # >= max |u'| of each weight
    # >= the largest row norm of each new weight (with room for the norms' rounding)
    new_w = (top.sqrt() + lr * new_u) * _ROOM
    # A NaN or Inf gradient makes its bounds NaN or Inf, which fail the comparison.
    flags = torch.stack([(new_u < big).all() & (new_w < big).all(),
                         (new_w > max_norm).any()]).tolist()
    return bool(flags[0]), bool(flags[1])


#: Bounds are widened by this factor so that the rounding of the norms never makes a row
#: that passes ``max_norm`` look as if it did not (a wider bound only costs the pass of
#: :func:`_renormalise_`, which tests each row exactly).
_ROOM = 1.01


def _norms(X):
    """The 2-norm of each tensor in ``X`` as one tensor, from ``dot(x, x)``: one pass of
    BLAS over each (``torch._foreach_norm`` on the CPU reads at half that speed). A sum of
    squares that overflows gives ``inf``, which fails the bounds: the core then takes the
    step."""
    return torch.stack([torch.dot(v, v) for v in (x.reshape(-1) for x in X)]).sqrt()


def _renormalise_(W, U, max_norm) -> None:
    """Rows whose norm passed ``max_norm`` divided by it, their buffers too (``U``, or
    ``None`` for PSI-SGD: the core's rule), without a host synchronisation."""
    for i, w in enumerate(W):
        norm = torch.linalg.vector_norm(w, dim=1, keepdim=True)
        scale = torch.where(norm > max_norm, norm, torch.ones_like(norm))
        w.div_(scale)
        if U is not None:
            U[i].div_(scale)


class PSIPlan:
    """The PSI-SGD(M) step of torch tensors compiled by ``torch.compile``, owned by whoever
    steps (the torch optimizers keep one per part of normalised weights).

    PSI-SGD is one loop per weight that takes a row's squared norm, its new values and
    their norm while the row is in cache, then writes it, by the core's per-row rules
    (:func:`gsgd_core.psi_update`: a row whose new values are not all finite keeps its old
    ones; one past ``max_norm`` is divided by its norm) inside the graph, with no host read.
    PSI-SGDM is :func:`psi_step_` (its row norms, its check with one host read, its
    renormalisation) with one compiled loop per weight updating buffer and weight
    (:func:`_momentum_rows_`) in place of three multi-tensor passes: inductor does not fuse
    the per-row rules of two in-place updates behind a reduction (it fails or stages whole
    copies). The graphs are specialised to the shapes they meet; the learning rate and
    momentum enter as tensors, so a schedule never recompiles.
    """

    def __init__(self) -> None:
        from .torch import COMPILED  # the kernels' compile: one copy of each stage per plan

        self._plain = COMPILED.compile(_plain_rows_)
        self._momentum = COMPILED.compile(_momentum_rows_)

    def step_(self, weights, grads, buffers, *, lr: float, momentum: float,
              max_norm: float) -> bool:
        """One step in place, as :func:`psi_step_`; ``False`` (nothing written) for what
        the compiled graphs do not take (half precision, mixed dtypes or devices, weights or
        read buffers not contiguous) and, with momentum, for a step :func:`psi_step_`'s
        check refuses (the core then takes it). PSI-SGD handles non-finite gradients and
        overflows row by row, by the core's rules."""
        if not weights:
            return True

        def tensors(*values):  # as the graphs take them (a new float would recompile)
            return (torch.full((), float(v), dtype=weights[0].dtype, device=weights[0].device)
                    for v in values)

        if momentum:
            return psi_step_(weights, grads, buffers, lr=lr, momentum=momentum,
                             max_norm=max_norm, update=lambda W, G, U, sq: self._momentum(
                                 W, G, U, sq, *tensors(lr, momentum)))
        rows = _rows(weights, grads, buffers, momentum)
        if rows is None:
            return False
        with torch.no_grad():
            self._plain(rows[0], rows[1], *tensors(lr, max_norm))
        return True


def _scale(new, max_norm):
    """The core's renormalisation of rows ``new``: their norm where it passes ``max_norm``,
    else 1; and whether every entry of the row is finite. ``new*new + (new - new)`` sums to
    ``NaN`` exactly when an entry is not finite (``x - x`` is 0 for a finite ``x``), and to
    the squared norm otherwise (``inf`` if it overflows, as the core's)."""
    q = torch.sum(new * new + (new - new), dim=1, keepdim=True)
    norm = torch.sqrt(q)
    return 1.0 / torch.where(norm > max_norm, norm, 1.0), q == q


def _plain_rows_(W, G, lr, max_norm) -> None:
    """PSI-SGD by the core's rules, each ``(rows, rest)`` weight in place::

        w_i' = w_i - lr ||w_i||^2 g_i, divided by ||w_i'|| if that passes max_norm,
        kept where any entry of w_i' is not finite (so a NaN or Inf gradient)."""
    for w, g in zip(W, G):
        new = w - lr * (torch.sum(w * w, dim=1, keepdim=True) * g)
        scale, ok = _scale(new, max_norm)
        w.copy_(torch.where(ok, new * scale, w))


def _momentum_rows_(W, G, U, SQ, lr, momentum) -> None:
    """PSI-SGDM's update of each ``(rows, rest)`` weight and buffer in place from the rows'
    squared norms ``SQ``, without the per-row rules (:func:`psi_step_` checks first)::

        u_i' = momentum u_i + ||w_i||^2 g_i,   w_i' = w_i - lr u_i'"""
    for w, g, u, sq in zip(W, G, U, SQ):
        u_new = momentum * u + sq * g
        w.sub_(lr * u_new)
        u.copy_(u_new)
