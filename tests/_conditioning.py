"""How far apart two correct float64 computations of one path-space step may lie.

The fast steps (``gsgd_backends``) and the core compute the same numbers, but their sums
run in different orders (NumPy's pairwise sums, torch's blocked ``addcmul_``, a column sum
taken over blocks of rows). On every path but the tau paths that changes nothing beyond a
few units of rounding: ``D = grad / (F B)`` and ``Db = grad_b / F`` involve no sum. On a tau
edge the path gradient is a difference of sums (paper eq. 3, DESIGN §3)::

    D_tau = (w g - T) / V,    T = sum of w g over the basis paths whose tau-chain passes b

and when the network carries no gradient through that tau edge's node other than along its
tau chain (a unit whose other inputs are dead), the gradient's orthogonality to the group
orbit makes ``w g - T`` exactly ``0``: what is left is the rounding of two sums of ``N``
terms, at most ``gamma_N * sum |terms|`` each (Higham, *Accuracy and Stability of Numerical
Algorithms*, §4.2: any order of summation; ``u`` is the dtype's unit roundoff). The two
computations of ``D_tau`` may then differ by ``2 gamma_N sum|terms| / |V|``, however small
``D_tau`` is.

A well-conditioned rule passes that on unchanged (G-SGD: ``Delta = lr D``). Adam's step
``lr m / (sqrt(s) + eps)`` has slope ``lr / eps`` at ``D = 0``: it multiplies the rounding of a
cancelled ``D`` by ``10^6`` (``lr = 0.01``, ``eps = 1e-8``). The tolerance of a comparison
is therefore the rule's own response to that bound: the change of ``Delta`` and of the new
buffers when ``D`` moves by ``dD``, evaluated by the core's rule itself at ``D - dD`` and
``D + dD`` (:func:`step_tolerance`). Path values and buffers are compared path by path with
it (:func:`assert_step_close`). Weights are compared as well wherever no tau path ratio
``R`` nears 0: a weight above node ``a`` is divided by ``rho[a] = R``, so it carries the
rounding of the cancelling ``1 - lr D / V`` divided by ``R`` (a diverging run drives ``R``
toward 0; path values are products in which that division cancels).
"""

from __future__ import annotations

import contextlib

import numpy as np

import gsgd_backends as gb
import gsgd_core as gc
from gsgd_backends import fast
from gsgd_backends._dispatch import assign

#: Rounding of a path gradient off the sums (a division, chain products of ``L`` factors
#: formed in either order), relative to ``|D|``, in units of ``u`` per layer.
PER_LAYER = 8


def unit_roundoff(a) -> float:
    """``u`` of ``a``'s floating dtype (half the machine epsilon)."""
    return float(np.finfo(np.asarray(a).dtype).eps) / 2


def tau_rounding(chain: gc.Chain, W, G) -> list:
    """Per layer (3-D, host float64): a bound on how far two computations of ``w g - T``
    may differ at each tau edge (``0`` elsewhere).

    ``sum |terms|`` follows the backward sweep with absolute values: every ``|W * grad|`` of
    the layers above (the fast path sums whole columns and subtracts the free edges, so
    those count twice) and the sums carried down through free tau edges."""
    m = sum(int(np.size(w)) for w in W)
    n = 2 * m + chain.L  # the terms of any one backward sum, products counted as terms
    u = unit_roundoff(W[0])
    gamma = n * u / (1 - n * u)
    T_abs = np.zeros(chain.sizes[-1])
    out = [None] * chain.L
    for l in range(chain.L, 0, -1):
        shape = chain.layer_shape(l)
        free, tau = chain.free_mask(l), chain.tau_mask(l)
        P = np.abs(np.reshape(W[l - 1], shape) * np.reshape(G[l - 1], shape))
        carried = T_abs[:, None, None]
        out[l - 1] = np.where(tau & ~free, 2 * gamma * (P + carried), 0.0)
        T_abs = np.sum(P + np.where(free, P, 0.0) + np.where(free & tau, carried, 0.0),
                       axis=(0, 2))
    return out


def gradient_rounding(chain: gc.Chain, W, b, G, Gb):
    """``(D, dD)``: the core's path gradients as the rule sees them (layers, then the layers
    with a bias) and a bound on how far another correct computation's may lie from each."""
    D, Db = gc.icr(chain, W, b, G, Gb)
    V, Vb = gc.path_values(chain, W, b)
    rel = PER_LAYER * chain.L * unit_roundoff(W[0])
    dD = [rel * np.abs(d) + np.where(v == 0, 0.0, s / np.where(v == 0, 1.0, np.abs(v)))
          for d, v, s in zip(D, V, tau_rounding(chain, W, G))]
    dDb = [None if d is None else rel * np.abs(d) for d in Db]
    keep = [d is not None for d in Db]
    flat = lambda xs, ys: list(xs) + [y for y, k in zip(ys, keep) if k]
    return flat(D, Db), flat(dD, dDb), flat(V, Vb)


def step_tolerance(rule: gc.ElementwiseRule, count: int, D, dD, V, buffers):
    """Per path array: the largest change of the rule's step and of each new buffer when
    every ``D`` moves by up to ``dD`` (``buffers``: per buffer name, a tuple of arrays like
    ``D``). Returns ``(for Delta, [for each buffer])``, each a list of arrays like ``D``."""
    coef = rule.coefficients(np, np.asarray(count, dtype=np.int32), np.asarray(D[0]).dtype)
    tol_delta, tol_bufs = [], [[] for _ in rule.buffers]
    for i, (d, e, v) in enumerate(zip(D, dD, V)):
        bufs = tuple(b[i] for b in buffers)
        mid, *ends = (rule.apply(np, d + s * e, v, bufs, coef) for s in (0.0, -1.0, 1.0))
        tol_delta.append(_spread(mid[0], [o[0] for o in ends]))
        for j in range(len(rule.buffers)):
            tol_bufs[j].append(_spread(mid[1][j], [o[1][j] for o in ends]))
    return tol_delta, tol_bufs


def _spread(mid, ends):
    """Twice the larger distance from ``mid`` to either end (twice: the rule may curve
    within ``[D - dD, D + dD]``)."""
    return 2 * np.maximum(*(np.abs(np.asarray(e) - mid) for e in ends))


def assert_paths_close(actual, expected, rtol: float, tol, what: str) -> None:
    """``|actual - expected| <= rtol (max|expected| + 1) + tol``, entry by entry."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    bound = rtol * (float(np.max(np.abs(expected), initial=0.0)) + 1.0) + tol
    err = np.abs(actual - expected)
    worst = np.unravel_index(int(np.argmax(err - bound)), err.shape) if err.size else ()
    assert np.all(err <= bound), (f"{what}: error {err[worst]:.3g} at {worst} > "
                                  f"bound {bound[worst]:.3g}")


#: Weights are compared where no tau path ratio is below this in magnitude: a weight above
#: node ``a`` is divided by ``rho[a] = R``, whose relative rounding is ``u / |R|`` when ``R``
#: is the cancelling difference ``1 - lr D / V`` (a diverging run drives ``R`` toward 0).
MIN_RATIO = 1e-3


def synced_gsgd_steps(ns, chain, problem, hyper: dict, steps: int, *, lr: float, rtol: float,
                      blocks=None, plan=None, step=None) -> None:
    """G-SGD's fast step (``gsgd_backends.fast``, momentum buffers in place) against
    :func:`gsgd_core.gsgd_update`, ``steps`` times along the core's trajectory, each from
    the core's state (weights, biases, buffers, step count), compared by
    :func:`assert_step_close` and the momentum buffers by the same tolerance.
    ``blocks(kernels)`` is a context that sets the block sizes; ``plan(weight)`` gives the
    step plan to take (e.g. torch's GPU plan), else the weights' kernels plan one.
    ``step(A, Ab, G, Gb, lr, state)`` takes the step in place instead of the fast step
    (another in-place implementation, e.g. the fused kernels)."""
    blocks = blocks or (lambda kernels: contextlib.nullcontext())
    W, b = ns.tolist(ns.aslist(problem.W)), ns.tolist(ns.aslist(problem.b))
    core = gc.gsgd_init(chain, W, b)
    for count in range(steps):
        G, Gb = (ns.tolist(ns.aslist(g)) for g in problem.grads(W, b))
        tol, tol_m = gsgd_tolerance(chain, hyper, lr, count, W, b, G, Gb, core)
        A, Ab = ns.aslist(W), ns.aslist(b)
        state = gc.gsgd_init(chain, A, Ab)
        state = state._replace(momentum=tuple(ns.aslist(core.momentum)),
                               bias_momentum=tuple(ns.aslist(core.bias_momentum)))
        assign(state.step, state.step + count)
        if step is not None:
            step(A, Ab, ns.aslist(G), ns.aslist(Gb), lr, state if hyper else None)
        else:
            kernels = gb.kernels_for(A[0])
            with blocks(kernels):
                assert fast.fast_step_(kernels, chain, A, Ab, ns.aslist(G), ns.aslist(Gb),
                                       lr, state if hyper else None,
                                       plan=None if plan is None else plan(A[0]), **hyper)
        old = (W, b)
        W, b, core = gc.gsgd_update(chain, core, W, b, G, Gb, lr=lr, **hyper)
        assert_step_close(chain, old, (ns.tolist(A), ns.tolist(Ab)), (W, b), rtol, tol,
                          f"step {count}")
        if hyper.get("momentum"):
            assert_buffers_close(ns.tolist(state.momentum) + ns.tolist(state.bias_momentum),
                                 list(core.momentum) + list(core.bias_momentum), rtol, tol_m,
                                 f"step {count} momentum")


def gsgd_tolerance(chain, hyper: dict, lr: float, count: int, W, b, G, Gb, state):
    """:func:`step_tolerance` of G-SGD's update (:func:`gsgd_core.sgd_rule` with ``hyper``)
    from a :class:`gsgd_core.GSGDState`: per path array, for the step and for the momentum
    buffer (layers, then the layers with a bias; empty without momentum)."""
    rule = gc.sgd_rule(lr, **hyper)
    D, dD, V = gradient_rounding(chain, W, b, G, Gb)
    bufs = (tuple(state.momentum) + tuple(m for m in state.bias_momentum if m is not None),)
    tol, tol_bufs = step_tolerance(rule, count, D, dD, V, bufs if rule.buffers else ())
    return tol, (tol_bufs[0] if tol_bufs else [])


def assert_step_close(chain, old, got, want, rtol: float, tol, what: str = "") -> None:
    """One step's result ``got`` against ``want`` (``(weights, biases)`` host lists, both
    from ``old``): free weights bit for bit, path values within ``rtol`` plus ``tol`` (per
    path array, as :func:`step_tolerance` gives it), and the weights and biases within
    ``rtol`` where that tolerance is below rounding and no tau path ratio is below
    :data:`MIN_RATIO`."""
    for l, (a, e) in enumerate(zip(got[0], want[0]), start=1):
        free = chain.free_mask(l)
        np.testing.assert_array_equal(np.reshape(a, free.shape)[free],
                                      np.reshape(e, free.shape)[free])
    V_new = flat_paths(*gc.path_values(chain, *want))
    for i, (a, e, t) in enumerate(zip(flat_paths(*gc.path_values(chain, *got)), V_new, tol)):
        assert_paths_close(a, e, rtol, np.reshape(t, np.shape(e)), f"{what} paths [{i}]")
    negligible = all(float(np.max(t, initial=0.0)) <= 1e-2 * rtol for t in tol)
    if negligible and smallest_tau_ratio(chain, gc.path_values(chain, *old)[0],
                                         V_new) >= MIN_RATIO:
        for i, (a, e) in enumerate(zip(got[0] + got[1], want[0] + want[1])):
            if e is not None:
                assert_paths_close(a, e, rtol, 0.0, f"{what} weights/biases [{i}]")


def assert_buffers_close(got, want, rtol: float, tol, what: str = "") -> None:
    """Path-space buffers (layers, then biases; ``None`` entries skipped) within ``rtol``
    plus ``tol``, the arrays of ``tol`` following the ones that are not ``None``."""
    pairs = [(a, e) for a, e in zip(got, want) if e is not None]
    for i, ((a, e), t) in enumerate(zip(pairs, tol)):
        assert_paths_close(a, e, rtol, np.reshape(t, np.shape(e)), f"{what} [{i}]")


def ill_conditioned(chain: gc.Chain, tol, V_old, V_new, rel: float = 1e-4) -> bool:
    """Whether a step (path values ``V_old`` to ``V_new``, layers' arrays) moved some tau
    path by a rounding bound ``tol`` (:func:`step_tolerance`'s for ``Delta``, layers first)
    above ``rel`` of its new value, or drove a tau ratio below :data:`MIN_RATIO`. From
    there two correct runs part by that rounding, amplified into every weight above the
    node, like a run that diverges: comparisons of separate trajectories stop there."""
    for l in range(1, chain.L):
        tau = chain.tau_mask(l) & ~chain.free_mask(l)
        t = np.reshape(tol[l - 1], tau.shape)[tau]
        v = np.abs(np.reshape(V_new[l - 1], tau.shape)[tau])
        if np.any(t > rel * v):
            return True
    return smallest_tau_ratio(chain, V_old, V_new) < MIN_RATIO


def smallest_tau_ratio(chain: gc.Chain, V_old, V_new) -> float:
    """The smallest ``|R| = |V'/V|`` over the tau paths that had a value."""
    out = np.inf
    for l in range(1, chain.L):
        tau = chain.tau_mask(l) & ~chain.free_mask(l)
        old = np.reshape(V_old[l - 1], tau.shape)[tau]
        new = np.reshape(V_new[l - 1], tau.shape)[tau]
        if np.any(old != 0):
            out = min(out, float(np.min(np.abs(new[old != 0] / old[old != 0]))))
    return out


def flat_paths(V, Vb) -> list:
    """Path arrays as rules see them: the layers', then the biases' that exist."""
    return list(V) + [v for v in Vb if v is not None]
