"""A step plan: everything a chain's fast step reuses, built once and owned by whoever steps.

A :class:`StepPlan` is built by a kernel set (:meth:`gsgd_backends.kernels.Kernels.plan`)
for one chain, device and dtype. It holds the index plan of the special edges and node
vectors of every layer (:class:`Stack`), the kernels each layer's bulk takes (picked
once: this is where a small CPU layer is given NumPy's kernels), the namespace the step
computes in (with the view that maps the caller's arrays into it), the compiled stages, the
validated signature of the last call and the scratch buffers (per thread). Nothing is cached
on the :class:`~gsgd_core.Chain` and nothing is module-global: the torch optimizers keep one
plan per chain, :class:`gsgd_adapters.cupy.GSGD` keeps its own, and a call without a plan
builds a temporary one.
"""

from __future__ import annotations

import functools
import operator
import threading
from itertools import chain as concat
from typing import Any, Callable, NamedTuple, Sequence

import array_api_compat.numpy as np_compat
import numpy as np

from gsgd_core import Chain
from gsgd_core.arrays import Prepared, layer_meta, prepare

__all__ = ["LayerMarks", "Marks", "Scratch", "Stack", "StepPlan", "check_column_sums",
           "marks_dtype", "marks_of", "special_edges", "split", "stack_in", "stack_plan"]


def special_edges(chain: Chain, l: int) -> np.ndarray:
    """The sorted flat indices of layer ``l``'s tau and free edges (into its 3-D view).

    They sit one per row, all over the layer, so each access misses the cache: a step
    gathers them once and writes them back once."""
    meta = layer_meta(chain, np_compat, "cpu")[l - 1]
    return np.union1d(meta.tau_idx, meta.free_idx).astype(np.int64)


def check_column_sums(chain: Chain, sums, dtype, gradient_check=None) -> None:
    """``ValueError`` naming the layer and the shapes unless ``sums`` holds, for each layer
    ``l = 2..L``, a vector of ``chain.sizes[l-1]`` entries (one per input unit) of ``dtype``,
    and ``gradient_check``, if given, is one number of ``dtype``: what a caller hands a step
    (:meth:`StepPlan.column_sums`)."""
    if sums is None:
        raise ValueError("gradient_check is the check of column_sums: pass both")
    if len(sums) != chain.L - 1:
        raise ValueError(f"column_sums: a chain of {chain.L} layers takes {chain.L - 1} "
                         f"vectors (layers 2..{chain.L}), got {len(sums)}")
    for l, s in enumerate(sums, start=2):
        if tuple(s.shape) != (chain.sizes[l - 1],) or s.dtype != dtype:
            raise ValueError(f"column_sums of layer {l}: expected shape "
                             f"({chain.sizes[l - 1]},) and dtype {dtype}, got "
                             f"{tuple(s.shape)} and {s.dtype}")
    if gradient_check is not None and (tuple(gradient_check.shape) != ()
                                     or gradient_check.dtype != dtype):
        raise ValueError(f"gradient_check: expected a 0-d array of dtype {dtype}, got shape "
                         f"{tuple(gradient_check.shape)} and dtype {gradient_check.dtype}")


class Stack(NamedTuple):
    """Every layer's special edges stacked in one vector and every layer's nodes in another,
    with the index plans that take the step's node-vector work over all layers at once.

    Nodes are numbered layer by layer, ``0..L`` (layer ``l`` starts at ``nodes[l]``); the
    *inner* nodes are those of layers ``1..L-1`` (each has a tau edge and a free edge out).
    Chain products, backward sums and path ratios run along tau chains (``B``, ``T``, ``rho``)
    or free edges (``F``): each is a gather over precomputed paths, not a loop over layers.
    """

    spec: tuple       # per layer, the flat indices of its special edges (special_edges)
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
    """The :class:`Stack` of ``chain`` as NumPy arrays (from the core's layer metadata)."""
    L, sizes = chain.L, chain.sizes
    meta = layer_meta(chain, np_compat, "cpu")
    spec = tuple(special_edges(chain, l) for l in range(1, L + 1))
    nodes = tuple(int(x) for x in np.cumsum((0,) + tuple(sizes)))
    edges = tuple(int(x) for x in np.cumsum([0] + [a.size for a in spec]))
    hidden, first, inner = range(1, L), nodes[1], nodes[L] - nodes[1]

    def stacked(parts, dtype=np.int64):
        return np.concatenate([np.asarray(p, dtype) for p in parts] + [np.zeros(0, dtype)])

    tau = stacked(edges[l - 1] + np.searchsorted(spec[l - 1], meta[l - 1].tau_idx)
                  for l in hidden)
    free = stacked(edges[l] + np.searchsorted(spec[l], meta[l].free_idx) for l in hidden)
    src = stacked(nodes[l - 1] + meta[l - 1].tau_src for l in hidden)
    up = stacked(nodes[l + 1] + meta[l].sigma for l in hidden)
    layer = stacked(np.full(sizes[l], l) for l in hidden)
    tau_free = stacked((meta[l - 1].tau_free for l in hidden), bool)
    b_path = np.zeros((L - 1, nodes[L]), np.int64)  # a chain has L >= 2 layers
    f_path = np.zeros((L - 1, nodes[L + 1] - first), np.int64)
    rho_from = np.zeros(nodes[L], np.int64)
    carry = []
    # Every inner node walks down its tau chain (B's factors, the ratio that is its rho, the
    # nodes its T is carried to) and up its free edges (F's factors), all in step.
    start = np.arange(inner)
    x, on, carried = start, np.ones(inner, bool), np.ones(inner, bool)
    for _ in hidden:
        b_path[layer[x[on]] - 1, first + start[on]] = 1 + x[on]
        now = on & (rho_from[first + start] == 0) & ~tau_free[x]
        rho_from[first + start[now]] = 1 + x[now]
        on = on & (src[x] >= first)
        carried = carried & on & tau_free[x]
        x = np.where(on, src[x] - first, 0)
        carry.append((start[carried], x[carried]))
    x, on = start, np.ones(inner, bool)
    for _ in hidden:
        f_path[L - 1 - layer[x[on]], start[on]] = 1 + x[on]
        on = on & (up[x] < nodes[L])
        x = np.where(on, up[x] - first, 0)
    node, moved = np.zeros(edges[L], np.int64), np.zeros(edges[L], bool)
    node[tau] = start
    moved[tau[~tau_free]] = True
    scale = np.asarray(chain.skeleton_scale, float)
    units = (None, None) if np.all(scale == 1) else (scale[layer - 1], scale[layer])
    carry_from, carry_to = (stacked(c[k] for c in carry) for k in (0, 1))
    return Stack(spec, edges, nodes, tau, free, src, carry_from, carry_to, b_path.reshape(-1),
                 f_path.reshape(-1), rho_from, node, moved, *units)


class LayerMarks(NamedTuple):
    """Where a layer's special edges lie, seen as ``(n, p*k)``, for a pass that writes them
    with the bulk (:func:`gsgd_backends.fast.marked`): each row holds at most one tau edge
    (its node's) and each column at most one free edge (out of its source node), so two
    compares of a row's and a column's index against short vectors find them all, with no
    full-size mask and no scatter. Indices are compared as floating-point numbers (exact
    below :func:`marks_dtype`'s bound): a compiled loop compares and selects those 16 to a
    vector, and integers several times slower."""

    row: Any        # per row: its index
    col: Any        # per column: its index
    tau_col: Any    # per row: the column of its tau edge (-1: none, layer L)
    free_row: Any   # per column: the row of its free edge (-1: none, layer 1, other slots)
    tau_at: Any     # per row: that edge's position among the layer's special edges (0: none)
    free_at: Any    # per column: that edge's position among the layer's special edges


class Marks(NamedTuple):
    """Every layer's :class:`LayerMarks` in two arrays (a compiled step takes each array as
    an input, and each input costs it checks on every call): the indices, then the
    positions, layer after layer."""

    index: Any      # row, col, tau_col, free_row of layer 1, then of layer 2, ...
    at: Any         # tau_at, free_at of layer 1, then of layer 2, ...
    shapes: tuple   # per layer, (rows, columns)

    def layer(self, l: int) -> LayerMarks:
        """Layer ``l``'s marks (views)."""
        i = a = 0
        for n, c in self.shapes[:l - 1]:
            i, a = i + 2 * (n + c), a + n + c
        n, c = self.shapes[l - 1]
        return LayerMarks(*split(self.index, [i, i + n, i + n + c, i + 2 * n + c, i + 2 * (n + c)]),
                          *split(self.at, [a, a + n, a + n + c]))


def split(v, starts) -> list:
    """``v`` cut at ``starts`` (the first entry of each part, and the end): views."""
    return [v[a:e] for a, e in zip(starts[:-1], starts[1:])]


def marks_of(chain: Chain, stack: Stack, dtype) -> Marks:
    """The :class:`Marks` of ``chain`` as NumPy arrays (from ``stack``, :func:`stack_plan`'s),
    the indices compared in NumPy's ``dtype``."""
    first, index, at, shapes = stack.nodes[1], [], [], []
    for l in range(1, chain.L + 1):
        n, p, k = chain.layer_shape(l)
        spec, start = stack.spec[l - 1], stack.edges[l - 1]
        tau_at, free_at = np.zeros(n, np.int64), np.zeros(p * k, np.int64)
        tau_col, free_row = np.full(n, -1, np.int64), np.full(p * k, -1, np.int64)
        if l < chain.L:  # the tau edges of layer l's nodes
            tau_at = stack.tau[stack.nodes[l] - first:stack.nodes[l + 1] - first] - start
            tau_col = spec[tau_at] - np.arange(n) * (p * k)
        if l > 1:  # the free edges out of layer l-1's nodes
            on = stack.free[stack.nodes[l - 1] - first:stack.nodes[l] - first] - start
            rows, cols = np.divmod(spec[on], p * k)
            free_row[cols], free_at[cols] = rows, on
        index += [np.arange(n), np.arange(p * k), tau_col, free_row]
        at += [tau_at, free_at]
        shapes.append((n, p * k))
    return Marks(np.concatenate(index).astype(dtype), np.concatenate(at), tuple(shapes))


def marks_dtype(chain: Chain, dtype) -> np.dtype:
    """NumPy's ``dtype`` if it holds every row and column index of ``chain``'s layers
    exactly (below ``2**(mantissa bits + 1)``), else ``float64``."""
    dtype = np.dtype(dtype)
    most = max(max(n, p * k) for n, p, k in map(chain.layer_shape, range(1, chain.L + 1)))
    return dtype if most < 2 ** (np.finfo(dtype).nmant + 1) else np.dtype(np.float64)


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
        # str: a CuPy Device is not hashable (CuPy 14), and equal devices print alike
        key = (type(like), like.dtype, str(getattr(like, "device", None)))
        buf = self.buffers.get(key)
        if buf is None or buf.shape[0] < size:
            buf = self.buffers[key] = empty(size)
        return buf


def signature(lists) -> list | None:
    """What validating a call's lists of arrays depends on: each list's length and each
    entry's type, shape, dtype and device (a training loop passes the same every step);
    ``None`` where an entry of ``lists`` is neither a list, a tuple nor ``None``."""
    if not all([v is None or isinstance(v, (list, tuple)) for v in lists]):
        return None
    return [-1 if v is None else len(v) for v in lists] + [
        None if a is None else (type(a), getattr(a, "shape", None), getattr(a, "dtype", None),
                                getattr(a, "device", None))
        for a in concat.from_iterable([v for v in lists if v is not None])]


class StepPlan:
    """Everything a fast step of ``chain`` reuses (module docstring).

    Parameters
    ----------
    chain : Chain
        The chain the plan steps.
    kernels : Kernels
        The kernel set of the step's node-vector work and special edges.
    xp : namespace
        The array-api-compat namespace the step computes in.
    device
        The caller's arrays' device (the plan fits only those).
    dtype
        The caller's arrays' dtype (the plan fits only those).
    layer_kernels : sequence of LayerKernels
        Per layer, the kernels of its column sum and bulk update.
    view : callable, optional
        Maps a list of the caller's arrays (``None`` entries stay) to the arrays the step
        computes on; ``None``: the arrays themselves.
    step_device : device, optional
        The device of the arrays the step computes on; ``None``: the caller's.
    step_dtype : dtype, optional
        The dtype of the arrays the step computes on; ``None``: the caller's.
    """

    def __init__(self, chain: Chain, kernels, *, xp, device, dtype,
                 layer_kernels: Sequence[Any], view: Callable[[Any], Any] | None = None,
                 step_device=None, step_dtype=None) -> None:
        self.chain, self.kernels, self.xp = chain, kernels, xp
        self.device, self.dtype = device, dtype
        self.step_device = device if step_device is None else step_device
        self.layer_kernels = tuple(layer_kernels)
        self.view = view
        self._host_stack = stack_plan(chain)
        self.stack = stack_in(self._host_stack, xp, self.step_device,
                              dtype if step_dtype is None else step_dtype)
        self._marks: tuple | None = None
        self.shapes = tuple(chain.layer_shape(l) for l in range(1, chain.L + 1))
        self.scratch = Scratch()
        self._stages: dict = {}
        self._signature: tuple | None = None
        self._prepared: Prepared | None = None
        self._hypers: tuple = (None, None)

    def __repr__(self) -> str:
        return (f"StepPlan({self.chain}, {type(self.kernels).__name__}, device={self.device}, "
                f"dtype={self.dtype})")

    @property
    def marks(self) -> Marks:
        """The chain's :class:`Marks` in the step's namespace and device (built on first
        use: only a step that writes the special edges with the bulk reads them)."""
        if self._marks is None:
            host = marks_of(self.chain, self._host_stack,
                            marks_dtype(self.chain, str(self.dtype).removeprefix("torch.")))
            self._marks = host._replace(**{f: self.xp.asarray(getattr(host, f),
                                                              device=self.step_device)
                                           for f in ("index", "at")})
        return self._marks

    def fits(self, chain: Chain, array) -> bool:
        """Whether this plan steps ``chain`` for arrays like ``array`` (same chain, device
        and dtype)."""
        return ((chain is self.chain or chain == self.chain) and array.dtype == self.dtype
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

    def column_sums(self, W, G, given=None, gradient_check=None) -> list:
        """A sum that checks the gradients (a non-finite gradient makes it non-finite), then
        ``colsum(W_l * grad_l)``, ``l = 2..L``, by each layer's kernels: the pass over the
        weights before a step's update, which reads every weight but layer 1's and every
        gradient (layer 1's only through its sum).

        ``given``: those column sums taken elsewhere, from the backward pass (DESIGN §12,
        ``colsum_l[a] = sum over batch and positions of x_l * dL/dx_l``); the step then reads
        no weight before its update, and the check is ``gradient_check`` (a number that is
        finite only if every weight gradient's entry is: a bound on them taken in the
        backward pass) or, without one, the sum of each layer's gradients' sums (one read of
        the gradients)."""
        kernels = self.layer_kernels
        if given is not None:
            if gradient_check is None:
                totals = [k.total(g) for k, g in zip(kernels, G)]
                gradient_check = functools.reduce(operator.add, totals)
            return [gradient_check] + list(given)
        return [kernels[0].total(G[0])] + [
            kernels[l].colsum(W[l], G[l], self.scratch) for l in range(1, self.chain.L)]

    def checked(self, hyper: dict, check: Callable[[dict], Any]) -> Any:
        """``check(hyper)``, memoised on the last hyperparameters' names, types and values
        (a check that raises is not remembered): a training loop passes the same ones step
        after step, and checking them costs as much as a small layer's update."""
        key = (tuple(hyper), tuple(map(type, hyper.values())), tuple(hyper.values()))
        if key[:2] == self._hypers[0] and key[2] == self._hypers[1][0]:
            return self._hypers[1][1]
        result = check(hyper)
        self._hypers = (key[:2], (key[2], result))
        return result

    def prepared(self, weights, biases, grads, bias_grads, extra=()) -> Prepared:
        """:func:`gsgd_core.arrays.prepare` of the call, memoised on the arrays' signature
        (type, shape, dtype and device of each): a training loop passes the same signature
        every step, and validating it anew costs as much as updating a small layer."""
        lists = [weights, biases, grads, bias_grads] + [v for _, v in extra]
        sig = signature(lists)
        if sig is None:
            return prepare(self.chain, weights, biases, grads=grads, bias_grads=bias_grads,
                           extra=extra)
        if sig != self._signature:
            self._prepared = prepare(self.chain, weights, biases, grads=grads,
                                     bias_grads=bias_grads, extra=extra)
            self._signature = sig
        return self._prepared
