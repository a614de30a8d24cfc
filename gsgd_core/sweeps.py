"""The two sweeps of G-SGD over a chain: ICR (backward) and weight allocation (forward).

Everything here works on 3-D layer views ``(n_l, n_{l-1}, k_l)`` of one namespace ``xp`` and
is the masked reference formulation of the theory page: clear, jit-friendly (no data-dependent
shapes or control flow), and O(m) work per sweep. The public wrappers live in
:mod:`gsgd_core.gsgd` and :mod:`gsgd_core.group`.
"""

from __future__ import annotations

import math

from .arrays import outer3
from .rules import (frozen_if_overflow, path_gradient, safe_div, scaled_div, tau_ratio,
                    written_ratio)


def tau_edges(xp, m, A):
    """The entries of ``A`` (one layer's 3-D view) at the layer's tau edges, one per node
    of the layer: ``A[j, tau(j), s]``; ``m`` is the layer's :class:`~.arrays.LayerMeta`.

    A masked maximum over each row, not a gather: a gather from a flattened array needs the
    whole array where it is sharded (XLA gathers every shard), a row's reduction only a
    vector. Each row holds one tau edge among ``-inf`` entries, so the maximum is that entry
    exactly (signed zeros, infinities and NaN included)."""
    return xp.max(xp.where(m.tau_mask, A, -math.inf), axis=(1, 2))


def free_edges(xp, m, A):
    """The entries of ``A`` (one layer's 3-D view) at the free edges lying in the layer, one
    per node of the layer below (column): ``A[sigma(a), a, s]``, as :func:`tau_edges`."""
    return xp.max(xp.where(m.free_mask, A, -math.inf), axis=(0, 2))


def chain_products(xp, chain, meta, W, dtype, device):
    """Tau and sigma chain products ``B_0..B_{L-1}`` and ``F_1..F_L`` (theory page).

    ``B_l[j] = B_{l-1}[tau_l(j)] * W_l[j, tau_l(j), s_l] / r_l`` (input -> j along tau edges),
    ``F_l[j] = W_{l+1}[sigma_l(j), j, s_{l+1}] / r_{l+1} * F_{l+1}[sigma_l(j)]`` (j -> output
    along free edges), with ``r`` the chain's :attr:`~gsgd_core.Chain.skeleton_scale`
    (``1`` by default). Returned as lists indexed by node layer (``B[l]``, ``F[l]``); ``B[L]`` and
    ``F[0]`` are ``None``.
    """
    L = chain.L
    tau_w = [tau_edges(xp, meta[l - 1], W[l - 1]) for l in range(1, L)]
    # layer l+1 holds the free edges of the nodes of layer l
    free_w = [free_edges(xp, meta[l], W[l]) for l in range(1, L)]
    return products_of_edges(xp, chain, meta, tau_w, free_w, dtype, device)


def products_of_edges(xp, chain, meta, tau_w, free_w, dtype, device):
    """:func:`chain_products` from the skeleton edges' values alone: ``tau_w[l-1]`` holds
    the tau edges into layer ``l``'s nodes, ``free_w[l-1]`` the free edges out of them
    (``l = 1..L-1``), wherever the caller gathered them from."""
    L, r = chain.L, chain.skeleton_scale
    B = [xp.ones(chain.sizes[0], dtype=dtype, device=device)] + [None] * L
    for l in range(1, L):
        B[l] = xp.take(B[l - 1], meta[l - 1].tau_src) * in_units(xp, tau_w[l - 1], r[l - 1], device)
    F = [None] * L + [xp.ones(chain.sizes[L], dtype=dtype, device=device)]
    for l in range(L - 1, 0, -1):
        F[l] = in_units(xp, free_w[l - 1], r[l], device) * xp.take(F[l + 1], meta[l].sigma)
    return B, F


def in_units(xp, w, r: float, device):
    """Skeleton edges ``w`` of a layer in units of its reference magnitude ``r``
    (:attr:`Chain.skeleton_scale`); untouched, bit for bit, in the paper's units (``r = 1``).
    Dividing each factor, rather than the finished product, keeps deep products in range.
    ``r`` divides as an array: torch on CUDA multiplies by the reciprocal of a Python
    scalar divisor instead, whose product misses the quotient by an ulp (``r / r != 1``)."""
    return w if r == 1.0 else w / xp.asarray(r, dtype=w.dtype, device=device)


def path_values3(xp, meta, W, b, B, F):
    """``V_l = F_l ⊗ W_l ⊗ B_{l-1}`` (0 at free edges) and ``Vb_l = b_l * F_l``."""
    V = [xp.where(meta[l].free_mask, 0.0, outer3(F[l + 1], B[l]) * W[l]) for l in range(len(W))]
    Vb = [None if bl is None else bl * F[l + 1] for l, bl in enumerate(b)]
    return V, Vb


def icr3(xp, chain, meta, *, W, b, G, Gb, B, F, dtype, device):
    """Inverse chain rule: path gradients ``D = dL/dv`` by one backward sweep (theory page).

    Solves eq. (3) of the paper, ``dL/dw = G^T dL/dv``, restricted to non-free edges, where
    it is unit triangular. With ``P_l = W_l * grad_l`` and ``T_L = 0``, for ``l = L..1``::

        U_l     = where(free_l, 0, P_l - tau_l * T_l)
        T_{l-1} = sum_{0,2}( where(free_l, 0, P_l) + where(free_l & tau_l, T_l, 0) )

    ``T_l[j]`` sums ``U = v * dL/dv`` over the basis paths whose tau-chain passes node ``j``.
    Then ``D = U / V`` on tau edges and ``D = grad / (F_l[b] B_{l-1}[a])`` elsewhere (the
    same number, with no division by the weight: exact for pruned weights); biases
    ``Db = grad_b / F_l``; ``0`` at free edges and wherever a skeleton product is ``0`` or
    so small that ``D`` overflows (numerics guide: such paths are frozen).

    Returns ``D``, ``Db`` and ``V`` (path values, needed by the forward sweep).
    """
    L = chain.L
    V, Vb = path_values3(xp, meta, W, b, B, F)
    D = [None] * L
    T = xp.zeros(chain.sizes[L], dtype=dtype, device=device)
    for l in range(L, 0, -1):
        m = meta[l - 1]
        P = xp.where(m.free_mask, 0.0, W[l - 1] * G[l - 1])
        Tb = T[:, None, None]
        U_tau = P - Tb
        D_bulk = safe_div(xp, G[l - 1], outer3(F[l], B[l - 1]))
        D[l - 1] = frozen_if_overflow(xp, xp.where(
            m.free_mask, 0.0, xp.where(m.tau_mask, safe_div(xp, U_tau, V[l - 1]), D_bulk)),
            G[l - 1])
        # Paths through a free tau edge still pass its source: carry T_l down unchanged.
        carried = xp.where(m.free_mask & m.tau_mask, Tb, 0.0)
        T = xp.sum(P + carried, axis=(0, 2))
    Db = [None if g is None else path_gradient(xp, g, F[l + 1], g)
          for l, g in enumerate(Gb)]
    return D, Db, V, Vb




def allocate3(xp, chain, meta, *, W, b, D, Db, V, B, F, lr, dtype, device):
    """Weight allocation: apply ``V' = V - lr*D`` by one forward sweep (eq. 5–6, theory page).

    With ``rho_{l-1}[a]`` the product of weight ratios along the tau-chain into ``a``
    (``rho_0 = 1``), each non-free edge ``(a -> b)`` of layer ``l`` gets::

        W'[b, a, :] = (W[b, a, :] - lr * D[b, a, :] / (F_l[b] B_{l-1}[a])) / rho_{l-1}[a]
        b'_l        = b_l - lr * Db_l / F_l
        rho_l[b]    = 1 - lr * D_tau / V_tau   (tau edge of b not free)
                    = rho_{l-1}[tau_l(b)]      (tau edge of b free)

    Free edges keep their values. This is ``W * r`` with ``r = ((1..1, R) ⊙ Ã^{-1})`` written
    so that no weight is divided by itself. ``rho_l`` is a single path ratio, never a product,
    so it cannot underflow. A tau path ratio of exactly ``0`` (a path value landing on 0)
    would zero the tau weight and leave the weights above it undefined; it is replaced by the
    dtype's machine epsilon. A tau weight whose new value would not be finite keeps its value
    and its node takes its source's ``rho`` (:func:`~gsgd_core.rules.written_ratio`): the
    weights above are allocated against the tau chain as written. These are the only cases
    where ``V' != V - lr*D``.
    """
    eps = float(xp.finfo(dtype).eps)
    rho = xp.ones(chain.sizes[0], dtype=dtype, device=device)
    W_new, b_new = [], []
    for l in range(1, chain.L + 1):
        m = meta[l - 1]
        Wl = (W[l - 1] - scaled_div(xp, lr, D[l - 1], outer3(F[l], B[l - 1]))) / rho[None, :, None]
        bl = b[l - 1]
        b_new.append(None if bl is None else bl - scaled_div(xp, lr, Db[l - 1], F[l]))
        if l < chain.L:
            D_tau, V_tau = tau_edges(xp, m, D[l - 1]), tau_edges(xp, m, V[l - 1])
            R = tau_ratio(xp, scaled_div(xp, lr, D_tau, V_tau), eps)
            tau_w = tau_edges(xp, m, W[l - 1])
            _, R = written_ratio(xp, tau_w, R, xp.take(rho, m.tau_src))
            # The tau edge itself as W * R / rho, so that the epsilon rule holds for it too.
            tau_new = W[l - 1] * (R[:, None, None] / rho[None, :, None])
            Wl = xp.where(m.tau_mask, tau_new, Wl)
            rho = xp.where(m.tau_free, xp.take(rho, m.tau_src), R)
        W_new.append(xp.where(m.free_mask, W[l - 1], Wl))
    return W_new, b_new
