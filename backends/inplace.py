"""In-place versions of the core's operations (trailing underscore), for mutable arrays.

Each computes the new values with the functional core and writes them back into the caller's
arrays. Per-library fast paths (issue 3) will replace the computation, not the contract:
same arguments, same results to float64 rounding, arrays updated in place.
"""

from __future__ import annotations

import gsgd_core
from gsgd_core import Chain, GSGDState

from ._dispatch import assign

__all__ = ["gsgd_step_", "gsgd_update_", "rescale_", "canonicalize_", "skeleton_init_",
           "path_sgd_step_", "psi_update_"]


def _write(dsts, srcs) -> None:
    for d, s in zip(dsts, srcs):
        if d is not None:
            assign(d, s)


def _write_state(state: GSGDState, new: GSGDState) -> None:
    _write(state.momentum, new.momentum)
    _write(state.bias_momentum, new.bias_momentum)
    assign(state.step, new.step)


def gsgd_update_(chain: Chain, state: GSGDState | None, weights, biases, grads, bias_grads,
                 **hyper) -> None:
    """:func:`gsgd_core.gsgd_update` applied in place to ``weights``, ``biases`` and ``state``."""
    W, b, new_state = gsgd_core.gsgd_update(chain, state, weights, biases, grads, bias_grads,
                                            **hyper)
    _write(weights, W)
    _write(biases or [], b)
    if state is not None:
        _write_state(state, new_state)


def gsgd_step_(chain: Chain, weights, biases, grads, bias_grads, lr) -> None:
    """:func:`gsgd_core.gsgd_step` applied in place."""
    gsgd_update_(chain, None, weights, biases, grads, bias_grads, lr=lr)


def rescale_(chain: Chain, weights, biases, scales) -> None:
    """:func:`gsgd_core.rescale` applied in place."""
    W, b = gsgd_core.rescale(chain, weights, biases, scales)
    _write(weights, W)
    _write(biases or [], b)


def canonicalize_(chain: Chain, weights, biases=None) -> None:
    """:func:`gsgd_core.canonicalize` applied in place."""
    W, b = gsgd_core.canonicalize(chain, weights, biases)
    _write(weights, W)
    _write(biases or [], b)


def skeleton_init_(chain: Chain, weights) -> None:
    """:func:`gsgd_core.skeleton_init` applied in place (skeleton edges set to ``+1``)."""
    W, _ = gsgd_core.skeleton_init(chain, weights)
    _write(weights, W)


def path_sgd_step_(chain: Chain, weights, biases, grads, bias_grads, lr) -> None:
    """:func:`gsgd_core.path_sgd_step` applied in place."""
    W, b = gsgd_core.path_sgd_step(chain, weights, biases, grads, bias_grads, lr)
    _write(weights, W)
    _write(biases or [], b)


def psi_update_(state: gsgd_core.PSIState, weights, grads, **hyper) -> None:
    """:func:`gsgd_core.psi_update` applied in place to ``weights`` and ``state``."""
    W, new_state = gsgd_core.psi_update(state, weights, grads, **hyper)
    _write(weights, W)
    _write(state.momentum, new_state.momentum)
