"""Update rules in path space: SGD(M), Adam, AdamW, or any rule of the user's (beyond the paper).

The inverse chain rule gives the path gradients ``D = dL/dv`` of the basis paths, and they,
like the path values ``V``, are invariant under every positive rescaling (Theorem 3.3). So any
rule that computes a step ``Delta`` from ``D`` and ``V`` alone gives an invariant optimizer
once weight allocation writes the weights whose basis-path values are ``V - Delta``
(:func:`gsgd_core.path_update`). A rule follows the :class:`PathRule` protocol (optax's
``init``/``update`` pair, in path space). Its arrays are one flat tuple per call: the layers'
path arrays in the weights' own shapes, then those of the layers that have a bias
(free edges carry ``D = V = 0``; their entries of ``Delta`` are ignored).

The built-in rules are :class:`ElementwiseRule`\\ s: ``Delta`` at a path depends only on that
path's ``D``, ``V``, per-path buffers and the step count, so a fast path may apply them to
any subset of the paths (the special edges, a block of rows) and get the same numbers.
"""

from __future__ import annotations

import abc
import numbers
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol, Sequence, runtime_checkable

import array_api_compat

from .arrays import check_hyper, creation_device
from .gsgd import check_update_hypers
from .rules import StepRule, direction

__all__ = ["PathRule", "ElementwiseRule", "RuleState", "SGDRule", "AdamRule", "sgd_rule",
           "adam_rule", "adamw_rule"]


# A protocol declares and runs nothing: mutating it (mutmut's "no mutate block") would
# only add members that no rule has.
@runtime_checkable
class PathRule(Protocol):  # pragma: no mutate block
    """A per-path update rule: ``init(V) -> state`` and ``update(D, state, V) -> (Delta,
    state)``, with ``D``, ``V`` and ``Delta`` tuples of arrays (module docstring). The step
    moves each basis path's value from ``V`` to ``V - Delta``. Every array leaf of the state
    is guarded by :func:`gsgd_core.path_update` (kept on a skipped step), so a rule's state
    should hold its counters as arrays."""

    def init(self, values: tuple) -> Any: ...

    def update(self, grads: tuple, state: Any, values: tuple) -> tuple[tuple, Any]: ...


class RuleState(NamedTuple):
    """State of an :class:`ElementwiseRule`: per buffer name (``rule.buffers``) a tuple of
    arrays shaped like the path arrays, and ``count``, the completed steps (0-d int32)."""

    buffers: tuple
    count: Any


class ElementwiseRule(abc.ABC):
    """Base of rules whose step at a path depends on that path alone.

    Subclasses name their per-path ``buffers`` and implement :meth:`coefficients` (the
    step's scalars, from the step count) and :meth:`apply` (one array of paths).
    """

    buffers: ClassVar[tuple[str, ...]] = ()

    @abc.abstractmethod
    def coefficients(self, xp, count, dtype) -> Any:
        """The step's scalars from ``count`` (completed steps, 0-d int array)."""

    @abc.abstractmethod
    def apply(self, xp, D, V, bufs: tuple, coef) -> tuple[Any, tuple]:
        """``(Delta, new buffers)`` of one array of paths; elementwise."""

    def init(self, values: tuple) -> RuleState:
        """Zero buffers shaped and placed like ``values``, ``count = 0``."""
        xp = array_api_compat.array_namespace(*values)
        zeros = tuple(tuple(xp.zeros_like(v) for v in values) for _ in self.buffers)
        return RuleState(zeros, xp.asarray(0, dtype=xp.int32,
                                           device=creation_device(values[0])))

    def update(self, grads: tuple, state: RuleState, values: tuple) -> tuple[tuple, RuleState]:
        """:meth:`apply` on every array, with the coefficients of ``state.count``."""
        if not isinstance(state, RuleState) or len(state.buffers) != len(self.buffers):
            raise ValueError(f"{type(self).__name__} needs the state of its own init(), with "
                             f"buffers {self.buffers}")
        xp = array_api_compat.array_namespace(*grads, *values)
        coef = self.coefficients(xp, state.count, values[0].dtype)
        out = [self.apply(xp, d, v, tuple(b[i] for b in state.buffers), coef)
               for i, (d, v) in enumerate(zip(grads, values))]
        buffers = tuple(tuple(o[1][j] for o in out) for j in range(len(self.buffers)))
        return tuple(o[0] for o in out), RuleState(buffers, state.count + 1)


@dataclass(frozen=True)
class SGDRule(ElementwiseRule):
    """SGD with momentum in path space, ``torch.optim.SGD``'s conventions
    (:func:`gsgd_core.gsgd_update`'s rule): ``D += weight_decay * V``; ``M = D`` on the
    first step, then ``M = momentum*M + (1-dampening)*D``; ``Delta = lr * (D + momentum*M``
    if Nesterov, else ``M)``."""

    lr: Any = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0

    def __post_init__(self):
        for name in ("momentum", "dampening", "weight_decay"):
            _number(name, getattr(self, name))
        check_update_hypers(self.lr, self.momentum, self.dampening, self.nesterov,
                            self.weight_decay)

    @property
    def buffers(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("momentum",) if self.momentum else ()

    def coefficients(self, xp, count, dtype):
        rule = None
        if self.momentum or self.weight_decay:
            rule = StepRule(self.weight_decay or None, self.momentum or None, self.dampening,
                            self.nesterov, count == 0 if self.momentum else None)
        return rule, _lr(xp, self.lr, dtype)

    def apply(self, xp, D, V, bufs, coef):
        rule, lr = coef
        step, M = direction(xp, D, bufs[0] if bufs else None, V, rule)
        return lr * step, (() if M is None else (M,))


class AdamCoefficients(NamedTuple):
    lr: Any
    step_size: Any       # lr / (1 - beta1**t)
    sqrt_bc2: Any        # sqrt(1 - beta2**t)


@dataclass(frozen=True)
class AdamRule(ElementwiseRule):
    """Adam (Kingma & Ba 2015) on basis-path values, ``torch.optim.Adam``'s arithmetic::

        D <- D + weight_decay * V                (L2; not with decoupled)
        m <- beta1*m + (1-beta1)*D
        s <- beta2*s + (1-beta2)*D**2            (s_max <- max(s_max, s))
        Delta = lr/(1-beta1**t) * m / (sqrt(s)/sqrt(1-beta2**t) + eps)
        Delta <- Delta + lr * weight_decay * V   (decoupled: AdamW)

    Every quantity is a path's own, so each step commutes with positive rescaling, exactly.
    """

    lr: Any = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = False
    amsgrad: bool = False

    def __post_init__(self):
        for name in ("eps", "weight_decay"):
            _number(name, getattr(self, name))
        check_hyper("lr", self.lr)
        check_hyper("eps", self.eps)
        check_hyper("weight_decay", self.weight_decay)
        if len(self.betas) != 2:
            raise ValueError(f"betas must be a pair, got {self.betas!r}")
        for i, b in enumerate(self.betas):
            _number(f"betas[{i}]", b)
            check_hyper(f"betas[{i}]", b, high=1.0)
            if b == 1.0:
                raise ValueError(f"betas[{i}] must be in [0, 1), got {b!r}")

    @property
    def buffers(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if self.amsgrad else ())

    def coefficients(self, xp, count, dtype):
        t = xp.astype(count + 1, dtype)
        b1, b2 = self.betas
        lr = _lr(xp, self.lr, dtype)
        return AdamCoefficients(lr, lr / (1.0 - b1 ** t), xp.sqrt(1.0 - b2 ** t))

    def apply(self, xp, D, V, bufs, coef):
        b1, b2 = self.betas
        if self.weight_decay and not self.decoupled:
            D = D + self.weight_decay * V
        m = b1 * bufs[0] + (1.0 - b1) * D
        s = b2 * bufs[1] + (1.0 - b2) * (D * D)
        new = (m, s)
        if self.amsgrad:
            s = xp.maximum(bufs[2], s)
            new = (m, new[1], s)
        delta = coef.step_size * m / (xp.sqrt(s) / coef.sqrt_bc2 + self.eps)
        if self.weight_decay and self.decoupled:
            delta = delta + (coef.lr * self.weight_decay) * V
        return delta, new


def sgd_rule(lr, momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False,
             weight_decay: float = 0.0) -> SGDRule:
    """:class:`SGDRule`: :func:`gsgd_core.path_update` with it is G-SGD (paper Algorithm 1
    with ``momentum = 0``), :func:`gsgd_core.gsgd_update` to rounding."""
    return SGDRule(lr, momentum, dampening, nesterov, weight_decay)


def adam_rule(lr=1e-3, betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8,
              weight_decay: float = 0.0, amsgrad: bool = False) -> AdamRule:
    """G-Adam: :class:`AdamRule` with L2 weight decay on path values."""
    return AdamRule(lr, tuple(betas), eps, weight_decay, False, amsgrad)


def adamw_rule(lr=1e-3, betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8,
               weight_decay: float = 1e-2, amsgrad: bool = False) -> AdamRule:
    """G-AdamW: :class:`AdamRule` with decoupled weight decay on path values
    (``torch.optim.AdamW``'s default ``weight_decay=1e-2``)."""
    return AdamRule(lr, tuple(betas), eps, weight_decay, True, amsgrad)


def _lr(xp, lr, dtype):
    """The learning rate as it combines with arrays of ``dtype`` (a 0-d array is cast)."""
    return float(lr) if isinstance(lr, numbers.Real) else xp.astype(lr, dtype)


def _number(name: str, value) -> None:
    if not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a Python number (only lr may be an array), "
                         f"got {value!r}")
