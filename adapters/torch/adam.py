"""G-Adam and G-AdamW: Adam in path space, as ``torch.optim`` optimizers that take a model.

``opt = GAdam(model, lr=1e-3)`` finds the model's chains as :class:`~.optim.GSGD` does and
updates each by :func:`gsgd_core.path_update` with :func:`gsgd_core.adam_rule`: Adam's
moments are kept per basis path, of the path gradients ``D = dL/dv``, and weight allocation
writes the weights whose path values are ``V - Delta``. Every step commutes with positive
rescaling of the hidden units, exactly. Every other parameter (normalised layers' weights
included) takes ``torch.optim.Adam``'s (or ``AdamW``'s) own update with the same
hyperparameters.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from gsgd_core import AdamRule

from . import functional as F
from .hyper import hyper_value
from .optim import ScaleInvariantOptimizer

__all__ = ["GAdam", "GAdamW"]


def _rule(group: dict, decoupled: bool, lr=None) -> AdamRule:
    """The group's Adam rule (it validates the hyperparameters), at ``lr`` if given (the
    group's as the steps take it)."""
    return AdamRule(hyper_value(group["lr"], "lr") if lr is None else lr,
                    tuple(hyper_value(b, "betas") for b in group["betas"]),
                    group["eps"], group["weight_decay"], decoupled, group["amsgrad"])


class GAdam(ScaleInvariantOptimizer):
    """G-Adam: Adam on the values of a basis of paths (an invariant optimizer of ReLU nets).

    Parameters
    ----------
    params : nn.Module, or an iterable of parameters / param groups
        As :class:`~.optim.GSGD`.
    lr : float
        The learning rate, as ``torch.optim.Adam``'s.
    betas : (float, float)
        The decay rates of the first and second moments, as ``torch.optim.Adam``'s; in
        chains the moments are those of the path gradients.
    eps : float
        The term added to the denominator, as ``torch.optim.Adam``'s.
    weight_decay : float
        The L2 penalty, as ``torch.optim.Adam``'s; in chains on the basis-path values
        (``D += weight_decay * V``; :class:`GAdamW`: decoupled, ``Delta += lr*wd*V``).
    amsgrad : bool
        Divide by the largest second moment so far (AMSGrad), as ``torch.optim.Adam``.
    maximize : bool
        Maximise the objective instead, as ``torch.optim.Adam``.
    foreach : bool, optional
        As ``torch.optim.Adam``: the implementation of the update of the parameters outside
        chains.
    model : nn.Module, optional
        The model, when ``params`` are param groups, as :class:`~.optim.GSGD`'s.
    chains : list of lists of layers, optional
        The chains by hand, as :class:`~.optim.GSGD`'s.
    skeleton : {"he", "paper"}
        The units of the chains' path values, as :class:`~.optim.GSGD`'s (see Notes).
    strict : bool
        Raise ``ValueError`` when a Linear/Conv layer lands in no chain, as
        :class:`~.optim.GSGD`.
    example_input : tensor or tuple of tensors, optional
        Check every chain on this input before training, as :class:`~.optim.GSGD`.
    check_finite : bool
        Raise ``ValueError`` naming a parameter whose gradient has NaN/Inf, as
        :class:`~.optim.GSGD`.
    backward_sums : bool, optional
        Take the chains' column sums from the backward pass, as :class:`~.optim.GSGD`
        (``None``: unless the step is fused).
    compile : bool
        The chains' update of every edge (the rule's moments and the weights) runs as one
        ``torch.compile`` graph per chain, specialised to the model's shapes: each layer is
        one fused loop that reads its weights, gradients and moments once. The first step
        compiles for some seconds. Off by default.
    fused : bool, optional
        The fused step, as :class:`~.optim.GSGD`'s ``fused``: every chain of a group in
        three Triton launches with no read back to the host
        (:func:`gsgd_backends.fused_adam.fused_adam_step_`; a one-element tensor ``lr`` is
        read on the device), and the other parameters by ``torch.optim.Adam``'s fused
        update, each skipped on the device for a non-finite gradient or ``GradScaler``'s
        ``found_inf``. ``None`` (the default): on for CUDA parameters where Triton imports;
        ``True`` on CPU tensors only under Triton's interpreter (tests).
    bn : {"adam", "paper"}
        Weight layers directly followed by a normalisation end their chain and take Adam
        (``"adam"``, the default), or, with ``"paper"``, batch norm does not end a chain and
        the ICR of such a layer uses ``grad * ||W[j]||`` (paper Appendix 10.2; approximate).

    Notes
    -----
    Adam's step has the size of ``lr`` on every path whatever the path's value, so a path
    whose value is much smaller than ``lr`` changes sign or grows by orders of magnitude in
    one step: initialise the skeleton (:func:`~gsgd_adapters.torch.skeleton_init_`) so that
    path values have the size of the weights (``skeleton="he"``, the default). Every
    hyperparameter is per param group, as in ``torch.optim``; the chain's step count is kept
    in its first weight's state (``"step"``).

    Numerics as :func:`gsgd_core.path_update`: a chain step whose gradients hold a NaN or Inf
    is skipped (weights and moments unchanged; counted in ``describe()``), and so is the
    Adam step of a group's parameters outside chains.
    """

    algorithm = "G-Adam"
    takes_column_sums = True
    rest_rule = "Adam"
    described = ("lr", "weight_decay", "eps")
    decoupled = False
    keeps_plans = True
    functional = staticmethod(F.gadam)
    fused_functional = staticmethod(F.fused_gadam)
    fused_rest = True

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, model: nn.Module | None = None, chains=None,
                 skeleton: str = "he", bn: str = "adam", strict: bool = False,
                 example_input=None, check_finite: bool = False,
                 backward_sums: bool | None = None, compile: bool = False,
                 fused: bool | None = None) -> None:
        if bn not in ("adam", "paper"):
            raise ValueError(f"bn must be 'adam' or 'paper', got {bn!r}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize, foreach=foreach,
                        check_finite=check_finite)
        self._compile = bool(compile)
        super().__init__(params, defaults, model=model, chains=chains, find_chains=True,
                         find_normalised=False, through_bn=(bn == "paper"), skeleton=skeleton,
                         strict=strict, backward_sums=backward_sums, fused=fused)
        self._check_chains(params, model, example_input)

    def _validate(self, group: dict, where: str) -> None:
        try:
            if len({isinstance(b, torch.Tensor) for b in group["betas"]}) > 1:
                raise ValueError("betas must be both numbers or both tensors (as "
                                 f"torch.optim.Adam requires), got {group['betas']!r}")
            _rule(group, self.decoupled)
        except ValueError as exc:
            raise ValueError(f"{where}{exc}") from None

    def _hyper(self, group: dict) -> dict:
        return dict(rule=_rule(group, self.decoupled, self._value(group, "lr")))

    def _chain_state(self, state, W, b, fixed, hyper: dict):
        return F.rule_state(state, W, b, fixed, hyper["rule"])

    def _rest_update(self, params, group: dict, state, found_inf=None,
                     grad_scale=None) -> None:
        """``torch.optim.Adam``'s (``AdamW``'s) update of ``params``."""
        F.adam(params, state, group, self.decoupled, found_inf, grad_scale)


class GAdamW(GAdam):
    """G-AdamW: :class:`GAdam` with decoupled weight decay on basis-path values
    (``Delta += lr * weight_decay * V``); ``torch.optim.AdamW`` on the other parameters.
    ``weight_decay`` defaults to ``1e-2``, as ``torch.optim.AdamW``'s."""

    algorithm = "G-AdamW"
    rest_rule = "AdamW"
    decoupled = True

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, **kwargs) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, **kwargs)
