"""The numerics rules of a step in path space (numerics guide), in one place.

Every step, the core's sweeps (:mod:`.sweeps`, :mod:`.gsgd`, :mod:`.path_space`) and each
fast kernel of ``gsgd_backends``, takes its per-entry arithmetic from here, so that the
rules exist once:

- a **path gradient** ``D = num / den`` is ``0`` where the skeleton product ``den`` is ``0``
  or so small that ``D`` overflows from a finite gradient (the path is frozen), and keeps a
  non-finite gradient visible (:func:`path_gradient`);
- **momentum and weight decay** act on ``D`` with ``torch.optim.SGD``'s conventions
  (:func:`direction`, paper eq. 2 with momentum);
- a **tau path ratio** ``R = 1 - lr D / V`` that lands on exactly ``0`` becomes the dtype's
  machine epsilon (:func:`tau_ratio`; paper eq. 6), and a tau edge whose new value would
  not be finite keeps its value, its node's ``rho`` then being its source's
  (:func:`written_ratio`);
- a **step** ``lr * D / (F B)`` is formed so that it overflows only where its value does
  (:func:`scaled`, :func:`scaled_div`);
- a new value that is not finite is not written: the entry keeps its old value
  (:func:`kept`, :func:`guard`), and a step with a non-finite gradient is skipped whole
  (:func:`all_finite`).

Functions take the array namespace ``xp`` first and return new arrays.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["StepRule", "all_finite", "direction", "finite_mask", "finite_or_zero",
           "frozen_if_overflow", "guard", "kept", "path_gradient", "safe_div", "scaled",
           "scaled_div", "tau_ratio", "written_ratio"]


def safe_div(xp, num, den):
    """``num / den`` with ``0`` where ``den == 0`` (never NaN or Inf from finite input)."""
    zero = den == 0
    return xp.where(zero, 0.0, num / xp.where(zero, 1.0, den))


def scaled(xp, lr, x, apply):
    """``lr * apply(x)``, ``apply`` a division or product by fixed factors, in the order that
    overflows only where the value does: ``apply(lr * x)`` for ``|lr| <= 1``, ``lr * apply(x)``
    above. With a finite ``x``, no intermediate then exceeds both ``|x|`` and the value, so a
    step whose value is representable is written (an entry keeps its value only where the
    step itself overflows). ``lr`` is a Python number or a 0-d array (traced under ``jit``):
    then one factor is ``lr`` and the other ``1``, which changes no bit."""
    if isinstance(lr, (int, float)):
        return apply(lr * x) if abs(lr) <= 1 else lr * apply(x)
    small = xp.abs(lr) <= 1
    return xp.where(small, 1.0, lr) * apply(xp.where(small, lr, 1.0) * x)


def scaled_div(xp, lr, num, den):
    """``lr * num / den`` (:func:`safe_div`) in :func:`scaled`'s order."""
    return scaled(xp, lr, num, lambda n: safe_div(xp, n, den))


def frozen_if_overflow(xp, D, G):
    """A path gradient that overflows from a finite gradient (a skeleton product at the edge
    of the dtype's range) is treated like an underflowed product: 0, the path is frozen.
    Non-finite gradients still propagate, so callers can see them."""
    return xp.where(xp.isfinite(D) | ~xp.isfinite(G), D, 0.0)


def path_gradient(xp, num, den, grad):
    """``D = num / den`` by the rules above: ``0`` where ``den == 0`` or where ``D``
    overflows from a finite ``grad`` (numerics guide). ``num`` is ``grad`` itself off the tau
    edges (``D = grad / (F_l[b] B_{l-1}[a])``) and ``w * grad - T`` on them (paper eq. 3)."""
    return frozen_if_overflow(xp, safe_div(xp, num, den), grad)


class StepRule(NamedTuple):
    """Weight decay and momentum of one update as the arithmetic takes them: ``None`` where
    switched off; ``first`` (0-d) says the state is at its first step."""

    weight_decay: Any
    momentum: Any
    dampening: Any
    nesterov: bool
    first: Any


def direction(xp, D, M, V, rule: StepRule | None):
    """Weight decay and path-space momentum on one array of path gradients ``D`` (path
    values ``V``, buffer ``M``), torch.optim.SGD's conventions::

        D <- D + weight_decay * V
        M' = D on the first step, else momentum * M + (1 - dampening) * D
        direction = D + momentum * M' (Nesterov) or M'

    Returns the direction and ``M'`` (``None`` without momentum, and for ``D = None``)."""
    if rule is None or D is None:
        return D, None
    if rule.weight_decay is not None:
        D = D + rule.weight_decay * V
    if rule.momentum is None:
        return D, None
    M_new = xp.where(rule.first, D, rule.momentum * M + (1.0 - rule.dampening) * D)
    return (D + rule.momentum * M_new if rule.nesterov else M_new), M_new


def tau_ratio(xp, drop, eps: float):
    """A tau edge's path ratio ``R = V'/V = 1 - drop`` (``drop = lr D / V``, paper eq. 6),
    with ``eps`` (the dtype's machine epsilon) where ``R`` is exactly ``0``: a path value
    landing on 0 would zero the tau weight and leave the weights above it undefined."""
    R = 1.0 - drop
    return xp.where(R == 0, eps, R)


def written_ratio(xp, w, R, rho_src):
    """A tau edge's new value and its node's ``rho`` (paper eq. 6): ``w' = w R / rho_src``
    and ``rho = R``, with ``rho_src`` its source's ``rho``. A new value that is not finite
    is not written (the edge keeps ``w``), and then the node's ``rho`` is its source's: the
    ratio its tau chain was actually moved by, so that the weights above are allocated
    against the tau chain as written (an infinite ``rho`` would zero them all)."""
    new = w * (R / rho_src)
    ok = finite_mask(new)
    return xp.where(ok, new, w), xp.where(ok, R, rho_src)


def finite_mask(x):
    """``isfinite(x)`` in two operations: ``x - x`` is exactly 0 for a finite ``x`` and NaN
    otherwise. Fast kernels test every entry twice, and a compiled ``isfinite`` costs about
    six vector instructions (compilers keep ``x - x``: inductor builds with
    ``-fno-finite-math-only``, and a test holds it to that)."""
    return (x - x) == 0


def finite_or_zero(xp, delta):
    """A step ``delta`` where finite, else ``0``: a path whose step is not finite keeps its
    value."""
    return xp.where(finite_mask(delta), delta, 0.0)


def kept(xp, new, old):
    """``new`` where finite, else ``old``: an entry whose update overflows keeps its value
    (``None`` stays)."""
    return None if new is None else xp.where(finite_mask(new), new, old)


def all_finite(xp, arrays):
    """One 0-d boolean array: every entry of every array is finite (no host round-trip)."""
    flags = [xp.all(xp.isfinite(a)) for a in arrays if a is not None]
    out = flags[0]
    for f in flags[1:]:
        out = out & f
    return out


def guard(xp, ok, new, old):
    """``new`` where it is finite and ``ok``, else ``old``: finite input never writes NaN/Inf
    (``ok`` false: the step is skipped)."""
    return [None if n is None else xp.where(ok & xp.isfinite(n), n, o)
            for n, o in zip(new, old)]
