"""G-SGD: SGD on basis-path values (paper Algorithm 1), functional, with explicit state.

``gsgd_step`` is one plain step; ``gsgd_init``/``gsgd_update`` is the optax-style pair that
adds momentum, dampening, Nesterov and weight decay, all taken in path space so that every
iterate commutes with positive rescaling.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

from .arrays import (NO_GRADS, check_hyper, check_list, is_off, is_real, prepare, quiet_fp,
                     restore, scalar, unvecs, vecs, view3)
from .chain import Chain
from .rules import StepRule, all_finite, direction, guard
from .sweeps import allocate3, chain_products, icr3, path_values3

__all__ = ["GSGDState", "path_values", "icr", "gsgd_step", "gsgd_init", "gsgd_update"]

Arrays = Sequence[Any]
OptArrays = Sequence[Optional[Any]]


class GSGDState(NamedTuple):
    """Momentum state in path space: one buffer per layer (the layer's shape) and per bias.

    ``step`` counts completed updates (0-d integer array); on the first update the buffer
    is set to the path gradient itself, as ``torch.optim.SGD`` does.
    """

    momentum: tuple
    bias_momentum: tuple
    step: Any


def sweep_inputs(chain, weights, biases, grads=NO_GRADS, bias_grads=None, extra=()):
    """What every sweep starts from: the validated call (:func:`.arrays.prepare`), the
    weights as ``(n, p, k)`` views, the biases, and the chain products ``B``, ``F``."""
    p = prepare(chain, weights, biases, grads=grads, bias_grads=bias_grads, extra=extra)
    W = view3(p, chain, weights)
    b = vecs(p, biases, chain.L)
    B, F = chain_products(p.xp, chain, p.meta, W, p.dtype, p.device)
    return p, W, b, B, F


def path_values(chain: Chain, weights: Arrays, biases: OptArrays | None = None):
    """Values of the basis paths, in the layers' own shapes.

    ``V_l = F_l[:, None, None] * W_l * B_{l-1}[None, :, None]`` and ``Vb_l = b_l * F_l``
    (theory page; paper §2.2, ``v_p(w) = prod_e w_e``). Entries at free edges are ``0`` (they
    own no basis path). Invariant under :func:`gsgd_core.rescale` (Theorem 3.3).

    Returns
    -------
    V, Vb : lists with one array (or ``None`` for ``Vb`` of a layer without bias) per layer.
    """
    p, W, b, B, F = sweep_inputs(chain, weights, biases)
    V, Vb = path_values3(p.xp, p.meta, W, b, B, F)
    return restore(p, V), unvecs(p, Vb)


def icr(chain: Chain, weights: Arrays, biases: OptArrays | None, grads: Arrays,
        bias_grads: OptArrays | None = None):
    """Gradients with respect to basis-path values by the inverse chain rule (paper eq. 3).

    Solves ``dL/dw = G^T dL/dv`` (``G[p, e] = v_p / w_e`` for ``e`` on ``p``) by one backward
    sweep; see :func:`gsgd_core.sweeps.icr3`. Returns ``(D, Db)`` in the layers' own shapes,
    ``0`` at free edges.
    """
    with quiet_fp():
        p, W, b, B, F = sweep_inputs(chain, weights, biases, grads, bias_grads)
        G, Gb = view3(p, chain, grads), vecs(p, bias_grads, chain.L)
        D, Db, _, _ = icr3(p.xp, chain, p.meta, W=W, b=b, G=G, Gb=Gb, B=B, F=F, dtype=p.dtype,
                           device=p.device)
        return restore(p, D), unvecs(p, Db)


def gsgd_step(chain: Chain, weights: Arrays, biases: OptArrays | None, grads: Arrays,
              bias_grads: OptArrays | None, lr):
    """One G-SGD step: ``v <- v - lr * dL/dv`` on basis paths (paper eq. 2), free weights kept.

    ICR (eq. 3) gives ``dL/dv``; weight allocation (eq. 5–6) writes the new path values back
    into the weights. Returns new ``(weights, biases)``; the inputs are not modified.
    """
    weights, biases, _ = gsgd_update(chain, None, weights, biases, grads, bias_grads, lr=lr)
    return weights, biases


def gsgd_init(chain: Chain, weights: Arrays, biases: OptArrays | None = None) -> GSGDState:
    """Zero momentum buffers shaped and placed like ``weights`` and ``biases``."""
    p = prepare(chain, weights, biases)
    xp = p.xp
    # zeros_like: each buffer placed as its array is (a sharded array's shards included)
    zeros = tuple(xp.zeros_like(w, dtype=p.store) for w in weights)
    bzeros = tuple(None if b is None else xp.zeros_like(b, dtype=p.store)
                   for b in (biases if biases is not None else [None] * chain.L))
    return GSGDState(zeros, bzeros, xp.asarray(0, dtype=xp.int32, device=p.device))


def check_update_hypers(lr, momentum=0.0, dampening=0.0, nesterov=False,
                        weight_decay=0.0) -> None:
    """``ValueError`` for hyperparameters :func:`gsgd_update` refuses (shared by the
    in-place layer and the adapters, so every entry point refuses the same values)."""
    check_hyper("lr", lr)
    check_hyper("momentum", momentum)
    check_hyper("dampening", dampening, high=1.0)
    check_hyper("weight_decay", weight_decay)
    if nesterov and ((is_real(momentum) and momentum <= 0)
                     or (is_real(dampening) and dampening != 0)):
        raise ValueError("nesterov needs momentum > 0 and dampening = 0, "
                         f"got momentum={momentum!r}, dampening={dampening!r}")


def gsgd_update(chain: Chain, state: GSGDState | None, weights: Arrays,
                biases: OptArrays | None, grads: Arrays, bias_grads: OptArrays | None, *,
                lr, momentum=0.0, dampening=0.0, nesterov: bool = False,
                weight_decay=0.0):
    """One G-SGD step with momentum, dampening, Nesterov and weight decay in path space.

    With ``D = dL/dv`` from ICR (eq. 3) and ``V`` the basis-path values::

        D <- D + weight_decay * V                     (L2 on basis-path values)
        M <- D                          on the first step,
        M <- momentum * M + (1 - dampening) * D       afterwards
        V' = V - lr * (D + momentum * M if nesterov else M)

    (``torch.optim.SGD``'s conventions, taken in path space), then weight allocation (eq. 6)
    writes ``V'`` back with the free weights unchanged. With ``momentum == 0`` this is the
    paper's Algorithm 1 and ``state`` may be ``None``.

    Numerics (numerics guide): a step whose gradients hold a NaN or Inf is skipped whole (weights,
    biases and state come back unchanged); an entry whose update overflows keeps its old
    value; float16/bfloat16 are computed in float32. None of this needs a host round-trip.

    Returns
    -------
    weights, biases, state : new arrays in the inputs' namespace, dtype, device and shapes.
    """
    with quiet_fp():
        check_update_hypers(lr, momentum, dampening, nesterov, weight_decay)
        use_momentum = not is_off(momentum)
        if use_momentum and state is None:
            raise ValueError("momentum needs a state: create one with gsgd_init(chain, weights, "
                             "biases)")
        if use_momentum:
            check_buffers(chain, state)
        extra = () if state is None else (("momentum", state.momentum),
                                          ("bias_momentum", state.bias_momentum))

        def steps(p, ok, D, Db, V, Vb):
            xp, L = p.xp, chain.L
            rule = None
            if use_momentum or not is_off(weight_decay):
                rule = StepRule(None if is_off(weight_decay) else scalar(p, weight_decay),
                                scalar(p, momentum) if use_momentum else None,
                                scalar(p, dampening), nesterov,
                                state.step == 0 if use_momentum else None)
            M_old = view3(p, chain, state.momentum) if use_momentum else [None] * L
            Mb_old = vecs(p, state.bias_momentum, L) if use_momentum else [None] * L
            S, M = zip(*[direction(xp, d, m, v, rule) for d, m, v in zip(D, M_old, V)])
            Sb, Mb = zip(*[direction(xp, d, m, v, rule) for d, m, v in zip(Db, Mb_old, Vb)])
            new_state = state
            if use_momentum:
                new_state = GSGDState(tuple(restore(p, guard(xp, ok, M, M_old))),
                                      tuple(unvecs(p, guard(xp, ok, Mb, Mb_old))),
                                      xp.where(ok, state.step + 1, state.step))
            elif state is not None:
                new_state = state._replace(step=xp.where(ok, state.step + 1, state.step))
            return S, Sb, scalar(p, lr), new_state

        return path_step(chain, weights, biases, grads, bias_grads, steps, extra)


def check_buffers(chain: Chain, state: GSGDState) -> None:
    """``ValueError`` naming the layer where a momentum step's ``state`` lacks a buffer:
    every layer needs one, and every layer with a bias a bias buffer."""
    momentum = check_list(chain, "momentum", state.momentum)
    bias_momentum = check_list(chain, "bias_momentum", state.bias_momentum)
    for l, (m, mb) in enumerate(zip(momentum, bias_momentum), start=1):
        if m is None:
            raise ValueError(f"layer {l}: state.momentum[{l - 1}] is None; a step with "
                             f"momentum needs a buffer per layer (gsgd_init makes them)")
        if chain.bias[l - 1] and mb is None:
            raise ValueError(f"layer {l}: the layer has a bias but state.bias_momentum"
                             f"[{l - 1}] is None (gsgd_init makes every buffer)")


def path_step(chain: Chain, weights: Arrays, biases: OptArrays | None, grads: Arrays,
              bias_grads: OptArrays | None, steps, extra=()):
    """The scaffold of every update in path space: validation, ICR (eq. 3), the caller's
    rule, weight allocation (eq. 5–6) and the skip rule (numerics guide).

    ``steps(p, ok, D, Db, V, Vb)`` gets the validated call ``p``, the 0-d flag ``ok`` (every
    gradient finite) and the path gradients and values as 3-D layer views and bias vectors
    in the compute dtype; it returns ``(S, Sb, lr, state)``: the basis paths move by
    ``-lr * S`` (``V' = V - lr*S``). Where ``ok`` is false, weights and biases come back
    unchanged; ``steps`` guards its own state.
    """
    p, W, b, B, F = sweep_inputs(chain, weights, biases, grads, bias_grads, extra)
    xp = p.xp
    G, Gb = view3(p, chain, grads), vecs(p, bias_grads, chain.L)
    ok = all_finite(xp, G + Gb)
    D, Db, V, Vb = icr3(xp, chain, p.meta, W=W, b=b, G=G, Gb=Gb, B=B, F=F, dtype=p.dtype,
                        device=p.device)
    S, Sb, lr, new_state = steps(p, ok, D, Db, V, Vb)
    W_new, b_new = allocate3(xp, chain, p.meta, W=W, b=b, D=S, Db=Sb, V=V, B=B, F=F, lr=lr,
                             dtype=p.dtype, device=p.device)
    W_new, b_new = guard(xp, ok, W_new, W), guard(xp, ok, b_new, b)
    return restore(p, W_new), unvecs(p, b_new), new_state
