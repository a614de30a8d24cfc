"""Weight layers followed by a per-unit normalisation (batch norm): PSI-SGD's weights.

PSI-SGD (seed 004) needs each row of the weight to be scale-invariant: scaling output unit
``j``'s incoming weights by ``c_j > 0`` must leave the model's output unchanged. Here the
layer's output is followed as for a chain, with a *degree* per value (it scales as
``c**d``): squares double it, ``rsqrt`` halves and negates it, products add degrees and
quotients subtract them, sums of one degree and means over other axes keep it (a sum of two
degrees has none), and a value of degree 0 no longer depends on the scales. The layer is
normalised when its output is used and nothing of non-zero degree reaches the model's
output or a layer. Batch norm's ``var + eps`` counts as degree 2 (exact only up to ``eps``,
as on the torch side): a scalar constant counts as such an ``eps`` only where it is added
to a *statistic*, a value reduced over the batch or the positions (a variance, a standard
deviation, a mean square), never to the layer's output itself (``h + 1``); its running
statistics, returned under ``batch_stats`` (Flax) or by ``*_ema`` modules (Haiku), do not
count as the model's output. A norm over the units' axis (layer norm, RMS norm, group norm
with several channels a group) mixes rows: not per unit.
"""

from __future__ import annotations

from .layers import Layer
from .program import Eqn, Program
from .units import REDUCTIONS, step

_POWERS = {"square": 2.0, "rsqrt": -0.5, "sqrt": 0.5}


def is_statistic(path: tuple) -> bool:
    """An output leaf that is a running statistic: Flax's ``batch_stats``, Haiku's
    ``ExponentialMovingAverage`` state (``.../~/mean_ema``)."""
    return any(str(k) == "batch_stats" or str(k).endswith("_ema") for k in path)


def _degree(e: Eqn, st: list) -> list | None:
    """``(units, degree, statistic)`` of each output of ``e`` (``None`` for an output
    independent of the scales), or ``None`` where ``e`` takes its operands out of the degree
    rules: values with their units on two axes, a sum of two degrees or of a constant and a
    value that is no statistic, a primitive that is not per-unit homogeneous."""
    carried = [s for s in st if s is not None]
    units, d, _ = carried[0]
    stat = all(s[2] for s in carried)
    if len(carried) == 2 and not units.same(carried[1][0]):
        return None
    if e.prim == "mul":
        return [(units, sum(s[1] for s in carried), stat)]
    if e.prim == "div":
        return [(units, (st[0][1] if st[0] else 0.0) - (st[1][1] if st[1] else 0.0), stat)]
    if e.prim in _POWERS:
        return [(units, d * _POWERS[e.prim], stat)]
    if e.prim == "integer_pow":
        return [(units, d * e.params["y"], stat)]
    if e.prim == "select_n" and e.ins[0].scalar is not None:
        return [st[1 + int(e.ins[0].scalar)]]   # fixed when traced: that case, as it is
    if e.prim in ("add", "sub", "max", "min"):
        others = [v for v, s in zip(e.ins, st) if s is None]
        # two operands of one degree; a zero; the eps of var + eps
        if all(s[1] == d for s in carried) and all(
                v.zero or (e.prim == "add" and v.const and not v.shape and stat)
                for v in others):
            return [(units, d, stat)]
        return None
    out = step(e, [None if s is None else s[0] for s in st])
    if isinstance(out, str):
        return None
    stat = stat or e.prim in REDUCTIONS   # over other axes than the units' (step checked)
    return [None if u is None else (u, d, stat) for u in out]


def is_normalised(program: Program, layer: Layer, outputs) -> bool:
    """Whether every row of ``layer``'s weight is scale-invariant through a per-unit
    normalisation: its output reaches ``outputs`` (the model's outputs that are not
    statistics), but no value of non-zero degree in its scales reaches them or a layer. A
    value that leaves the degree rules counts as reaching them."""
    live = program.reaching(outputs)
    h = program.eqns[layer.eqn].outs[0]
    if h not in live:   # an unused layer: nothing normalises it, it is not used
        return False
    carried = {h: (layer.out_units, 1.0, False)}
    for e in program.eqns[layer.eqn + 1:]:
        st = [carried.get(v) for v in e.ins]
        if all(s is None for s in st) or not any(v in live for v in e.outs):
            continue
        out = _degree(e, st)   # None at a layer too: a contraction is in no rule
        if out is None:
            return False
        carried.update((v, s) for v, s in zip(e.outs, out) if s is not None and s[1] != 0)
    return not any(v in carried for v in outputs)
