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
from torch.optim.adam import adam as adam_update

from gsgd_backends import path_update_
from gsgd_backends.sharded import sharded_path_update_
from gsgd_backends.torch import COMPILED, KERNELS
from gsgd_core import AdamRule, RuleState

from .fsdp import is_sharded, sharded_step
from .groups import hyper_value
from .optim import ScaleInvariantOptimizer

__all__ = ["GAdam", "GAdamW"]

_HALF = (torch.float16, torch.bfloat16)


def _rule(group: dict, decoupled: bool) -> AdamRule:
    """The group's Adam rule (it validates the hyperparameters)."""
    return AdamRule(hyper_value(group["lr"], "lr"),
                    tuple(hyper_value(b, "betas") for b in group["betas"]),
                    group["eps"], group["weight_decay"], decoupled, group["amsgrad"])


def _zeros(p: torch.Tensor) -> torch.Tensor:
    """A buffer for ``p`` in the dtype the core computes it in (float32 for half types)."""
    return torch.zeros_like(p, dtype=torch.float32 if p.dtype in _HALF else p.dtype)


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
    backward_sums : bool
        Take the chains' column sums from the backward pass, as :class:`~.optim.GSGD`.
    compile : bool
        The chains' update of every edge (the rule's moments and the weights) runs as one
        ``torch.compile`` graph per chain, specialised to the model's shapes: each layer is
        one fused loop that reads its weights, gradients and moments once. The first step
        compiles for some seconds. Off by default.
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

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, model: nn.Module | None = None, chains=None,
                 skeleton: str = "he", bn: str = "adam", strict: bool = False,
                 example_input=None, check_finite: bool = False,
                 backward_sums: bool = True, compile: bool = False) -> None:
        if bn not in ("adam", "paper"):
            raise ValueError(f"bn must be 'adam' or 'paper', got {bn!r}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize, foreach=foreach,
                        check_finite=check_finite)
        self._compile = bool(compile)
        super().__init__(params, defaults, model=model, chains=chains, find_chains=True,
                         find_normalised=False, through_bn=(bn == "paper"), skeleton=skeleton,
                         strict=strict, backward_sums=backward_sums)
        self._check_chains(params, model, example_input)

    def _validate(self, group: dict, where: str) -> None:
        try:
            if len({isinstance(b, torch.Tensor) for b in group["betas"]}) > 1:
                raise ValueError("betas must be both numbers or both tensors (as "
                                 f"torch.optim.Adam requires), got {group['betas']!r}")
            _rule(group, self.decoupled)
        except ValueError as exc:
            raise ValueError(f"{where}{exc}") from None

    @property
    def kernels(self):
        return COMPILED if self.__dict__.get("_compile") else KERNELS

    def _apply(self, chain, W, b, G, Gb, *, group, state, fixed, stepper, sums) -> bool:
        rule = _rule(group, self.decoupled)
        for p in W + [x for x, f in zip(b, fixed) if x is not None and not f]:
            for name in rule.buffers:
                if name not in state[p]:
                    state[p][name] = _zeros(p)
        first = state[W[0]]
        first.setdefault("step", torch.zeros((), dtype=torch.int32, device=W[0].device))

        def buffers(name):  # a frozen bias's moments are scratch (it never moves)
            return tuple(state[w][name] for w in W) + tuple(
                _zeros(x) if f else state[x][name] for x, f in zip(b, fixed) if x is not None)

        st = RuleState(tuple(buffers(n) for n in rule.buffers), first["step"])
        if not is_sharded(W[0]):
            return path_update_(chain, rule, st, W, b, G, Gb, plan=stepper,
                                **sums)

        def fast(a):
            done = sharded_path_update_(KERNELS, stepper, rule, *a)
            if done:
                st.count.add_(1)
            return done

        return sharded_step((st, W, b, G, Gb), fast,
                            lambda a: path_update_(chain, rule, *a))

    def _rest(self, params, group: dict, state) -> None:
        """``torch.optim.Adam``'s (``AdamW``'s) update of ``params`` with a gradient."""
        params = self._live(params, group)
        if not params:
            return
        names = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
        sts = [state[p] for p in params]
        for p, st in zip(params, sts):
            if "step" not in st:
                st["step"] = torch.tensor(0.0)
            for name in names:
                if name not in st:
                    st[name] = torch.zeros_like(p)
        beta1, beta2 = (hyper_value(x, "betas") for x in group["betas"])
        adam_update(params, [p.grad for p in params], [s["exp_avg"] for s in sts],
                    [s["exp_avg_sq"] for s in sts],
                    [s["max_exp_avg_sq"] for s in sts] if group["amsgrad"] else [],
                    [s["step"] for s in sts], foreach=group.get("foreach"),
                    decoupled_weight_decay=self.decoupled, amsgrad=group["amsgrad"],
                    beta1=beta1, beta2=beta2, lr=hyper_value(group["lr"], "lr"),
                    weight_decay=group["weight_decay"], eps=group["eps"],
                    maximize=group["maximize"])


class GAdamW(GAdam):
    """G-AdamW: :class:`GAdam` with decoupled weight decay on basis-path values
    (``Delta += lr * weight_decay * V``); ``torch.optim.AdamW`` on the other parameters.
    ``weight_decay`` defaults to ``1e-2``, as ``torch.optim.AdamW``'s."""

    algorithm = "G-AdamW"
    rest_rule = "AdamW"
    decoupled = True

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, **kwargs) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)
