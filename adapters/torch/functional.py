"""Each algorithm's step as a function of tensors and hyperparameters (torch's ``sgd()``).

The optimizers (:mod:`.optim`, :mod:`.adam`) gather a chain's tensors and state, as
torch's ``_init_group`` does (:func:`momentum_state`, :func:`rule_state`), and call one
function per algorithm, whose keyword-only parameters are the group's hyperparameters it
reads (:func:`hyperparameters`):

- :func:`gsgd`: G-SGD(M), ``V' = V - lr * M`` with ``M`` the momentum of the path gradients
  ``D = dL/dv + weight_decay * V`` (:func:`gsgd_core.gsgd_update`);
- :func:`path_sgd`: Path-SGD, ``w_e <- w_e - lr * grad_e / gamma_e``;
- :func:`gadam`: a rule on the path values (:func:`gsgd_core.path_update`, Adam's);
- :func:`psi`: PSI-SGD(M) on normalised weights, row by row.

Each chooses its implementation in one place: the whole-layer update
(:mod:`gsgd_backends.inplace`), or, for a chain FSDP2 shards, the update of the local rows
(:mod:`gsgd_backends.sharded`) with the gathered layers' update as its fallback
(:func:`.fsdp.sharded_step`). :func:`sgd` and :func:`adam` are torch's own rules, for the
parameters outside chains.
"""

from __future__ import annotations

import inspect

import torch
from torch.optim.adam import adam as torch_adam
from torch.optim.sgd import sgd as torch_sgd

from gsgd_backends import gsgd_update_, path_sgd_step_, path_update_, psi_update_
from gsgd_backends.sharded import sharded_gsgd_update_, sharded_path_update_
from gsgd_backends.torch import KERNELS
from gsgd_core import GSGDState, PSIState, RuleState

from .fsdp import is_sharded, sharded_step
from .hyper import hyper_value

__all__ = ["adam", "gadam", "gsgd", "hyperparameters", "momentum_buffer", "momentum_state",
           "path_sgd", "psi", "row_norm_scaled", "rule_state", "sgd"]

_HALF = (torch.float16, torch.bfloat16)
#: The keyword-only parameters of a chain step that are not hyperparameters.
_NOT_HYPER = ("plan", "sums")


def hyperparameters(step) -> tuple[str, ...]:
    """The group keys the chain step ``step`` takes: its keyword-only parameters."""
    return tuple(n for n, p in inspect.signature(step).parameters.items()
                 if p.kind is p.KEYWORD_ONLY and n not in _NOT_HYPER)


# ---------------------------------------------------------------------- state (_init_group)
def momentum_buffer(state: dict, p: torch.Tensor) -> torch.Tensor:
    """``state["momentum_buffer"]``, zeros like ``p`` when missing (allocated only then:
    ``setdefault`` would build a full-size default every step)."""
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(p)
    return state["momentum_buffer"]


def _zeros(p: torch.Tensor) -> torch.Tensor:
    """A buffer for ``p`` in the dtype the core computes it in (float32 for half types)."""
    return torch.zeros_like(p, dtype=torch.float32 if p.dtype in _HALF else p.dtype)


def _buffers(state, W, b, fixed, name: str, zeros) -> tuple[tuple, tuple]:
    """The chain's buffers ``name`` (``zeros(p)`` where missing): one per weight, and one
    per bias (``None`` where a layer has none; scratch for a fixed bias, which never
    moves, kept out of the state)."""
    for p in W + [x for x, f in zip(b, fixed) if x is not None and not f]:
        if name not in state[p]:
            state[p][name] = zeros(p)
    return (tuple(state[w][name] for w in W),
            tuple(None if x is None else zeros(x) if f else state[x][name]
                  for x, f in zip(b, fixed)))


def _step_count(state, W) -> torch.Tensor:
    """The chain's step count, kept in its first weight's state (int32, on its device)."""
    first = state[W[0]]
    first.setdefault("step", torch.zeros((), dtype=torch.int32, device=W[0].device))
    return first["step"]


def momentum_state(state, W, b, fixed) -> GSGDState:
    """The chain's momentum buffers and step count in ``state`` (torch's per-parameter
    state), allocated on its first step."""
    weights, biases = _buffers(state, W, b, fixed, "momentum_buffer", torch.zeros_like)
    return GSGDState(weights, biases, _step_count(state, W))


def rule_state(state, W, b, fixed, rule) -> RuleState:
    """The chain's buffers of ``rule`` (Adam's moments) and step count in ``state``."""
    per_name = [_buffers(state, W, b, fixed, n, _zeros) for n in rule.buffers]
    return RuleState(tuple(w + tuple(x for x in bs if x is not None) for w, bs in per_name),
                     _step_count(state, W))


def row_norm_scaled(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``grad * ||W[j]||`` per output unit ``j``: the BN variant of ICR (paper eq. 30)."""
    norms = torch.linalg.vector_norm(weight.reshape(weight.shape[0], -1), dim=1)
    return grad * norms.reshape((-1,) + (1,) * (grad.ndim - 1))


# ---------------------------------------------------------------------- chain steps
def _sharded_or_whole(arrays, update, local_rows, count, plan, sums: dict) -> bool:
    """``update(arrays)`` with the chain's ``plan`` and column ``sums`` unless FSDP2 shards
    the chain: then ``local_rows`` on the local rows (``None``: none), falling back on
    ``update`` of the gathered layers (no plan: it is the local rows'; no sums); a step
    taken on the local rows adds one to ``count`` (the state's step count, if any)."""
    if not is_sharded(arrays[1][0]):
        return update(arrays, plan=plan, **sums)
    if local_rows is None:
        return sharded_step(arrays, None, update)

    def fast(a):  # eager kernels: a compiled stage is specialised to whole layers
        done = local_rows(a)
        if done and count is not None:
            count.add_(1)
        return done

    return sharded_step(arrays, fast, update)


def gsgd(chain, state: GSGDState | None, W, b, G, Gb, *, lr, momentum, dampening, nesterov,
         weight_decay, plan, sums: dict) -> bool:
    """One G-SGD(M) step of a chain (``state``: ``None`` without momentum); ``sums``: the
    column sums from the backward pass, as :func:`gsgd_backends.gsgd_update_`'s keywords.
    ``False`` when it was skipped for a non-finite gradient."""
    hyper = dict(lr=lr, momentum=momentum, dampening=dampening, nesterov=nesterov,
                 weight_decay=weight_decay)
    return _sharded_or_whole(
        (state, W, b, G, Gb), lambda a, **kw: gsgd_update_(chain, *a, **hyper, **kw),
        lambda a: sharded_gsgd_update_(KERNELS, plan, *a, **hyper),
        None if state is None else state.step, plan, sums)


def gadam(chain, state: RuleState, W, b, G, Gb, *, rule, plan, sums: dict) -> bool:
    """One step of ``rule`` (G-Adam's) on a chain's path values, as :func:`gsgd`."""
    return _sharded_or_whole(
        (state, W, b, G, Gb), lambda a, **kw: path_update_(chain, rule, *a, **kw),
        lambda a: sharded_path_update_(KERNELS, plan, rule, *a), state.count, plan, sums)


def path_sgd(chain, state: None, W, b, G, Gb, *, lr, plan, sums: dict) -> bool:
    """One Path-SGD step of a chain (it keeps no state, no plan and takes no sums). Its
    scales are products along whole paths: under FSDP2 it steps the gathered full layers
    (``O(m)`` communication; it is the paper's baseline)."""
    def update(a, **_):
        path_sgd_step_(chain, *a[1:], lr)
        return True

    return _sharded_or_whole((state, W, b, G, Gb), update, None, None, plan, sums)


def psi(U, W, G, *, lr, momentum, max_norm, plan) -> None:
    """PSI-SGD(M) (Yi et al., Algorithm 1) per row ``i`` of each weight:
    ``u <- momentum*u + ||w_i||^2 g_i; w_i <- w_i - lr*u``, rows of norm above
    ``max_norm`` renormalised; ``U`` the momentum buffers."""
    psi_update_(PSIState(tuple(U)), W, G, lr=lr, momentum=momentum, max_norm=max_norm,
                plan=plan)


# ---------------------------------------------------------------------- the rest: torch's
def sgd(params, state, group: dict) -> None:
    """``torch.optim.SGD``'s update of ``params`` with the group's hyperparameters."""
    bufs = [state[p].get("momentum_buffer") for p in params]
    torch_sgd(params, [p.grad for p in params], bufs, weight_decay=group["weight_decay"],
              momentum=group["momentum"], lr=group["lr"], dampening=group["dampening"],
              nesterov=group["nesterov"], maximize=group["maximize"],
              foreach=group.get("foreach"))
    if group["momentum"] != 0:
        for p, buf in zip(params, bufs):
            state[p]["momentum_buffer"] = buf


def adam(params, state, group: dict, decoupled: bool) -> None:
    """``torch.optim.Adam``'s (``AdamW``'s: ``decoupled``) update of ``params``."""
    names = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
    sts = [state[p] for p in params]
    for p, st in zip(params, sts):
        if "step" not in st:
            st["step"] = torch.tensor(0.0)
        for name in names:
            if name not in st:
                st[name] = torch.zeros_like(p)
    torch_adam(params, [p.grad for p in params], [s["exp_avg"] for s in sts],
               [s["exp_avg_sq"] for s in sts],
               [s["max_exp_avg_sq"] for s in sts] if group["amsgrad"] else [],
               [s["step"] for s in sts], foreach=group.get("foreach"),
               decoupled_weight_decay=decoupled, amsgrad=group["amsgrad"],
               beta1=hyper_value(group["betas"][0], "betas"),
               beta2=hyper_value(group["betas"][1], "betas"), lr=hyper_value(group["lr"], "lr"),
               weight_decay=group["weight_decay"], eps=group["eps"],
               maximize=group["maximize"])
