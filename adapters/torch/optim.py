"""G-SGD, PSI-SGD and Path-SGD as ``torch.optim`` optimizers that take a model.

``opt = GSGD(model, lr=0.1, momentum=0.9)`` finds the model's chains (see
:mod:`.discovery`), updates each chain by G-SGD in path space, the weights of layers followed
by a normalisation by PSI-SGD(M), and every other parameter by ``torch.optim.SGD``'s update
with the same hyperparameters. ``param_groups`` are the user's groups (:mod:`.groups`);
updates go through :mod:`gsgd_backends` (in place).
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn as nn
from torch.optim import Optimizer
from torch.optim.sgd import sgd as sgd_update

import gsgd_backends.torch as gsgd_torch_kernels
from gsgd_backends import StepPlan, gsgd_update_, path_sgd_step_, psi_update_, step_plan
from gsgd_backends.psi import PSIPlan
from gsgd_backends.sharded import RowShard, sharded_gsgd_update_
from gsgd_core import GSGDState, PSIState
from gsgd_core.group import SKELETON_STATES

from .backward_sums import ChainSums
from .ddp import find_ddp
from .discovery import ChainLayers, unwrap
from .fsdp import (all_finite, check_chain, every_finite, is_sharded, local, row_ranges,
                   row_shard, sharded_step)
from .groups import (ChainPart, Description, PartInfo, Runs, SGDPart, explicit_chains,
                     hyper_value, initialised, partition, skeleton_state, warn_user)
from .model_ops import check_invariance

__all__ = ["GSGD", "PSISGD", "PathSGD", "ScaleInvariantOptimizer", "SkeletonWarning",
           "SkippedStepWarning"]

# Attributes of the optimizer beyond torch's own, carried by copy.deepcopy and pickle.
_OWN_STATE = ("_parts", "_names", "_reasons", "_skeleton", "_skipped", "_compile",
              "_backward_sums", "_began", "_unchecked")


class SkeletonWarning(UserWarning):
    """G-SGD was built on chains whose skeleton is not initialised (see ``skeleton_init_``),
    or that the weights cannot tell from trained ones."""


class SkippedStepWarning(UserWarning):
    """A part's step (a chain, or a group's parameters outside chains) was skipped because
    a gradient held NaN or Inf."""


def _check(name: str, value, high: float | None = None) -> None:
    value = hyper_value(value, name)
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(
            value) or value < 0 or (high is not None and value > high):
        bound = f"in [0, {high:g}]" if high is not None else ">= 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")


def _check_group(group: dict, where: str) -> None:
    for key in ("lr", "momentum", "weight_decay"):
        _check(f"{where}{key}", group[key])
    _check(f"{where}dampening", group["dampening"], high=1.0)
    if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"]):
        raise ValueError(f"{where}nesterov needs momentum > 0 and dampening = 0")


def _user_groups(params, model):
    """``(model, groups)``: a model stands for one group of all its parameters, as
    ``torch.optim.SGD(model.parameters())``; otherwise params are torch's params or groups."""
    if isinstance(params, nn.Module):
        if model is not None:
            raise ValueError("pass the model once: as params, or as model= with param groups")
        model = unwrap(params)
        return model, [dict(params=list(model.parameters()))]
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be a model, an iterable of tensors or of dicts, got a "
                        "Tensor")
    groups = list(params)
    if groups and not isinstance(groups[0], dict):
        groups = [dict(params=groups)]
    return (None if model is None else unwrap(model)), [dict(g) for g in groups]


def _add_chain_params(groups: list[dict], chains: list[ChainLayers]) -> None:
    """Parameters of chains given by hand join the first group unless a group has them
    (``GSGD(other_params, chains=...)``: ``params`` holds the parameters outside chains)."""
    have = {id(p) for g in groups for p in g["params"]}
    extra = [p for layers in chains for m in layers.modules
             for p in (m.weight, m.bias) if p is not None and p.requires_grad
             and id(p) not in have]
    if not groups:
        groups.append(dict(params=[]))
    groups[0]["params"] = list(groups[0]["params"]) + extra


class ScaleInvariantOptimizer(Optimizer):
    """User param groups, stepped part by part: chains (each subclass's ``_apply``), PSI
    weights and the rest (``_rest``: ``torch.optim.SGD``'s update unless a subclass says
    otherwise)."""

    algorithm = "?"
    #: The rule of parameters outside chains and PSI parts, as describe() names it.
    rest_rule = "plain SGD"
    #: The hyperparameters describe() reports per part.
    described = ("lr", "momentum", "weight_decay")
    _validate = staticmethod(_check_group)

    #: Whether chain steps can take their column sums from the backward pass.
    takes_column_sums = False
    #: Whether chain steps read the skeleton (its units are those of the path values).
    reads_skeleton = True

    def __init__(self, params, defaults: dict, *, model=None, chains=None, find_chains: bool,
                 find_normalised: bool, through_bn: bool = False,
                 skeleton: str = "paper", strict: bool = False,
                 backward_sums: bool = False) -> None:
        self._validate(defaults, "")
        replicated = isinstance(params if model is None else model, nn.DataParallel)
        ddp = find_ddp(params if model is None else model)
        model, groups = _user_groups(params, model)
        if chains is not None:
            chains = explicit_chains(model, chains)  # validated before any parameter is read
            _add_chain_params(groups, chains)
        if not groups or not any(g["params"] for g in groups):
            raise ValueError("the optimizer got no parameters")
        super().__init__(groups, defaults)
        for i, g in enumerate(self.param_groups):
            self._validate(g, f"param group {i}: " if len(self.param_groups) > 1 else "")
        found = partition(model, self.param_groups, chains=chains, find_chains=find_chains,
                          find_normalised=find_normalised and model is not None,
                          through_bn=through_bn, skeleton=skeleton, strict=strict)
        self._parts, self._names, self._reasons = found.parts, found.names, found.reasons
        for part in self._parts:
            if part.kind == "chain":
                params = [p for w, x in zip(part.weights, part.biases) for p in (w, x)
                          if p is not None]
                check_chain(params, [self._name(p) for p in params])
        self._skeleton = skeleton
        self._skipped = 0
        # chain -> its skeleton's state when training began (the first step, after any
        # load_state_dict; saved in the state dict): once stepped, weights may not tell
        self._began: dict[int, str] = {}
        self._unchecked = self.reads_skeleton
        self._backward_sums = bool(backward_sums and self.takes_column_sums and not replicated)
        self._hook_chains(ddp)

    def _hook_chains(self, ddp=None) -> None:
        """The chains' :class:`.backward_sums.ChainSums` (hooks on their layers), if the
        optimizer takes its column sums from the backward pass; averaged over processes
        with the gradients when the optimizer was given the ``ddp`` module (a copy of the
        optimizer is not: its steps read ``W * grad``)."""
        self._sums = ChainSums([p for p in self._parts if p.kind == "chain"],
                               on=bool(self.__dict__.get("_backward_sums")), ddp=ddp)

    # ------------------------------------------------------------------ torch.optim API
    #: ``torch.amp.GradScaler.step`` hands the step its scale and ``found_inf`` instead of
    #: unscaling the gradients itself (its unscaling kernel bypasses version counters, which
    #: the column sums from the backward pass rely on).
    _step_supports_amp_scaling = True

    def step(self, closure=None):
        """One step of every part; ``closure`` re-evaluates the loss (torch convention)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            if self._unscale_amp():
                self._sums.reduce()
                if self._unchecked:
                    self._check_skeleton()
                for part in self._parts:
                    getattr(self, f"_step_{part.kind}")(part, self.param_groups[part.group])
        return loss

    def _unscale_amp(self) -> bool:
        """``GradScaler``'s part of a step called by ``scaler.step(opt)``: ``False`` (no step)
        if it found a non-finite gradient, as it skips other optimizers' steps; else the
        gradients unscaled as ``scaler.unscale_`` would, and the chains' column sums with them
        (:meth:`.backward_sums.BackwardSums.rescale`). Gradients that ``scaler.unscale_``
        already unscaled (no ``grad_scale`` then) refuse the sums."""
        found, scale = getattr(self, "found_inf", None), getattr(self, "grad_scale", None)
        if found is None and scale is None:
            return True
        if found is not None and bool(found):
            return False
        if scale is None:
            self._sums.refuse("GradScaler.unscale_ changed the gradients in place")
            return True
        inv = scale.double().reciprocal().float()
        grads: dict = {}
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    grads.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
        for (device, _), gs in grads.items():
            torch._amp_foreach_non_finite_check_and_unscale_(
                gs, torch.zeros(1, device=device, dtype=torch.float32), inv.to(device))
        self._sums.rescale(float(inv))
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``; the chains' column sums restart with the gradients."""
        super().zero_grad(set_to_none)
        self._sums.clear()

    def add_param_group(self, param_group: dict) -> None:
        """torch's ``add_param_group``; parameters added after construction take the SGD rule
        (build a new optimizer to have chains found among them)."""
        built = "_parts" in self.__dict__
        if built:  # refused before torch adds it, as torch refuses its own bad groups
            self._validate({**self.defaults, **param_group},
                           f"param group {len(self.param_groups)}: ")
        super().add_param_group(param_group)
        if built:
            self._parts.append(SGDPart(list(self.param_groups[-1]["params"]),
                                       len(self.param_groups) - 1))

    def __setstate__(self, state: dict) -> None:
        # a copy's sums start anew, on the copy's layers (a copy of the model carries the
        # original's hooks disarmed)
        super().__setstate__(state)
        if "_parts" in self.__dict__:
            self.__dict__.setdefault("_began", {})  # pickled before the states were kept
            self.__dict__.setdefault("_unchecked", False)
            self._hook_chains()

    def __getstate__(self) -> dict:
        # torch keeps only defaults, state and param_groups; the partition goes along so that
        # copy.deepcopy and pickling give a working optimizer.
        state = super().__getstate__()
        state.update({k: self.__dict__[k] for k in _OWN_STATE if k in self.__dict__})
        return state

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["gsgd_parts"] = self._layout()
        sd["gsgd_skeleton"] = [self._began.get(i) for i in range(len(self._parts))]
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's ``load_state_dict``; the chains' skeleton states when training began come
        with it (state dicts saved without them load as before)."""
        state_dict = dict(state_dict)
        saved = state_dict.pop("gsgd_parts", None)
        if saved is not None and saved != self._layout():
            raise ValueError(f"the state dict was saved for a different structure: its parts "
                             f"are {saved}, this optimizer's {self._layout()}")
        began = state_dict.pop("gsgd_skeleton", None)
        if began is not None and (len(began) != len(self._parts) or not set(began) <= {
                None, *SKELETON_STATES}):
            raise ValueError(f"the state dict's gsgd_skeleton must hold one skeleton state or "
                             f"None per part ({len(self._parts)}), got {began!r}")
        super().load_state_dict(state_dict)
        if began is not None:
            self._began = {i: v for i, v in enumerate(began) if v is not None}

    def _layout(self) -> list:
        return [[p.kind, p.group] + ([p.names, p.fingerprint] if p.kind == "chain" else [])
                for p in self._parts]

    def describe(self) -> Description:
        """The parts (chains with m, H, G-space dimension; PSI and SGD parameters), the
        hyperparameters each uses, why parameters are not in a chain, and skipped steps."""
        infos = []
        for i, p in enumerate(self._parts):
            g = self.param_groups[p.group]
            hyper = {k: hyper_value(g[k], k) for k in self.described}
            if p.kind == "chain":
                state = self._skeleton_state(i, p)
                infos.append(PartInfo("chain", p.names, hyper, p.chain, initialised(state),
                                      state))
            elif p.kind == "psi":
                infos.append(PartInfo("psi", p.names, hyper))
            else:
                infos.append(PartInfo("sgd", [self._name(q) for q in p.params], hyper))
        counts = self._sums.counts
        return Description(infos, self.algorithm, dict(self._reasons), self._skipped,
                           self._skeleton, self.rest_rule, dict(counts))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(\n{self.describe()}\n)"

    def _skeleton_state(self, i: int, part: ChainPart) -> str:
        """Chain ``i``'s skeleton as describe() says it (:data:`.groups.SKELETON_TEXT`): as
        its weights show it, unless it has been stepped from a skeleton that was (or was not)
        initialised; training moves weights, but never out of "initialised, then trained"."""
        if not self.reads_skeleton:
            return "unused"
        now, began = skeleton_state(part), self._began.get(i)
        if now == "trained" or began in ("initialised", "trained"):
            return "trained"
        return {"default": "began default", "unknown": "unknown"}.get(began, now)

    def _check_chains(self, params, model, example_input) -> None:
        """After construction: the invariance check on ``example_input``, if given."""
        if example_input is not None:
            check_invariance(params if model is None else model, example_input,
                             chains=[p.modules for p in self._parts if p.kind == "chain"])

    def _check_skeleton(self) -> None:
        """At the first step (after any ``load_state_dict``, whose chains' states stand):
        each chain's skeleton state as its weights show it, kept, and a warning for those
        not initialised or that the weights cannot tell (stacklevel: the user's call). A
        chain trained by this algorithm keeps its free edges, so a resumed or second
        optimizer on it is not warned."""
        if all(hyper_value(g["lr"], "lr") == 0 for g in self.param_groups):
            return  # trains nothing: DCP's get_state_dict steps at lr 0 before it loads
        self._unchecked = False
        now = {i: skeleton_state(p) for i, p in enumerate(self._parts)
               if p.kind == "chain" and i not in self._began}
        self._began.update(now)
        named = {state: "; ".join(" -> ".join(self._parts[i].names)
                                  for i, s in now.items() if s == state)
                 for state in ("default", "unknown")}
        skeleton, name = self._skeleton, self.algorithm
        silence = (" Silence with warnings.filterwarnings('ignore', category="
                   "gsgd_adapters.torch.SkeletonWarning)")
        if named["default"]:
            warn_user(
                f"{name}: the skeleton of chain(s) {named['default']} is not initialised for "
                f"skeleton={skeleton!r}: call gsgd_adapters.torch.skeleton_init_(model) "
                "before building the optimizer (from a default init, path values are tiny "
                f"and {name} diverges at the usual learning rates)." + silence,
                SkeletonWarning)
        if named["unknown"]:
            warn_user(
                f"{name}: the skeleton of chain(s) {named['unknown']} is not initialised for "
                f"skeleton={skeleton!r}, or was and has been trained by another rule (its "
                f"free edges, which {name} never changes, are off the recipe's scale): if "
                "this model was skeleton-initialised and trained, ignore this; otherwise "
                "call gsgd_adapters.torch.skeleton_init_(model) before training." + silence,
                SkeletonWarning)

    # ------------------------------------------------------------------ helpers
    #: The kernels of this algorithm's chain steps (``None``: it keeps no step plan).
    kernels = None

    def _stepper(self, chain, W, names) -> StepPlan | RowShard | None:
        """What steps the chain: its step plan or, when FSDP2 shards it, its
        :class:`RowShard` (which holds the plan of its local rows). Built on the chain's
        first step and kept by the optimizer, not in its state (a shard holds the process
        group); rebuilt when it no longer fits (the model moved to another device or dtype,
        or was sharded anew)."""
        if self.kernels is None:
            return None
        held = self.__dict__.setdefault("_steppers", {}).get(id(chain))
        if is_sharded(W[0]):
            rows = row_ranges(W, [f"{n}.weight" for n in names])
            if not (isinstance(held, RowShard) and held.rows == rows):
                held = row_shard(chain, rows, W[0])
        elif not (isinstance(held, StepPlan) and held.fits(chain, W[0])):
            held = step_plan(chain, W, kernels=self.kernels)
        self._steppers[id(chain)] = held
        return held

    def _psi_plan(self, part) -> PSIPlan | None:
        """The compiled PSI step of a part of normalised weights (``compile=True``), built
        on its first step and kept by the optimizer beside the chains' step plans."""
        if not self.__dict__.get("_compile"):
            return None
        held = self.__dict__.setdefault("_steppers", {})
        if id(part) not in held:
            held[id(part)] = PSIPlan()
        return held[id(part)]

    def _name(self, p: torch.Tensor) -> str:
        name = self._names.get(id(p))  # a lazy parameter has no shape yet
        return f"<{tuple(p.shape)}>" if name is None else name

    def _grad(self, p: torch.Tensor, group: dict, name: str) -> torch.Tensor:
        """``p.grad`` as the update reads it (never modified): zeros if None, negated to
        maximise, checked for non-finite values on request."""
        g = torch.zeros_like(p) if p.grad is None else p.grad
        if group.get("check_finite") and not all_finite(g):
            raise ValueError(f"non-finite gradient in {name}")
        return -g if group.get("maximize") else g

    def _step_psi(self, part, group: dict) -> None:
        """PSI-SGD(M) on the weights of normalised layers (Yi et al., Algorithm 1)."""
        live = [(p, n) for p, n in zip(part.weights, part.names) if p.grad is not None]
        if not live:
            return
        # PSI acts on each row (output unit) alone: FSDP2's local rows are stepped as they are.
        W = [local(p) for p, _ in live]
        G = [local(self._grad(p, group, f"{n}.weight")) for p, n in live]
        momentum = hyper_value(group["momentum"], "momentum")
        # PSI-SGD reads no buffer and keeps none (torch.optim.SGD's state): a zero that
        # takes no memory stands for a buffer the state does not have.
        U = [local(_buffer(self.state[p], p)) if momentum else w.new_zeros(()).expand_as(w)
             for (p, _), w in zip(live, W)]
        psi_update_(PSIState(tuple(U)), W, G, lr=hyper_value(group["lr"], "lr"),
                    momentum=momentum, max_norm=group["max_norm"], plan=self._psi_plan(part))

    def _step_sgd(self, part, group: dict) -> None:
        self._rest(part.params, group, self.state)

    def _live(self, params, group: dict) -> list:
        """The parameters with a gradient (checked for non-finite values on request); none
        when one of those gradients holds NaN or Inf: the part's step is skipped, as a
        chain's is (numerics guide: never written into the weights, nor into a buffer)."""
        params = [p for p in params if p.grad is not None]
        if group.get("check_finite"):
            for p in params:
                self._grad(p, group, self._name(p))
        if params and not every_finite([p.grad for p in params]):
            self._count_skip(", ".join(self._name(p) for p in params))
            return []
        return params

    def _rest(self, params, group: dict, state) -> None:
        """``torch.optim.SGD``'s update of ``params`` (those with a gradient)."""
        params = self._live(params, group)
        if not params:
            return
        bufs = [state[p].get("momentum_buffer") for p in params]
        sgd_update(params, [p.grad for p in params], bufs, weight_decay=group["weight_decay"],
                   momentum=group["momentum"], lr=group["lr"], dampening=group["dampening"],
                   nesterov=group["nesterov"], maximize=group["maximize"],
                   foreach=group.get("foreach"))
        if group["momentum"] != 0:
            for p, buf in zip(params, bufs):
                state[p]["momentum_buffer"] = buf

    def _step_chain(self, part: ChainPart, group: dict) -> None:
        """Step a chain; layers without a weight gradient this step are never written (their
        biases take SGD's rule): the chain is stepped as the runs of consecutive layers that
        have one (a run of one layer takes SGD's rule), each with momentum restarted, and a
        warning says so once."""
        live = [w.grad is not None for w in part.weights]
        if not any(live) and all(x is None or x.grad is None for x in part.biases):
            return  # nothing of the chain has a gradient (a branch this step did not use)
        if all(live):
            self._update_chain(part.chain, part, range(len(live)), group, self.state)
            return
        runs = part.runs.get(tuple(live))
        if runs is None:
            runs = part.runs[tuple(live)] = Runs.of(part.chain, live)
            dead = [n for n, ok in zip(part.names, live) if not ok]
            warn_user(
                f"{self.algorithm}: {', '.join(dead)} had no gradient, so the chain "
                f"{' -> '.join(part.names)} was stepped as the runs of layers that have one; "
                "those layers are never written, and the runs' momentum restarts")
        # Single-layer runs take the rest's rule; so do the biases of layers without a weight
        # gradient (their weights have no grad, and _rest leaves those alone).
        self._rest([p for i in runs.outside for p in part.layer_params(i)], group, runs.state)
        for (start, stop), chain in runs.chains.items():
            self._update_chain(chain, part, range(start, stop), group, runs.state)

    def _update_chain(self, chain, part: ChainPart, layers, group: dict, state) -> None:
        """One chain update (``self._apply``, each algorithm's own) of ``part``'s layers
        ``layers`` as ``chain``; counts and warns about skipped steps."""
        W = [part.weights[i] for i in layers]
        b = [part.biases[i] for i in layers]
        names = [part.names[i] for i in layers]
        G = [self._grad(w, group, f"{n}.weight") for w, n in zip(W, names)]
        Gb = [None if x is None else self._grad(x, group, f"{n}.bias") for x, n in zip(b, names)]
        # A frozen bias (or one without a gradient) is a basis path that does not move: the
        # update writes into a copy of it (and a scratch momentum buffer, kept out of the
        # optimizer's state), so the parameter itself is never written.
        fixed = [x is not None and (part.frozen_bias[i] or x.grad is None)
                 for x, i in zip(b, layers)]
        b = [x.detach().clone() if f else x for x, f in zip(b, fixed)]
        G = [_row_norm_scaled(g, w) if part.normalised[i] else g
             for g, w, i in zip(G, W, layers)]
        applied = self._apply(chain, W, b, G, Gb, group=group, state=state, fixed=fixed,
                              stepper=self._stepper(chain, W, names),
                              sums=self._sums.take(part, len(layers) == len(part.weights),
                                                   bool(group.get("maximize"))))
        if not applied:
            self._count_skip(f"the chain {' -> '.join(names)}")

    def _count_skip(self, what: str) -> None:
        """Count a part's step skipped for a non-finite gradient; warn the first time."""
        self._skipped += 1
        if self._skipped == 1:
            warn_user(
                f"{self.algorithm}: a gradient of {what} holds NaN or Inf, so the step was "
                "skipped (weights and momentum unchanged); later skips are counted in "
                "describe() without a warning", SkippedStepWarning)


def _buffer(state: dict, p: torch.Tensor) -> torch.Tensor:
    """``state["momentum_buffer"]``, zeros like ``p`` when missing (allocated only then:
    ``setdefault`` would build a full-size default every step)."""
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(p)
    return state["momentum_buffer"]


def _row_norm_scaled(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``grad * ||W[j]||`` per output unit ``j``: the BN variant of ICR (paper eq. 30)."""
    norms = torch.linalg.vector_norm(weight.reshape(weight.shape[0], -1), dim=1)
    return grad * norms.reshape((-1,) + (1,) * (grad.ndim - 1))


class GSGD(ScaleInvariantOptimizer):
    """G-SGD (Meng et al., ICLR 2019): SGD on the values of a basis of paths.

    Parameters
    ----------
    params : nn.Module, or an iterable of parameters / param groups
        A model: its chains are found with ``torch.fx`` (:func:`~.discovery.discover`) and
        ``param_groups`` is one group of all its parameters, as for
        ``torch.optim.SGD(model.parameters())``. Otherwise torch's params or param groups,
        with ``model=`` (chains found in it among those parameters) or ``chains=``.
    lr : float
        The learning rate, as ``torch.optim.SGD``'s. No buffer holds it, so a schedule acts
        at once.
    momentum : float
        The momentum factor, as ``torch.optim.SGD``'s; in chains the momentum is that of the
        path gradients.
    dampening : float
        The momentum's dampening, as ``torch.optim.SGD``'s.
    weight_decay : float
        The L2 penalty, as ``torch.optim.SGD``'s; in chains on the basis-path values
        (``D += weight_decay * V``).
    nesterov : bool
        Nesterov momentum, as ``torch.optim.SGD``'s; in chains in path space.
    maximize : bool
        Maximise the objective instead, as ``torch.optim.SGD``.
    foreach : bool, optional
        As ``torch.optim.SGD``: the implementation of the update of the parameters outside
        chains.
    model : nn.Module, optional
        The model, when ``params`` are param groups: chains are found in it, and a chain
        whose layers lie in two groups is an error.
    chains : list of lists of layers, optional
        The chains by hand, each an ordered list of Linear/Conv modules, or a
        :class:`ChainLayers` (as :func:`discover` and :func:`skeleton_init_` return them).
    skeleton : {"he", "paper"}
        The units of the chains' path values (:attr:`gsgd_core.Chain.skeleton_scale`), which
        must match :func:`~gsgd_adapters.torch.skeleton_init_`'s (same default). ``"he"``:
        skeleton edges of He init's standard deviation; ``lr`` then means SGD's learning rate
        on plain deep CNNs too (skeleton guide). ``"paper"``: skeleton edges of 1 (paper §11.2),
        better on small, narrow MLPs and ruinous on wide plain CNNs (the measurement:
        ``docs/skeleton_recipe.md``). The first step (after any ``load_state_dict``) warns
        when the model's skeleton is not initialised for the chosen recipe, or the weights
        cannot tell (:func:`gsgd_core.skeleton_state`); a chain trained by G-SGD keeps its
        free edges, and the state dict keeps each chain's state, so a resume is not warned.
    strict : bool
        Raise ``ValueError`` when a Linear/Conv layer lands in no chain and no PSI part
        (the message says why, per layer), or when the model cannot be traced. By default
        such layers take SGD's rule and ``describe()`` says why.
    example_input : tensor or tuple of tensors, optional
        Check every chain on this input before training: :func:`check_invariance` rescales
        a copy of the model at random and raises ``ValueError`` naming the first chain whose
        output moves.
    bn : {"psi", "sgd", "paper"}
        Weight layers directly followed by batch/group/layer norm end their chain (exact
        invariance holds only without them). By default (``"psi"``) their weights are updated
        by PSI-SGD(M) (Yi et al.), which is exactly invariant under the rescaling that the norm
        allows (batch and instance norm, and group norm with a group per channel; layer norm
        and coarser group norms normalise units together, so those weights take SGD's rule);
        PSI weights take no weight decay (their scale does not affect the loss).
        ``"sgd"`` updates them like the rest. ``"paper"`` is the G-SGD paper's approximate
        variant (Appendix 10.2, eq. 29-30): batch norm does not end a chain, and the ICR of a
        BN-followed layer uses ``grad * ||W[j]||`` (row norms). It is approximate: the
        trajectory does not commute exactly with rescaling.
    compile : bool
        Steps run their node-vector work and every layer's update (momentum and weight
        decay included) as two ``torch.compile`` graphs specialised to the model's shapes,
        and PSI-SGD(M)'s step of the normalised weights as compiled row loops
        (:class:`gsgd_backends.psi.PSIPlan`). The first step compiles for some seconds. Off
        by default.
    max_norm : float
        With ``bn="psi"``, a PSI weight's row whose norm exceeds it is divided by its norm
        (PSI-SGD's renormalisation, :class:`PSISGD`).
    check_finite : bool
        Raise ``ValueError`` naming the parameter when a gradient has NaN/Inf (one host
        synchronisation per parameter). Off by default: a chain step whose gradients are not
        finite is skipped (a :class:`SkippedStepWarning` the first time, a count in
        ``describe()``), at no more cost than a normal step; so is the step of a group's
        parameters outside chains, and a PSI weight's row keeps its values.
    backward_sums : bool
        Take each chain's column sums ``colsum(W_l * grad_l)`` from the backward pass
        (:mod:`.backward_sums`: hooks on the chain's layers), so that a step reads each
        weight and gradient once. Where the gradients are not exactly the accumulation of
        the backward passes the sums saw (clipped, unscaled, replaced, ...) the step reads
        ``W * grad`` instead, with the same result; ``describe()`` counts both. Given a DDP
        module, the sums are averaged over its processes as DDP averages the gradients
        (one all-reduce of vectors per step, :mod:`.ddp`). Writes through ``.data`` are not detected: call ``zero_grad()`` after one.
        On by default; ``False`` removes the hooks' cost from the backward pass.

    Notes
    -----
    Every hyperparameter is per param group, as in ``torch.optim``. In chains, momentum and
    Nesterov act in path space and weight decay is L2 on basis-path values, so every iterate
    commutes with positive rescaling.

    Frozen parameters (``requires_grad=False``) are never in a chain: they split it, and the
    trainable runs on either side form chains. A layer whose ``.grad`` is ``None`` at a step
    is never written: its chain is stepped as the runs of layers that have gradients.

    A model sharded by FSDP2 (``fully_shard``) is stepped on each process's rows, with one
    all-reduce of ``O(sum of widths)`` numbers per chain and step (:mod:`.fsdp`); DDP
    models step their replicas, with the column sums averaged over the processes.
    """

    algorithm = "G-SGD"
    takes_column_sums = True

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 model: nn.Module | None = None, chains=None, skeleton: str = "he",
                 bn: str = "psi", strict: bool = False, example_input=None,
                 check_finite: bool = False, foreach: bool | None = None,
                 max_norm: float = 1e4, compile: bool = False,
                 backward_sums: bool = True) -> None:
        if bn not in ("psi", "sgd", "paper"):
            raise ValueError(f"bn must be 'psi', 'sgd' or 'paper', got {bn!r}")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
                        check_finite=check_finite, foreach=foreach, max_norm=max_norm)
        self._compile = bool(compile)
        super().__init__(params, defaults, model=model, chains=chains, find_chains=True,
                         find_normalised=(bn == "psi"), through_bn=(bn == "paper"),
                         skeleton=skeleton, strict=strict, backward_sums=backward_sums)
        self._check_chains(params, model, example_input)

    @property
    def kernels(self):
        return gsgd_torch_kernels.COMPILED if self._compile else gsgd_torch_kernels.KERNELS

    def _apply(self, chain, W, b, G, Gb, *, group, state, fixed, stepper, sums) -> bool:
        momentum = hyper_value(group["momentum"], "momentum")
        st = None
        if momentum != 0:
            for p in W + [x for x, f in zip(b, fixed) if x is not None and not f]:
                _buffer(state[p], p)
            first = state[W[0]]
            first.setdefault("step", torch.zeros((), dtype=torch.int32, device=W[0].device))
            st = GSGDState(tuple(state[w]["momentum_buffer"] for w in W),
                           tuple(None if x is None else torch.zeros_like(x) if f
                                 else state[x]["momentum_buffer"] for x, f in zip(b, fixed)),
                           first["step"])
        hyper = dict(lr=hyper_value(group["lr"], "lr"), momentum=momentum,
                     dampening=hyper_value(group["dampening"], "dampening"),
                     nesterov=group["nesterov"],
                     weight_decay=hyper_value(group["weight_decay"], "weight_decay"))
        if not is_sharded(W[0]):
            return gsgd_update_(chain, st, W, b, G, Gb, **hyper, plan=stepper,
                                **sums)

        def fast(a):  # eager kernels: a compiled stage is specialised to whole layers
            done = sharded_gsgd_update_(gsgd_torch_kernels.KERNELS, stepper, *a, **hyper)
            if done and st is not None:
                st.step.add_(1)
            return done

        return sharded_step((st, W, b, G, Gb), fast, lambda a: gsgd_update_(chain, *a, **hyper))


class PSISGD(ScaleInvariantOptimizer):
    """PSI-SGD / PSI-SGDM (Yi et al., Algorithm 1) for a model with normalisation layers.

    Weights of Linear/Conv layers directly followed by batch, group or layer norm get
    ``u <- momentum*u + ||w_i||^2 g_i; w_i <- w_i - lr*u`` per row (rows with norm above
    ``max_norm`` renormalised); every other parameter gets ``torch.optim.SGD``'s update with
    the same ``lr``, ``momentum`` and ``weight_decay``. ``compile=True`` runs the normalised
    weights' step as compiled row loops (:class:`gsgd_backends.psi.PSIPlan`).
    """

    algorithm = "PSI-SGD"

    def __init__(self, model: nn.Module, lr: float = 1e-3, momentum: float = 0.0,
                 weight_decay: float = 0.0, *, max_norm: float = 1e4, maximize: bool = False,
                 foreach: bool | None = None, compile: bool = False) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError("PSISGD takes a model: it finds the normalised layers in it")
        self._compile = bool(compile)
        defaults = dict(lr=lr, momentum=momentum, dampening=0.0, weight_decay=weight_decay,
                        nesterov=False, maximize=maximize, check_finite=False,
                        foreach=foreach, max_norm=max_norm)
        super().__init__(model, defaults, chains=None, find_chains=False, find_normalised=True)


class PathSGD(ScaleInvariantOptimizer):
    """Path-SGD (Neyshabur et al. 2015), the G-SGD paper's baseline: on every chain
    ``w_e <- w_e - lr * grad_e / gamma_e``; other parameters take plain SGD."""

    algorithm = "Path-SGD"
    reads_skeleton = False  # gamma_e sums over every path: no unit is chosen

    def __init__(self, params, lr: float = 1e-3, *, model: nn.Module | None = None,
                 chains=None, maximize: bool = False, foreach: bool | None = None) -> None:
        defaults = dict(lr=lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                        maximize=maximize, check_finite=False, foreach=foreach)
        super().__init__(params, defaults, model=model, chains=chains, find_chains=True,
                         find_normalised=False)

    def _apply(self, chain, W, b, G, Gb, *, group, state, fixed, stepper, sums) -> bool:
        def full(a):
            path_sgd_step_(chain, *a, hyper_value(group["lr"], "lr"))
            return True

        # Path-SGD's scales are products along whole paths: under FSDP2 it steps the
        # gathered full layers (O(m) communication; it is the paper's baseline).
        if not is_sharded(W[0]):
            return full((W, b, G, Gb))
        return sharded_step((W, b, G, Gb), None, full)
