"""G-SGD for hand-written CuPy training loops (NumPy arrays work the same way).

:class:`GSGD` holds the chain, the caller's arrays and the momentum state, and its
:meth:`~GSGD.step` updates the arrays in place through :mod:`gsgd_backends` (its fused fast
path), or, with ``fused=True``, through the fused Triton kernels of
:mod:`gsgd_backends.fused` (three launches, no host read) on the arrays' own memory. CuPy
itself is never imported here: the arrays say which library they belong to.

Examples
--------
>>> import numpy as np              # or cupy: the same code on a GPU
>>> import gsgd_core as gc
>>> from gsgd_adapters.cupy import GSGD
>>> chain = gc.Chain.mlp([4, 8, 3])
>>> rng = np.random.default_rng(0)
>>> weights = [rng.standard_normal((8, 4)) / 2,
...            rng.standard_normal((3, 8)) / 3]
>>> biases = [np.zeros(8), np.zeros(3)]
>>> opt = GSGD(chain, weights, biases, lr=0.1, momentum=0.9)
>>> opt.skeleton_init()             # once, before training
>>> grads = [np.full_like(w, 0.01) for w in weights]
>>> bias_grads = [np.full_like(b, 0.01) for b in biases]
>>> opt.step(grads, bias_grads)     # updates the arrays in place
>>> opt
GSGD(Chain(4 -> 8 -> 3; m=67, H=8, G-space dim=59, H/m=0.119),
     lr=0.1, momentum=0.9, weight_decay=0.0)
"""

from __future__ import annotations

from typing import Any, Sequence

from gsgd_backends import gsgd_update_, skeleton_init_, step_plan
from gsgd_core import Chain, GSGDState, gsgd_init
from gsgd_core.arrays import prepare
from gsgd_core.gsgd import check_update_hypers

__all__ = ["GSGD"]


class GSGD:
    """G-SGD over lists of arrays: one weight (and bias, or ``None``) per layer of ``chain``.

    Parameters
    ----------
    chain : gsgd_core.Chain
        The layers' sizes and skeleton.
    weights : list of arrays
        One weight per layer, ``(out, in)`` or ``(out, in, *kernel)``, updated in place by
        :meth:`step`.
    biases : list of arrays or None, optional
        One bias per layer (``None`` for a layer without one), updated in place by
        :meth:`step`.
    lr : float
        The learning rate in path space (:func:`gsgd_core.gsgd_update`). It may be changed
        between steps (a schedule).
    momentum : float
        Momentum of the path gradients, with ``torch.optim.SGD``'s conventions.
    dampening : float
        Dampening of the momentum, as ``torch.optim.SGD``.
    nesterov : bool
        Nesterov momentum, as ``torch.optim.SGD``.
    weight_decay : float
        L2 penalty on the basis-path values: ``D += weight_decay * V``.
    fused : bool
        Step through the fused Triton kernels (:func:`gsgd_backends.fused.fused_step_`) on
        the arrays' memory, seen as torch tensors through DLPack (no copy): CUDA arrays
        (CuPy's) compiled, NumPy's only under Triton's interpreter (for tests). Needs torch
        and triton; the arrays must be contiguous and keep their memory between steps.
    """

    def __init__(self, chain: Chain, weights: Sequence[Any], biases: Sequence[Any] | None = None,
                 *, lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 nesterov: bool = False, weight_decay: float = 0.0, fused: bool = False) -> None:
        prepare(chain, weights, biases)
        check_update_hypers(lr, momentum, dampening, nesterov, weight_decay)
        self.chain, self.weights = chain, list(weights)
        self.biases = list(biases) if biases is not None else [None] * chain.L
        self.lr, self.momentum, self.dampening = lr, momentum, dampening
        self.nesterov, self.weight_decay = nesterov, weight_decay
        # the fused step keeps its step counter in the state, and weight decay needs one
        stateful = momentum or (fused and weight_decay)
        self.state = gsgd_init(chain, self.weights, self.biases) if stateful else None
        #: The chain's step plan (:func:`gsgd_backends.step_plan`), built once.
        self.plan = step_plan(chain, self.weights)
        self._fused = _FusedStep(chain, self.weights, self.biases, self.state) if fused else None

    def skeleton_init(self) -> None:
        """Set the skeleton weights to ``+1`` (paper §11.2), in place."""
        skeleton_init_(self.chain, self.weights)

    def step(self, grads: Sequence[Any], bias_grads: Sequence[Any] | None = None) -> None:
        """One G-SGD step in place from the gradients of the weights (and biases)."""
        hyper = dict(momentum=self.momentum, dampening=self.dampening,
                     nesterov=self.nesterov, weight_decay=self.weight_decay)
        if self._fused is not None:
            self._fused(grads, bias_grads, self.lr, **hyper)
            return
        gsgd_update_(self.chain, self.state, self.weights, self.biases, grads, bias_grads,
                     lr=self.lr, plan=self.plan, **hyper)

    def __repr__(self) -> str:
        return (f"GSGD({self.chain}, lr={self.lr}, momentum={self.momentum}, "
                f"weight_decay={self.weight_decay})")


def _views(arrays):
    """Torch tensors on the memory of ``arrays`` (DLPack, no copy); ``None`` stays."""
    import torch
    return [None if a is None else torch.from_dlpack(a) for a in arrays]


class _FusedStep:
    """The fused step of one chain over torch views of the caller's arrays and state (the
    plan's tables are built once; the gradients are viewed at each step)."""

    def __init__(self, chain: Chain, weights, biases, state) -> None:
        from gsgd_backends import fused
        from gsgd_backends.torch import ON_DEVICE
        self.fused = fused
        self.weights, self.biases = _views(weights), _views(biases)
        self.state = None if state is None else GSGDState(
            tuple(_views(state.momentum)), tuple(_views(state.bias_momentum)),
            _views([state.step])[0])
        self.plan = fused.FusedPlan([ON_DEVICE.plan(chain, self.weights[0])])

    def __call__(self, grads, bias_grads, lr, **hyper) -> None:
        self.fused.fused_step_(self.plan, [self.weights], [self.biases], [_views(grads)],
                               [None if bias_grads is None else _views(bias_grads)], lr,
                               None if self.state is None else [self.state], **hyper)
