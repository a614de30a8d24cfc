"""Follow one layer's units forward through the program, to the next layer or to a reason.

From the layer's output, every value computed from it that reaches the model's output (dead
code cannot change it) is followed in program order
(:func:`gsgd_adapters.jax.units.step`). The units pass on only if all of it ends in one
weight layer that reads them as its input units; a bias joins the layer when a leaf laid
out along the units is added before any other operation (JAX guide).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .layers import CONTRACTIONS, Layer, linked_layout, source_leaf
from .leaves import Layout
from .program import Eqn, Program
from .units import Units, step

_BIAS_LAYOUT = {"reshape", "broadcast_in_dim", "convert_element_type", "squeeze"}


@dataclass
class Walk:
    """Where a layer's units go: the bias leaf that joins it, the next layer (equation
    index) and its weight's layout there, or why the units stop (``""``: they reach the
    model's output, as the last layer's do)."""

    bias: int | None = None
    next: int | None = None
    layout: Layout | None = None
    end: str = ""


def bias_units(program: Program, value, n_params: int, readers) -> tuple[int, Units] | None:
    """The leaf that ``value`` lays out (through reshapes, broadcasts, float casts) and
    where its entries are, when the leaf has one non-trivial axis and is read only here."""
    ops = []
    while (source := source_leaf(program, value, n_params)) is None:
        i = program.producer.get(value)
        if i is None or program.eqns[i].prim not in _BIAS_LAYOUT:
            return None
        ops.append(program.eqns[i])
        value = program.eqns[i].ins[0]
    leaf, axes = source
    shape = program.inputs[leaf].shape
    long = [a for a, d in enumerate(shape) if d != 1]
    if not shape or len(long) > 1 or len(readers[leaf]) != 1 or axes != tuple(range(len(shape))):
        return None
    units = Units(long[0] if long else 0, math.prod(shape))
    for e in reversed(ops):   # a cast to integers rounds: step refuses it
        out = step(e, [units])
        if isinstance(out, str):
            return None
        units = out[0]
    return leaf, units


def _add_bias(e: Eqn, st: list, program, n_params, readers, walk: Walk) -> Units | None:
    """The units after ``e`` when it adds the layer's bias, else ``None``."""
    if e.prim != "add" or walk.bias is not None:
        return None
    carried = [(s, v) for s, v in zip(st, e.ins) if s is not None]
    if len(carried) != 1 or not carried[0][0].linear:
        return None
    units = carried[0][0]
    other = e.ins[1] if st[0] is not None else e.ins[0]
    found = bias_units(program, other, n_params, readers)
    if found is None or not found[1].same(units):
        return None
    walk.bias = found[0]   # no second bias joins
    return units


def walk(program: Program, layer: Layer, layers: dict, n_params: int, readers) -> Walk:
    """Follow ``layer``'s units (see the module's docstring)."""
    out = Walk()
    carried = {program.eqns[layer.eqn].outs[0]: layer.out_units}
    for i in range(layer.eqn + 1, len(program.eqns)):
        e = program.eqns[i]
        st = [carried.get(v) for v in e.ins]
        if all(s is None for s in st) or not any(v in program.live for v in e.outs):
            continue   # dead code cannot change the output
        if i in layers and st[layers[i].weight_operand] is None:
            linked = linked_layout(e, layers[i], st[1 - layers[i].weight_operand])
            if isinstance(linked, str) or out.next is not None:
                out.end = linked if isinstance(linked, str) else (
                    "its output feeds two layers (a branch)")
                return out
            out.next, out.layout = i, linked
            continue
        if e.prim in CONTRACTIONS:
            out.end = (f"its output goes to {e.describe()}, which is not a layer that can be "
                       "in a chain (see the reason given for its weight)")
            return out
        units = _add_bias(e, st, program, n_params, readers, out)
        result = [units] if units is not None else step(e, st)
        if isinstance(result, str):
            out.end = result
            return out
        carried.update((v, s) for v, s in zip(e.outs, result) if s is not None)
    if any(v in carried for v in program.outputs):
        out.end = ("its output is returned by the model and also feeds the next layer"
                   if out.next is not None else "")
    elif out.next is None:
        out.end = "its output is not used"
    return out
