"""A step plan: everything a chain's fast step reuses, built once and owned by whoever steps.

A :class:`StepPlan` is built by a kernel set (:meth:`gsgd_backends.kernels.Kernels.plan`)
for one chain, device and dtype. It holds the index plan of the special edges
(:class:`LayerPlan`), the core's layer metadata, the kernels each layer's bulk takes (picked
once: this is where a small CPU layer is given NumPy's kernels), the namespace the step
computes in (with the view that maps the caller's arrays into it), the compiled stages, the
validated signature of the last call and the scratch buffers (per thread). Nothing is cached
on the :class:`~gsgd_core.Chain` and nothing is module-global: the torch optimizers keep one
plan per chain, :class:`gsgd_adapters.cupy.GSGD` keeps its own, and a call without a plan
builds a temporary one.
"""

from __future__ import annotations

import threading
from itertools import chain as concat
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from gsgd_core import Chain
from gsgd_core.arrays import Prepared, prepare

__all__ = ["LayerPlan", "Scratch", "Stack", "StepPlan", "layer_plan", "stack_in", "stack_plan"]


class LayerPlan(NamedTuple):
    """Where layer ``l``'s special edges lie, as index arrays of one namespace and device.

    The tau and free edges sit one per row, all over the layer, so each access misses the
    cache: they are gathered once per step (``spec``) and written back once.
    """

    spec: Any         # sorted flat indices of the layer's tau and free edges
    tau: Any          # position in ``spec`` of each node's tau edge (none for l = L)
    free: Any         # position in ``spec`` of each free edge (one per node of l-1)
    node: Any         # per position in ``spec``: the node whose tau edge it is (0 if none)
    moved: Any        # per position in ``spec``: a tau edge that is not free (gets a new value)
    carry_nodes: Any  # nodes of layer l whose tau edge is free (T_l is carried down them)
    carry_src: Any    # their tau sources in layer l-1


def layer_plan(chain: Chain, l: int) -> LayerPlan:
    """Layer ``l``'s :class:`LayerPlan` as NumPy arrays."""
    tau_idx, free_idx = chain.tau_index(l), chain.free_index(l)
    spec = np.union1d(tau_idx, free_idx).astype(np.int64)
    tau, free = np.searchsorted(spec, tau_idx), np.searchsorted(spec, free_idx)
    tau_free = chain.free_masks[l - 1].reshape(-1)[tau_idx]
    node, moved = np.zeros(spec.size, np.int64), np.zeros(spec.size, bool)
    node[tau] = np.arange(tau.size)
    moved[tau[~tau_free]] = True
    carry_nodes = np.flatnonzero(tau_free)
    carry_src = np.asarray(chain.tau[l - 1] if l < chain.L else [], np.int64)[carry_nodes]
    return LayerPlan(spec, tau, free, node, moved, carry_nodes, carry_src)




class Stack(NamedTuple):
    """Every layer's special edges stacked in one vector and every layer's nodes in another,
    with the index plans that take the step's node-vector work over all layers at once.

    Nodes are numbered layer by layer, ``0..L`` (layer ``l`` starts at ``nodes[l]``); the
    *inner* nodes are those of layers ``1..L-1`` (each has a tau edge and a free edge out).
    Chain products, backward sums and path ratios run along tau chains (``B``, ``T``, ``rho``)
    or free edges (``F``): each is a gather over precomputed paths, not a loop over layers.
    """

    spec: tuple       # per layer, the flat indices of its special edges (LayerPlan.spec)
    edges: tuple      # where each layer's special edges start in the stack (and the total)
    nodes: tuple      # where each layer's nodes start, layers 0..L+1
    tau: Any          # per inner node: position of its tau edge in the stack
    free: Any         # per inner node: position of the free edge out of it
    src: Any          # per inner node: its tau source (a node of layers 0..L-2)
    carry_from: Any   # inner-node pairs: T of ``carry_from`` is summed into T of ``carry_to``
    carry_to: Any     # (each free tau edge carries a node's sum one layer down, T_{l-1})
    b_path: Any       # (L-1, nodes[L]) flat: the inner node whose tau edge is row d's factor of
                      # B at each node of layers 0..L-1 (d: layer d+1), as 1 + inner index; 0: 1
    f_path: Any       # (L-1, nodes[L+1]-nodes[1]) flat: likewise the free edges of F at layers
                      # 1..L (d: layer L-1-d, top first as the core multiplies)
    rho_from: Any     # per node of layers 0..L-1: 1 + the inner node whose R is its rho (0: 1)
    node: Any         # per stacked special edge: the inner node whose tau edge it is (0 if none)
    moved: Any        # per stacked special edge: a tau edge that is not free (gets a new value)
    b_unit: Any       # per inner node: the skeleton scale its B factor is divided by (None: 1)
    f_unit: Any       # per inner node: likewise its F factor


def stack_plan(chain: Chain) -> Stack:
    """The :class:`Stack` of ``chain`` as NumPy arrays."""
    L, sizes = chain.L, chain.sizes
    nodes = tuple(int(x) for x in np.cumsum((0,) + tuple(sizes)))
    plans = [layer_plan(chain, l) for l in range(1, L + 1)]
    edges = tuple(int(x) for x in np.cumsum([0] + [p.spec.size for p in plans]))
    hidden, first, inner = range(1, L), nodes[1], nodes[L] - nodes[1]

    def stacked(parts, dtype=np.int64):
        return np.concatenate([np.asarray(p, dtype) for p in parts] + [np.zeros(0, dtype)])

    tau = stacked(edges[l - 1] + plans[l - 1].tau for l in hidden)
    free = stacked(edges[l] + plans[l].free for l in hidden)
    src = stacked(nodes[l - 1] + np.asarray(chain.tau[l - 1], np.int64) for l in hidden)
    up = stacked(nodes[l + 1] + np.asarray(chain.sigma[l - 1], np.int64) for l in hidden)
    layer = stacked(np.full(sizes[l], l) for l in hidden)
    tau_free = stacked((chain.free_masks[l - 1].reshape(-1)[chain.tau_index(l)] for l in hidden),
                       bool)
    b_path = np.zeros((max(L - 1, 0), nodes[L]), np.int64)
    f_path = np.zeros((max(L - 1, 0), nodes[L + 1] - first), np.int64)
    rho_from = np.zeros(nodes[L], np.int64)
    carry = []
    for i in range(inner):
        x, carried = i, True  # down the tau chain: B's factors, rho's ratio, T's carries
        while True:
            b_path[layer[x] - 1, first + i] = 1 + x
            if not rho_from[first + i] and not tau_free[x]:
                rho_from[first + i] = 1 + x
            if src[x] < first:
                break
            carried = carried and tau_free[x]
            if carried:
                carry.append((i, src[x] - first))
            x = src[x] - first
        x = i  # up the free edges: F's factors
        while True:
            f_path[L - 1 - layer[x], i] = 1 + x
            if up[x] >= nodes[L]:
                break
            x = up[x] - first
    node, moved = np.zeros(edges[L], np.int64), np.zeros(edges[L], bool)
    node[tau] = np.arange(inner)
    moved[tau[~tau_free]] = True
    scale = np.asarray(chain.skeleton_scale, float)
    units = (None, None) if np.all(scale == 1) else (scale[layer - 1], scale[layer])
    carry_from, carry_to = (np.asarray([c[k] for c in carry], np.int64) for k in (0, 1))
    return Stack(tuple(p.spec for p in plans), edges, nodes, tau, free, src, carry_from,
                 carry_to, b_path.reshape(-1), f_path.reshape(-1), rho_from, node, moved,
                 *units)


def stack_in(stack: Stack, xp, device, dtype) -> Stack:
    """``stack`` in namespace ``xp`` on ``device`` (the skeleton scales in ``dtype``)."""
    def arr(a, dt=None):
        return None if a is None else xp.asarray(a, dtype=dt, device=device)

    return stack._replace(spec=tuple(arr(a) for a in stack.spec),
                          b_unit=arr(stack.b_unit, dtype), f_unit=arr(stack.f_unit, dtype),
                          **{f: arr(getattr(stack, f)) for f in (
                              "tau", "free", "src", "carry_from", "carry_to", "b_path",
                              "f_path", "rho_from", "node", "moved")})


class Scratch(threading.local):
    """Reused flat buffers, one per (library, dtype, device) and per thread: two threads
    stepping with one plan never write into one buffer."""

    def __init__(self) -> None:
        self.buffers: dict = {}

    def get(self, like, size: int, empty: Callable[[int], Any]):
        """A buffer of at least ``size`` elements like ``like`` (``empty(n)`` makes one)."""
        key = (type(like), like.dtype, getattr(like, "device", None))
        buf = self.buffers.get(key)
        if buf is None or buf.shape[0] < size:
            buf = self.buffers[key] = empty(size)
        return buf


class StepPlan:
    """Everything a fast step of ``chain`` reuses (module docstring).

    Parameters
    ----------
    chain : Chain
    kernels : the kernel set of the step's node-vector work and special edges.
    xp : array-api-compat namespace the step computes in.
    device, dtype : the caller's arrays' (the plan fits only those).
    layer_kernels : per layer, the kernels of its column sum and bulk update.
    view : maps a list of the caller's arrays (``None`` entries stay) to the arrays the
        step computes on (``None``: the arrays themselves).
    step_device, step_dtype : the device and dtype of the arrays the step computes on
        (``None``: the caller's).
    """

    def __init__(self, chain: Chain, kernels, *, xp, device, dtype,
                 layer_kernels: Sequence[Any], view: Callable[[Any], Any] | None = None,
                 step_device=None, step_dtype=None) -> None:
        self.chain, self.kernels, self.xp = chain, kernels, xp
        self.device, self.dtype = device, dtype
        self.step_device = device if step_device is None else step_device
        self.layer_kernels = tuple(layer_kernels)
        self.view = view
        self.stack = stack_in(stack_plan(chain), xp, self.step_device,
                              dtype if step_dtype is None else step_dtype)
        self.shapes = tuple(chain.layer_shape(l) for l in range(1, chain.L + 1))
        self.scratch = Scratch()
        self._stages: dict = {}
        self._signature: tuple | None = None
        self._prepared: Prepared | None = None

    def __repr__(self) -> str:
        return (f"StepPlan({self.chain}, {type(self.kernels).__name__}, device={self.device}, "
                f"dtype={self.dtype})")

    def fits(self, chain: Chain, array) -> bool:
        """Whether this plan steps ``chain`` for arrays like ``array`` (same chain, device
        and dtype)."""
        return (chain == self.chain and array.dtype == self.dtype
                and str(getattr(array, "device", "cpu")) == str(self.device))

    def mapped(self, lists: list) -> list:
        """Each list of the caller's arrays as the step computes on them (:attr:`view`:
        NumPy views of CPU tensors); ``None`` lists and entries stay."""
        if self.view is None:
            return lists
        return [None if v is None else self.view(v) for v in lists]

    def stage(self, fn: Callable) -> Callable:
        """``fn`` as the kernels run it (:meth:`Kernels.compile`), once per plan and
        function."""
        staged = self._stages.get(fn)
        if staged is None:
            staged = self._stages[fn] = self.kernels.compile(fn)
        return staged

    def column_sums(self, W, G) -> list:
        """The sum of layer 1's gradients (it checks them: a non-finite gradient makes it
        non-finite), then ``colsum(W_l * grad_l)``, ``l = 2..L``, by each layer's kernels
        (the pass over the weights before a step's update)."""
        return [self.xp.sum(G[0])] + [self.layer_kernels[l].colsum(W[l], G[l], self.scratch)
                                      for l in range(1, self.chain.L)]

    def prepared(self, weights, biases, grads, bias_grads, extra=()) -> Prepared:
        """:func:`gsgd_core.arrays.prepare` of the call, memoised on the arrays' signature
        (type, shape, dtype and device of each): a training loop passes the same signature
        every step, and validating it anew costs as much as updating a small layer."""
        lists = [weights, biases, grads, bias_grads] + [v for _, v in extra]
        if not all([v is None or isinstance(v, (list, tuple)) for v in lists]):
            return prepare(self.chain, weights, biases, grads=grads, bias_grads=bias_grads,
                           extra=extra)
        sig = [-1 if v is None else len(v) for v in lists] + [
            None if a is None else (type(a), a.shape, a.dtype, getattr(a, "device", None))
            for a in concat.from_iterable([v for v in lists if v is not None])]
        if sig != self._signature:
            self._prepared = prepare(self.chain, weights, biases, grads=grads,
                                     bias_grads=bias_grads, extra=extra)
            self._signature = sig
        return self._prepared
