"""The positive-scaling group acting on a chain, and moves along or across its orbits.

``rescale`` is the group action (paper Def. 3.1); ``canonicalize`` picks one point per orbit;
``skeleton_init`` (paper §11.2) and ``weights_from_path_values`` set weights from the
skeleton's point of view.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import array_api_compat
import numpy as np

from .arrays import check_hyper, is_array, outer3, prepare, restore, unvecs, vecs, view3
from .chain import Chain
from .rules import safe_div
from .sweeps import chain_products, in_units, tau_edges

__all__ = ["rescale", "random_rescaling", "canonicalize", "skeleton_init",
           "weights_from_path_values"]


def _apply_scales(W, b, c):
    """``W_l * c_l[:, None, None] / c_{l-1}[None, :, None]``, ``b_l * c_l`` (c per node layer)."""
    W_new = [W[l] * c[l + 1][:, None, None] / c[l][None, :, None] for l in range(len(W))]
    b_new = [None if bl is None else bl * c[l + 1] for l, bl in enumerate(b)]
    return W_new, b_new


def _host_scales(chain: Chain, scales) -> list:
    """Validate the scales' count and shapes (and, for host data, positivity) up front."""
    if isinstance(scales, (str, bytes)) or not isinstance(scales, Sequence):
        raise ValueError(f"scales must be a list of {chain.L - 1} vectors (one per hidden "
                         f"layer), got {type(scales).__name__}")
    if len(scales) != chain.L - 1:
        raise ValueError(f"scales has {len(scales)} vectors, but the chain has "
                         f"{chain.L - 1} hidden layers")
    out = []
    for l, s in enumerate(scales, start=1):
        if not is_array(s):
            s = np.asarray(s, dtype=np.float64)
        if tuple(s.shape) != (chain.sizes[l],):
            raise ValueError(f"hidden layer {l}: scales have shape {tuple(s.shape)}, "
                             f"expected ({chain.sizes[l]},)")
        if isinstance(s, np.ndarray) and not (np.all(np.isfinite(s)) and np.all(s > 0)):
            raise ValueError(f"hidden layer {l}: scales must be finite and > 0")
        out.append(s)
    return out


def rescale(chain: Chain, weights: Sequence[Any], biases, scales):
    """Apply the positive scaling operator ``g_c`` (paper Def. 3.1) with node scales ``c``.

    ``W_l <- W_l * c_l[:, None, None] / c_{l-1}[None, :, None]``, ``b_l <- b_l * c_l`` with
    ``c_0 = c_L = 1``. The network function and all path values are unchanged (Thm 3.3).

    Parameters
    ----------
    scales : list of L - 1 vectors
        The positive node scales ``c_l``, ``scales[l-1]`` of shape ``(n_l,)``: on the host
        (NumPy, lists) or arrays of the weights' namespace.
    """
    scales = _host_scales(chain, scales)
    p = prepare(chain, weights, biases)
    xp = p.xp
    ones = [xp.ones(chain.sizes[0], dtype=p.dtype, device=p.device)]
    c = ones + [xp.astype(xp.asarray(s, device=p.device), p.dtype) for s in scales] + [
        xp.ones(chain.sizes[-1], dtype=p.dtype, device=p.device)]
    W_new, b_new = _apply_scales(view3(p, chain, weights), vecs(p, biases, chain.L), c)
    return restore(p, W_new), unvecs(p, b_new)


def random_rescaling(chain: Chain, rng: np.random.Generator, spread: float = 1.0) -> list:
    """Random node scales ``exp(spread * N(0, 1))`` for :func:`rescale` (host NumPy arrays)."""
    if not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    if not np.isfinite(spread) or spread < 0:
        raise ValueError(f"spread must be finite and >= 0, got {spread!r}")
    return [np.exp(spread * rng.standard_normal(n)) for n in chain.sizes[1:-1]]


def canonicalize(chain: Chain, weights: Sequence[Any], biases=None):
    """The canonical point of the orbit: every free skeleton weight becomes ``±1``
    (``±r_l`` in a chain with a :attr:`~gsgd_core.Chain.skeleton_scale`).

    Uses ``c_l[j] = |W_{l+1}[sigma(j), j, s]| * c_{l+1}[sigma(j)] = |F_l[j]|`` (top down),
    the unique group element with that property. Idempotent, and equal for ``w`` and every
    rescaling of ``w``. A node whose free chain holds a zero weight has no such element; it
    keeps scale ``1``.
    """
    p = prepare(chain, weights, biases)
    xp = p.xp
    W = view3(p, chain, weights)
    _, F = chain_products(xp, chain, p.meta, W, p.dtype, p.device)
    c = [xp.ones(chain.sizes[0], dtype=p.dtype, device=p.device)]
    c += [xp.where(F[l] == 0, 1.0, xp.abs(F[l])) for l in range(1, chain.L)]
    c += [F[chain.L]]
    W_new, b_new = _apply_scales(W, vecs(p, biases, chain.L), c)
    # Exactly +-r in every namespace, whatever order the compiler evaluates W * c / c' in;
    # the free edges of layer l leave nodes of layer l-1, and only those with F != 0 moved.
    W_new = [wn if l == 1 else xp.where(m.free_mask & (F[l - 1] != 0)[None, :, None],
                                        xp.sign(w) * r, wn)
             for l, (m, w, wn, r) in enumerate(zip(p.meta, W, W_new, chain.skeleton_scale),
                                               start=1)]
    return restore(p, W_new), unvecs(p, b_new)


def skeleton_init(chain: Chain, weights: Sequence[Any], biases=None, *,
                  keep_signs: bool = False, rest_scale: float = 1.0):
    """Set every skeleton edge (tau and free edges) of layer ``l`` to ``+r_l`` (paper §11.2).

    ``r`` is the chain's :attr:`~gsgd_core.Chain.skeleton_scale`: ``1`` in the paper's units.
    Afterwards ``|B| = |F| = 1`` in the chain's units, so the first G-SGD step moves every
    non-skeleton weight of layer 1 by SGD's step (above, also divided by the tau ratio of
    its column) and learning rates mean what they mean for SGD. With ``keep_signs`` each
    skeleton edge keeps the sign it has (``+`` where it is ``0``), so a random init stays
    zero-mean; ``rest_scale`` multiplies every other weight (the He recipe, skeleton guide,
    uses ``sqrt(1 - share)`` with :meth:`Chain.he_skeleton_scale`). It changes the network
    function; biases are returned as given (they may be left out).
    """
    check_hyper("rest_scale", rest_scale)
    p = prepare(chain, weights, biases, biases_optional=True)
    xp = p.xp
    W_new = []
    for m, w, r in zip(p.meta, view3(p, chain, weights), chain.skeleton_scale):
        value = xp.where(w < 0, -r, xp.full_like(w, r)) if keep_signs else r
        rest = w if rest_scale == 1.0 else w * rest_scale
        W_new.append(xp.where(m.free_mask | m.tau_mask, value, rest))
    return restore(p, W_new), (None if biases is None else list(biases))


#: How :func:`skeleton_state` finds a chain's skeleton.
SKELETON_STATES = ("initialised", "trained", "default", "unknown")


def skeleton_state(chain: Chain, weights: Sequence[Any], *, rows=None,
                   default_bound: float = 1.0) -> str:
    """Whether the chain's skeleton was initialised (:func:`skeleton_init`), as its weights
    show it; one of ``SKELETON_STATES``.

    G-SGD and G-Adam never change the ``H`` free edges (the basis paths are the other
    edges), so they keep :attr:`Chain.skeleton_scale` through training, while training moves
    the tau edges of the first layer:

    - ``"initialised"``: every skeleton edge (tau and free) has its layer's scale ``r_l``
      (``+r_l`` for the paper's recipe, ``|w| = r_l`` for the He recipe);
    - ``"trained"``: the free edges have it and some tau edge does not: initialised, then
      trained in path space;
    - ``"default"``: the free edges do not have it, nor all lie within a factor 2 of it, and
      every weight lies within a framework's default initialisation, ``|w| <= default_bound
      / sqrt(fan_in)`` (torch's Linear and Conv: ``1``): never skeleton-initialised;
    - ``"unknown"``: neither: a trained model whose free edges another optimizer moved, a
      rescaled one, or one initialised some other way.

    ``rows`` gives, per layer, the ``(start, stop)`` output rows that ``weights[l - 1]``
    holds (a shard's local rows; default: all of them). One host synchronisation per layer.
    """
    xp = array_api_compat.array_namespace(*weights)
    paper = all(r == 1.0 for r in chain.skeleton_scale)
    free_ok = tau_ok = near = default = True
    for l, w in enumerate(weights, start=1):
        r0, r1 = rows[l - 1] if rows is not None else (0, chain.sizes[l])
        shape, r = chain.layer_shape(l), chain.skeleton_scale[l - 1]
        W = xp.reshape(w, (r1 - r0,) + shape[1:])
        size = W if paper else xp.abs(W)
        device = array_api_compat.device(W)

        def every(mask, ok) -> bool:  # ok at every edge of the mask (in these rows)
            return bool(xp.all(xp.where(xp.asarray(mask[r0:r1], device=device), ok, True)))

        free_ok = free_ok and every(chain.free_mask(l), size == r)
        tau_ok = tau_ok and every(chain.tau_mask(l), size == r)
        near = near and every(chain.free_mask(l), (size >= r / 2) & (size <= 2 * r))
        bound = default_bound / math.sqrt(shape[1] * shape[2]) * (1 + 1e-6)
        default = default and bool(xp.all(xp.abs(W) <= bound))
    if free_ok:
        return "initialised" if tau_ok else "trained"
    # free edges all near their scale: a skeleton moved by another rule, not a random init
    return "default" if default and not near else "unknown"


def weights_from_path_values(chain: Chain, V: Sequence[Any], Vb, weights: Sequence[Any]):
    """Weights with basis-path values ``V``, ``Vb``, keeping the free weights of ``weights``.

    Only the free entries of ``weights`` are read. A forward sweep sets every non-free edge to
    ``W = V / (F_l[b] B_{l-1}[a])`` (products in the chain's units) and ``b = Vb / F_l``,
    with ``B`` taken from the new weights. Inverts :func:`path_values` for weights whose
    skeleton products are non-zero (Theorem 3.6); where a product is zero the edge is set to
    ``0``.
    """
    p = prepare(chain, weights, Vb, extra=(("path values", V),))
    xp = p.xp
    W = view3(p, chain, weights)
    V3 = view3(p, chain, V)
    _, F = chain_products(xp, chain, p.meta, W, p.dtype, p.device)
    B = xp.ones(chain.sizes[0], dtype=p.dtype, device=p.device)
    W_new = []
    for l in range(1, chain.L + 1):
        m = p.meta[l - 1]
        Wl = xp.where(m.free_mask, W[l - 1], safe_div(xp, V3[l - 1], outer3(F[l], B)))
        W_new.append(Wl)
        if l < chain.L:
            tau_w = tau_edges(xp, m, Wl)
            B = xp.take(B, m.tau_src) * in_units(xp, tau_w, chain.skeleton_scale[l - 1], p.device)
    b_new = [None if v is None else safe_div(xp, v, F[l + 1])
             for l, v in enumerate(vecs(p, Vb, chain.L))]
    return restore(p, W_new), unvecs(p, b_new)
