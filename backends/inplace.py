"""In-place versions of the core's operations (trailing underscore), for mutable arrays.

The G-SGD step of NumPy, PyTorch and CuPy arrays takes the fast path of :mod:`.fast`;
everything else computes the new values with the functional core and writes them back.
Either way: same arguments, same results to float64 rounding, arrays updated in place.
"""

from __future__ import annotations

import importlib
import inspect

from array_api_compat import array_namespace

import gsgd_core
from gsgd_core import Chain, GSGDState
from gsgd_core.arrays import check_hyper, is_real, quiet_fp
from gsgd_core.gsgd import check_buffers, check_update_hypers
from gsgd_core.rules import all_finite

from ._dispatch import assign, kernels_for, library
from .fast import fast_step_
from .plan import StepPlan, check_column_sums
from .rule_step import rule_step_

__all__ = ["gsgd_step_", "gsgd_update_", "path_update_", "rescale_", "canonicalize_",
           "skeleton_init_", "path_sgd_step_", "psi_update_", "step_plan"]


def _write(dsts, srcs) -> None:
    for d, s in zip(dsts, srcs):
        if d is not None and d is not s:  # an array handed back as it was is not copied
            assign(d, s)


def _write_state(state: GSGDState, new: GSGDState) -> None:
    _write(state.momentum, new.momentum)
    _write(state.bias_momentum, new.bias_momentum)
    assign(state.step, new.step)


def _write_tree(dst, src) -> None:
    """Every array of the state ``src`` into the same place of ``dst`` (nested tuples,
    lists, NamedTuples, dicts)."""
    if isinstance(dst, dict):
        for k in dst:
            _write_tree(dst[k], src[k])
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            _write_tree(d, s)
    elif dst is not None:
        assign(dst, src)


def step_plan(chain: Chain, weights, *, kernels=None) -> StepPlan | None:
    """The :class:`~gsgd_backends.plan.StepPlan` of ``chain`` for arrays like ``weights``
    (their library's kernels, or ``kernels``), to pass to :func:`gsgd_update_` and
    :func:`path_update_` step after step; ``None`` when the library has no fast path."""
    kernels = kernels_for(weights[0]) if kernels is None else kernels
    return None if kernels is None else kernels.plan(chain, weights[0])


def gsgd_update_(chain: Chain, state: GSGDState | None, weights, biases, grads, bias_grads,
                 *, kernels=None, plan: StepPlan | None = None, column_sums=None,
                 gradient_check=None, **hyper) -> bool:
    """:func:`gsgd_core.gsgd_update` applied in place to ``weights``, ``biases`` and ``state``.

    A step of NumPy, PyTorch or CuPy arrays with hyperparameters given as Python numbers
    runs :func:`gsgd_backends.fast.fast_step_` (momentum buffers updated in place too),
    which hands the step back when it holds a non-finite value or cannot be done in place.
    A step whose gradients hold a NaN or Inf is then skipped here, as the core would skip
    it, without the core's full computation; any other step goes to the core. ``plan``
    (:func:`step_plan`) is what the fast path reuses from step to step; without one a plan
    is built for the call, of ``kernels`` (``gsgd_backends.torch.COMPILED``, ...) or of the
    kernels :func:`kernels_for` chooses.

    ``column_sums``: ``colsum(W_l * grad_l)`` for ``l = 2..L`` (one vector per layer, an
    entry per input unit, the weights' dtype), when the caller has them from the backward
    pass (DESIGN §12: ``sum over batch and positions of x_l * dL/dx_l``); the fast path then
    reads each weight once. They must be exactly those of ``weights`` and ``grads``: the
    core, when it takes the step, computes its own. ``gradient_check`` (with them): a 0-d
    array that is finite only if every weight gradient's entry is (their sum, or a bound on
    them), if the caller has one: the step then reads each gradient once, and where the
    check is not finite it checks the gradients themselves.

    Returns ``False`` when the step was skipped for a non-finite gradient (nothing written),
    ``True`` otherwise.
    """
    if kernels is None and plan is None and isinstance(weights, (list, tuple)) and weights:
        kernels = kernels_for(weights[0])
    if column_sums is not None or gradient_check is not None:
        check_column_sums(chain, column_sums, weights[0].dtype, gradient_check)
    h = _fast_hypers(hyper, state, plan)
    if h is not None and h["momentum"] != 0:
        check_buffers(chain, state)  # before the fast path reads a buffer that is not there
    finite = None  # known once the fast path has declined the step
    if (kernels is not None or plan is not None) and h is not None:
        if fast_step_(kernels, chain, weights, biases, grads, bias_grads, state=state,
                      plan=plan, column_sums=column_sums, gradient_check=gradient_check, **h):
            if state is not None:
                assign(state.step, state.step + 1)
            return True
        finite = _finite(grads, bias_grads)
        if not finite:
            return False
    W, b, new_state = gsgd_core.gsgd_update(chain, state, weights, biases, grads, bias_grads,
                                            **hyper)
    _write(weights, W)
    _write(biases or [], b)
    if state is not None:
        _write_state(state, new_state)
    return _finite(grads, bias_grads) if finite is None else finite


def _finite(grads, bias_grads) -> bool:
    """Whether every gradient is finite. A finite sum proves an array finite, and a sum is
    one read of it with nothing allocated; only arrays whose sum is not finite (a NaN or
    Inf, or finite values whose sum overflows) get the exact, costlier check."""
    with quiet_fp():
        arrays = [g for g in list(grads) + list(bias_grads or []) if g is not None]
        xp = array_namespace(*arrays)
        finite = xp.isfinite(xp.stack([xp.sum(xp.reshape(g, (-1,))) for g in arrays]))
        if bool(xp.all(finite)):  # the usual case: one host synchronisation
            return True
        suspects = [a for i, a in enumerate(arrays) if not bool(finite[i])]
        return bool(all_finite(xp, suspects))


def _fast_hypers(hyper: dict, state, plan: StepPlan | None = None) -> dict | None:
    """The hyperparameters of a valid step that the fast path takes (Python numbers, and a
    state wherever momentum needs one), or ``None``: the core then raises or computes.
    ``plan`` memoises the check (:meth:`StepPlan.checked`)."""
    h = _checked_hypers(hyper) if plan is None else plan.checked(hyper, _checked_hypers)
    return h if h is not None and (h["momentum"] == 0 or state is not None) else None


def _checked_hypers(hyper: dict) -> dict | None:
    """``hyper`` with the defaults filled in, checked (``ValueError`` for a value the core
    refuses); ``None`` where the core must take them (not all Python numbers, or an
    unknown name: the core raises its ``TypeError``)."""
    h = dict(dict(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0), **hyper)
    if set(h) != {"lr", "momentum", "dampening", "nesterov", "weight_decay"}:
        return None
    check_update_hypers(**h)
    return h if all(is_real(v) for v in h.values()) else None


def path_update_(chain: Chain, rule, state, weights, biases, grads, bias_grads, *,
                 plan: StepPlan | None = None, column_sums=None,
                 gradient_check=None) -> bool:
    """:func:`gsgd_core.path_update` applied in place to ``weights``, ``biases`` and every
    array of ``state`` (which must be mutable arrays, as the rule's ``init`` makes them).

    An elementwise rule (:class:`gsgd_core.ElementwiseRule`, e.g. Adam) on NumPy, PyTorch
    or CuPy arrays takes the fast path of :mod:`.rule_step`, which hands the step back when
    it holds a non-finite value or cannot be done in place; a step whose gradients hold a
    NaN or Inf is then skipped here, and any other goes to the core. ``plan``,
    ``column_sums`` and ``gradient_check`` as for :func:`gsgd_update_`.

    Returns ``False`` when the step was skipped for a non-finite gradient, ``True``
    otherwise.
    """
    kernels = kernels_for(weights[0]) if plan is None and isinstance(
        weights, (list, tuple)) and weights else None
    if column_sums is not None or gradient_check is not None:
        check_column_sums(chain, column_sums, weights[0].dtype, gradient_check)
    finite = None  # known once the fast path has declined the step
    if kernels is not None or plan is not None:
        if rule_step_(kernels, chain, rule, state, weights, biases, grads, bias_grads,
                      plan=plan, column_sums=column_sums, gradient_check=gradient_check):
            assign(state.count, state.count + 1)
            return True
        finite = _finite(grads, bias_grads)
        if not finite:
            return False
    # the core validates the arrays (a clear error for bad input) and skips a non-finite step
    W, b, new_state = gsgd_core.path_update(chain, rule, state, weights, biases, grads,
                                            bias_grads)
    _write(weights, W)
    _write(biases or [], b)
    _write_tree(state, new_state)
    return _finite(grads, bias_grads) if finite is None else finite


def gsgd_step_(chain: Chain, weights, biases, grads, bias_grads, lr, *, kernels=None) -> None:
    """:func:`gsgd_core.gsgd_step` applied in place."""
    gsgd_update_(chain, None, weights, biases, grads, bias_grads, lr=lr, kernels=kernels)


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


def skeleton_init_(chain: Chain, weights, *, keep_signs: bool = False,
                   rest_scale: float = 1.0) -> None:
    """:func:`gsgd_core.skeleton_init` applied in place (skeleton edges set to ``+r_l``,
    or ``±r_l`` with their signs kept; other weights times ``rest_scale``)."""
    W, _ = gsgd_core.skeleton_init(chain, weights, keep_signs=keep_signs,
                                   rest_scale=rest_scale)
    _write(weights, W)


def path_sgd_step_(chain: Chain, weights, biases, grads, bias_grads, lr) -> None:
    """:func:`gsgd_core.path_sgd_step` applied in place."""
    W, b = gsgd_core.path_sgd_step(chain, weights, biases, grads, bias_grads, lr)
    _write(weights, W)
    _write(biases or [], b)


def psi_update_(state: gsgd_core.PSIState, weights, grads, *, plan=None, **hyper) -> None:
    """:func:`gsgd_core.psi_update` applied in place to ``weights`` and ``state``; torch
    tensors take :func:`gsgd_backends.psi.psi_step_` (multi-tensor, in place), which hands
    back a step it cannot take exactly (non-finite gradients, half precision, a possible
    overflow), or, given a :class:`gsgd_backends.psi.PSIPlan` as ``plan``, its compiled
    step first."""
    if _fast_psi(state, weights, grads, hyper, plan):
        return
    W, new_state = gsgd_core.psi_update(state, weights, grads, **hyper)
    _write(weights, W)
    _write(state.momentum, new_state.momentum)


#: The core's defaults of psi_update's hyperparameters, read from it (not restated here).
_PSI_DEFAULTS = {k: p.default
                 for k, p in inspect.signature(gsgd_core.psi_update).parameters.items()
                 if k in ("momentum", "max_norm")}


def _fast_psi(state, weights, grads, hyper, plan) -> bool:
    if not (isinstance(state, gsgd_core.PSIState) and isinstance(weights, (list, tuple))
            and weights and library(weights[0]) == "torch"
            and set(hyper) <= {"lr", "momentum", "max_norm"}):
        return False
    h = dict(_PSI_DEFAULTS, **hyper)
    for k in ("lr", "momentum", "max_norm"):  # the core's own checks and messages
        check_hyper(k, h.get(k))
    if not all(is_real(v) for v in h.values()) or not (
            len(weights) == len(grads) == len(state.momentum)) or any(
            tuple(w.shape) != tuple(g.shape) or tuple(w.shape) != tuple(u.shape) or w.ndim < 2
            for w, g, u in zip(weights, grads, state.momentum)):
        return False  # the core raises its errors
    # torch tensors: torch is loaded; a NumPy or CuPy user need not have it installed
    psi = importlib.import_module(".psi", __package__)
    args = (list(weights), list(grads), list(state.momentum))
    floats = {k: float(v) for k, v in h.items()}
    return (plan is not None and plan.step_(*args, **floats)) or psi.psi_step_(*args, **floats)
