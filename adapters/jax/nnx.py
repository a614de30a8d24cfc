"""Flax NNX modules as the rest of the JAX side sees models: a function of a params pytree.

A module's params are its ``nnx.Param`` variables in their pure form (``nnx.as_pure``), the
form ``nnx.Optimizer.update`` hands its transformation; everything else the module holds
(batch statistics, RNG state) stays with the function. Flax is imported only for a module,
so the rest of the JAX side works without it.
"""

from __future__ import annotations

import sys
from typing import Any, Callable


def is_module(x: Any) -> bool:
    """Whether ``x`` is a Flax NNX module (never true while Flax NNX is not imported)."""
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, nnx.Module)


def as_function(model) -> tuple[Callable, Any]:
    """``(apply_fn, params)``: the module's pure ``nnx.Param`` state, and
    ``apply_fn(params, *args, **kwargs)`` calling a copy of the module that holds them.

    The copy keeps what a call writes into the module's other variables (batch statistics,
    RNG counts) away from ``model``: a traced call would otherwise leave tracers there.
    """
    from flax import nnx

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def apply_fn(p, *args, **kwargs):
        return nnx.merge(graphdef, p, rest, copy=True)(*args, **kwargs)

    return apply_fn, nnx.as_pure(params)


def update_params(model, fn: Callable) -> None:
    """Write ``fn(params)`` into ``model``'s ``nnx.Param`` variables (in place, as NNX
    updates modules)."""
    from flax import nnx

    nnx.update(model, fn(nnx.as_pure(nnx.state(model, nnx.Param))))
