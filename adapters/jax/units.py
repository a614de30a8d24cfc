"""Where a layer's units are in a value, and which primitives carry them through.

A value *carries the units* of a layer when a positive rescaling ``c`` of the layer's units
multiplies the value's slice ``j`` along one axis by ``c_j`` and changes nothing else: the
value is positively homogeneous per unit. :class:`Units` records that axis; after a flatten
the axis holds ``P * n * Q`` entries, unit ``j`` at ``(p * n + j) * Q + q`` (a Flax flatten
of an NHWC tensor is position-major, ``Q = 1``; Equinox's of a CHW tensor channel-major,
``P = 1``).

:func:`step` passes one primitive: it returns the :class:`Units` of each output (``None``
where the output does not depend on the units' scales: a sign test, a mask) or the reason it
does not commute with per-unit positive scaling. Operands that do not carry the units are
invariant under their rescaling (everything upstream of the layer is, and the next layer's
output is), so multiplying or dividing by them, selecting with them, comparing a carried
value with zero are all per-unit homogeneous; adding them is not (a constant or a residual
that does not carry the same scales), unless they are zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from .program import Eqn


@dataclass(frozen=True)
class Units:
    """The units of one layer on ``axis`` of a value: ``n`` units, ``P`` position blocks
    before and ``Q`` after each (``P = Q = 1`` unless flattened). ``linear``: only layout
    operations since the layer's contraction, so a bias may still be added."""

    axis: int
    n: int
    P: int = 1
    Q: int = 1
    linear: bool = True

    def same(self, other: "Units") -> bool:
        return (self.axis, self.n, self.P, self.Q) == (other.axis, other.n, other.P, other.Q)


ELEMENTWISE = {"neg", "copy", "reduce_precision", "abs"}
COMPARISONS = {"gt", "ge", "lt", "le", "eq", "ne"}
REDUCTIONS = {"reduce_sum", "reduce_max", "reduce_min", "argmax", "argmin"}
WINDOWS = {"reduce_window_max", "reduce_window_min", "reduce_window_sum", "reduce_window"}
CUMULATIVE = {"cumsum", "cummax", "cummin"}   # homogeneous along an axis other than the units
NOT_HOMOGENEOUS = "which is not positively homogeneous per unit"


def reshape_units(in_shape, u: Units, out_shape) -> Units | None:
    """The units after a row-major reshape, or ``None`` when it splits them across axes.

    The unit index sits at a fixed stride of the flat order: ``outer`` blocks before it,
    ``inner`` entries after. An output axis holds it whole iff the product of the axes before
    it divides ``outer`` and the product up to and including it is a multiple of
    ``outer * n``."""
    outer = math.prod(in_shape[:u.axis]) * u.P
    before = 1
    for axis, size in enumerate(out_shape):
        if outer % before == 0 and (before * size) % (outer * u.n) == 0:
            P = outer // before
            Q, rest = divmod(size, P * u.n)
            if rest == 0:
                return replace(u, axis=axis, P=P, Q=Q)
        before *= size
    return None


def _along(u: Units, axes) -> bool:
    return u.axis in tuple(int(a) for a in axes)


def _binary(e: Eqn, st: list) -> list | str:
    carried = [s for s in st if s is not None]
    others = [v for v, s in zip(e.ins, st) if s is None]
    first = carried[0]
    if len(carried) == 2:
        if not carried[0].same(carried[1]):
            return f"it meets a value with its units on another axis in {e.describe()}"
        if e.prim in ("mul", "div", "pow", "atan2", "rem"):
            return (f"{e.describe()} of two values that carry its units is not of degree 1 "
                    "in their scales")
        return [replace(first, linear=False)]
    if e.prim == "mul" or (e.prim == "div" and st[0] is not None):
        return [replace(first, linear=False)]
    if e.prim in ("add", "sub", "max", "min") and all(v.zero for v in others):
        return [replace(first, linear=False)]
    if e.prim in ("add", "sub"):
        return (f"it is added to a value that does not carry its unit scales in "
                f"{e.describe()} (a constant, a residual or another branch)")
    return f"its output goes to {e.describe()}, {NOT_HOMOGENEOUS}"


def _select(e: Eqn, st: list) -> list | str:
    if e.ins[0].scalar is not None:   # a test fixed when the model was traced picks one case
        return [st[1 + int(e.ins[0].scalar)]]
    if st[0] is not None:
        return f"it selects by value in {e.describe()}"
    cases = [(v, s) for v, s in zip(e.ins[1:], st[1:])]
    carried = [s for _, s in cases if s is not None]
    if any(s is None and not v.zero for v, s in cases):
        return (f"{e.describe()} chooses between it and a value that does not carry its "
                "scales")
    if any(not s.same(carried[0]) for s in carried):
        return f"{e.describe()} chooses between values with their units on different axes"
    return [replace(carried[0], linear=False)]


def _layout(e: Eqn, u: Units) -> Units | str:
    """Shape-only primitives: where the units go, or why they do not stay whole."""
    p, shape = e.prim, e.ins[0].shape
    if p == "reshape":
        out = reshape_units(shape, u, e.outs[0].shape)
        return out if out is not None else (
            f"{e.describe()} to {e.outs[0].shape} splits its units across axes")
    if p == "transpose":
        return replace(u, axis=list(e.params["permutation"]).index(u.axis))
    if p == "broadcast_in_dim":
        return replace(u, axis=int(e.params["broadcast_dimensions"][u.axis]))
    if p == "squeeze":
        dims = [int(d) for d in e.params["dimensions"]]   # lax keeps them non-negative
        if u.axis in dims:
            return f"{e.describe()} removes its unit axis"
        return replace(u, axis=u.axis - sum(d < u.axis for d in dims))
    if p == "rev":
        return f"{e.describe()} reverses its units" if _along(u, e.params["dimensions"]) else u
    return f"its output goes to {e.describe()}, {NOT_HOMOGENEOUS}"


def _window(e: Eqn, u: Units) -> Units | str:
    """A pooling passes the units when its window along their axis is one entry, unpadded
    and undilated: each entry there (after a flatten too) is pooled with entries of other
    axes only."""
    a, prm = u.axis, e.params
    whole = (prm["window_dimensions"][a] == 1 and prm["window_strides"][a] == 1
             and tuple(prm["padding"][a]) == (0, 0) and prm["base_dilation"][a] == 1)
    if not whole:
        return f"{e.describe()} pools across its units (it mixes units)"
    return replace(u, linear=False)


def _other(e: Eqn, u: Units) -> Units | str:
    p, prm = e.prim, e.params
    if p in REDUCTIONS:
        axes = [int(a) for a in prm["axes"]]
        if u.axis in axes:
            return f"{e.describe()} across its units (it mixes units)"
        if p in ("argmax", "argmin"):
            return f"its output goes to {e.describe()}, {NOT_HOMOGENEOUS}"
        return replace(u, axis=u.axis - sum(a < u.axis for a in axes), linear=False)
    if p in WINDOWS:
        return _window(e, u)
    if p in CUMULATIVE and prm["axis"] != u.axis:
        return replace(u, linear=False)
    if p == "slice":
        stride = (prm.get("strides") or [1] * len(e.ins[0].shape))[u.axis]
        whole = (prm["start_indices"][u.axis] == 0 and stride == 1
                 and prm["limit_indices"][u.axis] == e.ins[0].shape[u.axis])
        return replace(u, linear=False) if whole else f"{e.describe()} drops some of its units"
    if p == "pad":
        if not e.ins[1].zero or tuple(prm["padding_config"][u.axis]) != (0, 0, 0):
            return f"{e.describe()} pads it with a value other than zero or along its units"
        return replace(u, linear=False)
    return _layout(e, u)


def step(e: Eqn, st: list) -> list | str:
    """The :class:`Units` of ``e``'s outputs given its operands' (``None``: not carried),
    or why ``e`` does not commute with a per-unit positive rescaling of them."""
    p = e.prim
    carried = [s for s in st if s is not None]
    if p in COMPARISONS or p == "sign":   # a sign test is invariant under positive scaling
        if len(carried) == 2:
            return [None] * len(e.outs) if carried[0].same(carried[1]) else (
                f"it meets a value with its units on another axis in {e.describe()}")
        if all(v.zero for v, s in zip(e.ins, st) if s is None):
            return [None] * len(e.outs)
        return f"it is compared with a non-zero value in {e.describe()}"
    if p == "convert_element_type":
        if not np.issubdtype(np.dtype(e.params["new_dtype"]), np.floating):
            return f"it is converted to {e.params['new_dtype']} (rounding is not homogeneous)"
        return [carried[0]]
    if p in ELEMENTWISE:
        return [carried[0] if p == "copy" else replace(carried[0], linear=False)]
    if p == "select_n":
        return _select(e, st)
    if p in ("mul", "div", "add", "sub", "max", "min", "add_any", "pow", "atan2", "rem"):
        return _binary(e, st)
    if len(carried) != 1 or st[0] is None or len(e.outs) != 1:
        return f"its output goes to {e.describe()}, {NOT_HOMOGENEOUS}"
    out = _other(e, st[0])
    return out if isinstance(out, str) else [out]
