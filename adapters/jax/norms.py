"""Weight layers followed by a per-unit normalisation (batch norm): PSI-SGD's weights.

PSI-SGD (seed 004) needs each row of the weight to be scale-invariant: scaling output unit
``j``'s incoming weights by ``c_j > 0`` must leave the model's output unchanged. Here the
layer's output is followed as for a chain, with a *degree* per value (it scales as
``c**d``): squares double it, ``rsqrt`` halves and negates it, products add degrees, sums
and means over other axes keep it, and a value of degree 0 no longer depends on the scales.
The layer is normalised when nothing of non-zero degree reaches the model's output or a
layer. Batch norm's ``var + eps`` counts as degree 2 (exact only up to ``eps``, as on the
torch side); its running statistics, returned under ``batch_stats`` (Flax) or by ``*_ema``
modules (Haiku), do not count as the model's output. A norm over the units' axis (layer
norm, RMS norm, group norm with several channels a group) mixes rows: not per unit.
"""

from __future__ import annotations

from .layers import CONTRACTIONS, Layer
from .program import Eqn, Program
from .units import step

_POWERS = {"square": 2.0, "rsqrt": -0.5, "sqrt": 0.5}


def is_statistic(path: tuple) -> bool:
    """An output leaf that is a running statistic: Flax's ``batch_stats``, Haiku's
    ``ExponentialMovingAverage`` state (``.../~/mean_ema``)."""
    return any(str(k) == "batch_stats" or str(k).endswith("_ema") for k in path)


def _matters(program: Program, outputs) -> set:
    """Values from which some of ``outputs`` (the model's own) can be reached."""
    live = {v for v in outputs}
    for e in reversed(program.eqns):
        if any(v in live for v in e.outs):
            live.update(e.ins)
    return live


def _degree(e: Eqn, st: list) -> list | str:
    """``(units, degree)`` of each output of ``e`` (``None``: independent of the scales)."""
    carried = [s for s in st if s is not None]
    units, d = carried[0]
    if len(carried) == 2 and not units.same(carried[1][0]):
        return f"{e.describe()} meets values with their units on different axes"
    others = [v for v, s in zip(e.ins, st) if s is None]
    if e.prim == "mul":
        return [(units, sum(s[1] for s in carried))]
    if e.prim == "div":
        return [(units, (st[0][1] if st[0] else 0.0) - (st[1][1] if st[1] else 0.0))]
    if e.prim in _POWERS or e.prim == "integer_pow":
        return [(units, d * _POWERS.get(e.prim, e.params.get("y", 1)))]
    if e.prim in ("add", "sub", "max", "min"):
        if len(carried) == 2 and carried[0][1] == carried[1][1]:
            return [(units, d)]
        if all(v.zero or (e.prim == "add" and v.const and not v.shape) for v in others):
            return [(units, d)]   # a zero, or the eps of var + eps
        return f"{e.describe()} adds a value of another degree in its scales"
    out = step(e, [None if s is None else s[0] for s in st])
    if isinstance(out, str):
        return out
    return [None if u is None else (u, d) for u in out]


def normalised_by(program: Program, layer: Layer, outputs) -> str:
    """``""`` when every row of ``layer``'s weight is scale-invariant through a per-unit
    normalisation, else why not. ``outputs``: the model's outputs that are not statistics."""
    live = _matters(program, outputs)
    carried = {program.eqns[layer.eqn].outs[0]: (layer.out_units, 1.0)}
    for e in program.eqns[layer.eqn + 1:]:
        st = [carried.get(v) for v in e.ins]
        if all(s is None for s in st) or not any(v in live for v in e.outs):
            continue
        if e.prim in CONTRACTIONS:
            return f"{e.describe()} reads its scale before any normalisation"
        out = _degree(e, st)
        if isinstance(out, str):
            return out
        carried.update((v, s) for v, s in zip(e.outs, out) if s is not None and s[1] != 0)
    return "its scale reaches the model's output" if any(v in carried for v in outputs) else ""
