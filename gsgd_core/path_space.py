"""Any update rule in path space: ICR, the rule, weight allocation (beyond the paper).

:func:`path_update` is G-SGD with its step rule made a parameter: ICR (paper eq. 3) gives
the path gradients ``D``, a :class:`~gsgd_core.path_rules.PathRule` maps ``(D, state, V)``
to a step ``Delta``, and weight allocation (eq. 5–6 with ``lr * D`` replaced by ``Delta``)
writes the weights whose basis-path values are ``V - Delta``, free weights unchanged.
:func:`allocate` is that last sweep alone.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from .arrays import guard_tree, quiet_fp, restore, shaped, unvecs, vecs, view3
from .chain import Chain
from .gsgd import path_step, sweep_inputs
from .path_rules import PathRule
from .rules import finite_or_zero
from .sweeps import allocate3, path_values3

__all__ = ["path_init", "path_update", "allocate"]

Arrays = Sequence[Any]
OptArrays = Sequence[Optional[Any]]


def _flat_paths(p, arrays, bias_arrays):
    """The rule's flat tuple: layer arrays in the weights' shapes, then the biases'."""
    return tuple(shaped(p, arrays)) + tuple(a for a in bias_arrays if a is not None)


def _check_rule(rule) -> None:
    if not isinstance(rule, PathRule):
        raise ValueError(f"rule must have init(values) and update(grads, state, values) "
                         f"(gsgd_core.PathRule), got {type(rule).__name__}")


def path_init(chain: Chain, rule: PathRule, weights: Arrays, biases: OptArrays | None = None):
    """The rule's initial state, ``rule.init(V)`` from the basis-path values of the weights
    (the flat tuple of :mod:`gsgd_core.path_rules`, in the compute dtype)."""
    _check_rule(rule)
    p, W, b, B, F = sweep_inputs(chain, weights, biases)
    V, Vb = path_values3(p.xp, p.meta, W, b, B, F)
    return rule.init(_flat_paths(p, V, Vb))


def path_update(chain: Chain, rule: PathRule, state, weights: Arrays, biases: OptArrays | None,
                grads: Arrays, bias_grads: OptArrays | None = None):
    """One step of ``rule`` in path space; ``V' = V - Delta`` on every basis path.

    ::

        D, V           = ICR (eq. 3), path values          (invariant under rescaling)
        Delta, state'  = rule.update(D, state, V)
        weights'       = allocation of V - Delta (eq. 5–6), free weights kept

    Bias paths take part like every other basis path. With :func:`gsgd_core.sgd_rule` this
    is :func:`gsgd_core.gsgd_update` to rounding; with :func:`gsgd_core.adam_rule` it is
    G-Adam. Numerics (numerics guide) as there: a step whose gradients hold a NaN or Inf is
    skipped (weights, biases and every array of the state unchanged); a path whose
    ``Delta`` is not finite keeps its value (``Delta = 0``), so does an entry whose new
    weight overflows, and a state entry that overflows keeps its old value; a tau path
    ratio ``R = 1 - Delta_tau / V_tau`` of exactly 0 becomes the dtype's epsilon.

    Returns
    -------
    weights, biases, state : new arrays in the inputs' namespace, dtype and shapes.
    """
    with quiet_fp():
        _check_rule(rule)

        def steps(p, ok, D, Db, V, Vb):
            xp = p.xp
            delta, new_state = rule.update(_flat_paths(p, D, Db), state, _flat_paths(p, V, Vb))
            if len(delta) != chain.L + sum(v is not None for v in Vb):
                raise ValueError(f"the rule returned {len(delta)} arrays for "
                                 f"{chain.L + sum(v is not None for v in Vb)} path arrays")
            delta = [finite_or_zero(xp, d) for d in delta]
            rest = iter(delta[chain.L:])
            bias_delta = [None if v is None else next(rest) for v in Vb]
            return (view3(p, chain, delta[:chain.L]), vecs(p, bias_delta, chain.L), 1.0,
                    guard_tree(xp, ok, new_state, state))

        return path_step(chain, weights, biases, grads, bias_grads, steps)


def allocate(chain: Chain, weights: Arrays, biases: OptArrays | None, delta: Arrays,
             bias_delta: OptArrays | None = None):
    """Weight allocation alone (eq. 5–6): the weights whose basis-path values are
    ``V - delta`` (``delta`` in the weights' shapes, ignored at free edges; ``bias_delta``
    per layer with a bias), free weights unchanged. An entry that would not be finite keeps
    its value; a tau path ratio of exactly 0 becomes the dtype's epsilon."""
    with quiet_fp():
        bias_delta = [None] * chain.L if bias_delta is None else bias_delta
        p, W, b, B, F = sweep_inputs(chain, weights, biases, extra=(
            ("delta", delta), ("bias_delta", bias_delta)))
        xp = p.xp
        for l, (d, x, db) in enumerate(zip(delta, b, bias_delta), start=1):
            if d is None:
                raise ValueError(f"layer {l}: delta[{l - 1}] is None; every layer needs one")
            if x is not None and db is None:
                raise ValueError(f"layer {l}: the layer has a bias but bias_delta[{l - 1}] is None")
        V, _ = path_values3(xp, p.meta, W, b, B, F)
        S = [finite_or_zero(xp, d) for d in view3(p, chain, delta)]
        Sb = [None if d is None else finite_or_zero(xp, d)
              for d in vecs(p, bias_delta, chain.L)]
        W_new, b_new = allocate3(xp, chain, p.meta, W=W, b=b, D=S, Db=Sb, V=V, B=B, F=F, lr=1.0,
                                 dtype=p.dtype, device=p.device)
        ok = xp.asarray(True, device=p.device)
        return restore(p, guard_tree(xp, ok, W_new, W)), unvecs(p, guard_tree(xp, ok, b_new, b))
