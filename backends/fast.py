"""The fast G-SGD step: bulk formula plus gathers (DESIGN §8), written once for every library.

Only ``O(n_l)`` edges of layer ``l`` are special (tau and free edges), so the step treats the
bulk of each layer with one formula and the special edges as short vectors, gathered once
(they lie one per row, each access a cache miss) and written back once:

- **Column sums** ``colsum_{0,2}(W_l * grad_l)``, ``l = 2..L`` (the one pass over the
  weights before the update; layer 1's is never needed, ``T_0`` is unused).
- **Vector stage** (:func:`_vectors`): the special edges gathered, the backward sweep
  (``l = L..2``, :func:`_sums`)::

      T_{l-1} = colsum_{0,2}(W_l * grad_l) - P_l[free edges] + scatter(T_l[free tau edges])

  (``T_l[b]`` is the sum of ``U = v * dL/dv`` over the basis paths whose tau chain passes
  ``b``), chain products ``B``, ``F``, the tau edges' path ratios ``R`` and ``rho`` (exactly
  :func:`gsgd_core.sweeps.allocate3`'s rules), new biases, and the flags read back in the
  step's one host synchronisation.
- **Bulk stage**: every layer in place, then its special edges and bias written back::

      W' = (W - lr * grad / (F_l[b] B_{l-1}[a])**2) / rho_{l-1}[a]

The heavy passes (column sum, bulk update) are the library's *kernels* (:mod:`.numpy`,
:mod:`.torch`, :mod:`.cupy`); a kernel set may also compile the two stages whole
(``kernels.stage``). Memory traffic is 5 passes over the weights against SGD's 3.

Numerics (DESIGN §6) match the core without a second pass over the weights: the backward
sums see every non-finite gradient (``0 * inf`` is NaN), so a step that the core would skip
or treat specially is handed back to the core before anything is written. Eager kernels
check each chunk of the bulk while it is still in cache and recompute a chunk holding a
non-finite value with the core's per-entry rules (:func:`exact_rows`); compiled kernels run
:func:`recip_rows` on layers whose node vectors are tame and :func:`exact_rows` elsewhere.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from gsgd_core import Chain
from gsgd_core.arrays import all_finite, outer3, prepare, safe_div
from gsgd_core.sweeps import frozen_if_overflow


class _Layer(NamedTuple):
    """Where layer ``l``'s special edges lie, as index arrays of one namespace and device.

    The tau and free edges sit one per row, all over the layer, so each access misses the
    cache: they are gathered once per step (``spec``) and written back once.
    """

    spec: Any         # sorted flat indices of the layer's tau and free edges
    tau: Any          # position in ``spec`` of each node's tau edge (none for l = L)
    free: Any         # position in ``spec`` of each free edge (one per node of l-1)
    node: Any         # per position in ``spec``: the node whose tau edge it is (0 if none)
    moved: Any        # per position in ``spec``: a tau edge that is not free (gets a new value)
    carry_nodes: Any  # nodes of layer l whose tau edge is free (T_l is carried down them)
    carry_src: Any    # their tau sources in layer l-1


def _layer_plan(chain: Chain, l: int) -> tuple:
    tau_idx, free_idx = chain.tau_index(l), chain.free_index(l)
    spec = np.union1d(tau_idx, free_idx).astype(np.int64)
    tau, free = np.searchsorted(spec, tau_idx), np.searchsorted(spec, free_idx)
    tau_free = chain.free_masks[l - 1].reshape(-1)[tau_idx]
    node, moved = np.zeros(spec.size, np.int64), np.zeros(spec.size, bool)
    node[tau] = np.arange(tau.size)
    moved[tau[~tau_free]] = True
    carry_nodes = np.flatnonzero(tau_free)
    carry_src = np.asarray(chain.tau[l - 1] if l < chain.L else [], np.int64)[carry_nodes]
    return spec, tau, free, node, moved, carry_nodes, carry_src


def _plan(chain: Chain, xp, device) -> tuple[_Layer, ...]:
    key = ("fast", xp.__name__, str(device))
    plan = chain._cache.get(key)
    if plan is None:
        plan = chain._cache[key] = tuple(
            _Layer(*(xp.asarray(a, device=device) for a in _layer_plan(chain, l)))
            for l in range(1, chain.L + 1))
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
    p = _prepared(chain, weights, biases, grads, bias_grads)
    xp, L = kernels.xp, chain.L
    if p.dtype != p.store:
        return False
    W = [kernels.view3(w, chain.layer_shape(l)) for l, w in enumerate(weights, start=1)]
    if any(w is None for w in W):
        return False
    G = [kernels.view3(g, chain.layer_shape(l), writable=False)
         for l, g in enumerate(grads, start=1)]
    b = list(biases) if biases is not None else [None] * L
    Gb = list(bias_grads) if bias_grads is not None else [None] * L
    plan = _plan(chain, p.xp, p.device)
    # Layer 1's gradients are checked through their sum (ATen's sum outruns inductor's).
    C = [xp.sum(G[0])] + [kernels.colsum(W[l], G[l]) for l in range(1, L)]
    lr = kernels.scalar(float(lr), p.dtype, p.device)
    vectors = kernels.stage(_vectors, chain)(kernels, chain, p.meta, plan, W, G, C, b, Gb, lr,
                                             p.device)
    flags = vectors[-1].tolist()  # the step's one host synchronisation
    if not flags[0]:
        return False
    B, F, rho, recips, special, bias, _ = vectors
    tame = tuple(flags[1:]) or (False,) * L
    # The bulk sees each layer as (n, p*k): a compiled loop then runs over contiguous columns
    # and writes its input itself (mutating a view of an input, inductor stages a copy).
    rows = [[xp.reshape(a, (a.shape[0], -1)) for a in A] for A in (W, G)]
    kernels.stage(_bulk_, chain)(kernels, *rows, B, F, rho, recips, lr, tame)
    for l in range(L):
        kernels.put_(W[l], plan[l].spec, special[l])
        if b[l] is not None:
            kernels.put_(b[l], None, bias[l])
    return True


def _prepared(chain: Chain, weights, biases, grads, bias_grads):
    """:func:`gsgd_core.arrays.prepare`, memoised on the arrays' signature (type, shape,
    dtype and device of each): a training loop passes the same signature every step, and
    validating it anew costs as much as updating a small layer."""
    lists = (weights, biases, grads, bias_grads)
    if not all(v is None or isinstance(v, (list, tuple)) for v in lists):
        return prepare(chain, weights, biases, grads=grads, bias_grads=bias_grads)
    sig = tuple(None if v is None else tuple(
        None if a is None else (type(a), tuple(a.shape), a.dtype, getattr(a, "device", None))
        for a in v) for v in lists)
    hit = chain._cache.get("fast-prepared")
    if hit is not None and hit[0] == sig:
        return hit[1]
    p = prepare(chain, weights, biases, grads=grads, bias_grads=bias_grads)
    chain._cache["fast-prepared"] = (sig, p)
    return p


def _sums(kernels, plan, ws, gs, C):
    """``T_1..T_{L-1}`` as ``T[l]`` from the column sums
    ``C[l-2] = colsum(W_l * grad_l)``, ``l = 2..L`` (the backward sweep above)."""
    xp, L = kernels.xp, len(plan)
    T = [None] * (L + 1)
    for l in range(L, 1, -1):
        s = plan[l - 1]
        below = C[l - 2] - xp.take(ws[l - 1], s.free) * xp.take(gs[l - 1], s.free)
        if l < L:
            below = kernels.scatter_add(below, s.carry_src, xp.take(T[l], s.carry_nodes))
        T[l - 1] = below
    return T


def _products(xp, chain, meta, plan, ws, dtype, device):
    """:func:`gsgd_core.sweeps.chain_products` from the gathered special edges."""
    L = chain.L
    B = [xp.ones(chain.sizes[0], dtype=dtype, device=device)] + [None] * L
    for l in range(1, L):
        B[l] = xp.take(B[l - 1], meta[l - 1].tau_src) * xp.take(ws[l - 1], plan[l - 1].tau)
    F = [None] * L + [xp.ones(chain.sizes[L], dtype=dtype, device=device)]
    for l in range(L - 1, 0, -1):
        F[l] = xp.take(ws[l], plan[l].free) * xp.take(F[l + 1], meta[l].sigma)
    return B, F


def _vectors(kernels, chain, meta, plan, W, G, C, b, Gb, lr, device):
    """Everything of the step that lives on node vectors, as one function (compiled whole by
    :data:`gsgd_backends.torch.COMPILED`): the special edges gathered, the backward sums
    ``T``, chain products ``B``, ``F``, new special edges, ``rho``, new biases, and the flags
    ``[ok, tame_1..tame_L]``. ``C`` holds the sum of layer 1's gradients, then the column
    sums ``colsum(W_l * grad_l)``, ``l = 2..L``. ``ok``: every backward sum, bias gradient
    and layer-1 gradient is finite; ``tame_l``: layer ``l`` may use :func:`recip_rows`
    (tested only for kernels that use it, ``kernels.recip``)."""
    xp = kernels.xp
    ws = [xp.take(_flat(xp, w), s.spec) for w, s in zip(W, plan)]
    gs = [xp.take(_flat(xp, g), s.spec) for g, s in zip(G, plan)]
    T = _sums(kernels, plan, ws, gs, C[1:])
    B, F = _products(xp, chain, meta, plan, ws, ws[0].dtype, device)
    special, rho = _special(xp, chain, meta, plan, ws, gs, T, B, F, lr, device)
    bias = [None if bl is None else _bias(xp, bl, g, f, lr) for bl, g, f in zip(b, Gb, F[1:])]
    # T_1..T_{L-1} sum every weight gradient above layer 1.
    ok = all_finite(xp, T[1:chain.L] + Gb) & xp.isfinite(C[0])
    tame, recips = [], None
    if kernels.recip:
        tame = [_tame(xp, F[l], True) & _tame(xp, B[l - 1], True) & _tame(xp, rho[l - 1], False)
                for l in range(1, chain.L + 1)]
        recips = [reciprocals(xp, F[l], B[l - 1], rho[l - 1], chain.layer_shape(l)[2])
                  for l in range(1, chain.L + 1)]
    return B, F, rho, recips, special, bias, xp.stack([ok] + tame)


def _bulk_(kernels, W, G, B, F, rho, recips, lr, tame) -> None:
    """Every layer's bulk update, ``W`` and ``G`` as ``(n, p*k)`` (one compiled stage: the
    special edges are written after it, outside, since a scatter inside would make the
    compiler stage the layer in a copy); a tame layer gets its node vectors' reciprocals
    for :func:`recip_rows`."""
    for l in range(len(W), 0, -1):  # the column sums ended on the top layers' first rows
        kernels.bulk_(W[l - 1], G[l - 1], F[l], B[l - 1], rho[l - 1], lr,
                      recips[l - 1] if tame[l - 1] else None)


def _bias(xp, b, Gb, F, lr):
    """The core's bias rule: ``b - lr * Db / F`` with ``Db = Gb / F`` (frozen on overflow)."""
    Db = frozen_if_overflow(xp, safe_div(xp, Gb, F), Gb)
    new = b - lr * safe_div(xp, Db, F)
    return xp.where(xp.isfinite(new), new, b)


def _tame(xp, v, zero_ok: bool):
    """Every entry of ``v`` lies in ``[4 sqrt(tiny), sqrt(max) / 4]`` (or is 0 if
    ``zero_ok``), so products and reciprocals of two such numbers neither overflow nor
    underflow: :func:`recip_rows` then equals :func:`exact_rows` to rounding."""
    fi = xp.finfo(v.dtype)
    a = xp.abs(v)
    inside = (a >= 4 * math.sqrt(fi.smallest_normal)) & (a <= math.sqrt(fi.max) / 4)
    return xp.all((inside | (a == 0)) if zero_ok else inside)


def _special(xp, chain, meta, plan, ws, gs, T, B, F, lr, device):
    """New values of each layer's special edges (new tau edges, free edges unchanged) and
    ``rho_0..rho_{L-1}``."""
    dtype = ws[0].dtype
    eps = float(xp.finfo(dtype).eps)
    rho = [xp.ones(chain.sizes[0], dtype=dtype, device=device)]
    special = []
    for l in range(1, chain.L):
        s = plan[l - 1]
        tau_new, rho_next = _tau_edges(xp, meta[l - 1], xp.take(ws[l - 1], s.tau),
                                       xp.take(gs[l - 1], s.tau), T[l], B[l - 1], F[l],
                                       rho[-1], lr, eps)
        special.append(xp.where(s.moved, xp.take(tau_new, s.node), ws[l - 1]))
        rho.append(rho_next)
    return special + [ws[-1]], rho


def _tau_edges(xp, m, w, g, T, B_prev, F, rho, lr, eps):
    """New tau-edge weights and ``rho_l``, by the rules of :func:`gsgd_core.sweeps.allocate3`:
    ``D = (P - T_l)/V``, ``R = 1 - lr*D/V`` (``0 -> eps``), tau edge ``W * R / rho_{l-1}``."""
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


def reciprocals(xp, F, B_prev, rho, k: int) -> tuple:
    """``(1/F, 1/B_prev, 1/rho)``, ``0`` for a zero ``F`` or ``B_prev`` (the core's
    ``safe_div``: a frozen path), the last two repeated ``k`` times (one entry per column of
    the layer seen as ``(n, p*k)``): the node vectors that :func:`recip_rows` takes."""
    def per_column(v):
        return xp.reshape(xp.broadcast_to(v[:, None], (v.shape[0], k)), (-1,))

    return safe_div(xp, 1.0, F), per_column(safe_div(xp, 1.0, B_prev)), per_column(1.0 / rho)


def recip_rows(xp, W, G, recips, lr) -> Any:
    """:func:`exact_rows` with the node vectors' :func:`reciprocals` ``(u, v, r)`` in place
    of divisions per entry (``c = u v = 1/(F B)``: ``D = G c``, ``W' = (W - lr D c) r``),
    for a layer whose vectors are tame (:func:`_tame`): no product of them under- or
    overflows, so the two agree to rounding (at the overflow edge of ``D``, to a unit in the
    last place). ``W`` and ``G`` come as ``(n, p*k)`` and the reciprocals precomputed, so
    that a compiled loop runs over contiguous columns without a division per entry."""
    u, v, r = recips
    c = u[:, None] * v[None, :]
    D = G * c
    D = xp.where(xp.isfinite(D), D, 0.0)
    new = (W - lr * (D * c)) * r[None, :]
    return xp.where(xp.isfinite(new), new, W)
