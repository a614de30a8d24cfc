"""G-SGD, PSI-SGD and Path-SGD as ``torch.optim`` optimizers that take a model.

``opt = GSGD(model, lr=0.1, momentum=0.9)`` finds the model's chains (see
:mod:`.discovery`), updates each chain by G-SGD in path space, the weights of layers followed
by a normalisation by PSI-SGD(M), and every other parameter by ``torch.optim.SGD``'s update
with the same hyperparameters. ``param_groups`` are the user's groups (:mod:`.groups`); the
optimizer steps their parts (:mod:`.parts`), each chain through its algorithm's function of
tensors and hyperparameters (:mod:`.functional`), as ``torch.optim.SGD`` steps through
``sgd()``.
"""

from __future__ import annotations

import abc
import functools
from collections import defaultdict

import torch
import torch.nn as nn
from torch.optim import Optimizer

import gsgd_backends.torch as gsgd_torch_kernels
from gsgd_backends import StepPlan, step_plan
from gsgd_backends.psi import PSIPlan
from gsgd_backends.sharded import RowShard
from gsgd_core.group import SKELETON_STATES

from . import functional as F
from .backward_sums import ChainSums
from .ddp import find_ddp
from .description import Description
from .discovery import ChainLayers, unwrap
from .fsdp import all_finite, check_chain, every_finite, is_sharded, row_ranges, row_shard
from .groups import explicit_chains, partition
from .hyper import check_sgd_group, hyper_value
from .model_ops import check_invariance
from .parts import ChainPart, SGDPart, skeleton_state
from .warn import SkeletonWarning, SkippedStepWarning, warn_user

__all__ = ["GSGD", "PSISGD", "PathSGD", "ScaleInvariantOptimizer", "SkeletonWarning",
           "SkippedStepWarning"]

# Attributes of the optimizer beyond torch's own, carried by copy.deepcopy and pickle.
_OWN_STATE = ("_parts", "_names", "_reasons", "_skeleton", "_skipped", "_compile", "_sums",
              "_began", "_unchecked", "_fused")


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


@functools.lru_cache(maxsize=None)
def _hyper_names(step) -> tuple[str, ...]:
    return F.hyperparameters(step)


class ScaleInvariantOptimizer(Optimizer, metaclass=abc.ABCMeta):
    """User param groups, stepped part by part (:mod:`.parts`): chains (each subclass's
    ``functional`` chain step, on the state its ``_chain_state`` gathers), PSI weights and
    the rest (each subclass's ``_rest_update``)."""

    algorithm = "?"
    #: The rule of parameters outside chains and PSI parts, as describe() names it.
    rest_rule = "plain SGD"
    #: The hyperparameters describe() reports per part.
    described = ("lr", "momentum", "weight_decay")
    #: The chain step (:mod:`.functional`): its keyword-only parameters are read from the
    #: chain's group (:meth:`_hyper`).
    functional = None

    #: Whether chain steps can take their column sums from the backward pass.
    takes_column_sums = False
    #: Whether chain steps read the skeleton (its units are those of the path values).
    reads_skeleton = True
    #: Whether chain steps keep a step plan (:meth:`_stepper`).
    keeps_plans = False
    #: The fused step of a group's chains (:mod:`.functional`; ``None``: none, so
    #: ``fused=True`` is refused), the plan it takes (of the chains' step plans), and
    #: whether the other parts have their fused steps.
    fused_functional = None
    fused_plan = staticmethod(F.fused_plan)
    fused_rest = False

    def __init__(self, params, defaults: dict, *, model=None, chains=None, find_chains: bool,
                 find_normalised: bool, through_bn: bool = False,
                 skeleton: str = "paper", strict: bool = False,
                 backward_sums: bool | None = False, fused: bool | None = False) -> None:
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
        for part in self._chains():
            params = [p for p in part.weights + part.biases if p is not None]
            check_chain(params, [self._name(p) for p in params])
        self._skeleton = skeleton
        self._skipped = 0
        # chain -> its skeleton's state when training began (the first step, after any
        # load_state_dict; saved in the state dict): once stepped, weights may not tell
        self._began: dict[int, str] = {}
        self._unchecked = self.reads_skeleton and bool(self._chains())  # none: no read
        self._fused = F.use_fused(
            fused, [p for g in self.param_groups for p in g["params"]], self.algorithm,
            self.fused_rest and (self.fused_functional is not None or not self._chains()))
        if backward_sums is None:  # measured (docs/step_overhead_gpu.md): the hooks' own
            backward_sums = not self._fused  # launches cost a GPU more than W * grad's read
        self._sums = ChainSums(self._chains(), on=bool(
            backward_sums and self.takes_column_sums and not replicated), ddp=ddp)

    def _chains(self) -> list[ChainPart]:
        return [p for p in self._parts if isinstance(p, ChainPart)]

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
            fused = self._fusable() if self._fused else ()
            if self._unscale_amp(len(fused) == len(self._chains())):
                self._check_finite()
                self._sums.reduce()
                if self._unchecked:
                    self._check_skeleton()
                for part in self._parts:
                    if part not in fused:
                        part.step(self, self.param_groups[part.group])
                if fused:
                    self._step_fused(fused)
        return loss

    def _unscale_amp(self, in_kernels: bool) -> bool:
        """``GradScaler``'s part of a step called by ``scaler.step(opt)``: ``False`` (no step)
        if it found a non-finite gradient, as it skips other optimizers' steps; else the
        gradients unscaled as ``scaler.unscale_`` would, and the chains' column sums with them
        (:meth:`.backward_sums.ChainSums.unscaled`). Gradients that ``scaler.unscale_``
        already unscaled (no ``grad_scale`` then) refuse the sums. Under ``fused`` nothing is
        read: ``found_inf`` goes to the fused steps, which skip on the device, and the sums
        are refused (their rescaling is exact only for a power of two, which only a read
        could tell); where every chain steps fused (``in_kernels``), ``grad_scale`` goes to
        the fused steps too, which read the gradients unscaled and write them back so, as
        torch's fused optimizers do, instead of a pass of their own."""
        found, scale = getattr(self, "found_inf", None), getattr(self, "grad_scale", None)
        self._found_inf = found if self._fused else None  # the fused steps skip on the device
        self._grad_scale = scale if self._fused and in_kernels else None
        if found is None and scale is None:
            return True
        if not self._fused and found is not None and bool(found):
            return False
        inv = None if scale is None or self._grad_scale is not None else self._unscale(scale)
        if self._fused and scale is not None:  # its factor cannot be read without a host sync
            self._sums.unscaled(None, "the fused step unscaled the gradients on the device")
        else:
            self._sums.unscaled(None if inv is None else float(inv))
        return True

    def _unscale(self, scale: torch.Tensor) -> torch.Tensor:
        """Every gradient times ``1 / scale`` (in float64, rounded to float32), in place, as
        ``scaler.unscale_`` unscales them; returns that factor."""
        inv = scale.double().reciprocal().float()
        grads: dict = {}
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    grads.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
        for (device, _), gs in grads.items():
            torch._amp_foreach_non_finite_check_and_unscale_(
                gs, torch.zeros(1, device=device, dtype=torch.float32), inv.to(device))
        return inv

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``; the chains' column sums restart with the gradients."""
        super().zero_grad(set_to_none)
        self._sums.clear()

    def add_param_group(self, param_group: dict) -> None:
        """torch's ``add_param_group``; parameters added after construction take the rest's
        rule (build a new optimizer to have chains found among them)."""
        built = "_parts" in self.__dict__
        if built:  # refused before torch adds it, as torch refuses its own bad groups
            self._validate({**self.defaults, **param_group},
                           f"param group {len(self.param_groups)}: ")
        super().add_param_group(param_group)
        if built:
            self._parts.append(SGDPart(list(self.param_groups[-1]["params"]),
                                       len(self.param_groups) - 1))

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        at = self.__dict__.pop("_names_at", None)
        if at is not None:  # the names of the copy's parameters, by their places in the groups
            params = [p for g in self.param_groups for p in g["params"]]
            self._names = {id(params[i]): name for i, name in at.items()}
        if "_parts" in self.__dict__:
            self.__dict__.setdefault("_began", {})  # pickled before the states were kept
            self.__dict__.setdefault("_unchecked", False)
            self.__dict__.setdefault("_fused", False)

    def __getstate__(self) -> dict:
        # torch keeps only defaults, state and param_groups; the partition goes along so that
        # copy.deepcopy and pickling give a working optimizer (the copy's column sums start
        # anew, on the copy's layers: ChainSums.__reduce__).
        state = super().__getstate__()
        state.update({k: self.__dict__[k] for k in _OWN_STATE if k in self.__dict__})
        if "_names" in state:  # keyed by id, which a copy's parameters do not share
            at = {id(p): i for i, p in enumerate(p for g in self.param_groups
                                                 for p in g["params"])}
            state["_names_at"] = {at[k]: name for k, name in state.pop("_names").items()
                                  if k in at}
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
        return [p.layout() for p in self._parts]

    def describe(self) -> Description:
        """The parts (chains with m, H, G-space dimension; PSI and SGD parameters), the
        hyperparameters each uses, why parameters are not in a chain, and skipped steps."""
        infos = [p.info(self, i, {k: hyper_value(self.param_groups[p.group][k], k)
                                  for k in self.described})
                 for i, p in enumerate(self._parts)]
        return Description(infos, self.algorithm, dict(self._reasons), self._skipped,
                           self._skeleton, self.rest_rule, dict(self._sums.counts))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(\n{self.describe()}\n)"

    def _skeleton_state(self, i: int, part: ChainPart) -> str:
        """Chain ``i``'s skeleton as describe() says it (:data:`.description.SKELETON_TEXT`):
        as its weights show it, unless it has been stepped from a skeleton that was (or was
        not) initialised; training moves weights, but never out of "initialised, then
        trained"."""
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
                             chains=[p.modules for p in self._chains()])

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
               if isinstance(p, ChainPart) and i not in self._began}
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
    # ------------------------------------------------------------------ the fused step
    def _fusable(self) -> list[ChainPart]:
        """The chains the fused step takes now: whole (every layer and bias with a
        gradient, none frozen), not FSDP2's, their gradients not scaled by row norms
        (``bn="paper"``); the others step one by one."""
        return [p for p in self._chains() if not any(p.normalised) and not any(
            p.frozen_bias) and not is_sharded(p.weights[0]) and all(
            x.grad is not None for x in p.weights + p.biases if x is not None)]

    def _step_fused(self, parts: list[ChainPart]) -> None:
        """The fused step of ``parts``: one call per group, device and dtype, on a plan
        (:attr:`fused_plan`) built from the chains' step plans and kept while they are the
        same."""
        together = defaultdict(list)
        for p in parts:
            together[p.group, p.weights[0].device, p.weights[0].dtype].append(p)
        for key, ps in together.items():
            group = self.param_groups[key[0]]
            plans = [self._stepper(p.chain, p.weights, p.names) for p in ps]
            held = self.__dict__.setdefault("_fused_plans", {}).get(key)
            if held is None or len(held.plans) != len(plans) or any(
                    a is not b for a, b in zip(held.plans, plans)):
                held = self._fused_plans[key] = self.fused_plan(plans)
            sums = [self._sums.take(p, True, False) for p in ps]
            self.fused_functional(
                held, self.state, [(p.weights, p.biases, [w.grad for w in p.weights],
                                    [None if x is None else x.grad for x in p.biases])
                                   for p in ps],
                maximize=bool(group["maximize"]), found_inf=self._found_inf,
                grad_scale=self._grad_scale, sums=sums if all(sums) else None,
                **self._hyper(group))

    # ------------------------------------------------------------------ what parts call
    def _hyper(self, group: dict) -> dict:
        """The chain step's hyperparameters, read from ``group`` (once per chain and step;
        under ``fused``, a tensor ``lr`` is left to the kernels, on the device)."""
        keep = self._fused and isinstance(group.get("lr"), torch.Tensor)
        return {k: group[k] if keep and k == "lr" else hyper_value(group[k], k)
                for k in _hyper_names(self.functional)}

    def _value(self, group: dict, key: str):
        """``group[key]`` as the steps take it (:func:`.hyper.hyper_value`), but a tensor
        ``lr`` under ``fused``: read on the device, not here."""
        if key == "lr" and self._fused and isinstance(group[key], torch.Tensor):
            return group[key]
        return hyper_value(group[key], key)

    def _chain_state(self, state, W, b, fixed, hyper: dict):
        """The chain's optimizer state, gathered from ``state`` (``None``: it keeps none)."""
        return None

    def _chain_step(self, chain, tensors, *, fixed, state, hyper, plan, sums) -> bool:
        """One step of a chain: its state gathered, then the algorithm's chain step."""
        W, b = tensors[:2]
        return self.functional(chain, self._chain_state(state, W, b, fixed, hyper), *tensors,
                               plan=plan, sums=sums, **hyper)

    def _stepper(self, chain, W, names) -> StepPlan | RowShard | None:
        """What steps the chain: its step plan or, when FSDP2 shards it, its
        :class:`RowShard` (which holds the plan of its local rows). Built on the chain's
        first step and kept by the optimizer, not in its state (a shard holds the process
        group); rebuilt when it no longer fits (the model moved to another device or dtype,
        or was sharded anew)."""
        if not self.keeps_plans:
            return None
        held = self.__dict__.setdefault("_steppers", {}).get(id(chain))
        if is_sharded(W[0]):
            rows = row_ranges(W, [f"{n}.weight" for n in names])
            if not (isinstance(held, RowShard) and held.rows == rows):
                held = row_shard(chain, rows, W[0])
        elif not (isinstance(held, StepPlan) and held.fits(chain, W[0])):
            held = step_plan(chain, W, kernels=gsgd_torch_kernels.COMPILED if self.__dict__.get(
                "_compile") else gsgd_torch_kernels.KERNELS)
        self._steppers[id(chain)] = held
        return held

    def _name(self, p: torch.Tensor) -> str:
        name = self._names.get(id(p))  # a lazy parameter has no shape yet
        return f"<{tuple(p.shape)}>" if name is None else name

    def _grad(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """``p.grad`` as the update reads it (never modified): zeros if None, negated to
        maximise."""
        g = torch.zeros_like(p) if p.grad is None else p.grad
        return -g if group.get("maximize") else g

    def _check_finite(self) -> None:
        """``check_finite``: ``ValueError`` naming a parameter of such a group whose
        gradient holds NaN or Inf, before any part steps (one host read per group where
        every gradient is finite; collectives where sharded, so every process raises)."""
        for group in self.param_groups:
            if not group.get("check_finite"):  # the default: nothing read, nothing listed
                continue
            params = [p for p in group["params"] if p.grad is not None]
            if params and not every_finite([p.grad for p in params]):
                bad = next(p for p in params if not all_finite(p.grad))
                raise ValueError(f"non-finite gradient in {self._name(bad)}")

    def _live(self, params) -> list:
        """The parameters with a gradient; none when one of those gradients holds NaN or
        Inf: the part's step is skipped, as a chain's is (numerics guide: never written
        into the weights, nor into a buffer)."""
        params = [p for p in params if p.grad is not None]
        if params and not every_finite([p.grad for p in params]):
            self._count_skip(", ".join(self._name(p) for p in params))
            return []
        return params

    def _rest(self, params, group: dict, state) -> None:
        """The update of ``params`` outside chains (those with a gradient): the family's
        torch update (:meth:`_rest_update`); under ``fused``, torch's fused update, skipped
        on the device for a non-finite gradient (not counted: counting would read the
        device)."""
        if self._fused:
            params = [p for p in params if p.grad is not None]
            if params:
                self._rest_update(params, group, state, self._nonfinite_flag(params),
                                  self._grad_scale)
            return
        params = self._live(params)
        if params:
            self._rest_update(params, group, state)

    @abc.abstractmethod
    def _rest_update(self, params, group: dict, state, found_inf=None,
                     grad_scale=None) -> None:
        """The family's torch update of ``params``: fused, skipped on the device while
        ``found_inf`` is set, where it is given (:mod:`.functional`'s ``sgd``/``adam``)."""

    def _nonfinite_flag(self, params) -> torch.Tensor:
        """The fused step's skip flag of ``params``' gradients: ``GradScaler``'s
        ``found_inf`` where given (it has checked every gradient of the optimizer), else
        the gradients' check on the device (:func:`.functional.nonfinite_flag`), in a
        tensor kept per device."""
        if self._found_inf is not None:
            return self._found_inf
        return F.nonfinite_flag([p.grad for p in params], None,
                                self.__dict__.setdefault("_flags", {}))

    def _count_skip(self, what: str) -> None:
        """Count a part's step skipped for a non-finite gradient; warn the first time."""
        self._skipped += 1
        if self._skipped == 1:
            warn_user(
                f"{self.algorithm}: a gradient of {what} holds NaN or Inf, so the step was "
                "skipped (weights and momentum unchanged); later skips are counted in "
                "describe() without a warning", SkippedStepWarning)


class _SGDRules(ScaleInvariantOptimizer):
    """The SGD family: ``torch.optim.SGD``'s hyperparameters and checks, its update of the
    parameters outside chains, and PSI-SGD(M) on normalised weights."""

    _validate = staticmethod(check_sgd_group)

    fused_rest = True

    def _rest_update(self, params, group: dict, state, found_inf=None,
                     grad_scale=None) -> None:
        """``torch.optim.SGD``'s update of ``params``."""
        F.sgd(params, state, group, found_inf, grad_scale)

    def _psi_plan(self, part, weights):
        """The PSI step's plan of a part of normalised weights: fused
        (:class:`~gsgd_backends.fused_psi.FusedPSIPlan`, rebuilt when the stepped weights'
        shapes, device or dtype change) or compiled (``compile=True``), built on its first
        step and kept by the optimizer beside the chains' step plans; else ``None``."""
        held = self.__dict__.setdefault("_steppers", {})
        if self._fused:
            plan = held.get(id(part))
            if plan is None or plan.shapes != tuple(tuple(w.shape) for w in weights) or (
                    plan.device, plan.dtype) != (weights[0].device, weights[0].dtype):
                from gsgd_backends.fused_psi import FusedPSIPlan
                plan = held[id(part)] = FusedPSIPlan(weights)
            return plan
        if not self.__dict__.get("_compile"):
            return None
        if id(part) not in held:
            held[id(part)] = PSIPlan()
        return held[id(part)]


class GSGD(_SGDRules):
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
        Each chain's step (its node-vector work, then every layer's update with its special
        edges, momentum and weight decay included) runs as one ``torch.compile`` graph
        specialised to the model's shapes, read once after it (a step in which skeleton
        products leave the range where reciprocals are exact writes nothing there and is
        taken by two graphs instead), and PSI-SGD(M)'s step of the normalised weights as
        compiled row loops (:class:`gsgd_backends.psi.PSIPlan`). The first step compiles for
        some seconds. Off by default.
    max_norm : float
        With ``bn="psi"``, a PSI weight's row whose norm exceeds it is divided by its norm
        (PSI-SGD's renormalisation, :class:`PSISGD`).
    check_finite : bool
        Raise ``ValueError`` naming the parameter when a gradient has NaN/Inf, before any
        parameter is written (one host read per param group). Off by default: a chain step
        whose gradients are not finite is skipped (a :class:`SkippedStepWarning` the first
        time, a count in ``describe()``), at no more cost than a normal step; so is the step
        of a group's parameters outside chains, and a PSI weight's row keeps its values.
    backward_sums : bool, optional
        Take each chain's column sums ``colsum(W_l * grad_l)`` from the backward pass
        (:mod:`.backward_sums`: hooks on the chain's layers), so that a step reads each
        weight and gradient once. Where the gradients are not exactly the accumulation of
        the backward passes the sums saw (clipped, unscaled, replaced, ...) the step reads
        ``W * grad`` instead, with the same result; ``describe()`` counts both. Given a DDP
        module, the sums are averaged over its processes as DDP averages the gradients
        (one all-reduce of vectors per step, :mod:`.ddp`). Writes through ``.data`` are not
        detected: call ``zero_grad()`` after one. ``None`` (the default): on, except with
        the fused step, where the hooks' own kernels cost a GPU's training step more than
        the read of ``W * grad`` they save (measured: docs/step_overhead_gpu.md); ``False``
        removes their cost from the backward pass.
    fused : bool, optional
        Step every chain of a param group in one fused step of three Triton launches
        (:mod:`gsgd_backends.fused`, DESIGN §14), the normalised weights in one more and the
        other parameters by ``torch.optim.SGD``'s fused update, with nothing read back to
        the host: ``lr`` may be a device tensor, ``GradScaler``'s ``found_inf`` skips the
        step on the device (its ``grad_scale`` read there too: the kernels and torch's
        fused update read the gradients unscaled and leave them so, as torch's fused
        optimizers do), and so does a non-finite gradient (not counted in
        ``describe()``: counting would read the device). ``None`` (the default): on for
        CUDA parameters where Triton imports, off otherwise; ``True`` on CPU parameters
        is refused (``ValueError``) unless the kernels run under Triton's interpreter. A
        chain with a layer or bias without gradient, a frozen bias, FSDP2's shards or
        ``bn="paper"`` steps unfused; ``check_finite`` still reads every gradient.

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
    keeps_plans = True
    functional = staticmethod(F.gsgd)
    fused_functional = staticmethod(F.fused_gsgd)

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 model: nn.Module | None = None, chains=None, skeleton: str = "he",
                 bn: str = "psi", strict: bool = False, example_input=None,
                 check_finite: bool = False, foreach: bool | None = None,
                 max_norm: float = 1e4, compile: bool = False,
                 backward_sums: bool | None = None, fused: bool | None = None) -> None:
        if bn not in ("psi", "sgd", "paper"):
            raise ValueError(f"bn must be 'psi', 'sgd' or 'paper', got {bn!r}")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
                        check_finite=check_finite, foreach=foreach, max_norm=max_norm)
        self._compile = bool(compile)
        super().__init__(params, defaults, model=model, chains=chains, find_chains=True,
                         find_normalised=(bn == "psi"), through_bn=(bn == "paper"),
                         skeleton=skeleton, strict=strict, backward_sums=backward_sums,
                         fused=fused)
        self._check_chains(params, model, example_input)

    def _chain_state(self, state, W, b, fixed, hyper: dict):
        return F.momentum_state(state, W, b, fixed) if hyper["momentum"] != 0 else None


class PSISGD(_SGDRules):
    """PSI-SGD / PSI-SGDM (Yi et al., Algorithm 1) for a model with normalisation layers.

    Weights of Linear/Conv layers directly followed by batch, group or layer norm get
    ``u <- momentum*u + ||w_i||^2 g_i; w_i <- w_i - lr*u`` per row (rows with norm above
    ``max_norm`` renormalised); every other parameter gets ``torch.optim.SGD``'s update with
    the same ``lr``, ``momentum`` and ``weight_decay``. ``compile=True`` runs the normalised
    weights' step as compiled row loops (:class:`gsgd_backends.psi.PSIPlan`); ``fused``
    (:class:`GSGD`'s) steps them in one Triton launch (:mod:`gsgd_backends.fused_psi`) and
    the rest by torch's fused SGD, with no host read.
    """

    algorithm = "PSI-SGD"

    def __init__(self, model: nn.Module, lr: float = 1e-3, momentum: float = 0.0,
                 weight_decay: float = 0.0, *, max_norm: float = 1e4, maximize: bool = False,
                 foreach: bool | None = None, compile: bool = False,
                 fused: bool | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError("PSISGD takes a model: it finds the normalised layers in it")
        self._compile = bool(compile)
        defaults = dict(lr=lr, momentum=momentum, dampening=0.0, weight_decay=weight_decay,
                        nesterov=False, maximize=maximize, check_finite=False,
                        foreach=foreach, max_norm=max_norm)
        super().__init__(model, defaults, chains=None, find_chains=False, find_normalised=True,
                         fused=fused)


class PathSGD(_SGDRules):
    """Path-SGD (Neyshabur et al. 2015), the G-SGD paper's baseline: on every chain
    ``w_e <- w_e - lr * grad_e / gamma_e``; other parameters take plain SGD."""

    algorithm = "Path-SGD"
    reads_skeleton = False  # gamma_e sums over every path: no unit is chosen
    functional = staticmethod(F.path_sgd)

    def __init__(self, params, lr: float = 1e-3, *, model: nn.Module | None = None,
                 chains=None, maximize: bool = False, foreach: bool | None = None) -> None:
        defaults = dict(lr=lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                        maximize=maximize, check_finite=False, foreach=foreach)
        super().__init__(params, defaults, model=model, chains=chains, find_chains=True,
                         find_normalised=False)
