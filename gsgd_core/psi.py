"""PSI-SGD / PSI-SGDM for weights followed by a normalisation layer (Yi et al., Algorithm 1).

A unit's incoming weight vector ``w_i`` (one row: ``W[i]`` flattened) feeding batch, layer or
group norm can be multiplied by any ``a_i > 0`` without changing the network. PSI-SGD takes
the Riemannian gradient of the quotient (PSI) manifold, ``||w_i||^2 * grad_i`` (eq. 7), and
the retraction ``W + Xi`` (eq. 8).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

import array_api_compat

from .arrays import check_hyper, is_array, is_off, quiet_fp

__all__ = ["PSIState", "check_psi_arguments", "psi_init", "psi_update"]


class PSIState(NamedTuple):
    """One momentum buffer ``u`` per weight, shaped like it."""

    momentum: tuple


def _check_pairs(weights, others, name):
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence) or not weights:
        raise ValueError("weights must be a non-empty list of arrays")
    if len(others) != len(weights):
        raise ValueError(f"{name} has {len(others)} entries for {len(weights)} weights")
    for i, (w, o) in enumerate(zip(weights, others)):
        if not (is_array(w) and is_array(o)):
            raise ValueError(f"weight {i}: weights and {name} must be arrays")
        if w.ndim < 1 or tuple(o.shape) != tuple(w.shape):
            raise ValueError(f"weight {i}: {name} has shape {tuple(o.shape)}, but the weight "
                             f"has shape {tuple(w.shape)}")


def psi_init(weights: Sequence[Any]) -> PSIState:
    """Zero momentum buffers ``u_0 = 0`` shaped like ``weights``."""
    _check_pairs(weights, weights, "weights")
    xp = array_api_compat.array_namespace(*weights)
    return PSIState(tuple(xp.zeros_like(w) for w in weights))


def check_psi_arguments(state: PSIState, weights: Sequence[Any], grads: Sequence[Any], *,
                        lr, momentum, max_norm) -> None:
    """``ValueError`` for arguments :func:`psi_update` does not take (hyperparameters, a
    state not from :func:`psi_init`, shapes, dtypes), before anything is computed."""
    check_hyper("lr", lr)
    check_hyper("momentum", momentum)
    check_hyper("max_norm", max_norm)
    if not (isinstance(state, PSIState)):
        raise ValueError("state must come from psi_init")
    _check_pairs(weights, grads, "grads")
    _check_pairs(weights, state.momentum, "momentum buffers")
    xp = array_api_compat.array_namespace(*weights, *grads, *state.momentum)
    for w, g in zip(weights, grads):
        if not xp.isdtype(w.dtype, "real floating") or g.dtype != w.dtype:
            raise ValueError(f"weights and grads must share one real floating dtype, got "
                             f"{w.dtype} and {g.dtype}")


def psi_update(state: PSIState, weights: Sequence[Any], grads: Sequence[Any], *, lr,
               momentum=0.0, max_norm: float = 1e4):
    """One PSI-SGDM step (Yi et al., Algorithm 1; eq. 10–11), per row ``i`` of each weight::

        u_i <- momentum * u_i + ||w_i||^2 * g_i
        w_i <- w_i - lr * u_i

    then rows with ``||w_i|| > max_norm`` are divided by their norm, and their ``u_i`` with
    them (Yi et al. §6: the function is unchanged, and the pair stays a rescaled copy of the
    un-normalised one). ``momentum = 0`` is PSI-SGD. Rows are indexed by the first axis
    (output units), as ``torch.nn.Linear``/``Conv`` store them. The buffer holds no
    learning rate (``torch.optim.SGD``'s convention): at a constant ``lr`` this is
    Algorithm 1's ``u <- momentum*u - lr*||w||^2 g; w <- w + u`` with ``u`` scaled by
    ``-lr``, and a change of ``lr`` acts at once. With ``momentum = 0`` (PSI-SGD) the
    buffers are returned unchanged: PSI-SGD keeps none.

    Returns ``(weights, state)``; the iterates commute with per-row rescaling of ``(W, u)``
    (Yi et al., Theorem 1) as long as no row is renormalised.
    """
    with quiet_fp():
        check_psi_arguments(state, weights, grads, lr=lr, momentum=momentum,
                            max_norm=max_norm)
        xp = array_api_compat.array_namespace(*weights, *grads, *state.momentum)
        # PSI-SGD keeps no buffer (torch.optim.SGD's convention): momentum switched on later
        # starts from u = 0, i.e. from ||w||^2 g, as torch's first momentum step does.
        plain = is_off(momentum)
        new_w, new_u = [], []
        for w, g, u in zip(weights, grads, state.momentum):
            compute = xp.float32 if xp.finfo(w.dtype).bits < 32 else w.dtype
            rows = (w.shape[0], math.prod(w.shape[1:]))  # explicit: a shard may hold no rows
            w2, g2, u2 = (xp.astype(xp.reshape(a, rows), compute) for a in (w, g, u))
            sq = xp.sum(w2 * w2, axis=1, keepdims=True)
            u_new = momentum * u2 + sq * g2
            w_new = w2 - lr * u_new
            norm = xp.sqrt(xp.sum(w_new * w_new, axis=1, keepdims=True))
            scale = xp.where(norm > max_norm, norm, 1.0)
            w_new, u_new = w_new / scale, u_new / scale
            # A row with a non-finite gradient or update keeps its old values (numerics guide).
            ok = xp.all(xp.isfinite(g2) & xp.isfinite(w_new) & xp.isfinite(u_new), axis=1,
                        keepdims=True)
            new_w.append(xp.astype(xp.reshape(xp.where(ok, w_new, w2), w.shape), w.dtype))
            new_u.append(u if plain else
                         xp.astype(xp.reshape(xp.where(ok, u_new, u2), w.shape), w.dtype))
        return new_w, PSIState(tuple(new_u))
