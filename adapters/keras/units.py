"""Where a Keras layer's units go: the rules that link one weight layer to the next.

A chain's hidden units are the ``units`` of a ``Dense`` or the ``filters`` of a ``Conv``;
between two weight layers the units may only pass through layers that commute with a
positive rescaling of each unit (ReLU in its Keras forms, leaky ReLU, pooling per channel,
dropout, a flatten). :func:`follow` walks from one weight layer's call to the next one and
says how the next kernel reads the units, or why the chain ends there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import keras

from .layout import KernelLayout

__all__ = ["Link", "Units", "follow", "is_weight_layer", "units_after"]

_CONV = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)
_POOL = (keras.layers.MaxPooling1D, keras.layers.MaxPooling2D, keras.layers.MaxPooling3D,
         keras.layers.AveragePooling1D, keras.layers.AveragePooling2D,
         keras.layers.AveragePooling3D)
_GLOBAL_POOL = (keras.layers.GlobalAveragePooling1D, keras.layers.GlobalAveragePooling2D,
                keras.layers.GlobalAveragePooling3D, keras.layers.GlobalMaxPooling1D,
                keras.layers.GlobalMaxPooling2D, keras.layers.GlobalMaxPooling3D)
_DROPOUT = (keras.layers.Dropout, keras.layers.SpatialDropout1D, keras.layers.SpatialDropout2D,
            keras.layers.SpatialDropout3D)
_HOMOGENEOUS = (keras.activations.relu, keras.activations.leaky_relu, keras.activations.linear)


@dataclass(frozen=True)
class Units:
    """The ``n`` units of the last weight layer as they sit in the current tensor: on its
    last axis (``first=False``) or its first (``channels_first``) with ``positions``
    entries per unit (``None``: not known), or flattened (``layout`` says how a kernel
    reads them)."""

    n: int
    positions: int | None = 1
    first: bool = False
    spatial: bool = False
    layout: KernelLayout = KernelLayout()


def is_weight_layer(layer) -> bool:
    """A ``Dense`` or an ungrouped ``Conv1D/2D/3D``: the layers a chain is made of."""
    if isinstance(layer, keras.layers.Dense) and type(layer).__name__ == "Dense":
        return True
    return isinstance(layer, _CONV) and getattr(layer, "groups", 1) == 1 and \
        type(layer).__name__ in ("Conv1D", "Conv2D", "Conv3D")


def _first(layer) -> bool:
    return getattr(layer, "data_format", "channels_last") == "channels_first"


def _positions(shape: tuple, n: int) -> int | None:
    """The positions of ``n`` units in a tensor of ``shape``; ``None`` where a size is not
    known (a sequence of any length): no kernel reads such units flattened."""
    return None if None in shape else math.prod(shape) // n


def units_after(layer, shape: tuple) -> Units:
    """The units of weight layer ``layer`` in its output, of ``shape`` (no batch axis)."""
    n = int(layer.kernel.shape[-1])
    if len(shape) == 1:
        return Units(n)
    return Units(n, _positions(shape, n), _first(layer) and isinstance(layer, _CONV), True)


def homogeneous(fn) -> bool:
    """``fn`` is one of Keras's positively homogeneous activations (relu, leaky_relu,
    linear) in its default form."""
    return any(fn is f for f in _HOMOGENEOUS)


def _through(layer, u: Units, shape: tuple) -> Units | str:
    """The units after ``layer`` (output ``shape``), or why they do not pass it."""
    name = type(layer).__name__
    if isinstance(layer, keras.layers.ReLU):
        if layer.max_value is None and float(layer.threshold) == 0.0:
            return u
        return "a ReLU with a max_value or threshold is not positively homogeneous"
    if isinstance(layer, keras.layers.LeakyReLU) or isinstance(layer, _DROPOUT):
        return u
    if isinstance(layer, keras.layers.Activation):
        return u if homogeneous(layer.activation) else \
            f"activation {getattr(layer.activation, '__name__', layer.activation)!r} is not " \
            "positively homogeneous"
    if isinstance(layer, _POOL + _GLOBAL_POOL):
        if not u.spatial or _first(layer) != u.first:
            return f"{name} does not pool over the units' positions ({_where(u)})"
        if isinstance(layer, _GLOBAL_POOL) and not layer.keepdims:
            return Units(u.n)
        return replace(u, positions=_positions(shape, u.n))
    if isinstance(layer, (keras.layers.Flatten, keras.layers.Reshape)):
        return _flattened(layer, u, shape)
    return f"{name} is not known to commute with a positive rescaling of each unit"


def _where(u: Units) -> str:
    if not u.spatial:
        return "units on the last axis, no positions" if u.layout == KernelLayout() else \
            "units flattened"
    return f"units on the {'first' if u.first else 'last'} axis of {u.positions} positions"


def _flattened(layer, u: Units, shape: tuple) -> Units | str:
    if len(shape) != 1:
        return f"{type(layer).__name__} to shape {shape} does not keep units together"
    if not u.spatial:
        return u
    transposes = isinstance(layer, keras.layers.Flatten) and _first(layer)
    if transposes and not u.first:
        return "Flatten(data_format='channels_first') of channels-last units mixes their axes"
    S = u.positions
    position_major = not u.first or transposes
    return Units(u.n, layout=KernelLayout(S, 1) if position_major else KernelLayout(1, S))


def _reads(layer, u: Units) -> KernelLayout | str:
    """How weight layer ``layer`` reads the units ``u``, or why it cannot."""
    fan_in = int(layer.kernel.shape[-2])
    if isinstance(layer, _CONV):
        if not u.spatial or _first(layer) != u.first:
            return f"{layer.name} convolves over another axis than the units' ({_where(u)})"
        layout = KernelLayout()
    elif u.spatial and u.first:
        return f"{layer.name} reads the last axis, the units are on the first"
    else:
        layout = u.layout
    if fan_in != layout.before * u.n * layout.after:
        return f"{layer.name} reads {fan_in} inputs, not the {u.n} units ({_where(u)})"
    return layout


@dataclass(frozen=True)
class Link:
    """Where :func:`follow` got from a weight layer: the ``next`` weight layer's call and
    the ``layout`` its kernel reads the units in, or the ``reason`` the chain ends at call
    ``stop`` (``None``: at the layer itself), with the ``units`` as they were there."""

    next: int | None
    layout: KernelLayout | None
    reason: str
    stop: int | None
    units: Units


def follow(calls, i: int) -> Link:
    """Follow the units of weight-layer call ``i`` to the next weight layer, or to where
    they stop. (A stateless layer called elsewhere too passes them all the same; a shared
    weight layer is refused by :func:`~.discovery.find_chains`.)"""
    u = units_after(calls[i].layer, calls[i].shape)
    activation = calls[i].layer.activation
    if not homogeneous(activation):
        return Link(None, None, f"its activation {getattr(activation, '__name__', activation)!r}"
                    " is not positively homogeneous", None, u)
    j = i
    while True:
        consumers = calls[j].consumers
        if consumers == [-2]:
            return Link(None, None, "its units reach the model's output", None, u)
        if len(consumers) != 1:
            return Link(None, None, f"{calls[j].layer.name}'s output is read by "
                        f"{len(consumers)} layers (a branch)", None, u)
        j = consumers[0]
        layer = calls[j].layer
        if len(calls[j].inputs) != 1:
            return Link(None, None, f"{layer.name} ({type(layer).__name__}) merges "
                        f"{len(calls[j].inputs)} tensors", j, u)
        if is_weight_layer(layer):
            layout = _reads(layer, u)
            if isinstance(layout, str):
                return Link(None, None, layout, j, u)
            return Link(j, layout, "", None, u)
        nxt = _through(layer, u, calls[j].shape)
        if isinstance(nxt, str):
            return Link(None, None, f"{layer.name}: {nxt}", j, u)
        u = nxt
