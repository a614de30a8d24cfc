"""Steps of a chain whose layers are sharded by rows across processes (FSDP2's ``Shard(0)``),
in place, with communication of ``O(sum of widths)`` numbers per step.

Each process holds rows ``[r0, r1)`` of every layer: the weights, gradients and buffers of
those output units, and their biases. Beyond its own rows, a step needs (speed guide):

- the column sums ``colsum(W_l * grad_l)`` over all rows: the sum of every process's
  partial sums;
- the special edges (tau and free edges, at most ``n_l + n_{l-1}`` per layer) of the
  weights, gradients and buffers, and the full bias vectors (biases, their gradients and
  buffers): each process writes the entries of its rows into zeros, and the sum over
  processes is the full vector.

All of it travels as one flat vector summed by the caller's ``reduce`` (one all-reduce).
Every process then runs the vector stage on the same full vectors, so every decision (skip
a non-finite step, hand it back) is the same everywhere, and updates its own rows with the
single-process kernels. A process that cannot step in place says so in the same vector,
and all hand the step back together, before anything is written (no process waits on a
collective that another skipped).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

from gsgd_core import Chain, ElementwiseRule, GSGDState, RuleState
from gsgd_core.arrays import alike, check_list, is_array
from gsgd_core.rules import StepRule

from . import rule_step
from .fast import bulk_stage_, special_vectors
from .plan import StepPlan, signature, special_edges

__all__ = ["RowShard", "sharded_gsgd_update_", "sharded_path_update_"]


class RowShard:
    """Which rows of each layer of ``chain`` this process holds, and how to sum over
    processes: built once per chain and layout by whoever steps (and kept by it), with the
    step plan of its local arrays.

    Parameters
    ----------
    chain : Chain
        The chain whose layers are sharded by rows.
    rows : sequence of (int, int)
        Per layer ``(r0, r1)``, the global rows (output units) held here.
    reduce : callable
        ``reduce(v)`` returns the sum over processes of the 1-D array ``v`` (the same
        length everywhere; an array of the plan's namespace: NumPy for CPU tensors, whose
        plan computes on NumPy views of them); it may write into ``v``.
    """

    def __init__(self, chain: Chain, rows: Sequence[tuple[int, int]],
                 reduce: Callable[[Any], Any]) -> None:
        rows = tuple((int(r0), int(r1)) for r0, r1 in rows)
        if len(rows) != chain.L:
            raise ValueError(f"rows: one (start, stop) per layer ({chain.L}), got {len(rows)}")
        for l, (r0, r1) in enumerate(rows, 1):
            if not 0 <= r0 <= r1 <= chain.sizes[l]:
                raise ValueError(f"layer {l}: rows [{r0}, {r1}) outside its "
                                 f"{chain.sizes[l]} output units")
        self.chain, self.rows, self.reduce = chain, rows, reduce
        self.spec_size, self._local = [], []  # per layer: |spec|; (i0, i1, local indices)
        for l, (r0, r1) in enumerate(rows, 1):
            spec = special_edges(chain, l)
            cols = math.prod(chain.layer_shape(l)[1:])
            i0, i1 = (int(i) for i in np.searchsorted(spec, [r0 * cols, r1 * cols]))
            self.spec_size.append(spec.size)
            self._local.append((i0, i1, spec[i0:i1] - r0 * cols))
        self._kernels = self._plan = self.local = None
        self._checked = (None, False)  # (signature, half precision) of the last valid call

    def plan(self, kernels, array) -> StepPlan:
        """``kernels.plan`` of the chain for local arrays like ``array``, kept while it
        fits them (as the single-process step's); :attr:`local` holds the local special
        edges' indices in its namespace and on its device."""
        if self._kernels is not kernels or not self._plan.fits(self.chain, array):
            plan = kernels.plan(self.chain, array)
            self.local = [(i0, i1, plan.xp.asarray(idx, device=plan.step_device))
                          for i0, i1, idx in self._local]
            self._kernels, self._plan = kernels, plan
        return self._plan

    def shapes(self) -> list[tuple[int, int, int]]:
        """Each layer's local 3-D view ``(r1 - r0, n_{l-1}, k_l)``."""
        return [(r1 - r0,) + self.chain.layer_shape(l)[1:]
                for l, (r0, r1) in enumerate(self.rows, 1)]

    def gather(self, plan: StepPlan, W, G, M, C, *, vectors, refused: bool):
        """The full vectors from every process's local pieces, by one ``reduce``.

        ``W``, ``G``: local 3-D views; ``M``: lists (one per buffer) of local 3-D buffers;
        ``C``: the sum of the local layer-1 gradients, then the local column sums of layers
        ``2..L``; ``vectors``: lists (biases, their gradients and buffers) of local row
        vectors or ``None``; ``refused``: this process cannot step in place. Returns the
        special edges' values of ``W``, ``G`` and each buffer (per layer, in
        ``layers[l].spec`` order), ``C`` summed, the full vectors, and whether any process
        refused."""
        xp, L = plan.xp, self.chain.L
        # (length of the piece, where the local values start in it, the local values)
        parts = [(1, 0, None)]  # the count of processes that refused, set below
        parts += [(c.shape[0] if c.ndim else 1, 0, xp.reshape(c, (-1,))) for c in C]
        for A in [W, G] + list(M):
            parts += [(self.spec_size[l], i0,
                       xp.take(xp.reshape(A[l], (-1,)), idx) if i1 > i0 else None)
                      for l, (i0, i1, idx) in enumerate(self.local)]
        for vec in vectors:
            parts += [(0 if v is None else self.chain.sizes[l], r0, v if r1 > r0 else None)
                      for l, (v, (r0, r1)) in enumerate(zip(vec, self.rows), 1)]
        flat = xp.zeros(sum(n for n, _, _ in parts), dtype=W[0].dtype,
                        device=plan.step_device)
        flat[0] = 1.0 if refused else 0.0
        offsets = np.cumsum([0] + [n for n, _, _ in parts]).tolist()
        for (_, start, values), o in zip(parts, offsets):
            if values is not None:
                flat[o + start:o + start + values.shape[0]] = values
        flat = self.reduce(flat)
        pieces = iter([flat[o:o + n] for (n, _, _), o in zip(parts, offsets)][1:])
        C_full = [xp.reshape(next(pieces), ()) if c.ndim == 0 else next(pieces) for c in C]
        special = [[next(pieces) for _ in range(L)] for _ in range(2 + len(M))]
        full = [[None if v is None else p for v, p in zip(vec, [next(pieces) for _ in vec])]
                for vec in vectors]
        return special[0], special[1], special[2:], C_full, full, bool(flat[0] > 0)

    def put_(self, plan: StepPlan, W, values) -> None:
        """Write each layer's new special-edge ``values`` (full, ``layers`` order) into the
        local rows ``W``."""
        for w, v, (i0, i1, idx) in zip(W, values, self.local):
            if i1 > i0:
                plan.kernels.put_(w, idx, v[i0:i1])

    def put_rows_(self, plan: StepPlan, dst, full) -> None:
        """Write the local rows of each full vector into ``dst`` (``None`` skipped)."""
        for d, f, (r0, r1) in zip(dst, full, self.rows):
            if d is not None and r1 > r0:
                plan.kernels.put_(d, None, f[r0:r1])

    def column_sums(self, plan: StepPlan, W, G) -> list:
        """The sum of the local layer-1 gradients and the local ``colsum(W_l * grad_l)``,
        ``l = 2..L`` by each layer's kernels (zeros for a layer with no local rows)."""
        xp = plan.xp
        C = [plan.layer_kernels[0].total(G[0])]
        for l in range(1, self.chain.L):
            if W[l].shape[0]:
                C.append(plan.layer_kernels[l].colsum(W[l], G[l], plan.scratch))
            else:
                C.append(xp.zeros(self.chain.sizes[l], dtype=W[l].dtype,
                                  device=plan.step_device))
        return C


def _views(kernels, shard: RowShard, arrays, writable: bool = True):
    """Local 3-D views, and whether every one could be made in place."""
    out, ok = [], True
    for a, s in zip(arrays, shard.shapes()):
        v = kernels.view3(a, s, writable)
        if v is None:  # gathered from a copy; the step is then handed back everywhere
            v, ok = kernels.view3(a, s, writable=False), False
        out.append(v)
    return out, ok


def _checked_half(shard: RowShard, weights, grads, biases, bias_grads, buffers=()) -> bool:
    """Check this process's rows as the core checks a chain's arrays, before any is read:
    one entry per layer; weights, their gradients and ``buffers`` (lists of one array per
    layer) holding the layer's local rows, ``r1 - r0`` of ``n_{l-1} k_l`` entries each;
    biases and their gradients ``r1 - r0`` long (a gradient for every bias), and of the
    weights' namespace, real floating dtype and device (``ValueError`` otherwise; buffers of
    half-precision weights are kept in float32). Returns whether the dtype is half
    precision, which the core computes in float32 (numerics guide), not in place. Memoised
    on the arrays' signature in ``shard``, as :meth:`StepPlan.prepared` is: a training loop
    passes the same one."""
    sig = signature([weights, grads, biases, bias_grads, *buffers])
    if sig is not None and shard._checked[0] == sig:
        return shard._checked[1]
    chain = shard.chain
    named = {"weights": weights, "grads": grads, "biases": biases, "bias_grads": bias_grads}
    named = {name: [None] * chain.L if v is None and name.startswith("bias") else
             check_list(chain, name, v) for name, v in named.items()}
    for name, arrays in [*named.items(), *((f"buffers[{i}]", b) for i, b in enumerate(buffers))]:
        bias = name.startswith("bias")
        for l, (a, (r0, r1)) in enumerate(zip(arrays, shard.rows), 1):
            if bias and a is None:
                continue
            if not is_array(a):
                raise ValueError(f"layer {l}: {name}[{l - 1}] is a {type(a).__name__}, not an "
                                 "array")
            n_in = math.prod(chain.layer_shape(l)[1:])
            if (tuple(a.shape) != (r1 - r0,) if bias else a.ndim < 2 or a.shape[0] != r1 - r0
                    or math.prod(a.shape[1:]) != n_in):
                raise ValueError(f"layer {l}: {name}[{l - 1}] has shape {tuple(a.shape)}, but "
                                 f"this process holds its rows [{r0}, {r1})"
                                 + ("" if bias else f" of {n_in} entries"))
    for l, (b, gb) in enumerate(zip(named["biases"], named["bias_grads"]), 1):
        if b is not None and gb is None:
            raise ValueError(f"layer {l}: the layer has a bias but bias_grads[{l - 1}] is None")
    xp, dtype, _ = alike([a for v in named.values() for a in v if a is not None])
    shard._checked = (sig, dtype not in (xp.float32, xp.float64))
    return shard._checked[1]


def sharded_gsgd_update_(kernels, shard: RowShard, state: GSGDState | None, weights, biases,
                         grads, bias_grads, *, lr: float, momentum: float = 0.0,
                         dampening: float = 0.0, nesterov: bool = False,
                         weight_decay: float = 0.0) -> bool:
    """:func:`gsgd_core.gsgd_update` on local rows, in place: ``weights`` etc. are this
    process's rows of each layer (``shard.rows``), ``state``'s buffers too (its step count
    is the caller's); the step runs on ``shard``'s plan of ``kernels``. Returns ``False``,
    with nothing written, on every process alike when the step holds a non-finite value or
    cannot be done in place: the caller then takes it on gathered full arrays."""
    L = shard.chain.L
    if momentum and state is None:
        raise ValueError("momentum needs a state: create one with gsgd_init(chain, weights, "
                         "biases)")
    M = state.momentum if momentum else None
    refused = _checked_half(shard, weights, grads, biases, bias_grads, [] if M is None else [M])
    plan = shard.plan(kernels, weights[0])
    b = list(biases) if biases is not None else [None] * L
    Gb = list(bias_grads) if bias_grads is not None else [None] * L
    Mb = list(state.bias_momentum) if M is not None else [None] * L
    step = None if M is None else [state.step]
    weights, grads, b, Gb, Mb, M, step = plan.mapped([weights, grads, b, Gb, Mb, M, step])
    k, xp = plan.kernels, plan.xp
    with k.context():
        W, ok_w = _views(k, shard, weights)
        G, _ = _views(k, shard, grads, writable=False)
        Ms, ok_m = ([], True) if M is None else _views(k, shard, M)
        ws, gs, ms, C, (b_full, Gb_full, Mb_full), refused = shard.gather(
            plan, W, G, [Ms] if M is not None else [], shard.column_sums(plan, W, G),
            vectors=[b, Gb, Mb], refused=refused or not (ok_w and ok_m))
        if refused:
            return False
        h = None if not (weight_decay or momentum) else StepRule(
            weight_decay or None, momentum or None, dampening, nesterov,
            step[0] == 0 if momentum else None)
        v = special_vectors(k, shard.chain, plan.stack, ws=ws, gs=gs,
                            ms=ms[0] if ms else None, C=C, b=b_full, Gb=Gb_full, lr=float(lr),
                            device=plan.step_device, Mb=Mb_full, h=h)
        if not bool(v.flags[0]):
            return False
        local_F = [None] + [f[r0:r1] for f, (r0, r1) in zip(v.F[1:], shard.rows)]
        local_sq = None if v.squares is None else [
            (u[r0:r1], w) for (u, w), (r0, r1) in zip(v.squares, shard.rows)]
        rows = [None if A is None else
                [xp.reshape(a, (a.shape[0], math.prod(a.shape[1:]))) for a in A]
                for A in (W, G, Ms if M is not None else None)]
        bulk_stage_(plan.layer_kernels, *rows, v=v._replace(F=local_F, squares=local_sq),
                    lr=float(lr), tame=(False,) * L, h=h, scratch=plan.scratch)
        shard.put_(plan, W, v.special)
        shard.put_rows_(plan, b, v.bias)
        if M is not None:
            shard.put_(plan, Ms, v.special_m)
            shard.put_rows_(plan, Mb, v.bias_m)
    return True


def sharded_path_update_(kernels, shard: RowShard, rule: ElementwiseRule, state: RuleState,
                         weights, biases, grads, bias_grads) -> bool:
    """:func:`gsgd_core.path_update` of an elementwise ``rule`` on local rows, in place
    (as :func:`sharded_gsgd_update_`; ``state``'s buffers are local rows, in the rule's
    flat layout: layers, then biases; its count is the caller's)."""
    L, chain = shard.chain.L, shard.chain
    refused = _checked_half(shard, weights, grads, biases, bias_grads,
                    [buf[:L] for buf in state.buffers])
    plan = shard.plan(kernels, weights[0])
    b = list(biases) if biases is not None else [None] * L
    Gb = list(bias_grads) if bias_grads is not None else [None] * L
    weights, grads, b, Gb, count, *buffers = plan.mapped(
        [weights, grads, b, Gb, [state.count], *state.buffers])
    k, xp = plan.kernels, plan.xp
    with k.context():
        W, ok = _views(k, shard, weights)
        G, _ = _views(k, shard, grads, writable=False)
        M = []
        for bufs in buffers:
            views, ok_m = _views(k, shard, bufs[:L])
            M.append(views)
            ok = ok and ok_m
        rest = [iter(bufs[L:]) for bufs in buffers]
        Mb = [[None if x is None else next(r) for x in b] for r in rest]
        ws, gs, ms, C, full, refused = shard.gather(
            plan, W, G, M, shard.column_sums(plan, W, G), vectors=[b, Gb] + Mb,
            refused=refused or not ok)
        if refused:
            return False
        coef = rule.coefficients(xp, count[0], W[0].dtype)
        v = rule_step.rule_vectors(k, chain, plan.stack, rule=rule, coef=coef,
                                   ws=ws, gs=gs, ms=ms, C=C, b=full[0], Gb=full[1],
                                   Mb=full[2:], device=plan.step_device)
        if v is None:
            return False
        for l in range(L, 0, -1):
            r0, r1 = shard.rows[l - 1]
            if r1 > r0:
                w, g, *ms = (a.reshape(a.shape[0], -1) for a in
                             [W[l - 1], G[l - 1]] + [m[l - 1] for m in M])
                plan.layer_kernels[l - 1].rule_bulk_(rule, coef, w, g, ms, F=v.F[l][r0:r1],
                                                     B=v.B[l - 1], rho=v.rho[l - 1])
        shard.put_(plan, W, v.special)
        for j, m in enumerate(M):
            shard.put_(plan, m, [s[j] for s in v.special_m])
        shard.put_rows_(plan, b, v.bias)
        for dst, new in zip(Mb, v.bias_m):
            shard.put_rows_(plan, dst, new)
    return True
