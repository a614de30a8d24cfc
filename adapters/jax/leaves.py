"""Which leaves of a params pytree form a chain, and how each weight leaf lays out its units.

The core views layer ``l``'s weight as ``(n_l, n_{l-1}, k_l)`` (theory page). A JAX leaf keeps
the same numbers in its library's order: Flax and Haiku kernels are ``(..., in, out)`` (HWIO
for convolutions), Equinox's ``(out, in, ...)`` (OIHW), and a Dense after a Flax flatten of an
NHWC tensor reads its inputs position-major. A :class:`Layout` names the leaf's axes, so the
view is a reshape and a transpose, and so is its inverse.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import numpy as np

from gsgd_core import Chain

Path = tuple
NNX_VALUE = "value"   # the last key of a Flax NNX Variable-wrapped leaf


@dataclass(frozen=True)
class Layout:
    """The axes of a weight leaf: ``out`` holds the layer's output units, ``inp`` its input
    units, ``slots`` the parallel edges (kernel positions). After a flatten, ``inp`` holds
    ``P * n * Q`` entries, input unit ``j`` at ``(p * n + j) * Q + q``; ``P`` and ``Q`` are
    slots too.

    Examples: a Flax ``Dense`` kernel ``(in, out)`` is ``Layout(out=1, inp=0)``; a Flax
    ``Conv`` kernel (HWIO) ``Layout(3, 2, (0, 1))``; an Equinox ``Conv2d`` weight (OIHW)
    ``Layout(0, 1, (2, 3))``; the kernel of a Flax ``Dense`` after flattening ``(H, W, C)``
    ``Layout(1, 0, P=H*W)``.
    """

    out: int
    inp: int
    slots: tuple[int, ...] = ()
    P: int = 1
    Q: int = 1

    @classmethod
    def out_in(cls, ndim: int) -> "Layout":
        """``(out, in, *kernel)``: torch's and Equinox's convention."""
        return cls(0, 1, tuple(range(2, ndim)))

    @classmethod
    def in_out(cls, ndim: int) -> "Layout":
        """``(*kernel, in, out)``: Flax's and Haiku's convention (HWIO)."""
        return cls(ndim - 1, ndim - 2, tuple(range(ndim - 2)))

    def _split(self, shape: tuple) -> tuple[tuple, tuple]:
        """The leaf's shape with ``inp`` split into ``(P, n, Q)``, and the order of the split
        axes that puts ``(out, n, P, *slots, Q)`` first."""
        axes = sorted((self.out, self.inp) + tuple(self.slots))
        if axes != list(range(len(shape))) or shape[self.inp] % (self.P * self.Q):
            raise ValueError(f"layout {self} does not fit a weight of shape {shape}")
        n = shape[self.inp] // (self.P * self.Q)
        split = shape[:self.inp] + (self.P, n, self.Q) + shape[self.inp + 1:]
        at = lambda a: a if a < self.inp else a + 2
        order = (at(self.out), self.inp + 1, self.inp, *(at(a) for a in self.slots),
                 self.inp + 2)
        return split, order

    def core_shape(self, shape: tuple) -> tuple[int, int, int]:
        """``(n_out, n_in, k)``: the core's view of a leaf of this shape."""
        split, order = self._split(tuple(shape))
        return split[order[0]], split[order[1]], math.prod(split[a] for a in order[2:])

    def view(self, x):
        """The core's ``(n_out, n_in, k)`` view of leaf ``x`` (a copy where it must be)."""
        split, order = self._split(tuple(x.shape))
        return x.reshape(split).transpose(order).reshape(self.core_shape(x.shape))

    def leaf(self, y, shape: tuple):
        """The inverse of :meth:`view`: ``y`` laid out as a leaf of ``shape``."""
        split, order = self._split(tuple(shape))
        inverse = tuple(int(a) for a in np.argsort(order))
        return y.reshape([split[a] for a in order]).transpose(inverse).reshape(shape)


@dataclass(frozen=True)
class ChainLeaves:
    """A chain and the key paths of its layers' weights and biases in the params pytree
    (``chain`` is ``None`` for a PSI-SGD group of normalised weights).

    ``layouts`` gives each weight's :class:`Layout`; without them a weight is read as
    ``(out, in, ...)``, or as a 2-D ``(in, out)`` kernel with ``transposed``. Biases are
    read flat (an Equinox ``Conv2d`` bias is ``(out, 1, 1)``).
    """

    chain: Chain | None
    weights: tuple
    biases: tuple
    transposed: bool = False
    layouts: tuple | None = None

    def view(self, i: int, x):
        """Weight ``i`` as the core reads it."""
        if self.layouts is not None:
            return self.layouts[i].view(x)
        return x.T if self.transposed and x.ndim == 2 else x

    def leaf(self, i: int, y, shape: tuple):
        """Weight ``i``'s core array ``y`` laid out as its leaf (of ``shape``)."""
        if self.layouts is not None:
            return self.layouts[i].leaf(y, shape)
        return y.T if self.transposed and y.ndim == 2 else y

    @staticmethod
    def bias_view(x):
        return x.reshape(-1)

    def arrays(self, index: dict, leaves: list) -> tuple[list, list]:
        """The chain's weights (as the core views them) and flat biases, taken from
        ``leaves`` (a flattened pytree whose key paths ``index`` maps to positions)."""
        return ([self.view(i, _leaf(index, leaves, p)) for i, p in enumerate(self.weights)],
                [None if p is None else self.bias_view(_leaf(index, leaves, p))
                 for p in self.biases])

    def put(self, out: list, index: dict, weights, biases) -> None:
        """Weights and biases as the core views them into their places in ``out`` (a
        flattened pytree whose entries there give the leaves' shapes)."""
        for i, (p, x) in enumerate(zip(self.weights, weights)):
            k = position(index, p)
            out[k] = self.leaf(i, x, out[k].shape)
        for p, x in zip(self.biases, biases):
            if p is not None:
                k = position(index, p)
                out[k] = x.reshape(out[k].shape)

    def name(self) -> str:
        return " -> ".join(path_name(p) for p in self.weights)


def _leaf(index: dict, leaves: list, path: Path):
    return leaves[position(index, path)]


def position(index: dict, path: Path) -> int:
    """Where the leaf at key path ``path`` is among the leaves whose key paths ``index``
    maps to positions.

    Flax NNX hands the same params in two forms: ``Variable``-wrapped (``nnx.state``; key
    paths end in ``"value"``, the attribute that holds the array) and pure
    (``nnx.as_pure``; ``nnx.Optimizer.update`` passes these), so a path found in one form
    also names its leaf in the other.
    """
    if path in index:
        return index[path]
    other = path[:-1] if path[-1:] == (NNX_VALUE,) else path + (NNX_VALUE,)
    if other in index:
        return index[other]
    raise ValueError(
        f"no leaf at key path {path} in params, nor at {other}: a Flax NNX leaf's key path "
        f"ends in {NNX_VALUE!r} when its params are Variable-wrapped (nnx.state), not when "
        "they are pure (nnx.as_pure)")


def positions(chains, index: dict) -> set[int]:
    """The positions (:func:`position`) of every weight and bias of ``chains``."""
    return {position(index, p) for c in chains for p in c.weights + c.biases if p is not None}


def _key(entry):
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return entry


def key_paths(tree):
    """Leaves of ``tree`` with plain key paths (dict keys, list indices, attribute names)."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [tuple(_key(k) for k in path) for path, _ in pairs], [x for _, x in pairs], treedef


def path_name(path: Path) -> str:
    """``('params', 'Dense_0', 'kernel')`` as ``params/Dense_0/kernel``."""
    return "/".join(str(k) for k in path)


def layouts_for(chain: Chain, shapes, transposed: bool) -> tuple:
    """Layouts of hand-described weights of ``shapes``: ``(out, in, ...)``, or with
    ``transposed`` ``(..., in, out)``; a 2-D weight after a flatten reads its inputs
    channel-major, as :meth:`gsgd_core.Chain.from_shapes` does."""
    out = []
    for shape, k in zip(shapes, chain.slots):
        if len(shape) == 2:
            out.append(Layout(1, 0, Q=k) if transposed else Layout(0, 1, Q=k))
        else:
            out.append(Layout.in_out(len(shape)) if transposed else Layout.out_in(len(shape)))
    return tuple(out)
