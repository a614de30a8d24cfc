"""The parts an optimizer steps: chains (a rule in path space) and normalised kernels
(PSI-SGD), each reading its Keras variables through the core's views and keeping its
state in optimizer variables.

A part's state is the core's (``GSGDState``, ``RuleState``, ``PSIState``: tuples of arrays
and ``None``); its arrays live in Keras variables made by the optimizer, so that
``model.save`` / ``load_model``, ``stateless_apply`` (the JAX trainer) and EMA see them like
any optimizer variable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .discovery import ChainLayers
from .layout import KernelLayout


def state_arrays(state) -> list:
    """The arrays of a core state (a tuple tree with ``None`` entries), in order."""
    if state is None:
        return []
    if isinstance(state, tuple):
        return [a for s in state for a in state_arrays(s)]
    return [state]


def rebuilt(template, arrays: list):
    """``template``'s tree with its arrays replaced, in order, by ``arrays`` (consumed)."""
    if template is None:
        return None
    if isinstance(template, tuple):
        parts = [rebuilt(t, arrays) for t in template]
        return type(template)(*parts) if hasattr(template, "_fields") else tuple(parts)
    return arrays.pop(0)


@dataclass(eq=False)
class Part:
    """Kernels (``layouts`` say how the core views each), optional biases, the core's step
    ``step(state, W, b, G, Gb, lr) -> (W, b, state)``, and the optimizer variables of its
    state (``template``: the state's tree)."""

    name: str
    kernels: tuple
    biases: tuple
    layouts: tuple
    step: Callable
    template: Any = None
    slots: tuple = ()

    @property
    def variables(self) -> list:
        return [v for v in self.kernels + self.biases if v is not None]

    def views(self, values: dict) -> tuple[list, list]:
        """The kernels as the core views them and the biases, from ``values`` (by id)."""
        return ([lay.view(values[id(k)]) for lay, k in zip(self.layouts, self.kernels)],
                [None if b is None else values[id(b)] for b in self.biases])

    def apply(self, optimizer, grads: dict, lr) -> None:
        """One step: read the variables and their gradients, call the core, assign."""
        values = {id(v): v.value for v in self.variables}
        W, b = self.views(values)
        G, Gb = self.views(grads)
        state = rebuilt(self.template, [s.value for s in self.slots])
        W2, b2, state = self.step(state, W, b, G, Gb, lr)
        for k, lay, w in zip(self.kernels, self.layouts, W2):
            optimizer.assign(k, lay.kernel(w, tuple(k.shape)))
        for v, x in zip(self.biases, b2):
            if v is not None:
                optimizer.assign(v, x)
        for s, x in zip(self.slots, state_arrays(state)):
            optimizer.assign(s, x)


def chain_part(c: ChainLayers, step: Callable) -> Part:
    return Part(c.name(), c.kernels, c.biases, c.layouts, step)


def row_part(name: str, kernel, step: Callable) -> Part:
    """A kernel followed by batch normalisation: rows are its output units."""
    return Part(name, (kernel,), (None,), (KernelLayout(),), step)
