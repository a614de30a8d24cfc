"""The fast G-SGD step: bulk formula plus gathers (DESIGN §8), written once for every library.

Only ``O(n_l)`` edges of layer ``l`` are special (tau and free edges), so the step treats the
bulk of each layer with one formula and fixes the special entries with gathers:

- **Backward sweep** (``l = L..2``)::

      T_{l-1} = colsum_{0,2}(W_l * grad_l) - P_l[free edges] + scatter(T_l[free tau edges])

  ``T_l[b]`` is the sum of ``U = v * dL/dv`` over the basis paths whose tau chain passes
  ``b``; layer 1's column sum is never needed (``T_0`` is unused).
- **Forward sweep**: tau edges, path ratios ``R`` and ``rho`` on vectors of size ``n_l``
  (exactly :func:`gsgd_core.sweeps.allocate3`'s rules), then every layer's bulk in place::

      W' = (W - lr * grad / (F_l[b] B_{l-1}[a])**2) / rho_{l-1}[a]

  and last the new tau edges and the saved free edges are written back.

The two heavy passes (the column sum and the bulk update) are the library's *kernels*
(:mod:`.numpy`, :mod:`.torch`, :mod:`.cupy`); everything else runs on the small vectors through
the array-API namespace. Memory traffic is 5 passes over the weights against SGD's 3.

Numerics (DESIGN §6) match the core without a second pass over the weights: the backward
sums see every non-finite gradient (``0 * inf`` is NaN), so a step that the core would skip
or treat specially is handed back to the core before anything is written; the bulk kernel
checks each chunk while it is still in cache and recomputes a chunk holding a non-finite
value with the core's per-entry rules (:func:`exact_rows`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from gsgd_core import Chain
from gsgd_core.arrays import all_finite, outer3, prepare, safe_div
from gsgd_core.sweeps import chain_products, frozen_if_overflow


class _Plan(NamedTuple):
    """Per-layer index arrays of one chain in one namespace and device (cached on the chain)."""

    free_tau_nodes: tuple  # nodes b of layer l whose tau edge is free (index l-1)
    free_tau_src: tuple    # their tau sources in layer l-1


def _plan(chain: Chain, xp, device) -> _Plan:
    key = ("fast", xp.__name__, str(device))
    plan = chain._cache.get(key)
    if plan is None:
        nodes, srcs = [], []
        for l in range(1, chain.L + 1):
            free_flat = chain.free_masks[l - 1].reshape(-1)
            tau_free = free_flat[chain.tau_index(l)]
            b = np.flatnonzero(tau_free)
            a = np.asarray(chain.tau[l - 1], dtype=np.int64)[b] if l < chain.L else b
            nodes.append(xp.asarray(b.astype(np.int64), device=device))
            srcs.append(xp.asarray(a.astype(np.int64), device=device))
        plan = chain._cache[key] = _Plan(tuple(nodes), tuple(srcs))
    return plan


def _flat(xp, a):
    return xp.reshape(a, (-1,))


def recip_square(xp, f):
    """``1 / f**2`` with ``0`` where ``f == 0`` (the core's ``safe_div``: a zero skeleton
    product freezes the path); an underflowing ``f**2`` gives ``inf``, which the bulk kernel
    sees and hands to :func:`exact_rows`."""
    return xp.where(f == 0, 0.0, 1.0 / xp.where(f == 0, 1.0, f * f))


def fast_step_(kernels, chain: Chain, weights, biases, grads, bias_grads, lr) -> bool:
    """One plain G-SGD step in place through ``kernels``; ``False`` if the core must take it.

    Returns ``False`` before writing anything when the weights cannot be updated in place
    (not contiguous, half precision) or when a gradient or a backward sum is not finite (the
    core then skips the step or freezes the paths concerned, DESIGN §6). Otherwise the
    weights and biases hold the core's :func:`gsgd_core.gsgd_step` result (to rounding).
    """
    with kernels.context():
        return _step(kernels, chain, weights, biases, grads, bias_grads, lr)


def _step(kernels, chain, weights, biases, grads, bias_grads, lr) -> bool:
    p = prepare(chain, weights, biases, grads=grads, bias_grads=bias_grads)
    xp, dtype, L = p.xp, p.dtype, chain.L
    if dtype != p.store:
        return False
    W = [kernels.view3(w, chain.layer_shape(l)) for l, w in enumerate(weights, start=1)]
    if any(w is None for w in W):
        return False
    G = [xp.reshape(g, chain.layer_shape(l)) for l, g in enumerate(grads, start=1)]
    b = list(biases) if biases is not None else [None] * L
    Gb = list(bias_grads) if bias_grads is not None else [None] * L
    lr = float(lr)
    B, F = chain_products(xp, chain, p.meta, W, dtype, p.device)
    T = _backward(kernels, xp, chain, p.meta, _plan(chain, xp, p.device), W, G, dtype, p.device)
    # T_1..T_{L-1} sum every weight gradient above layer 1; layer 1's are checked by one sum.
    if not (bool(all_finite(xp, T[1:L] + Gb)) and math.isfinite(float(xp.sum(G[0])))):
        return False
    _forward(kernels, xp, chain, p.meta, W, b, G, Gb, T, B, F, lr, dtype, p.device)
    return True


def _backward(kernels, xp, chain, meta, plan, W, G, dtype, device):
    """``T_1..T_{L-1}`` as ``T[l]`` (``T[L] = 0``)."""
    L = chain.L
    T = [None] * L + [xp.zeros(chain.sizes[L], dtype=dtype, device=device)]
    for l in range(L, 1, -1):
        m = meta[l - 1]
        P_free = (xp.take(_flat(xp, W[l - 1]), m.free_idx)
                  * xp.take(_flat(xp, G[l - 1]), m.free_idx))
        below = kernels.colsum(W[l - 1], G[l - 1]) - P_free
        if l < L:
            carried = xp.take(T[l], plan.free_tau_nodes[l - 1])
            below = kernels.scatter_add(below, plan.free_tau_src[l - 1], carried)
        T[l - 1] = below
    return T


def _forward(kernels, xp, chain, meta, W, b, G, Gb, T, B, F, lr, dtype, device):
    """Tau edges and ``rho`` on vectors, then each layer's bulk, tau and free writes."""
    eps = float(xp.finfo(dtype).eps)
    rho = xp.ones(chain.sizes[0], dtype=dtype, device=device)
    for l in range(1, chain.L + 1):
        m = meta[l - 1]
        flat = _flat(xp, W[l - 1])
        free_old = xp.take(flat, m.free_idx)
        if l < chain.L:
            tau_new, rho_next = _tau_edges(xp, m, flat, _flat(xp, G[l - 1]), T[l], B[l - 1],
                                           F[l], rho, lr, eps)
        kernels.bulk_(W[l - 1], G[l - 1], F[l], B[l - 1], rho, lr)
        if l < chain.L:
            kernels.put_(W[l - 1], m.tau_idx, tau_new)
            rho = rho_next
        kernels.put_(W[l - 1], m.free_idx, free_old)
        if b[l - 1] is not None:
            Db = frozen_if_overflow(xp, safe_div(xp, Gb[l - 1], F[l]), Gb[l - 1])
            new = b[l - 1] - lr * safe_div(xp, Db, F[l])
            kernels.put_(b[l - 1], None, xp.where(xp.isfinite(new), new, b[l - 1]))


def _tau_edges(xp, m, flat, gflat, T, B_prev, F, rho, lr, eps):
    """New tau-edge weights and ``rho_l``, by the rules of :func:`gsgd_core.sweeps.allocate3`:
    ``D = (P - T_l)/V``, ``R = 1 - lr*D/V`` (``0 -> eps``), tau edge ``W * R / rho_{l-1}``."""
    w, g = xp.take(flat, m.tau_idx), xp.take(gflat, m.tau_idx)
    rho_src = xp.take(rho, m.tau_src)
    V = (F * xp.take(B_prev, m.tau_src)) * w
    D = frozen_if_overflow(xp, safe_div(xp, w * g - T, V), g)
    R = 1.0 - lr * safe_div(xp, D, V)
    R = xp.where(R == 0, eps, R)
    new = w * (R / rho_src)
    return xp.where(xp.isfinite(new), new, w), xp.where(m.tau_free, rho_src, R)


def exact_rows(xp, W, G, F, B_prev, rho, lr) -> Any:
    """The bulk update by the core's per-entry rules (for a block holding an overflow, or
    whole layers where a compiler fuses it into one loop):
    ``D = G/(F B)`` (0 if that overflows: frozen path), ``W' = (W - lr*D/(F B))/rho``, and an
    entry whose ``W'`` is not finite keeps its value."""
    fb = outer3(F, B_prev)
    D = frozen_if_overflow(xp, safe_div(xp, G, fb), G)
    new = (W - lr * safe_div(xp, D, fb)) / rho[None, :, None]
    return xp.where(xp.isfinite(new), new, W)
