"""G-SGD, PSI-SGD and Path-SGD as ``torch.optim`` optimizers that take a model.

``opt = GSGD(model, lr=0.1, momentum=0.9)`` finds the model's chains (see
:mod:`.discovery`), updates each chain by G-SGD in path space, the weights of layers followed
by a normalisation by PSI-SGD(M), and every other parameter by ``torch.optim.SGD``'s update
with the same hyperparameters. Updates go through :mod:`gsgd_backends` (in place).
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn as nn
from torch.optim import Optimizer
from torch.optim.sgd import sgd as sgd_update

import gsgd_backends.torch as gsgd_torch_kernels
from gsgd_backends import gsgd_update_, path_sgd_step_, psi_update_
from gsgd_core import Chain, GSGDState, PSIState

from .groups import Description, chain_group, plan, skeleton_is_initialised

__all__ = ["GSGD", "PSISGD", "PathSGD"]


def _check(name: str, value, high: float | None = None) -> None:
    if isinstance(value, torch.Tensor):
        return
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(
            value) or value < 0 or (high is not None and value > high):
        bound = f"in [0, {high:g}]" if high is not None else ">= 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")


class _ScaleInvariantOptimizer(Optimizer):
    """Chain groups, PSI groups and an SGD group, each stepped by its own rule."""

    algorithm = "?"

    def __init__(self, params, defaults: dict, *, chains, find_chains: bool,
                 find_normalised: bool, through_bn: bool = False) -> None:
        for key in ("lr", "momentum", "weight_decay"):
            _check(key, defaults.get(key, 0.0))
        _check("dampening", defaults.get("dampening", 0.0), high=1.0)
        if defaults.get("nesterov") and (defaults["momentum"] <= 0 or defaults["dampening"]):
            raise ValueError("nesterov needs momentum > 0 and dampening = 0")
        p = plan(params, chains, find_chains=find_chains, find_normalised=find_normalised,
                 through_bn=through_bn)
        self._names = p.names
        groups = [chain_group(c) for c in p.chains]
        if p.normalised:
            groups.append(dict(params=[m.weight for _, m in p.normalised], kind="psi",
                               layer_names=[n for n, _ in p.normalised]))
        rest = [g if isinstance(g, dict) else dict(params=[g]) for g in p.others]
        if rest and all("lr" not in g and len(g) == 1 for g in rest):
            rest = [dict(params=[q for g in rest for q in g["params"]])]
        groups += [dict(g, kind=g.get("kind", "sgd")) for g in rest]
        if not groups:
            raise ValueError("the optimizer got no parameters")
        self._chains: dict[str, Chain] = {}
        super().__init__(groups, dict(defaults, kind="sgd"))

    # ------------------------------------------------------------------ torch.optim API
    @torch.no_grad()
    def step(self, closure=None):
        """One step of every group; ``closure`` re-evaluates the loss (torch convention)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            getattr(self, f"_step_{group['kind']}")(group)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups):
            raise ValueError(f"the state dict has {len(saved)} param groups, this optimizer "
                             f"{len(self.param_groups)}")
        for i, (old, new) in enumerate(zip(saved, self.param_groups)):
            if old.get("kind") != new["kind"] or old.get("fingerprint") != new.get("fingerprint"):
                raise ValueError(f"param group {i}: the state dict was saved for a different "
                                 f"structure ({old.get('kind')}, {old.get('layer_names')}) than "
                                 f"this optimizer's ({new['kind']}, {new.get('layer_names')})")
        super().load_state_dict(state_dict)

    def describe(self) -> Description:
        """The chains found (m, H, G-space dimension, invariant ratio) and the fallbacks."""
        chains, normalised, fallback = [], [], []
        for g in self.param_groups:
            if g["kind"] == "chain":
                chain = self._chain(g)
                chains.append((g["layer_names"], chain, skeleton_is_initialised(g, chain)))
            elif g["kind"] == "psi":
                normalised += [f"{n}.weight" for n in g["layer_names"]]
            else:
                fallback += [self._names.get(id(p), f"<{tuple(p.shape)}>") for p in g["params"]]
        return Description(chains, normalised, fallback, self.algorithm)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(\n{self.describe()}\n)"

    # ------------------------------------------------------------------ helpers
    def _chain(self, group: dict) -> Chain:
        key = group["fingerprint"]
        if key not in self._chains:
            self._chains[key] = Chain(**group["chain_spec"])
        return self._chains[key]

    def _grad(self, p: torch.Tensor, group: dict, name: str) -> torch.Tensor:
        """``p.grad`` as the update reads it (never modified): zeros if None, negated to
        maximise, checked for non-finite values on request."""
        g = torch.zeros_like(p) if p.grad is None else p.grad
        if group.get("check_finite") and not bool(torch.isfinite(g).all()):
            raise ValueError(f"non-finite gradient in {name}")
        return -g if group.get("maximize") else g

    def _chain_arrays(self, group: dict):
        params = group["params"]
        W = [params[w] for w, _ in group["layout"]]
        b = [None if i is None else params[i] for _, i in group["layout"]]
        names = group["layer_names"]
        G = [self._grad(w, group, f"{n}.weight") for w, n in zip(W, names)]
        Gb = [None if x is None else self._grad(x, group, f"{n}.bias") for x, n in zip(b, names)]
        return W, b, G, Gb

    def _step_psi(self, group: dict) -> None:
        """PSI-SGD(M) on the weights of normalised layers (seed 004, Algorithm 1)."""
        live = [(p, n) for p, n in zip(group["params"], group["layer_names"])
                if p.grad is not None]
        if not live:
            return
        W = [p for p, _ in live]
        G = [self._grad(p, group, f"{n}.weight") for p, n in live]
        U = [self.state[p].setdefault("momentum_buffer", torch.zeros_like(p)) for p in W]
        psi_update_(PSIState(tuple(U)), W, G, lr=group["lr"], momentum=group["momentum"],
                    max_norm=group["max_norm"])

    def _step_sgd(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        if group.get("check_finite"):
            for p in params:
                self._grad(p, group, self._names.get(id(p), "a parameter"))
        bufs = [self.state[p].get("momentum_buffer") for p in params]
        sgd_update(params, [p.grad for p in params], bufs, weight_decay=group["weight_decay"],
                   momentum=group["momentum"], lr=group["lr"], dampening=group["dampening"],
                   nesterov=group["nesterov"], maximize=group["maximize"],
                   foreach=group.get("foreach"))
        if group["momentum"] != 0:
            for p, buf in zip(params, bufs):
                self.state[p]["momentum_buffer"] = buf


class GSGD(_ScaleInvariantOptimizer):
    """G-SGD (Meng et al., ICLR 2019): SGD on the values of a basis of paths.

    Parameters
    ----------
    params : nn.Module, or an iterable of parameters / param groups
        A model: its chains are found with ``torch.fx`` (Linear/Conv layers joined by
        ReLU-like, pooling, flatten, dropout or identity ops). Otherwise ``chains`` must be
        given, and ``params`` holds the parameters outside them (plain SGD).
    lr, momentum, dampening, weight_decay, nesterov, maximize, foreach
        As ``torch.optim.SGD``. In chains, momentum and Nesterov act in path space and weight
        decay is L2 on basis-path values (``D += weight_decay * V``), so every iterate
        commutes with positive rescaling.
    chains : list of lists of layers, optional
        The chains by hand, each an ordered list of Linear/Conv modules.
    bn : {"psi", "sgd", "paper"}
        Weight layers directly followed by batch/group/layer norm end their chain (exact
        invariance holds only without them). By default (``"psi"``) their weights are updated
        by PSI-SGD(M) (seed 004), which is exactly invariant under the rescaling that the norm
        allows; PSI weights take no weight decay (their scale does not affect the loss).
        ``"sgd"`` updates them like the rest. ``"paper"`` is the G-SGD paper's approximate
        variant (Appendix 10.2, eq. 29-30): batch norm does not end a chain, and the ICR of a
        BN-followed layer uses ``grad * ||W[j]||`` (row norms). It is approximate: the
        trajectory does not commute exactly with rescaling.
    compile : bool
        Steps run their node-vector work and every layer's update (momentum and weight
        decay included) as two ``torch.compile`` graphs specialised to the model's shapes:
        0.4x to 0.55x the eager step's time at 10M weights on a 2-core CPU. The first step
        compiles for some seconds. Off by default: the eager fast path needs no compiler.
    check_finite : bool
        Raise ``ValueError`` naming the parameter when a gradient has NaN/Inf (one host
        synchronisation per parameter). Off by default; ``torch.amp.GradScaler`` already
        skips steps whose gradients are not finite.

    Notes
    -----
    G-SGD learns well from a skeleton-initialised start (paper §11.2): call
    :func:`~gsgd_adapters.torch.skeleton_init_` once before training (``describe()`` says
    whether it was).
    """

    algorithm = "G-SGD"

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 chains=None, bn: str = "psi", check_finite: bool = False,
                 foreach: bool | None = None, max_norm: float = 1e4,
                 compile: bool = False) -> None:
        if bn not in ("psi", "sgd", "paper"):
            raise ValueError(f"bn must be 'psi', 'sgd' or 'paper', got {bn!r}")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
                        check_finite=check_finite, foreach=foreach, max_norm=max_norm)
        self._kernels = gsgd_torch_kernels.COMPILED if compile else None
        super().__init__(params, defaults, chains=chains, find_chains=True,
                         find_normalised=(bn == "psi" and isinstance(params, nn.Module)),
                         through_bn=(bn == "paper"))

    def _step_chain(self, group: dict) -> None:
        if all(p.grad is None for p in group["params"]):
            return
        chain = self._chain(group)
        W, b, G, Gb = self._chain_arrays(group)
        G = [_row_norm_scaled(g, w) if bn else g
             for g, w, bn in zip(G, W, group.get("normalised", [False] * len(W)))]
        state = None
        if group["momentum"] != 0:
            st = [self.state[p] for p in group["params"]]
            for s, p in zip(st, group["params"]):
                s.setdefault("momentum_buffer", torch.zeros_like(p))
            first = st[0]
            first.setdefault("step", torch.zeros((), dtype=torch.int32, device=W[0].device))
            mom = [self.state[w]["momentum_buffer"] for w in W]
            bmom = [None if x is None else self.state[x]["momentum_buffer"] for x in b]
            state = GSGDState(tuple(mom), tuple(bmom), first["step"])
        gsgd_update_(chain, state, W, b, G, Gb, lr=group["lr"], momentum=group["momentum"],
                     dampening=group["dampening"], nesterov=group["nesterov"],
                     weight_decay=group["weight_decay"], kernels=self._kernels)



def _row_norm_scaled(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``grad * ||W[j]||`` per output unit ``j``: the BN variant of ICR (paper eq. 30)."""
    norms = torch.linalg.vector_norm(weight.reshape(weight.shape[0], -1), dim=1)
    return grad * norms.reshape((-1,) + (1,) * (grad.ndim - 1))


class PSISGD(_ScaleInvariantOptimizer):
    """PSI-SGD / PSI-SGDM (seed 004, Algorithm 1) for a model with normalisation layers.

    Weights of Linear/Conv layers directly followed by batch, group or layer norm get
    ``u <- momentum*u - lr*||w_i||^2 g_i; w_i <- w_i + u`` per row (rows with norm above
    ``max_norm`` renormalised); every other parameter gets ``torch.optim.SGD``'s update with
    the same ``lr``, ``momentum`` and ``weight_decay``.
    """

    algorithm = "PSI-SGD"

    def __init__(self, model: nn.Module, lr: float = 1e-3, momentum: float = 0.0,
                 weight_decay: float = 0.0, *, max_norm: float = 1e4, maximize: bool = False,
                 foreach: bool | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError("PSISGD takes a model: it finds the normalised layers in it")
        defaults = dict(lr=lr, momentum=momentum, dampening=0.0, weight_decay=weight_decay,
                        nesterov=False, maximize=maximize, check_finite=False,
                        foreach=foreach, max_norm=max_norm)
        super().__init__(model, defaults, chains=None, find_chains=False, find_normalised=True)



class PathSGD(_ScaleInvariantOptimizer):
    """Path-SGD (Neyshabur et al. 2015), the G-SGD paper's baseline: on every chain
    ``w_e <- w_e - lr * grad_e / gamma_e``; other parameters take plain SGD."""

    algorithm = "Path-SGD"

    def __init__(self, params, lr: float = 1e-3, *, chains=None, maximize: bool = False,
                 foreach: bool | None = None) -> None:
        defaults = dict(lr=lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                        maximize=maximize, check_finite=False, foreach=foreach)
        super().__init__(params, defaults, chains=chains, find_chains=True,
                         find_normalised=False)

    def _step_chain(self, group: dict) -> None:
        if all(p.grad is None for p in group["params"]):
            return
        W, b, G, Gb = self._chain_arrays(group)
        path_sgd_step_(self._chain(group), W, b, G, Gb, group["lr"])
