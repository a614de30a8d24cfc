"""The fused G-Adam step (G-AdamW, AMSGrad): every chain of a model in three Triton launches.

:func:`fused_adam_step_` is :func:`gsgd_core.path_update` with :class:`gsgd_core.AdamRule`
(Adam's moments per basis path, of the path gradients ``D``; weight allocation of
``V - Delta``) through the kernels of the fused G-SGD step (:mod:`.fused`, DESIGN §14): the
same read pass, vector stage and write pass over a :class:`~.fused.FusedPlan`'s tables, with
Adam's rule in place of SGD's direction. The bias corrections come from each state's step
counter on the device, so, as there, nothing is read back to the host: the learning rate
may be a 0-d device tensor, a chain with a non-finite gradient is skipped alone and a set
``found_inf`` skips every chain (moments and counter unchanged).

This module imports triton: import it only where triton is installed.
"""

from __future__ import annotations

from typing import Sequence

import torch

from gsgd_core import AdamRule, RuleState

from . import fused_kernels as fk
from .fused import Buffers, FusedPlan, check_lengths, checked_tensors, launch_step

__all__ = ["adam_buffers", "fused_adam_step_"]


def adam_buffers(c: int, rule: AdamRule, state, biases, L: int) -> list[Buffers]:
    """Chain ``c``'s moments as the kernels take them, from the flat tuples of a
    :class:`gsgd_core.RuleState` (per buffer: ``L`` weight arrays, then the biases' of
    the layers that have one); ``ValueError`` for a state of another rule or shape."""
    if not isinstance(state, RuleState) or len(state.buffers) != len(rule.buffers):
        raise ValueError(f"states[{c}]: G-Adam needs a RuleState with the buffers "
                         f"{rule.buffers} (gsgd_core.path_init(chain, rule, weights, biases))")
    biases = [None] * L if biases is None else list(biases)
    out = []
    for name, arrays in zip(rule.buffers, state.buffers):
        want = L + sum(b is not None for b in biases)
        if len(arrays) != want:
            raise ValueError(f"states[{c}]: {name} holds {len(arrays)} arrays; the chain's "
                             f"{L} layers and {want - L} biases need {want}")
        rest = iter(arrays[L:])
        out.append(Buffers(name, list(arrays[:L]),
                           [None if b is None else next(rest) for b in biases]))
    return out


def fused_adam_step_(plan: FusedPlan, weights, biases, grads, bias_grads, lr,
                     states: Sequence[RuleState], *, betas=(0.9, 0.999), eps: float = 1e-8,
                     weight_decay: float = 0.0, decoupled: bool = False,
                     amsgrad: bool = False, maximize: bool = False,
                     found_inf: torch.Tensor | None = None, column_sums=None,
                     gradient_check=None, grad_scale: torch.Tensor | None = None) -> None:
    """One G-Adam step of every chain of ``plan``, in place, in three kernel launches.

    Each chain's result is :func:`gsgd_core.path_update`'s with
    ``AdamRule(lr, betas, eps, weight_decay, decoupled, amsgrad)`` (to rounding)::

        D <- D + weight_decay * V                (L2; not with decoupled)
        m <- beta1 m + (1 - beta1) D,   s <- beta2 s + (1 - beta2) D**2   (s_max <- max)
        Delta = lr / (1 - beta1**t) * m / (sqrt(s) / sqrt(1 - beta2**t) + eps)
        Delta <- Delta + lr * weight_decay * V   (decoupled: G-AdamW)

    ``weights``, ``biases``, ``grads``, ``bias_grads``, ``lr``, ``maximize``,
    ``found_inf``, ``column_sums``, ``gradient_check`` and ``grad_scale`` as
    :func:`~.fused.fused_step_` takes them; ``states``: one :class:`gsgd_core.RuleState` per chain
    (:func:`gsgd_core.path_init`'s, buffers in the compute dtype: float32 for half
    parameters), whose moments and ``count`` are updated in place, ``t = count + 1`` read
    on the device. Bad input raises ``ValueError`` before any launch.
    """
    rule = AdamRule(1.0 if isinstance(lr, torch.Tensor) else lr, tuple(betas), eps,
                    weight_decay, decoupled, amsgrad)
    if states is None:
        raise ValueError("states: G-Adam needs one gsgd_core.path_init(chain, rule, weights, "
                         "biases) per chain")
    check_lengths(plan, biases=biases, states=states)
    buffers = [adam_buffers(c, rule, s, None if biases is None else biases[c], p.chain.L)
               for c, (p, s) in enumerate(zip(plan.plans, states))]
    counters = [(f"states[{c}].count", s.count) for c, s in enumerate(states)]
    tensors = checked_tensors(plan, weights, biases, grads, bias_grads, lr, counters=counters,
                              buffers=buffers, buffer_dtype=plan.compute, found_inf=found_inf,
                              sums=column_sums, checks=gradient_check, grad_scale=grad_scale)
    flags = fk.R_ADAM.value | (fk.R_AMSGRAD.value if amsgrad else 0)
    if weight_decay:
        flags |= fk.R_DECOUPLED.value if decoupled else fk.R_WD.value
    b1, b2 = rule.betas
    launch_step(plan, tensors, lr, counters=counters, checks=gradient_check,
                found_inf=found_inf, rule=flags,
                hyper=(b1, 1.0 - b1, b2, 1.0 - b2, eps, weight_decay), maximize=maximize,
                buffer_dtype=plan.compute, grad_scale=grad_scale)
