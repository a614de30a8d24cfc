"""The fast step of an elementwise path-space rule (G-Adam, ...), in place, eager.

The structure of :mod:`.fast`'s G-SGD step with the step rule made a parameter: one column
sum of ``W * grad`` per layer and the backward sweep on gathered special edges give the
path gradients, the rule's step ``Delta`` is taken where each path lives (tau edges and
biases on vectors, every other edge block by block of rows), and weight allocation writes
``W' = (W - Delta / (F_l[b] B_{l-1}[a])) / rho_{l-1}[a]`` and the rule's buffers in the same
pass. The rule must be a :class:`gsgd_core.ElementwiseRule`: ``Delta`` at a path depends on
that path alone, so applying it to a block gives the numbers the core gives to the whole
array. Numerics as :func:`gsgd_core.path_update`; a step holding a non-finite value or that
cannot be done in place is handed back before anything is written.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from gsgd_core import Chain, ElementwiseRule, RuleState
from gsgd_core.rules import (all_finite, finite_or_zero, kept, path_gradient, safe_div,
                             tau_ratio)

from .fast import (as_written, backward_sums, chain_products, gathered, per_column, plan_for,
                   stacked)
from .plan import StepPlan, split

__all__ = ["rule_step_"]

#: Elements per block of a CPU bulk update. A rule's block makes some twenty passes over
#: its temporaries, so blocks stay near L2; each pass is an op whose call costs as much as
#: a few thousand elements' work, so blocks are not much smaller (chosen by timing G-Adam's
#: step on the benchmark's MLPs and CNNs with blocks of 2^15, 2^16 and 2^17 elements).
BLOCK = 1 << 16


def rule_step_(kernels, chain: Chain, rule: ElementwiseRule, state: RuleState, weights, biases,
               grads, bias_grads, *, plan: StepPlan | None = None, column_sums=None,
               gradient_check=None) -> bool:
    """One step of ``rule`` in place through ``kernels`` (or ``plan``, reused across
    steps); ``False`` if the core must take it (nothing written then). ``state``'s buffers
    are updated in place; its count is the caller's. ``column_sums`` and ``gradient_check``
    as for :func:`~gsgd_backends.fast.fast_step_`."""
    if not isinstance(rule, ElementwiseRule) or not isinstance(state, RuleState):
        return False
    plan = plan_for(kernels, chain, weights, plan)
    with plan.kernels.context():
        return _step(plan, rule, state, weights, biases, grads, bias_grads,
                     column_sums, gradient_check)


def _step(plan: StepPlan, rule, state, weights, biases, grads, bias_grads, given,
          gradient_check) -> bool:
    chain, kernels, xp, L = plan.chain, plan.kernels, plan.xp, plan.chain.L
    p = plan.prepared(weights, biases, grads, bias_grads)
    b = list(biases) if biases is not None else [None] * L
    n_paths = L + sum(x is not None for x in b)
    if p.dtype != p.store or any(len(bufs) != n_paths for bufs in state.buffers):
        return False
    if any(m.dtype != p.dtype for bufs in state.buffers for m in bufs):
        return False
    Gb = list(bias_grads) if bias_grads is not None else [None] * L
    weights, grads, b, Gb, counts, given, total, *buffers = plan.mapped(
        [weights, grads, b, Gb, [state.count], given,
         None if gradient_check is None else [gradient_check], *state.buffers])
    W = [kernels.view3(w, s) for w, s in zip(weights, plan.shapes)]
    M = [[kernels.view3(m, s) for m, s in zip(bufs[:L], plan.shapes)] for bufs in buffers]
    if any(a is None for a in W + [m for ms in M for m in ms]):
        return False
    G = [kernels.view3(g, s, writable=False) for g, s in zip(grads, plan.shapes)]
    rest = [iter(bufs[L:]) for bufs in buffers]
    Mb = [[None if x is None else next(r) for x in b] for r in rest]
    spec = plan.stack.spec
    coef = rule.coefficients(xp, counts[0], W[0].dtype)
    C = plan.column_sums(W, G, given, None if total is None else total[0])
    v = rule_vectors(kernels, chain, plan.stack, rule=rule, coef=coef,
                     ws=gathered(xp, W, spec), gs=gathered(xp, G, spec),
                     ms=[gathered(xp, m, spec) for m in M], C=C, b=b, Gb=Gb, Mb=Mb,
                     device=plan.step_device)
    if v is None:
        return False
    # The bulk sees each layer as (n, p*k) (as fast.py's): a compiled loop then writes its
    # input itself (mutating a view of an input, inductor stages a copy).
    rows = [[a.reshape(a.shape[0], -1) for a in A] for A in (W, G, *M)]
    plan.stage(rule_bulk_stage_)(plan.layer_kernels, rule, coef, rows[0], rows[1], rows[2:],
                                 F=v.F, B=v.B, rho=v.rho)
    for l in range(L):
        kernels.put_(W[l], spec[l], v.special[l])
        for m, new in zip(M, v.special_m[l]):
            kernels.put_(m[l], spec[l], new)
        if b[l] is not None:
            kernels.put_(b[l], None, v.bias[l])
            for m, new in zip(Mb, v.bias_m):
                kernels.put_(m[l], None, new[l])
    return True


class RuleVectors(NamedTuple):
    """What a rule step computes on node vectors: new special edges (per layer) and rule
    buffers there (per layer, a list per buffer), ``rho``, ``B``, ``F``, and new biases and
    their buffers (``bias[l]``, ``bias_m[j][l]``; ``None`` for a layer without bias)."""

    special: list
    special_m: list
    rho: list
    B: list
    F: list
    bias: list
    bias_m: list


def rule_vectors(kernels, chain, st, *, rule, coef, ws, gs, ms, C, b, Gb, Mb,
                 device) -> RuleVectors | None:
    """The node-vector part of a rule step from the special edges' values (``ws``, ``gs``,
    ``ms`` at each layer's ``spec``), the column sums ``C`` (layer 1's gradient sum first)
    and the biases ``b``, their gradients and buffers, wherever they were gathered from
    (:mod:`.sharded` sums them over processes), over all layers at once (``st``: the plan's
    :class:`~gsgd_backends.plan.Stack`); ``None`` when a backward sum, a bias gradient or
    layer 1's gradients are not finite (the step's one host synchronisation)."""
    xp, L = kernels.xp, chain.L
    ws, gs, ms = stacked(xp, ws), stacked(xp, gs), [stacked(xp, m) for m in ms]
    one = xp.ones((1,), dtype=ws.dtype, device=device)
    T = backward_sums(kernels, st, ws, gs, C[1:])
    if not bool(all_finite(xp, [T] + Gb) & xp.isfinite(C[0])):
        return None
    B, F = chain_products(xp, st, ws, one)
    special, special_m, rho = rule_special(xp, st, ws, gs, ms, rule=rule, coef=coef, T=T, B=B,
                                           F=F, one=one)
    high = [n - st.nodes[1] for n in st.nodes[1:]]
    B, F, rho = split(B, st.nodes[:-1]) + [None], [None] + split(F, high), split(rho, st.nodes[:-1])
    bias, bias_m = [None] * L, [[None] * L for _ in Mb]
    for l in range(L):
        if b[l] is not None:
            bias[l], new = rule_bias(xp, rule, coef, b[l], Gb[l], F=F[l + 1],
                                     bufs=[m[l] for m in Mb])
            for j, m in enumerate(new):
                bias_m[j][l] = m
    special_m = [list(m) for m in zip(*[split(m, st.edges) for m in special_m])] or [[]] * L
    return RuleVectors(split(special, st.edges), special_m, rho, B, F, bias, bias_m)


def _apply(xp, rule, coef, D, V, bufs):
    """The rule's step and buffers on some paths; a step that is not finite is 0 (the path
    keeps its value) and a buffer that is not finite keeps its old value (the core's rules)."""
    delta, new = rule.apply(xp, D, V, tuple(bufs), coef)
    return finite_or_zero(xp, delta), [kept(xp, n, o) for n, o in zip(new, bufs)]


def rule_special(xp, st, ws, gs, ms, *, rule, coef, T, B, F, one):
    """New values of the stacked special edges (tau edges moved, free edges kept), of the
    rule's buffers there (a stacked vector per buffer), and ``rho`` at every node of layers
    ``0..L-1`` (:func:`.fast._special` with the rule's step in place of G-SGD's)."""
    eps = float(xp.finfo(ws.dtype).eps)
    zero = xp.zeros_like(ws)  # free edges own no path: D = V = 0 there (icr3)
    _, m_free = _apply(xp, rule, coef, zero, zero, ms)
    w, g = xp.take(ws, st.tau), xp.take(gs, st.tau)
    V = (F[:w.shape[0]] * xp.take(B, st.src)) * w
    D = path_gradient(xp, w * g - T, V, g)
    delta, m_tau = _apply(xp, rule, coef, D, V, [xp.take(a, st.tau) for a in ms])
    R = tau_ratio(xp, safe_div(xp, delta, V), eps)
    rho = xp.take(xp.concat([one, R]), st.rho_from)
    tau_new, rho = as_written(xp, st, w, R, rho, one)
    special = xp.where(st.moved, xp.take(tau_new, st.node), ws)
    return special, [xp.where(st.moved, xp.take(a, st.node), f)
                     for a, f in zip(m_tau, m_free)], rho


def rule_bias(xp, rule, coef, b, Gb, *, F, bufs):
    """``b' = b - Delta / F`` with ``Delta`` the rule's step at ``Db = Gb / F``, ``Vb = b F``."""
    delta, new = _apply(xp, rule, coef, path_gradient(xp, Gb, F, Gb), b * F, bufs)
    return kept(xp, b - safe_div(xp, delta, F), b), new


def rule_bulk_stage_(layer_kernels, rule, coef, W, G, M, *, F, B, rho) -> None:
    """Every layer's bulk by the rule, through its kernels' ``rule_bulk_`` (compiled whole
    by traced kernels: one fused loop per layer reading the weights, gradients and buffers
    once)."""
    for l in range(len(W), 0, -1):  # the column sums ended on the top layers' first rows
        layer_kernels[l - 1].rule_bulk_(rule, coef, W[l - 1], G[l - 1], [m[l - 1] for m in M],
                                        F=F[l], B=B[l - 1], rho=rho[l - 1])


def rule_bulk_(kernels, rule, coef, W, G, M, *, F, B_prev, rho, checked: bool = True) -> None:
    """Every edge of a ``(n, p*k)`` layer by the rule, in blocks of rows, in place: ``D = G/(F
    B)``, ``V = F B W``, the rule's step, ``W' = (W - Delta/(F B))/rho``; the special edges
    are overwritten afterwards. ``checked``: each block is computed without the per-entry
    guards and checked through the sums of ``D``, ``W'`` and the new buffers, each read on
    the host (on a CPU a read costs less than the ops that would stack them): where every
    sum is finite the guards would have changed nothing (a zero ``F B`` or an overflow makes
    ``D``, ``W'`` or a buffer non-finite; ``D`` is checked itself, since a rule may squash
    it), else the block is recomputed by the core's per-entry rules. Unchecked, every block
    takes the per-entry rules (no host read)."""
    xp = kernels.xp
    n, cols = W.shape
    k = cols // B_prev.shape[0]
    rows = kernels.block_rows(W)
    if not kernels.traced and str(getattr(W, "device", "cpu")).startswith("cpu"):
        rows = min(rows, max(1, BLOCK // cols))
    B_cols, rho_cols = per_column(xp, B_prev, k), per_column(xp, rho, k)
    for i in range(0, n, rows):
        sl = slice(i, min(n, i + rows))
        fb = F[sl][:, None] * B_cols[None, :]
        w, g, bufs = W[sl], G[sl], [m[sl] for m in M]
        exact = not checked
        if checked:
            D = g / fb
            delta, new = rule.apply(xp, D, fb * w, tuple(bufs), coef)
            w_new = (w - delta / fb) / rho_cols[None, :]
            exact = not all(math.isfinite(float(xp.sum(a))) for a in (D, w_new, *new))
        if exact:
            delta, new = _apply(xp, rule, coef, path_gradient(xp, g, fb, g), fb * w, bufs)
            w_new = kept(xp, (w - safe_div(xp, delta, fb)) / rho_cols[None, :], w)
        kernels.put_(w, None, w_new)
        for m, a in zip(bufs, new):
            kernels.put_(m, None, a)
