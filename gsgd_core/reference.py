"""Dense reference implementations for small chains (host NumPy, float64).

These build the paper's objects literally: every path, the structure matrix ``A``
(Theorem 3.4), the basis matrix ``A'`` and ``Ã`` of eq. (5), the ``⊙`` operator of
Def. 8.3, eq. (3) solved as a least-squares system, weight allocation through ``Ã^{-1}``
(eq. 6) and a second, minimum-norm projection (Theorem 4.1). They exist to check the sweeps,
not to train: their cost grows with the number of paths.

Edges are numbered globally, layer by layer: ``W_1`` (its ``(n_1, n_0, k_1)`` view in C
order), then ``b_1``, then ``W_2``, ``b_2``, ... A *basis vector* has one entry per non-free
edge, in that global order: the value of the basis path that edge owns.
"""

from __future__ import annotations

import itertools
import math
import numpy as np

from .chain import Chain

__all__ = [
    "edge_offsets", "flatten", "unflatten", "n_paths", "enumerate_paths", "structure_matrix",
    "free_edges", "basis_edges", "basis_paths", "basis_matrix", "a_tilde", "odot",
    "path_values", "path_jacobian", "icr", "allocate", "allocate_min_norm", "path_sgd_gamma",
    "to_basis", "from_basis",
]


def edge_offsets(chain: Chain) -> list[tuple[int, int | None]]:
    """``(weight offset, bias offset or None)`` of each layer in the global edge vector."""
    out, pos = [], 0
    for l in range(1, chain.L + 1):
        w_off = pos
        pos += chain.layer_size(l)
        b_off = pos if chain.bias[l - 1] else None
        pos += chain.sizes[l] if chain.bias[l - 1] else 0
        out.append((w_off, b_off))
    return out


def flatten(chain: Chain, weights, biases=None) -> np.ndarray:
    """Weights (any layer shape) and biases as one float64 edge vector."""
    parts = []
    biases = biases if biases is not None else [None] * chain.L
    for l, (w, b) in enumerate(zip(weights, biases), start=1):
        parts.append(np.asarray(w, dtype=np.float64).reshape(-1))
        if chain.bias[l - 1]:
            parts.append(np.asarray(b, dtype=np.float64).reshape(-1))
    return np.concatenate(parts)


def unflatten(chain: Chain, vec: np.ndarray):
    """Inverse of :func:`flatten`: 3-D layer views and biases (``None`` without bias)."""
    W, b = [], []
    for l, (w_off, b_off) in enumerate(edge_offsets(chain), start=1):
        W.append(vec[w_off:w_off + chain.layer_size(l)].reshape(chain.layer_shape(l)))
        b.append(None if b_off is None else vec[b_off:b_off + chain.sizes[l]].copy())
    return W, b


def _w_edge(chain: Chain, offsets, l: int, b: int, a: int, s: int) -> int:
    n, n_prev, k = chain.layer_shape(l)
    return offsets[l - 1][0] + (b * n_prev + a) * k + s


def n_paths(chain: Chain) -> int:
    """Number of paths, bias paths included (a bias is an edge from a constant node)."""
    def above(l):  # completions from a node of layer l to the outputs
        return math.prod(chain.sizes[i] * chain.slots[i - 1] for i in range(l + 1, chain.L + 1))
    total = chain.sizes[0] * above(0)
    return total + sum(chain.sizes[l] * above(l) for l in range(1, chain.L + 1)
                       if chain.bias[l - 1])


def enumerate_paths(chain: Chain, max_paths: int = 20_000) -> list[tuple[int, ...]]:
    """Every path as a tuple of global edge ids, input paths first, then bias paths."""
    if n_paths(chain) > max_paths:
        raise ValueError(f"{chain} has {n_paths(chain)} paths, more than max_paths={max_paths}")
    off = edge_offsets(chain)

    def up(l, node):  # all continuations from `node` in layer l to an output
        if l == chain.L:
            yield ()
            return
        for b, s in itertools.product(range(chain.sizes[l + 1]), range(chain.slots[l])):
            e = _w_edge(chain, off, l + 1, b, node, s)
            for rest in up(l + 1, b):
                yield (e,) + rest

    paths = [p for i0 in range(chain.sizes[0]) for p in up(0, i0)]
    for l in range(1, chain.L + 1):
        if chain.bias[l - 1]:
            for c in range(chain.sizes[l]):
                paths += [(off[l - 1][1] + c,) + p for p in up(l, c)]
    return paths


def _incidence(chain: Chain, paths) -> np.ndarray:
    A = np.zeros((chain.m, len(paths)))
    for j, p in enumerate(paths):
        A[list(p), j] = 1.0
    return A


def structure_matrix(chain: Chain, max_paths: int = 20_000) -> np.ndarray:
    """The ``m x n`` 0/1 structure matrix ``A`` (paper §3.2); ``rank(A) = m - H``."""
    return _incidence(chain, enumerate_paths(chain, max_paths))


def free_edges(chain: Chain) -> np.ndarray:
    """Global ids of the ``H`` free skeleton weights."""
    off = edge_offsets(chain)
    return np.concatenate([off[l - 1][0] + chain.free_index(l)
                           for l in range(2, chain.L + 1)]).astype(np.int64)


def basis_edges(chain: Chain) -> np.ndarray:
    """Global ids of the ``m - H`` non-free edges; basis vectors follow this order."""
    keep = np.ones(chain.m, dtype=bool)
    keep[free_edges(chain)] = False
    return np.flatnonzero(keep)


def basis_paths(chain: Chain) -> list[tuple[int, ...]]:
    """The basis path of each non-free edge: tau-chain down, the edge, sigma-chain up."""
    off = edge_offsets(chain)
    owner = {}
    for l in range(1, chain.L + 1):
        n, n_prev, k = chain.layer_shape(l)
        for b, a, s in itertools.product(range(n), range(n_prev), range(k)):
            owner[_w_edge(chain, off, l, b, a, s)] = (l, a, b)
        if chain.bias[l - 1]:
            for c in range(n):
                owner[off[l - 1][1] + c] = (l, None, c)
    paths = []
    for e in basis_edges(chain):
        l, a, b = owner[int(e)]
        path = [int(e)]
        node = a
        for ll in range(l - 1, 0, -1):  # tau-chain into `a`
            if node is None:
                break
            src = chain.tau[ll - 1][node]
            path.append(_w_edge(chain, off, ll, node, src, chain.skeleton_slots[ll - 1]))
            node = src
        node = b
        for ll in range(l + 1, chain.L + 1):  # sigma-chain out of `b`
            tgt = chain.sigma[ll - 2][node]
            path.append(_w_edge(chain, off, ll, tgt, node, chain.skeleton_slots[ll - 1]))
            node = tgt
        paths.append(tuple(sorted(path)))
    return paths


def basis_matrix(chain: Chain) -> np.ndarray:
    """``A' = (p^1, ..., p^{m-H})``: the ``m x (m-H)`` matrix of basis paths (eq. 4)."""
    return _incidence(chain, basis_paths(chain))


def a_tilde(chain: Chain) -> np.ndarray:
    """``Ã = [B, A']`` of eq. (5): unit columns of the free weights, then the basis paths."""
    units = np.zeros((chain.m, chain.H))
    units[free_edges(chain), np.arange(chain.H)] = 1.0
    return np.concatenate([units, basis_matrix(chain)], axis=1)


def odot(w: np.ndarray, A: np.ndarray) -> np.ndarray:
    """``w ⊙ A`` (Def. 8.3): ``(w ⊙ A)_k = prod_j sgn(w_j)^{a_jk} |w_j|^{a_jk}``.

    The sign factor is read as ``sgn(w_j)^{a_jk}`` (no factor where ``a_jk = 0``), the
    reading under which ``W ⊙ A ⊙ A^{-1} = W`` holds as the appendix proves; for the integer
    matrices of eq. (4)–(6) this is ``prod_j w_j^{a_jk}``. Non-integer exponents need
    positive ``w``.
    """
    w = np.asarray(w, dtype=np.float64)
    A = np.asarray(A, dtype=np.float64)
    if not np.allclose(A, np.round(A)):
        if np.any(w <= 0):
            raise ValueError("non-integer exponents need positive entries")
        return np.exp(np.log(w) @ A)
    return np.prod(w[:, None] ** np.round(A), axis=0)


def _exact_inverse(M: np.ndarray) -> np.ndarray:
    inv = np.round(np.linalg.inv(M))
    if not np.array_equal(inv @ M, np.eye(len(M))):
        raise ArithmeticError("Ã is not unimodular; the skeleton is not a basis")
    return inv


def path_values(chain: Chain, weights, biases=None) -> np.ndarray:
    """Basis vector of path values, each the plain product ``prod_{e in p} w_e``."""
    w = flatten(chain, weights, biases)
    return np.array([np.prod(w[list(p)]) for p in basis_paths(chain)])


def path_jacobian(chain: Chain, weights, biases=None) -> np.ndarray:
    """``G[p, e] = dv_p / dw_e`` (eq. 3): the product of the other edges of ``p``."""
    w = flatten(chain, weights, biases)
    paths = basis_paths(chain)
    G = np.zeros((len(paths), chain.m))
    for i, p in enumerate(paths):
        for e in p:
            G[i, e] = np.prod([w[f] for f in p if f != e])
    return G


def icr(chain: Chain, weights, biases, grads, bias_grads) -> np.ndarray:
    """``dL/dv`` by solving eq. (3), ``dL/dw = G^T dL/dv``, as one least-squares system."""
    G = path_jacobian(chain, weights, biases)
    g = flatten(chain, grads, bias_grads)
    return np.linalg.lstsq(G.T, g, rcond=None)[0]


def allocate(chain: Chain, weights, biases, R: np.ndarray) -> np.ndarray:
    """New edge vector from path ratios ``R`` by eq. (6): ``r = (1..1, R) ⊙ Ã^{-1}``."""
    w = flatten(chain, weights, biases)
    r = odot(np.concatenate([np.ones(chain.H), R]), _exact_inverse(a_tilde(chain)))
    return w * r


def allocate_min_norm(chain: Chain, weights, biases, R: np.ndarray) -> np.ndarray:
    """Another projection (Theorem 4.1): minimum-norm weight ratios in log space.

    ``log|r| = argmin ||x||`` subject to ``A'^T x = log|R|``; the signs of ``r`` are those of
    eq. (6) (free weights keep theirs), so every basis path gets ratio ``R`` while the free
    weights change magnitude.
    """
    w = flatten(chain, weights, biases)
    x = np.linalg.lstsq(basis_matrix(chain).T, np.log(np.abs(R)), rcond=None)[0]
    signs = odot(np.concatenate([np.ones(chain.H), np.sign(R)]),
                 _exact_inverse(a_tilde(chain)))
    return w * signs * np.exp(x)


def path_sgd_gamma(chain: Chain, weights, biases=None, max_paths: int = 20_000) -> np.ndarray:
    """Path-SGD's ``gamma_e = sum_{p through e} prod_{f in p, f != e} w_f^2`` by brute force."""
    w2 = flatten(chain, weights, biases) ** 2
    gamma = np.zeros(chain.m)
    for p in enumerate_paths(chain, max_paths):
        for e in p:
            gamma[e] += np.prod([w2[f] for f in p if f != e])
    return gamma


def to_basis(chain: Chain, V, Vb=None) -> np.ndarray:
    """Layer-shaped path values (``gsgd_core.path_values``) as a basis vector."""
    return flatten(chain, V, Vb)[basis_edges(chain)]


def from_basis(chain: Chain, v: np.ndarray):
    """A basis vector as 3-D layer arrays and biases, ``0`` at free edges."""
    full = np.zeros(chain.m)
    full[basis_edges(chain)] = v
    return unflatten(chain, full)

