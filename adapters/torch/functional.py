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

With ``fused`` on (:func:`use_fused`: CUDA parameters and Triton), every chain of a group
that can take it steps in one fused call (:func:`fused_gsgd`: three Triton launches, no host
read, :mod:`gsgd_backends.fused`), normalised weights in one (:func:`psi` given a
:class:`~gsgd_backends.fused_psi.FusedPSIPlan`), and the rest by torch's fused SGD, each
skipped on the device while ``found_inf`` (``GradScaler``'s, or a non-finite gradient's) is
set, and reading the gradients unscaled by ``GradScaler``'s ``grad_scale`` where given.
G-Adam's chains step in one fused call too (:func:`fused_gadam`,
:mod:`gsgd_backends.fused_adam`) and the rest by torch's fused Adam.
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

__all__ = ["adam", "fused_gadam", "fused_gsgd", "fused_plan", "gadam", "gsgd",
           "hyperparameters", "momentum_buffer", "momentum_state", "nonfinite_flag", "path_sgd",
           "psi", "row_norm_scaled", "rule_state", "sgd", "use_fused"]

_HALF = (torch.float16, torch.bfloat16)
#: The keyword-only parameters of a chain step that are not hyperparameters.
_NOT_HYPER = ("plan", "sums")


def use_fused(fused: bool | None, params, algorithm: str, available: bool) -> bool:
    """Whether an optimizer of ``params`` takes the fused step: ``fused=None``, for CUDA
    parameters (not FSDP2's) when Triton imports and the algorithm has a fused step;
    ``True`` on CPU tensors only where the kernels run under Triton's interpreter (tests),
    else ``ValueError``, as ``torch.optim`` refuses ``fused=True`` on a device it cannot
    fuse."""
    if fused is False:
        return False
    cuda = all(p.is_cuda for p in params)
    if fused is None:  # not for FSDP2's shards: torch's fused SGD does not take them
        return bool(available and cuda and not any(map(is_sharded, params))
                    and _fused_module() is not None)
    if not available:
        raise ValueError(f"fused=True: the fused {algorithm} step is not available; use "
                         "fused=False")
    module = _fused_module()
    if module is None:
        raise ValueError("fused=True requires Triton (the fused kernels are Triton's), which "
                         "does not import here; use fused=False")
    if not cuda and not module.interpreted():
        raise ValueError("fused=True requires all the params to be CUDA tensors: the fused "
                         "kernels run on CPU tensors only under Triton's interpreter "
                         "(TRITON_INTERPRET=1, for tests); use fused=False")
    return True


def _fused_module():
    """:mod:`gsgd_backends.fused`, imported only here (it imports triton); ``None`` without
    triton."""
    try:
        import gsgd_backends.fused as fused
    except ImportError:
        return None
    return fused


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
    """The chain's step count, kept in its first weight's state (int32, on its device),
    made on its first step only (``setdefault`` would fill a new tensor every step: on a
    GPU a launch per chain)."""
    first = state[W[0]]
    if "step" not in first:
        first["step"] = torch.zeros((), dtype=torch.int32, device=W[0].device)
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


def fused_plan(step_plans):
    """The :class:`~gsgd_backends.fused.FusedPlan` of chains' step plans (one device and
    dtype), which :func:`fused_gsgd` and :func:`fused_gadam` take."""
    from gsgd_backends.fused import FusedPlan

    return FusedPlan(step_plans)


def fused_gsgd(plan, state, chains, *, lr, momentum, dampening, nesterov, weight_decay,
               maximize: bool, sums: list | None, found_inf, grad_scale=None) -> None:
    """One G-SGD(M) step of every chain of ``plan`` (a :class:`gsgd_backends.fused.FusedPlan`)
    in three launches, no host read: ``chains``, their ``(W, b, G, Gb)`` (gradients as
    they are: the kernels negate them to maximise, and ``sums``, the column sums per chain
    or ``None``, with them); states gathered from ``state`` (momentum buffers; with weight
    decay alone, a step count the rule never reads). Skipped on the device while
    ``found_inf`` is set, as a chain with a non-finite gradient is; the gradients read
    unscaled by ``grad_scale`` where given (GradScaler's)."""
    from gsgd_backends.fused import fused_step_

    W, b, G, Gb = (list(x) for x in zip(*chains))
    states = None
    if momentum:
        states = [momentum_state(state, w, x, [False] * len(w)) for w, x in zip(W, b)]
    elif weight_decay:  # a count the kernels keep and weight decay alone never reads: made
        states = plan.cached("_counts", len(W), lambda: [  # once, not once per step
            GSGDState((), (), torch.zeros((), dtype=torch.int32, device=plan.device))
            for _ in W])
    given = {} if sums is None else dict(column_sums=[s["column_sums"] for s in sums],
                                         gradient_check=[s["gradient_check"] for s in sums])
    fused_step_(plan, W, b, G, Gb, _on(lr, plan.device), states, momentum=momentum,
                dampening=dampening, nesterov=nesterov, weight_decay=weight_decay,
                maximize=maximize, found_inf=found_inf, grad_scale=grad_scale, **given)


def fused_gadam(plan, state, chains, *, rule, maximize: bool, sums: list | None,
                found_inf, grad_scale=None) -> None:
    """One step of ``rule`` (G-Adam's, :class:`gsgd_core.AdamRule`) on every chain of
    ``plan`` in three launches, no host read, as :func:`fused_gsgd` (the moments and step
    count gathered from ``state``; ``rule.lr`` may be a one-element tensor, read on the
    device)."""
    from gsgd_backends.fused_adam import fused_adam_step_

    W, b, G, Gb = (list(x) for x in zip(*chains))
    states = [rule_state(state, w, x, [False] * len(w), rule) for w, x in zip(W, b)]
    given = {} if sums is None else dict(column_sums=[s["column_sums"] for s in sums],
                                         gradient_check=[s["gradient_check"] for s in sums])
    fused_adam_step_(plan, W, b, G, Gb, _on(rule.lr, plan.device), states, betas=rule.betas,
                     eps=rule.eps, weight_decay=rule.weight_decay, decoupled=rule.decoupled,
                     amsgrad=rule.amsgrad, maximize=maximize, found_inf=found_inf,
                     grad_scale=grad_scale, **given)


def _on(lr, device):
    """``lr`` as the fused kernels read it: a tensor on the parameters' device (copied
    there without waiting), or a number."""
    return lr.to(device, non_blocking=True) if isinstance(lr, torch.Tensor) else lr


def psi(U, W, G, *, lr, momentum, max_norm, plan, found_inf=None, grad_scale=None) -> None:
    """PSI-SGD(M) (Yi et al., Algorithm 1) per row ``i`` of each weight:
    ``u <- momentum*u + ||w_i||^2 g_i; w_i <- w_i - lr*u``, rows of norm above
    ``max_norm`` renormalised; ``U`` the momentum buffers (``None`` for PSI-SGD, which
    keeps none). ``plan``: a compiled :class:`~gsgd_backends.psi.PSIPlan`, or a fused one
    (one launch, skipped on the device while ``found_inf`` is set, the gradients read
    unscaled by ``grad_scale`` where given)."""
    if type(plan).__name__ == "FusedPSIPlan":
        from gsgd_backends.fused_psi import fused_psi_step_

        state = plan.idle_state() if U is None else PSIState(tuple(U))
        fused_psi_step_(plan, state, W, G, _on(lr, plan.device),
                        momentum=momentum, max_norm=max_norm, found_inf=found_inf,
                        grad_scale=grad_scale)
        return
    if U is None:  # zeros that take no memory stand for the buffers PSI-SGD does not keep
        U = [w.new_zeros(()).expand_as(w) for w in W]
    psi_update_(PSIState(tuple(U)), W, G, lr=lr, momentum=momentum, max_norm=max_norm,
                plan=plan)


# ---------------------------------------------------------------------- the rest: torch's
def nonfinite_flag(grads, found_inf=None, held: dict | None = None) -> torch.Tensor:
    """A one-element float32 tensor on the gradients' device, non-zero where ``found_inf``
    is or a gradient holds NaN or Inf; nothing is read back to the host. ``held`` keeps the
    flag (and the unit scale of torch's check) per device between steps: a step then makes
    no tensor and costs two launches, the flag set from ``found_inf`` (or cleared) and
    torch's multi-tensor check of every gradient."""
    device = grads[0].device
    made = None if held is None else held.get(device)
    if made is None:
        made = (torch.zeros(1, dtype=torch.float32, device=device),
                torch.ones(1, dtype=torch.float32, device=device))
        if held is not None:
            held[device] = made
    flag, one = made
    if found_inf is None:
        flag.zero_()
    else:
        flag.copy_(found_inf.reshape(1))
    with torch.no_grad():  # the check writes the gradients (times one) in place
        torch._amp_foreach_non_finite_check_and_unscale_(list(grads), flag, one)
    return flag


def _torch_lr(lr, params, found_inf):
    """The learning rate as torch's own update takes it: a tensor stays on the device for
    the fused update (``found_inf`` given), as float32, the only dtype torch's fused
    kernels read it in; otherwise a number."""
    if found_inf is None or not isinstance(lr, torch.Tensor):
        return hyper_value(lr, "lr")
    return lr.to(device=params[0].device, dtype=torch.float32)


def sgd(params, state, group: dict, found_inf=None, grad_scale=None) -> None:
    """``torch.optim.SGD``'s update of ``params`` with the group's hyperparameters; given
    ``found_inf`` (:func:`nonfinite_flag`, or GradScaler's), torch's fused update, skipped
    on the device while it is set, which unscales the gradients by ``grad_scale`` in place
    where given."""
    bufs = [state[p].get("momentum_buffer") for p in params]
    how = dict(foreach=group.get("foreach")) if found_inf is None else dict(
        fused=True, found_inf=found_inf, grad_scale=grad_scale)
    torch_sgd(params, [p.grad for p in params], bufs, weight_decay=group["weight_decay"],
              momentum=group["momentum"], lr=_torch_lr(group["lr"], params, found_inf),
              dampening=group["dampening"],
              nesterov=group["nesterov"], maximize=group["maximize"], **how)
    if group["momentum"] != 0:
        for p, buf in zip(params, bufs):
            state[p]["momentum_buffer"] = buf


def adam(params, state, group: dict, decoupled: bool, found_inf=None,
         grad_scale=None) -> None:
    """``torch.optim.Adam``'s (``AdamW``'s: ``decoupled``) update of ``params``; given
    ``found_inf`` (:func:`nonfinite_flag`, or GradScaler's), torch's fused update (its step
    counts on the parameters' device), skipped on the device while it is set, which
    unscales the gradients by ``grad_scale`` in place where given."""
    names = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
    sts = [state[p] for p in params]
    how = dict(foreach=group.get("foreach")) if found_inf is None else dict(
        fused=True, found_inf=found_inf.reshape(()),  # 0-d, as its step counts are
        grad_scale=grad_scale)
    for p, st in zip(params, sts):
        if "step" not in st:
            st["step"] = torch.tensor(0.0, device=None if found_inf is None else p.device)
        for name in names:
            if name not in st:
                st[name] = torch.zeros_like(p)
    torch_adam(params, [p.grad for p in params], [s["exp_avg"] for s in sts],
               [s["exp_avg_sq"] for s in sts],
               [s["max_exp_avg_sq"] for s in sts] if group["amsgrad"] else [],
               [s["step"] for s in sts], decoupled_weight_decay=decoupled,
               amsgrad=group["amsgrad"],
               beta1=hyper_value(group["betas"][0], "betas"),
               beta2=hyper_value(group["betas"][1], "betas"),
               lr=_torch_lr(group["lr"], params, found_inf),
               weight_decay=group["weight_decay"], eps=group["eps"],
               maximize=group["maximize"], **how)
