"""G-SGD for hand-written CuPy training loops (NumPy arrays work the same way).

``opt = GSGD(chain, weights, biases, lr=0.1)`` holds the chain, the caller's arrays and the
momentum state; ``opt.step(grads, bias_grads)`` updates the arrays in place through
:mod:`gsgd_backends` (its fused fast path). CuPy itself is never imported
here: the arrays say which library they belong to.
"""

from __future__ import annotations

from typing import Any, Sequence

from gsgd_backends import gsgd_update_, skeleton_init_, step_plan
from gsgd_core import Chain, gsgd_init
from gsgd_core.arrays import prepare
from gsgd_core.gsgd import check_update_hypers

__all__ = ["GSGD"]


class GSGD:
    """G-SGD over lists of arrays: one weight (and bias, or ``None``) per layer of ``chain``.

    Parameters
    ----------
    chain : gsgd_core.Chain
    weights, biases : lists of arrays, updated in place by :meth:`step`
    lr, momentum, dampening, nesterov, weight_decay
        As :func:`gsgd_core.gsgd_update` (``torch.optim.SGD``'s conventions in path space).
        ``lr`` may be changed between steps (a schedule).
    """

    def __init__(self, chain: Chain, weights: Sequence[Any], biases: Sequence[Any] | None = None,
                 *, lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 nesterov: bool = False, weight_decay: float = 0.0) -> None:
        prepare(chain, weights, biases)
        check_update_hypers(lr, momentum, dampening, nesterov, weight_decay)
        self.chain, self.weights = chain, list(weights)
        self.biases = list(biases) if biases is not None else [None] * chain.L
        self.lr, self.momentum, self.dampening = lr, momentum, dampening
        self.nesterov, self.weight_decay = nesterov, weight_decay
        self.state = gsgd_init(chain, self.weights, self.biases) if momentum else None
        #: The chain's step plan (:func:`gsgd_backends.step_plan`), built once.
        self.plan = step_plan(chain, self.weights)

    def skeleton_init(self) -> None:
        """Set the skeleton weights to ``+1`` (paper §11.2), in place."""
        skeleton_init_(self.chain, self.weights)

    def step(self, grads: Sequence[Any], bias_grads: Sequence[Any] | None = None) -> None:
        """One G-SGD step in place from the gradients of the weights (and biases)."""
        gsgd_update_(self.chain, self.state, self.weights, self.biases, grads, bias_grads,
                     lr=self.lr, momentum=self.momentum, dampening=self.dampening,
                     nesterov=self.nesterov, weight_decay=self.weight_decay, plan=self.plan)

    def __repr__(self) -> str:
        return (f"GSGD({self.chain}, lr={self.lr}, momentum={self.momentum}, "
                f"weight_decay={self.weight_decay})")
