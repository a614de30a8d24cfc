"""The fast PSI-SGD(M) step of torch tensors: every normalised weight of a model in a few
multi-tensor operations, in place.

:func:`gsgd_core.psi_update` per row ``i`` (seed 004, Algorithm 1)::

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
"""

from __future__ import annotations

import math

import torch

__all__ = ["psi_step_"]


def psi_step_(weights, grads, buffers, *, lr: float, momentum: float, max_norm: float) -> bool:
    """One PSI-SGD(M) step in place of torch ``weights`` and ``buffers``; ``False`` (nothing
    written) when the core must take it: half precision, mixed dtypes or devices,
    non-contiguous weights or buffers, a non-finite gradient, or a possible overflow."""
    if not weights:
        return True
    dtype, device = weights[0].dtype, weights[0].device
    # PSI-SGD (momentum 0) neither reads nor writes the buffers: any will do
    if dtype not in (torch.float32, torch.float64) or any(
            a.dtype != dtype or a.device != device or (a is not g and not a.is_contiguous())
            for w, g, u in zip(weights, grads, buffers)
            for a in ((w, g, u) if momentum else (w, g))):
        return False
    rows = [(w.shape[0], math.prod(w.shape[1:])) for w in weights]
    W = [w.detach().view(r) for w, r in zip(weights, rows)]
    G = [g.detach().reshape(r) for g, r in zip(grads, rows)]
    U = [u.detach().view(r) for u, r in zip(buffers, rows)] if momentum else None
    with torch.no_grad():
        sq = [torch.linalg.vector_norm(w, dim=1, keepdim=True).square_() for w in W]
        ok, may_pass = _bounds(W, G, U, sq, lr, momentum, max_norm)
        if not ok:
            return False
        if momentum:
            torch._foreach_mul_(U, momentum)
            torch._foreach_addcmul_(U, G, sq)
            torch._foreach_add_(W, U, alpha=-lr)
        else:  # PSI-SGD keeps no buffer (the core's rule): one pass, as SGD's
            torch._foreach_addcmul_(W, G, sq, value=-lr)
        if may_pass:
            _renormalise_(W, U, max_norm)
    return True


def _bounds(W, G, U, sq, lr, momentum, max_norm) -> tuple[bool, bool]:
    """Whether every gradient is finite and no new value can overflow, and whether a row
    might end above ``max_norm`` (one host synchronisation for both)."""
    big = torch.finfo(W[0].dtype).max / 4
    g = _norms(G)
    u = _norms(U) if momentum else torch.zeros_like(g)
    top = torch.stack([s.max() if s.numel() else s.new_zeros(()) for s in sq])
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
