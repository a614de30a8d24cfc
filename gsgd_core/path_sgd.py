"""Path-SGD (Neyshabur et al. 2015), the G-SGD paper's baseline (§5.3), for any chain.

``w_e <- w_e - lr * grad_e / gamma_e`` with ``gamma_e`` the path-norm curvature: the sum
over all paths through ``e`` of the product of the other edges' squares.
"""

from __future__ import annotations

from typing import Any, Sequence

from .arrays import check_hyper, outer3, prepare, quiet_fp, restore, scalar, unvecs, vecs, view3
from .rules import all_finite, guard, safe_div
from .chain import Chain

__all__ = ["path_sgd_gamma", "path_sgd_step"]


def _gamma3(xp, chain, W, b, dtype, device):
    """``gamma_l[b, a, :] = alpha_{l-1}[a] * beta_l[b]`` and ``gamma_b_l = beta_l``.

    ``alpha_0 = 1``, ``alpha_l = sum_{in, slot} W_l^2 alpha_{l-1} + b_l^2`` (a bias is an edge
    from a constant-1 node); ``beta_L = 1``, ``beta_{l-1} = sum_{out, slot} W_l^2 beta_l``.
    """
    L = chain.L
    alpha = [xp.ones(chain.sizes[0], dtype=dtype, device=device)]
    for l in range(1, L):  # alpha_L and beta_0 weigh no edge
        a = xp.sum(W[l - 1] ** 2 * alpha[-1][None, :, None], axis=(1, 2))
        alpha.append(a if b[l - 1] is None else a + b[l - 1] ** 2)
    beta = [None] * L + [xp.ones(chain.sizes[L], dtype=dtype, device=device)]
    for l in range(L, 1, -1):
        beta[l - 1] = xp.sum(W[l - 1] ** 2 * beta[l][:, None, None], axis=(0, 2))
    gamma = [xp.broadcast_to(outer3(beta[l], alpha[l - 1]), chain.layer_shape(l))
             for l in range(1, L + 1)]
    gamma_b = [None if b[l - 1] is None else beta[l] for l in range(1, L + 1)]
    return gamma, gamma_b


def path_sgd_gamma(chain: Chain, weights: Sequence[Any], biases=None):
    """Path-SGD's per-edge scaling ``gamma`` (theory page), in the layers' own shapes."""
    p = prepare(chain, weights, biases)
    gamma, gamma_b = _gamma3(p.xp, chain, view3(p, chain, weights), vecs(p, biases, chain.L),
                             p.dtype, p.device)
    return restore(p, gamma), unvecs(p, gamma_b)


def path_sgd_step(chain: Chain, weights: Sequence[Any], biases, grads: Sequence[Any],
                  bias_grads, lr):
    """One Path-SGD step, ``w_e <- w_e - lr * grad_e / gamma_e``; commutes with rescaling.

    An edge with ``gamma_e = 0`` lies on no path of non-zero value, so its gradient is 0 too;
    it is left unchanged. The numerics rules of :func:`gsgd_core.gsgd_update` apply.
    """
    with quiet_fp():
        check_hyper("lr", lr)
        p = prepare(chain, weights, biases, grads=grads, bias_grads=bias_grads)
        xp = p.xp
        W, b = view3(p, chain, weights), vecs(p, biases, chain.L)
        G, Gb = view3(p, chain, grads), vecs(p, bias_grads, chain.L)
        gamma, gamma_b = _gamma3(xp, chain, W, b, p.dtype, p.device)
        lr = scalar(p, lr)
        W_new = [w - lr * safe_div(xp, g, gm) for w, g, gm in zip(W, G, gamma)]
        b_new = [None if bl is None else bl - lr * safe_div(xp, g, gm)
                 for bl, g, gm in zip(b, Gb, gamma_b)]
        ok = all_finite(xp, G + Gb)
        return restore(p, guard(xp, ok, W_new, W)), unvecs(p, guard(xp, ok, b_new, b))
