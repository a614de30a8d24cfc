"""The layer graph of a built Keras model: one entry per layer call, nested models inlined.

Keras records every symbolic call of a layer as a node (``layer._inbound_nodes``) holding its
input and output tensors; a ``Functional`` model keeps the nodes it is made of, and a built
``Sequential`` keeps such a model too (``_functional``). This module reads them into a flat
list of :class:`Call` in data-flow order, a model called inside another replaced by its own
calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Call", "layer_graph"]


@dataclass
class Call:
    """One call of ``layer`` on the outputs of the calls ``inputs`` (``-1``: a model input),
    with the shape of its output (without the batch axis) and the calls that read it
    (``-2`` among ``consumers``: the model's output)."""

    layer: Any
    inputs: tuple
    shape: tuple
    consumers: list = field(default_factory=list)


def _functional(model):
    """The ``Functional`` graph of ``model``: itself, or a built ``Sequential``'s."""
    graph = getattr(model, "_functional", model) if _is_sequential(model) else model
    if graph is None or not hasattr(graph, "_nodes_by_depth"):
        raise ValueError(
            f"model {model.name!r}: its layers were not traced (a Sequential called eagerly, "
            "or a subclassed model): give it an input shape (keras.Input(...) as its first "
            "layer, or model.build(input_shape)) so that Keras records its layer graph")
    return graph


def _is_sequential(model) -> bool:
    return type(model).__name__ == "Sequential" and hasattr(model, "_functional")


def _is_model(layer) -> bool:
    return hasattr(layer, "_nodes_by_depth") or _is_sequential(layer)


def _add(calls: list, graph, entries: list) -> list:
    """Append ``graph``'s calls to ``calls``, its inputs fed by the call ids ``entries``;
    returns the call ids of its outputs."""
    where = {id(t): e for t, e in zip(graph.inputs, entries)}   # tensor -> call id
    for depth in sorted(graph._nodes_by_depth, reverse=True):
        for node in graph._nodes_by_depth[depth]:
            if node.is_input:
                continue
            ins = [where[id(t)] for t in node.input_tensors]
            op = node.operation
            if _is_model(op):
                outs = _add(calls, _functional(op), ins)
            else:
                calls.append(Call(op, tuple(ins), tuple(node.output_tensors[0].shape[1:])))
                outs = [len(calls) - 1] * len(node.output_tensors)
            for t, o in zip(node.output_tensors, outs):
                where[id(t)] = o
    return [where[id(t)] for t in graph.outputs]


def layer_graph(model) -> list[Call]:
    """The calls of ``model`` (built, with a traced layer graph) in data-flow order, each
    with its consumers."""
    graph = _functional(model)
    calls: list[Call] = []
    outputs = _add(calls, graph, [-1] * len(graph.inputs))
    for i, call in enumerate(calls):
        for j in call.inputs:
            if j >= 0:
                calls[j].consumers.append(i)
    for o in outputs:
        if o >= 0:
            calls[o].consumers.append(-2)
    return calls
