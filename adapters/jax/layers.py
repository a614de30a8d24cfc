"""The weight layers of a flattened program: contractions of a params leaf, with its layout.

A layer is a ``dot_general`` or ``conv_general_dilated`` one of whose operands is a params
leaf (possibly cast to another float type) that nothing else reads. Its dimension numbers
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
    """A weight layer: its equation, weight leaf, which operand is the weight, the layout
    it has when it starts a chain, and the units of its output."""

    eqn: int
    leaf: int
    weight_operand: int
    layout: Layout
    out_units: Units

    def input_value(self, program: Program):
        return program.eqns[self.eqn].ins[1 - self.weight_operand]


def source_leaf(program: Program, value, n_params: int) -> int | None:
    """The params leaf that ``value`` is (or a float cast of), else ``None``."""
    i = program.producer.get(value)
    if i is not None and program.eqns[i].prim == "convert_element_type":
        if np.issubdtype(np.dtype(program.eqns[i].params["new_dtype"]), np.floating):
            value = program.eqns[i].ins[0]
    for k, v in enumerate(program.inputs[:n_params]):
        if v is value:
            return k
    return None


def leaf_readers(program: Program, n_params: int) -> list[list]:
    """For each params leaf, the equations that read it (through float casts), with
    ``"output"`` for each time it is returned as it is."""
    readers: list[list] = [[] for _ in range(n_params)]
    outputs = {id(v) for v in program.outputs}
    for k, v in enumerate(program.inputs[:n_params]):
        for i in program.users.get(v, []):
            e = program.eqns[i]
            if e.prim == "convert_element_type" and source_leaf(program, e.outs[0], n_params) == k:
                readers[k] += program.users.get(e.outs[0], [])
                readers[k] += ["output"] * (id(e.outs[0]) in outputs)
            else:
                readers[k].append(i)
        readers[k] += ["output"] * sum(o is v for o in program.outputs)
    return readers


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
    x_shape = e.ins[1 - w].shape
    x_free = len(x_shape) - len((lc, rc)[1 - w]) - len((lb, rb)[1 - w])
    axis = len(lb) + (x_free if w == 1 else 0)
    return layout, Units(axis, shape[free[0]])


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
        leaves = [source_leaf(program, v, n_params) for v in e.ins[:2]]
        if (leaves[0] is None) == (leaves[1] is None):
            continue   # no weight, or a product of two leaves: not a layer
        w = 0 if leaves[0] is not None else 1
        leaf = leaves[w]
        if len(readers[leaf]) != 1:
            why[leaf] = (f"the weight is read {len(readers[leaf])} times (a layer applied "
                         "twice, tied weights, or a weight read outside its layer)")
            continue
        found = _dot_layer(e, w) if e.prim == "dot_general" else _conv_layer(e, w)
        if isinstance(found, str):
            why[leaf] = found
            continue
        layers[i] = Layer(i, leaf, w, *found)
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
    slots = tuple(int(a) for a in w_contract if int(a) != inp)
    return replace(layer.layout, inp=inp, slots=slots, P=units.P, Q=units.Q)
