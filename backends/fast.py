"""The fast G-SGD step: bulk formula plus gathers (speed guide), written once for every library.

Only ``O(n_l)`` edges of layer ``l`` are special (tau and free edges), so the step treats the
bulk of each layer with one formula and the special edges as short vectors, gathered once
(they lie one per row, each access a cache miss) and written back once:

- **Column sums** ``colsum_{0,2}(W_l * grad_l)``, ``l = 2..L`` (the one pass over the
  weights before the update; layer 1's is never needed, ``T_0`` is unused).
- **Vector stage** (:func:`vector_stage`): the special edges gathered, the backward sweep
  (``l = L..2``, :func:`backward_sums`)::

      T_{l-1} = colsum_{0,2}(W_l * grad_l) - P_l[free edges] + scatter(T_l[free tau edges])

  (``T_l[b]`` is the sum of ``U = v * dL/dv`` over the basis paths whose tau chain passes
  ``b``), chain products ``B``, ``F``, the tau edges' path ratios ``R`` and ``rho`` (exactly
  :func:`gsgd_core.sweeps.allocate3`'s rules), new biases, and the flags read back in the
  step's one host synchronisation. Every layer's vectors are stacked in one
  (:class:`~gsgd_backends.plan.Stack`): the sweeps along tau chains and free edges are
  gathers and one scatter over precomputed paths, and each rule is applied once.
- **Bulk stage**: every layer in place, then its special edges and bias written back::

      W' = (W - lr * grad / (F_l[b] B_{l-1}[a])**2) / rho_{l-1}[a]

A step runs through a :class:`~gsgd_backends.plan.StepPlan` (built once per chain, device
and dtype by a kernel set, :class:`~gsgd_backends.kernels.Kernels`, and kept by the caller):
the heavy passes (column sum, bulk update) are each layer's kernels, chosen in the plan
(:mod:`.numpy`, :mod:`.torch`, :mod:`.cupy`); traced kernels compile the whole step as one
function (:func:`one_graph_stage_`, :meth:`StepPlan.stage`): the bulk writes the special
edges where :class:`~gsgd_backends.plan.Marks` places them, and the flags are read after
it. Memory traffic is 5 passes over the weights against SGD's 3;
with the column sums and the gradients' check taken from the backward pass (DESIGN §12), 3,
as SGD's.

Numerics (numerics guide) are :mod:`gsgd_core.rules`, the core's own, without a second pass over
the weights: the backward sums see every non-finite gradient (``0 * inf`` is NaN), so a step
that the core would skip or treat specially is handed back to the core before anything is
written. Eager CPU kernels check each chunk of the bulk while it is still in cache and
recompute a chunk holding a non-finite value with the per-entry rules (:func:`plain_rows_`);
device and compiled kernels apply the per-entry rules to every entry (no host read), compiled
ones through :func:`recip_rows` on layers whose node vectors are tame.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, NamedTuple

from array_api_compat import device

from gsgd_core import Chain
from gsgd_core.rules import (StepRule, all_finite, direction, finite_mask, finite_or_zero, kept,
                             path_gradient, safe_div, scaled, scaled_div, tau_ratio,
                             written_ratio)

from .plan import StepPlan, split


def gathered(xp, arrays, spec) -> list:
    """Each layer's special edges: ``arrays[l].flat[spec[l]]`` (new arrays)."""
    return [xp.take(xp.reshape(a, (-1,)), s) for a, s in zip(arrays, spec)]


def recip_square(xp, f):
    """``1 / f**2`` with ``0`` where ``f == 0`` (the core's ``safe_div``: a zero skeleton
    product freezes the path); an underflowing ``f**2`` gives ``inf``, which the bulk kernel
    sees and hands to :func:`exact_rows`."""
    return xp.where(f == 0, 0.0, 1.0 / xp.where(f == 0, 1.0, f * f))


def bulk_factors(xp, F, B_prev, lr):
    """``(1/F**2, -lr/B_prev**2)`` (:func:`recip_square`): the node vectors by which
    :func:`plain_rows_` scales a layer's rows and columns (``-lr`` joins the second, one
    pass fewer over the weights)."""
    return recip_square(xp, F), recip_square(xp, B_prev) * -lr


def plan_for(kernels, chain: Chain, weights, plan: StepPlan | None) -> StepPlan:
    """``plan`` if given (it must fit ``chain`` and the weights), else a new plan of
    ``kernels`` (built for this call only: pass a plan to reuse one)."""
    if plan is None:
        return kernels.plan(chain, weights[0])
    if not plan.fits(chain, weights[0]):
        raise ValueError(f"{plan} does not fit this step: chain {chain}, weights of dtype "
                         f"{weights[0].dtype} on {device(weights[0])}")
    return plan


def fast_step_(kernels, chain: Chain, weights, biases, grads, bias_grads, lr, state=None, *,
               plan: StepPlan | None = None, momentum: float = 0.0, dampening: float = 0.0,
               nesterov: bool = False, weight_decay: float = 0.0, column_sums=None,
               gradient_check=None) -> bool:
    """One G-SGD step in place through ``kernels``; ``False`` if the core must take it.

    ``state`` (a :class:`gsgd_core.GSGDState`, needed with momentum) has its buffers
    updated in place; its step count is the caller's. ``plan`` (:meth:`Kernels.plan` of
    the chain) is reused across steps; without one a plan is built for this call. Returns
    ``False`` before writing anything when the weights or buffers cannot be updated in place
    (not contiguous, half precision) or when a gradient or a backward sum is not finite (the
    core then skips the step or freezes the paths concerned, numerics guide). Otherwise the
    weights, biases and buffers hold :func:`gsgd_core.gsgd_update`'s result (to rounding).
    ``column_sums``: ``colsum(W_l * grad_l)``, ``l = 2..L``, taken from the backward pass,
    and ``gradient_check``, finite only if every weight gradient's entry is
    (:meth:`StepPlan.column_sums`): the step then reads each weight and gradient once.
    """
    plan = plan_for(kernels, chain, weights, plan)
    with plan.kernels.context():
        return _step(plan, weights, biases, grads, bias_grads, lr,
                     state if state is not None and momentum else None,
                     StepRule(float(weight_decay), float(momentum), float(dampening),
                              bool(nesterov), None), column_sums, gradient_check)


def _step(plan: StepPlan, weights, biases, grads, bias_grads, lr, state, hyper,
          given=None, gradient_check=None) -> bool:
    chain, kernels, xp, L = plan.chain, plan.kernels, plan.xp, plan.chain.L
    extra = () if state is None else (("momentum", state.momentum),
                                      ("bias_momentum", state.bias_momentum))
    p = plan.prepared(weights, biases, grads, bias_grads, extra)
    if p.dtype != p.store:
        return False
    M = Mb = step = None
    if state is not None:
        M, Mb, step = state.momentum, state.bias_momentum, state.step
    b = list(biases) if biases is not None else [None] * L
    Gb = list(bias_grads) if bias_grads is not None else [None] * L
    Mb = list(Mb) if Mb is not None else [None] * L
    weights, grads, b, Gb, Mb, M, steps, given, total = plan.mapped(
        [weights, grads, b, Gb, Mb, M, None if M is None else [step], given,
         None if gradient_check is None else [gradient_check]])
    W = [kernels.view3(w, s) for w, s in zip(weights, plan.shapes)]
    M = None if M is None else [kernels.view3(m, s) for m, s in zip(M, plan.shapes)]
    if any(w is None for w in W + (M or [])):
        return False
    G = [kernels.view3(g, s, writable=False) for g, s in zip(grads, plan.shapes)]
    # Layer 1's gradients are checked through their sum (ATen's sum outruns inductor's).
    C = plan.column_sums(W, G, given, None if total is None else total[0])
    wd, mu = hyper.weight_decay, hyper.momentum
    scalar = kernels.scalar
    h = None if not (wd or mu) else StepRule(
        scalar(wd, W[0].dtype, plan.step_device) if wd else None,
        scalar(mu, W[0].dtype, plan.step_device) if mu else None,
        scalar(hyper.dampening, W[0].dtype, plan.step_device), hyper.nesterov,
        steps[0] == 0 if M is not None else None)
    lr = scalar(float(lr), W[0].dtype, plan.step_device)
    if not kernels.one_graph:
        return _two_stages(plan, W, G, M, C, b, Gb, Mb, lr, h)
    # Read after the graph, not between stages: it wrote the step unless a flag is down.
    ok, *tame = plan.stage(one_graph_stage_)(
        kernels, chain, plan.stack, plan.marks, W=_rows(xp, W), G=_rows(xp, G),
        M=_rows(xp, M), C=C, b=b, Gb=Gb, Mb=Mb, lr=lr, device=plan.step_device, h=h).tolist()
    if ok and not all(tame):  # nothing written: layers of extreme scale take the exact rules
        return _two_stages(plan, W, G, M, C, b, Gb, Mb, lr, h)
    return bool(ok)


def _rows(xp, A):
    """Each ``(n, p, k)`` layer of ``A`` as ``(n, p*k)`` (``None`` stays): a compiled loop then
    runs over contiguous columns and writes its input itself (mutating a view of an input,
    inductor stages a copy)."""
    return None if A is None else [xp.reshape(a, (a.shape[0], -1)) for a in A]


def _two_stages(plan: StepPlan, W, G, M, C, b, Gb, Mb, lr, h) -> bool:
    """The step as the vector stage, its flags read, then the bulk stage and the special
    edges and biases written (traced kernels compile each stage whole)."""
    chain, kernels = plan.chain, plan.kernels
    v = plan.stage(vector_stage)(kernels, chain, plan.stack, W=W, G=G, C=C, b=b,
                                 Gb=Gb, lr=lr, device=plan.step_device, M=M, Mb=Mb, h=h)
    flags = v.flags.tolist()  # the step's one host synchronisation
    if not flags[0]:
        return False
    tame = tuple(flags[1:]) or (False,) * chain.L
    plan.stage(bulk_stage_)(plan.layer_kernels, *(_rows(plan.xp, A) for A in (W, G, M)),
                            v=v, lr=lr, tame=tame, h=h,
                            scratch=None if kernels.traced else plan.scratch)
    for l, spec in enumerate(plan.stack.spec):
        kernels.put_(W[l], spec, v.special[l])
        if M is not None:
            kernels.put_(M[l], spec, v.special_m[l])
        for dst, new in ((b[l], v.bias[l]), (Mb[l], v.bias_m[l])):
            if dst is not None:
                kernels.put_(dst, None, new)
    return True


def stacked(xp, parts: list):
    """Per-layer vectors as one (:class:`~gsgd_backends.plan.Stack`'s order)."""
    return parts[0] if len(parts) == 1 else xp.concat(parts)


def backward_sums(kernels, st, ws, gs, C):
    """``T`` of every inner node (``T_1..T_{L-1}`` stacked) from the stacked special edges
    ``ws``, ``gs`` and the column sums ``C[l-2] = colsum(W_l * grad_l)``, ``l = 2..L``: the
    backward sweep above with every node's ``colsum - P[free edge]`` carried down its free
    tau edges at once (``st.carry_from`` to ``st.carry_to``)."""
    xp = kernels.xp
    P = xp.take(ws, st.free) * xp.take(gs, st.free)
    T = stacked(xp, C) - P  # a chain has two layers or more: C is never empty
    if st.carry_from.shape[0]:
        T = kernels.scatter_add(T, st.carry_to, xp.take(T, st.carry_from))
    return T


def chain_products(xp, st, ws, one):
    """``B`` at every node of layers ``0..L-1`` and ``F`` at every node of layers ``1..L``
    (stacked) from the stacked special edges ``ws``: :func:`gsgd_core.sweeps.products_of_edges`
    with each node's factors gathered along its path (``st.b_path``, ``st.f_path``; ``one``
    a 1-vector: the factor past a path's end) and multiplied in the core's order."""
    fb, ff = xp.take(ws, st.tau), xp.take(ws, st.free)
    if st.b_unit is not None:  # in_units: the chain's skeleton scales
        fb, ff = fb / st.b_unit, ff / st.f_unit
    rows, n = len(st.spec) - 1, st.nodes
    B = xp.take(xp.concat([one, fb]), st.b_path)
    F = xp.take(xp.concat([one, ff]), st.f_path)
    return (xp.prod(xp.reshape(B, (rows, n[-2])), axis=0),
            xp.prod(xp.reshape(F, (rows, n[-1] - n[1])), axis=0))


class Vectors(NamedTuple):
    """What the vector stage hands on: node vectors for the bulk, the special edges' and the
    biases' new values (weights and momentum buffers), and the flags."""

    B: list
    F: list
    rho: list
    recips: Any       # per layer (1/F, 1/B, 1/rho) for recip_rows, or None
    squares: Any      # per layer (1/F**2, -lr/B**2 per column) for plain_rows_, or None
    columns: Any      # per layer (B, rho) repeated per column, for rows_by_rules, or None
    special: list
    special_m: Any
    bias: list
    bias_m: list
    flags: Any        # [ok, tame_1..tame_L]


def vector_stage(kernels, chain, st, *, W, G, C, b, Gb, lr, device, M, Mb, h):
    """Everything of the step that lives on node vectors, as one function (compiled whole
    by traced kernels): the special edges gathered (``st``: the plan's
    :class:`~gsgd_backends.plan.Stack`), then :func:`special_vectors`. ``C`` holds the sum
    of layer 1's gradients, then the column sums ``colsum(W_l * grad_l)``, ``l = 2..L``."""
    xp = kernels.xp
    return special_vectors(kernels, chain, st, ws=gathered(xp, W, st.spec),
                           gs=gathered(xp, G, st.spec),
                           ms=None if M is None else gathered(xp, M, st.spec), C=C, b=b, Gb=Gb,
                           lr=lr, device=device, Mb=Mb, h=h)


def special_vectors(kernels, chain, st, *, ws, gs, ms, C, b, Gb, lr, device, Mb,
                    h) -> Vectors:
    """The vector stage from the special edges' values already gathered (``ws``, ``gs``,
    ``ms``: weights, gradients and momentum buffers at each layer's ``spec``), wherever they
    were gathered from (:mod:`.sharded` sums them over processes), over all layers at once
    (``st``: the :class:`~gsgd_backends.plan.Stack`): the backward sums ``T``, chain
    products ``B``, ``F``, new special edges and momentum buffers there, ``rho``, new
    biases, and the flags ``[ok, tame_1..tame_L]``. ``ok``: every backward sum, bias
    gradient and layer-1 gradient is finite; ``tame_l``: layer ``l`` may use
    :func:`recip_rows` (tested for traced kernels on plain steps). A plain step of kernels
    that run the block loops (``kernels.checked``) also gets every layer's
    :func:`bulk_factors` (``squares``), formed on the stacked node vectors: per layer they
    cost more in calls than in arithmetic."""
    xp, L = kernels.xp, chain.L
    ws, gs = stacked(xp, ws), stacked(xp, gs)
    ms = None if ms is None else stacked(xp, ms)
    one = xp.ones((1,), dtype=ws.dtype, device=device)
    T = backward_sums(kernels, st, ws, gs, C[1:])
    B, F = chain_products(xp, st, ws, one)
    special, special_m, rho = _special(xp, st, ws, gs, ms, T=T, B=B, F=F, lr=lr, h=h, one=one)
    # T sums every weight gradient above layer 1 (0 * inf is NaN).
    ok = all_finite(xp, [T] + Gb) & xp.isfinite(C[0])
    high = [n - st.nodes[1] for n in st.nodes[1:]]
    squares = None
    if h is None and kernels.checked:  # the block loops' factors, every layer at once
        u, v = bulk_factors(xp, F, B, lr)
        u, v = split(u, high), split(v, st.nodes[:-1])
        squares = [(u[l - 1], per_column(xp, v[l - 1], chain.layer_shape(l)[2]))
                   for l in range(1, L + 1)]
    B, F, rho = split(B, st.nodes[:-1]) + [None], [None] + split(F, high), split(rho, st.nodes[:-1])
    bias, bias_m = _biases(xp, b, Gb, Mb, F=F, lr=lr, h=h)
    tame, recips, columns = [], None, None
    if h is not None:
        columns = [tuple(per_column(xp, v, chain.layer_shape(l)[2])
                         for v in (B[l - 1], rho[l - 1])) for l in range(1, L + 1)]
    elif kernels.traced:
        tame = [_tame(xp, F[l], True) & _tame(xp, B[l - 1], True) & _tame(xp, rho[l - 1], False)
                for l in range(1, L + 1)]
        recips = [reciprocals(xp, F[l], B[l - 1], rho[l - 1], chain.layer_shape(l)[2])
                  for l in range(1, L + 1)]
    return Vectors(B, F, rho, recips, squares, columns, split(special, st.edges),
                   None if special_m is None else split(special_m, st.edges), bias, bias_m,
                   xp.stack([ok] + tame))


def one_graph_stage_(kernels, chain, st, marks, *, W, G, M, C, b, Gb, Mb, lr, device,
                     h):
    """The whole step of traced kernels as one function, compiled as one graph: the vector
    stage (:func:`vector_stage`), then every layer's bulk with its special edges
    (:func:`marked`), and the biases, each written in place where the step goes through
    (``W``, ``G``, ``M`` as ``(n, p*k)``; else every entry keeps its value). Returns the
    flags ``[ok, tame_1..tame_L]``: the step went through where all are set. A plain step
    takes :func:`recip_rows` on every layer, so a layer that is not tame stops it (the caller
    then takes the two stages, whose bulk gives such a layer the per-entry rules); weight
    decay and momentum take :func:`rows_by_rules` (no ``tame`` flags).

    The node vectors each layer's loop reads (per row and per column) are computed first,
    all at once, into one array (``kernels.realized``): left to the compiler, they would be
    recomputed, gathers and all, for every entry of the layer."""
    xp = kernels.xp
    v = vector_stage(kernels, chain, st, W=W, G=G, C=C, b=b, Gb=Gb, lr=lr, device=device,
                     M=M, Mb=Mb, h=h)
    go = xp.all(v.flags)
    at = [marks.layer(l) for l in range(1, chain.L + 1)]
    parts = [_layer_vectors(xp, v, l, at[l - 1], h) for l in range(1, chain.L + 1)]
    ends = list(itertools.accumulate(x.shape[0] for p in parts for x in p))
    flat = split(kernels.realized(xp.concat([x for p in parts for x in p])), [0] + ends)
    per_layer = [flat[i:i + len(p)] for i, p in zip(
        itertools.accumulate((len(p) for p in parts), initial=0), parts)]
    for l in range(chain.L, 0, -1):  # the column sums ended on the top layers' first rows
        factors, new_at = per_layer[l - 1][:3], per_layer[l - 1][3:]
        if h is None:
            new = recip_rows(xp, W[l - 1], G[l - 1], factors, lr)
        else:
            F, B_cols, rho_cols = factors
            new, new_m = rows_by_rules(xp, W[l - 1], G[l - 1], None if M is None else M[l - 1],
                                       F=F, B_cols=B_cols, rho_cols=rho_cols, lr=lr, rule=h)
        W[l - 1].copy_(xp.where(go, marked(xp, new, *new_at[:2], at[l - 1]), W[l - 1]))
        if M is not None:
            M[l - 1].copy_(xp.where(go, marked(xp, new_m, *new_at[2:], at[l - 1]), M[l - 1]))
    for dst, new in zip(b + Mb, v.bias + v.bias_m):
        if dst is not None:
            dst.copy_(xp.where(go, new, dst))
    return v.flags


def _layer_vectors(xp, v: Vectors, l: int, marks, h) -> tuple:
    """What layer ``l``'s loop in :func:`one_graph_stage_` reads besides its own arrays:
    three factors (:func:`reciprocals`, or ``F`` and ``B``, ``rho`` per column under weight
    decay and momentum), then the new special edges' values at each row's tau edge and at
    each column's free edge (:class:`~gsgd_backends.plan.LayerMarks`), then, with momentum,
    the buffers' there."""
    factors = v.recips[l - 1] if h is None else (v.F[l],) + v.columns[l - 1]
    new = [v.special[l - 1]] + ([] if v.special_m is None else [v.special_m[l - 1]])
    return tuple(factors) + tuple(xp.take(s, at) for s in new
                                  for at in (marks.tau_at, marks.free_at))


def marked(xp, bulk, at_rows, at_cols, marks):
    """A ``(n, p*k)`` layer's new values: ``bulk``, with ``at_cols[c]`` at column ``c``'s free
    edge and ``at_rows[r]`` at row ``r``'s tau edge where that edge is not free
    (``marks``, a :class:`~gsgd_backends.plan.LayerMarks`), as the two stages write them."""
    new = xp.where(marks.col[None, :] == marks.tau_col[:, None], at_rows[:, None], bulk)
    return xp.where(marks.row[:, None] == marks.free_row[None, :], at_cols[None, :], new)


def bulk_stage_(layer_kernels, W, G, M, *, v: Vectors, lr, tame, h, scratch) -> None:
    """Every layer's bulk update through its kernels, ``W``, ``G`` (and ``M``) as
    ``(n, p*k)`` (one compiled stage for traced kernels: the special edges are written
    after it, outside, since a scatter inside would make the compiler stage the layer in a
    copy). A plain step of a tame layer gets its node vectors' reciprocals for
    :func:`recip_rows`; weight decay or momentum take :func:`rows_by_rules`."""
    for l in range(len(W), 0, -1):  # the column sums ended on the top layers' first rows
        if W[l - 1].shape[0] == 0:  # a process that holds no rows of the layer (.sharded)
            continue
        k = layer_kernels[l - 1]
        if h is not None:
            B_cols, rho_cols = v.columns[l - 1]
            k.rows_bulk_(W[l - 1], G[l - 1], None if M is None else M[l - 1], F=v.F[l],
                         B_cols=B_cols, rho_cols=rho_cols, lr=lr, rule=h, scratch=scratch)
        else:
            k.bulk_(W[l - 1], G[l - 1], F=v.F[l], B=v.B[l - 1], rho=v.rho[l - 1], lr=lr,
                    recips=v.recips[l - 1] if tame[l - 1] else None, scratch=scratch,
                    squares=None if v.squares is None else v.squares[l - 1])


def plain_rows_(kernels, W, G, *, F, B_prev, rho, lr, scratch, squares) -> None:
    """The plain bulk update ``W <- (W - lr * G / (F[b] B_prev[a])**2) / rho[a]`` of a
    ``(n, p*k)`` layer in place, over blocks of rows (``kernels.block_rows``) through one
    block-sized scratch buffer: ``(G * v) * u + W`` (``kernels.add_product_``), then
    ``/ rho``, with ``(u, v) = squares``: :func:`bulk_factors`, ``u = 1/F**2`` per row and
    ``v = -lr/B_prev**2`` per column, each a row or a column vector that broadcasts along
    contiguous memory.

    Each block's quotient by ``rho`` is checked before it is written (:func:`_quotient_into_`:
    unchecked only where it cannot overflow); a block whose result is not finite (a zero or
    overflowing skeleton product, or an overflow) is recomputed by the core's per-entry
    rules (:func:`rows_by_rules`). The eager kernels' ``bulk_``."""
    xp, mod = kernels.xp, kernels.mod
    n, m = W.shape
    k = m // B_prev.shape[0]
    u, v = xp.reshape(squares[0], (-1, 1)), squares[1]
    r = per_column(xp, rho, k)
    direct = _divides_finitely(xp, rho)
    rows = kernels.block_rows(W)
    buf = kernels.scratch(scratch, W, rows * m)
    for i in range(0, n, rows):
        j = min(n, i + rows)
        block = buf[:(j - i) * m].reshape((j - i, m))
        mod.multiply(G[i:j], v, out=block)
        kernels.add_product_(block, u[i:j], W[i:j])
        if not _quotient_into_(kernels, W[i:j], block, r, direct):
            W[i:j] = rows_by_rules(xp, W[i:j], G[i:j], None, F=F[i:j],
                                   B_cols=per_column(xp, B_prev, k), rho_cols=r, lr=lr,
                                   rule=None)[0]


def _quotient_into_(kernels, dst, block, rho_cols, direct: bool) -> bool:
    """``dst <- block / rho_cols`` (``rho`` per column) when every quotient is finite;
    ``False``, ``dst`` untouched, otherwise (the block loops then take the core's per-entry
    rules). ``direct`` (:func:`_divides_finitely`): a finite sum of the block's squares
    bounds every entry by ``sqrt(max)``, so the quotient goes into ``dst`` unchecked; else,
    or where that sum is not finite, it is formed in ``block`` and its sum checked. One host
    read, two where the first fails."""
    mod = kernels.mod
    flat = block.reshape(-1)
    if direct and math.isfinite(float(mod.vdot(flat, flat))):
        mod.divide(block, rho_cols, out=dst)
        return True
    mod.divide(block, rho_cols, out=block)
    if not math.isfinite(float(mod.sum(block))):
        return False
    dst[...] = block
    return True


def _divides_finitely(xp, rho) -> bool:
    """Every ``|rho| >= 4 / sqrt(max)`` of its dtype (one host read): a quotient by ``rho``
    of a number whose square is finite is then finite (:func:`plain_rows_`)."""
    return float(xp.min(xp.abs(rho))) >= _least_divisor(xp, rho.dtype)


def _least_divisor(xp, dtype) -> float:
    """``4 / sqrt(max)`` of ``dtype``: :func:`_divides_finitely`'s bound."""
    return 4 / math.sqrt(float(xp.finfo(dtype).max))


def momentum_rows_(kernels, W, G, M, *, F, B_cols, rho_cols, lr, rule, scratch) -> None:
    """:func:`rows_by_rules` over blocks of rows (``kernels.block_rows``), written in place
    by :func:`momentum_block_`, which falls back to the functional rules for a block it
    cannot take (the eager kernels' ``rows_bulk_``)."""
    n = W.shape[0]
    rows = kernels.block_rows(W)
    direct = _divides_finitely(kernels.xp, rho_cols)
    for i in range(0, n, rows):
        sl = slice(i, min(n, i + rows))
        blocks = [None if a is None else a[sl] for a in (W, G, M)]
        if momentum_block_(kernels, *blocks, F=F[sl], B_cols=B_cols, rho_cols=rho_cols, lr=lr,
                           rule=rule, scratch=scratch, direct=direct):
            continue
        w, m = rows_by_rules(kernels.xp, *blocks, F=F[sl], B_cols=B_cols, rho_cols=rho_cols,
                             lr=lr, rule=rule)
        kernels.put_(blocks[0], None, w)
        if M is not None:
            kernels.put_(blocks[2], None, m)


def momentum_block_(kernels, W, G, M, *, F, B_cols, rho_cols, lr, rule, scratch,
                    direct: bool) -> bool:
    """:func:`rows_by_rules` on one ``(r, p*k)`` block through four block-sized scratch
    buffers and no other temporary: the core's operations in its order, so the results are
    bit-identical. Writes ``W`` and ``M`` and returns ``True`` when every new value is
    finite; otherwise writes nothing and returns ``False`` (a zero or overflowing ``F B``,
    or an overflow: the per-entry rules treat those specially).

    Only ``W' = (W - lr * dir / fb) / rho`` is checked (:func:`_quotient_into_`, ``direct``
    as there): a new buffer that is not finite makes ``dir / fb``, and so ``W'``, not
    finite."""
    mod = kernels.mod
    r, m = W.shape
    buf = kernels.scratch(scratch, W, 4 * r * m)
    fb, D, Mn, T = (buf[j * r * m:(j + 1) * r * m].reshape((r, m)) for j in range(4))
    mod.multiply(F[:, None], B_cols[None, :], out=fb)
    mod.divide(G, fb, out=D)
    if rule.weight_decay is not None:  # D + wd * (fb * W)
        mod.multiply(fb, W, out=T)
        mod.add(D, mod.multiply(T, rule.weight_decay, out=T), out=D)
    step_dir = D
    if M is not None:  # M' = D first, else mu M + (1 - dampening) D
        if rule.first:
            Mn[...] = D
        else:
            mod.multiply(M, rule.momentum, out=Mn)
            # (1 - 0) * D is D: the product is skipped, not the rounding changed
            mod.add(Mn, mod.multiply(D, 1.0 - rule.dampening, out=T) if rule.dampening else D,
                    out=Mn)
        step_dir = Mn
        if rule.nesterov:  # D + mu M'
            step_dir = mod.add(D, mod.multiply(Mn, rule.momentum, out=T), out=D)
    # W' = (W - lr * dir / fb) / rho, the step in rules.scaled's order (lr is a number)
    if abs(lr) <= 1:
        mod.divide(mod.multiply(step_dir, lr, out=T), fb, out=T)
    else:
        mod.multiply(mod.divide(step_dir, fb, out=T), lr, out=T)
    mod.subtract(W, T, out=T)
    if not _quotient_into_(kernels, W, T, rho_cols, direct):
        return False
    if M is not None:
        M[...] = Mn
    return True


def _bias(xp, b, Gb, Mb, *, F, lr, h):
    """The core's bias rule: ``b - lr * Db / F`` with ``Db = Gb / F`` (frozen on overflow),
    weight decay and momentum applied to ``Db`` (``Vb = b F``); returns ``b'`` and ``Mb'``."""
    step_dir, Mb_new = direction(xp, path_gradient(xp, Gb, F, Gb), Mb, b * F, h)
    return kept(xp, b - scaled_div(xp, lr, step_dir, F), b), kept(xp, Mb_new, Mb)


def _tame(xp, v, zero_ok: bool):
    """Every entry of ``v`` lies in ``[4 sqrt(tiny), sqrt(max) / 4]`` (or is 0 if
    ``zero_ok``), so products and reciprocals of two such numbers neither overflow nor
    underflow: :func:`recip_rows` then equals :func:`exact_rows` to rounding."""
    fi = xp.finfo(v.dtype)
    a = xp.abs(v)
    inside = (a >= 4 * math.sqrt(fi.smallest_normal)) & (a <= math.sqrt(fi.max) / 4)
    return xp.all((inside | (a == 0)) if zero_ok else inside)


def as_written(xp, st, w, R, rho, one):
    """:func:`gsgd_core.rules.written_ratio` on every tau edge at once: the new tau edges
    ``w R / rho_src`` (``w`` where that would not be finite) and ``rho``, in which such a
    node's ``R`` becomes its source's ``rho``. A pass over the stacked nodes settles one more
    inner layer, so ``L - 1`` passes give the core's layer-by-layer result (the last pass
    reads only settled sources)."""
    for _ in range(len(st.nodes) - 3):  # the inner layers: a tau chain crosses each once
        tau_new, R_w = written_ratio(xp, w, R, xp.take(rho, st.src))
        rho = xp.take(xp.concat([one, R_w]), st.rho_from)
    return tau_new, rho


def _special(xp, st, ws, gs, ms, *, T, B, F, lr, h, one):
    """New values of the stacked special edges (new tau edges, free edges unchanged), of the
    momentum buffers there (``None`` without momentum), and ``rho`` at every node of layers
    ``0..L-1``, by the rules of :func:`gsgd_core.sweeps.allocate3` on every inner node's tau
    edge at once: ``D = (P - T)/V`` (then :func:`gsgd_core.rules.direction`),
    ``R = 1 - lr*D/V`` (``0 -> eps``), tau edge ``W * R / rho_{l-1}``, ``rho_l = R`` or,
    down a free tau edge, its source's (:func:`as_written` where a new tau edge would not
    be finite)."""
    eps = float(xp.finfo(ws.dtype).eps)
    m_free = None
    if ms is not None:  # free edges carry no path: D = 0 there (icr3)
        zero = xp.zeros_like(ms)
        m_free = kept(xp, direction(xp, zero, ms, zero, h)[1], ms)
    w, g = xp.take(ws, st.tau), xp.take(gs, st.tau)
    M = None if ms is None else xp.take(ms, st.tau)
    V = (F[:w.shape[0]] * xp.take(B, st.src)) * w
    step_dir, M_new = direction(xp, path_gradient(xp, w * g - T, V, g), M, V, h)
    R = tau_ratio(xp, scaled_div(xp, lr, step_dir, V), eps)
    rho = xp.take(xp.concat([one, R]), st.rho_from)
    tau_new, rho = as_written(xp, st, w, R, rho, one)
    special = xp.where(st.moved, xp.take(tau_new, st.node), ws)
    if ms is None:
        return special, None, rho
    return special, xp.where(st.moved, xp.take(kept(xp, M_new, M), st.node), m_free), rho


def _biases(xp, b, Gb, Mb, *, F, lr, h):
    """:func:`_bias` of every layer that has a bias, stacked (``F[l]``: layer ``l``'s): the
    new biases and their momentum buffers per layer (``None`` where none)."""
    at = [l for l, bl in enumerate(b) if bl is not None]
    new, new_m = [None] * len(b), [None] * len(b)
    if not at:
        return new, new_m
    b_new, m_new = _bias(xp, stacked(xp, [b[l] for l in at]), stacked(xp, [Gb[l] for l in at]),
                         None if Mb[at[0]] is None else stacked(xp, [Mb[l] for l in at]),
                         F=stacked(xp, [F[l + 1] for l in at]), lr=lr, h=h)
    starts = [0]
    for l in at:
        starts.append(starts[-1] + b[l].shape[0])
    for l, v, m in zip(at, split(b_new, starts), split(m_new, starts) if m_new is not None
                       else [None] * len(at)):
        new[l], new_m[l] = v, m
    return new, new_m


def exact_rows(xp, W, G, *, F, B_prev, rho, lr) -> Any:
    """The plain bulk update of a ``(n, p, k)`` block by the core's per-entry rules
    (:func:`rows_by_rules`), for a block holding an overflow or a layer whose node vectors
    are not tame."""
    n, p, k = W.shape
    new, _ = rows_by_rules(xp, xp.reshape(W, (n, p * k)), xp.reshape(G, (n, p * k)), None, F=F,
                           B_cols=per_column(xp, B_prev, k), rho_cols=per_column(xp, rho, k),
                           lr=lr, rule=None)
    return xp.reshape(new, (n, p, k))


def per_column(xp, v, k: int):
    """A node vector of layer ``l-1`` repeated ``k`` times: one entry per column of the
    layer seen as ``(n, p*k)``."""
    if k == 1:
        return v
    return xp.reshape(xp.broadcast_to(v[:, None], (v.shape[0], k)), (-1,))


def reciprocals(xp, F, B_prev, rho, k: int) -> tuple:
    """``(1/F, 1/B_prev, 1/rho)``, ``0`` for a zero ``F`` or ``B_prev`` (the core's
    ``safe_div``: a frozen path), the last two per column (:func:`per_column`): the node
    vectors that :func:`recip_rows` takes."""
    return (safe_div(xp, 1.0, F), per_column(xp, safe_div(xp, 1.0, B_prev), k),
            per_column(xp, 1.0 / rho, k))


def rows_by_rules(xp, W, G, M, *, F, B_cols, rho_cols, lr, rule) -> tuple:
    """The bulk update by the core's per-entry rules, ``W``, ``G``, ``M`` as ``(n, p*k)``
    with ``B`` and ``rho`` per column: ``D = G/(F B)`` (0 if that overflows: frozen path),
    weight decay and momentum (:func:`gsgd_core.rules.direction`, ``V = F B W``),
    ``W' = (W - lr*direction/(F B))/rho``. Returns ``W'`` and ``M'`` (``None`` without
    momentum); an entry that is not finite keeps its value."""
    fb = F[:, None] * B_cols[None, :]
    step_dir, M_new = direction(xp, path_gradient(xp, G, fb, G), M, fb * W, rule)
    new = (W - scaled_div(xp, lr, step_dir, fb)) / rho_cols[None, :]
    return kept(xp, new, W), kept(xp, M_new, M)


def recip_rows(xp, W, G, recips, lr) -> Any:
    """:func:`exact_rows` with the node vectors' :func:`reciprocals` ``(u, v, r)`` in place
    of divisions per entry (``c = u v = 1/(F B)``: ``D = G c``, ``W' = (W - lr D c) r``),
    for a layer whose vectors are tame (:func:`_tame`): no product of them under- or
    overflows, so the two agree to rounding (at the overflow edge of ``D``, to a unit in the
    last place). ``W`` and ``G`` come as ``(n, p*k)`` and the reciprocals precomputed, so
    that a compiled loop runs over contiguous columns without a division per entry."""
    u, v, r = recips
    c = u[:, None] * v[None, :]
    step = scaled(xp, lr, finite_or_zero(xp, G * c), lambda D: D * c)
    new = (W - step) * r[None, :]
    return xp.where(finite_mask(new), new, W)
