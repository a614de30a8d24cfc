"""The weight layers of a flattened program: contractions of a params leaf, with its layout.

A layer is a ``dot_general`` or ``conv_general_dilated`` one of whose operands is a params
leaf (possibly transposed, as in ``x @ w.T``, or cast to another float type) that nothing
else reads. Its dimension numbers
say where the units are: the leaf's free axis (``dot_general``) or ``O`` axis (the
convolution's ``rhs_spec``) holds the output units, the contracted or ``I`` axis the input
units, the other contracted or spatial axes the parallel edges.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .leaves import Layout
from .program import Eqn, Program
from .units import Units

CONTRACTIONS = ("dot_general", "conv_general_dilated")


@dataclass(frozen=True)
class Layer:
    """A weight layer: its equation, weight leaf, which operand is the weight, the leaf's
    axis behind each of the operand's axes, the layout it has when it starts a chain, and
    the units of its output."""

    eqn: int
    leaf: int
    weight_operand: int
    axes: tuple
    layout: Layout
    out_units: Units


def _is_view(e: Eqn) -> bool:
    """A transpose or a float cast: the leaf's numbers, its axes permuted."""
    return e.prim == "transpose" or (e.prim == "convert_element_type" and np.issubdtype(
        np.dtype(e.params["new_dtype"]), np.floating))


def source_leaf(program: Program, value, n_params: int) -> tuple[int, tuple] | None:
    """The params leaf that ``value`` is a view of (:func:`_is_view`), and the leaf's axis
    behind each of ``value``'s axes; ``None`` if it is no such view."""
    axes = tuple(range(len(value.shape)))
    while (i := program.producer.get(value)) is not None and _is_view(program.eqns[i]):
        e = program.eqns[i]
        if e.prim == "transpose":
            axes = tuple(axes[int(a)] for a in e.params["permutation"])
        value = e.ins[0]
    for k, v in enumerate(program.inputs[:n_params]):
        if v is value:
            return k, axes
    return None


def leaf_readers(program: Program, n_params: int) -> list[list]:
    """For each params leaf, the equations that read it or a view of it, with ``"output"``
    for each time it (or a view) is returned as it is."""
    readers: list[list] = [[] for _ in range(n_params)]

    def read(k, value):
        readers[k] += ["output"] * sum(o is value for o in program.outputs)
        for i in program.users.get(value, []):
            if _is_view(program.eqns[i]):
                read(k, program.eqns[i].outs[0])
            else:
                readers[k].append(i)

    for k, v in enumerate(program.inputs[:n_params]):
        read(k, v)
    return readers


def _on_leaf(layout: Layout, axes: tuple) -> Layout:
    """A layout of the weight operand as a layout of its leaf."""
    return replace(layout, out=axes[layout.out], inp=axes[layout.inp],
                   slots=tuple(axes[a] for a in layout.slots))


def _dot_layer(e: Eqn, w: int) -> tuple[Layout, Units] | str:
    (lc, rc), (lb, rb) = e.params["dimension_numbers"]
    contract, batch = (lc, rc)[w], (lb, rb)[w]
    shape = e.ins[w].shape
    if batch:
        return "its weight has batch dimensions in dot_general (a weight per example)"
    free = [a for a in range(len(shape)) if a not in contract]
    if len(free) != 1 or not contract:
        return (f"its weight {shape} has {len(free)} output axes and {len(contract)} "
                "contracted ones in dot_general (one output axis is needed)")
    contract = [int(a) for a in contract]
    layout = Layout(free[0], contract[-1], tuple(contract[:-1]))
    # the output's axes are the input's free ones, then the weight's (no batch axes: the
    # weight has none, and dot_general pairs them)
    x_free = len(e.ins[1 - w].shape) - len((lc, rc)[1 - w])
    return layout, Units(x_free if w == 1 else 0, shape[free[0]])


def _conv_layer(e: Eqn, w: int) -> tuple[Layout, Units] | str:
    if w != 1:
        return "its weight is the convolution's input, not its kernel"
    if e.params["feature_group_count"] != 1 or e.params["batch_group_count"] != 1:
        return (f"grouped or depthwise convolution (feature_group_count="
                f"{e.params['feature_group_count']}, batch_group_count="
                f"{e.params['batch_group_count']})")
    lhs, rhs, out = e.params["dimension_numbers"]
    return (Layout(int(rhs[0]), int(rhs[1]), tuple(int(a) for a in rhs[2:])),
            Units(int(out[1]), e.ins[1].shape[rhs[0]]))


def find_layers(program: Program, n_params: int, readers) -> tuple[dict, dict]:
    """Weight layers by equation index, and the reason each other contraction of a leaf is
    no layer (by leaf)."""
    layers, why = {}, {}
    for i, e in enumerate(program.eqns):
        if e.prim not in CONTRACTIONS:
            continue
        sources = [source_leaf(program, v, n_params) for v in e.ins]   # two operands
        if (sources[0] is None) == (sources[1] is None):
            continue   # no weight, or a product of two leaves: not a layer
        w = 0 if sources[0] is not None else 1
        leaf, axes = sources[w]
        if len(readers[leaf]) != 1:
            why[leaf] = (f"the weight is read {len(readers[leaf])} times (a layer applied "
                         "twice, tied weights, or a weight read outside its layer)")
            continue
        found = _dot_layer(e, w) if e.prim == "dot_general" else _conv_layer(e, w)
        if isinstance(found, str):
            why[leaf] = found
            continue
        layers[i] = Layer(i, leaf, w, axes, _on_leaf(found[0], axes), found[1])
    return layers, why


def linked_layout(e: Eqn, layer: Layer, units: Units) -> Layout | str:
    """The layout of ``layer``'s weight when its input carries ``units`` of the layer
    before, or why the layer does not read those units as its input units."""
    w = layer.weight_operand
    if e.prim == "conv_general_dilated":
        lhs = e.params["dimension_numbers"][0]
        if units.axis != lhs[1] or units.P * units.Q != 1:
            return "the next convolution does not read its units as input channels"
        return layer.layout
    (lc, rc), _ = e.params["dimension_numbers"]
    x_contract, w_contract = (rc, lc) if w == 0 else (lc, rc)
    x_contract = [int(a) for a in x_contract]
    if units.axis not in x_contract:
        return "the next layer does not contract its units (they stay a free axis)"
    inp = int(w_contract[x_contract.index(units.axis)])
    slots = tuple(layer.axes[int(a)] for a in w_contract if int(a) != inp)
    return replace(layer.layout, inp=layer.axes[inp], slots=slots, P=units.P, Q=units.Q)
