"""The chain: a run of layers through which positive rescaling passes, and its skeleton.

A chain of ``L >= 2`` layers has node layers ``0..L`` of sizes ``n_0..n_L``; layer ``l``'s
weight is viewed as a 3-D array ``(n_l, n_{l-1}, k_l)`` (``k_l`` parallel edges, "slots",
e.g. the positions of a flattened conv kernel). The skeleton (theory page) gives every hidden
node ``j`` of layer ``l`` an incoming *tau* edge ``(j, tau_l(j), s_l)`` in ``W_l`` and an
outgoing *free* edge ``(sigma_l(j), j, s_{l+1})`` in ``W_{l+1}``. Free edges are the ``H``
free skeleton weights that G-SGD never changes; every other edge owns one basis path.

All metadata here is host (NumPy) data; :mod:`gsgd_core.arrays` converts it once per
array namespace and device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Sequence

import numpy as np

__all__ = ["Chain", "HE_SKELETON_SHARE"]

# The share of each row's He-init variance that the He skeleton recipe puts on skeleton
# edges (skeleton guide); measured on digits MLPs and VGG/AlexNet-style plain CNNs.
HE_SKELETON_SHARE = 0.25


def _int_tuple(values: Sequence[int], what: str) -> tuple[int, ...]:
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"{what}[{i}] must be an int, got {v!r}")
        out.append(int(v))
    return tuple(out)


@dataclass(frozen=True)
class Chain:
    """Structure and skeleton of a chain of positively homogeneous layers.

    Parameters
    ----------
    sizes : sequence of int
        ``[n_0, ..., n_L]``: inputs, hidden units (or channels) per layer, outputs. ``L >= 2``.
    slots : sequence of int, optional
        ``[k_1, ..., k_L]``, parallel edges per node pair (kernel positions; ``1`` for a
        Linear; ``S`` for a Linear after a flatten of ``S`` positions). Default all ``1``.
    bias : bool or sequence of bool
        Whether each layer has a bias (one flag for all layers, or one per layer).
    tau : sequence of sequences of int, optional
        Custom skeleton: ``tau[l-1][j]`` is the source (in layer ``l-1``) of hidden node ``j``'s
        incoming skeleton edge, for ``l = 1..L-1``. Default ``j mod n_{l-1}`` (theory page).
    sigma : sequence of sequences of int, optional
        Custom skeleton: ``sigma[l-1][j]`` is the target (in layer ``l+1``) of hidden node
        ``j``'s outgoing free edge, for ``l = 1..L-1``. Default ``j mod n_{l+1}``.
    skeleton_slots : sequence of int, optional
        The slot ``s_l`` of layer ``l`` shared by its tau and free edges, ``l = 1..L``.
        Default ``k_l // 2`` (the kernel centre).
    skeleton_scale : sequence of float, optional
        ``[r_1, ..., r_L]``, the reference magnitude of the skeleton edges lying in layer
        ``l`` (its tau edges and the free edges in it). The chain products are taken in
        these units, ``B_l[j] = B_{l-1}[tau(j)] * W_l[j, tau(j), s_l] / r_l`` and likewise
        ``F``, so a path value is measured against the path made of reference-sized skeleton
        edges: ``V_p / s_p`` with ``s_p = prod_{k != l} r_k`` for a weight path of layer
        ``l`` and ``prod_{k > l} r_k`` for a bias path. For G-SGD this is a fixed per-path
        learning-rate scale ``s_p**2`` (skeleton guide): still exactly invariant, and at a
        skeleton whose edges have magnitude ``r_l`` the step on every non-skeleton weight is
        SGD's. Default all ``1`` (the paper's units); :meth:`he_skeleton_scale` gives the
        scale of the He skeleton recipe.

    Notes
    -----
    A chain is immutable and hashable, so it can be a static argument under ``jax.jit``.
    Any ``tau``, ``sigma`` and slots give a valid basis (the basis matrix is unit
    triangular when edges are ordered by layer), so every choice is accepted.
    """

    sizes: tuple[int, ...]
    slots: tuple[int, ...] = None  # type: ignore[assignment]
    bias: tuple[bool, ...] | bool = True
    tau: tuple[tuple[int, ...], ...] = None  # type: ignore[assignment]
    sigma: tuple[tuple[int, ...], ...] = None  # type: ignore[assignment]
    skeleton_slots: tuple[int, ...] = None  # type: ignore[assignment]
    skeleton_scale: tuple[float, ...] = None  # type: ignore[assignment]
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        sizes = _int_tuple(self.sizes, "sizes")
        if len(sizes) < 3:
            raise ValueError(
                f"a chain needs at least 2 layers (3 node layers), got sizes={list(sizes)}")
        if min(sizes) < 1:
            raise ValueError(f"every layer needs at least one unit, got sizes={list(sizes)}")
        L = len(sizes) - 1
        slots = (1,) * L if self.slots is None else _int_tuple(self.slots, "slots")
        if len(slots) != L:
            raise ValueError(f"slots has {len(slots)} entries for {L} layers (sizes={list(sizes)})")
        if min(slots) < 1:
            raise ValueError(f"every layer needs at least one slot, got slots={list(slots)}")
        if isinstance(self.bias, (bool, np.bool_)):
            bias = (bool(self.bias),) * L
        else:
            bias = tuple(bool(b) for b in self.bias)
            if len(bias) != L:
                raise ValueError(f"bias has {len(bias)} flags for {L} layers")
        sk = tuple(k // 2 for k in slots) if self.skeleton_slots is None else _int_tuple(
            self.skeleton_slots, "skeleton_slots")
        if len(sk) != L:
            raise ValueError(f"skeleton_slots has {len(sk)} entries for {L} layers")
        for l, (s, k) in enumerate(zip(sk, slots), start=1):
            if not 0 <= s < k:
                raise ValueError(f"layer {l}: skeleton slot {s} outside 0..{k - 1}")
        tau = self._node_maps(self.tau, "tau", sizes, lambda l, j: j % sizes[l - 1], -1)
        sigma = self._node_maps(self.sigma, "sigma", sizes, lambda l, j: j % sizes[l + 1], +1)
        scale = self._scale(self.skeleton_scale, L)
        for name, value in (("sizes", sizes), ("slots", slots), ("bias", bias), ("tau", tau),
                            ("sigma", sigma), ("skeleton_slots", sk), ("skeleton_scale", scale)):
            object.__setattr__(self, name, value)

    @staticmethod
    def _scale(given, L: int) -> tuple[float, ...]:
        if given is None:
            return (1.0,) * L
        if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
            raise ValueError(f"skeleton_scale must be a sequence of {L} floats, got {given!r}")
        out = []
        for l, r in enumerate(given, start=1):
            if isinstance(r, bool) or not isinstance(r, (int, float, np.integer, np.floating)):
                raise ValueError(f"skeleton_scale[{l - 1}] must be a number, got {r!r}")
            if not (math.isfinite(r) and r > 0):
                raise ValueError(f"layer {l}: skeleton scale must be finite and > 0, got {r!r}")
            out.append(float(r))
        if len(out) != L:
            raise ValueError(f"skeleton_scale has {len(out)} entries for {L} layers")
        return tuple(out)

    @staticmethod
    def _node_maps(given, name, sizes, default, step):
        L = len(sizes) - 1
        if given is None:
            return tuple(tuple(default(l, j) for j in range(sizes[l])) for l in range(1, L))
        given = tuple(_int_tuple(m, f"{name}[{i}]") for i, m in enumerate(given))
        if len(given) != L - 1:
            raise ValueError(f"{name} needs one map per hidden layer ({L - 1}), got {len(given)}")
        for l, m in enumerate(given, start=1):
            if len(m) != sizes[l]:
                raise ValueError(
                    f"{name} of hidden layer {l} has {len(m)} entries for {sizes[l]} units")
            target = sizes[l + step]
            bad = [v for v in m if not 0 <= v < target]
            if bad:
                raise ValueError(
                    f"{name} of hidden layer {l}: values {bad[:5]} outside 0..{target - 1}")
        return given

    def __copy__(self) -> "Chain":
        return self

    def __deepcopy__(self, memo) -> "Chain":
        # Immutable: a copy of a model or an optimizer shares its chains (and their caches
        # of derived metadata, which may hold compiled functions that cannot be copied).
        return self

    # ----------------------------------------------------------------- constructors
    @classmethod
    def mlp(cls, widths: Sequence[int], bias: bool | Sequence[bool] = True) -> "Chain":
        """Chain of Linear layers ``widths[0] -> widths[1] -> ... -> widths[-1]``."""
        return cls(tuple(widths), None, bias=bias)

    @classmethod
    def from_shapes(cls, shapes: Sequence[Sequence[int]],
                    bias: bool | Sequence[bool] = True, **skeleton) -> "Chain":
        """Infer sizes and slots from weight shapes in the layers' own layout.

        ``(out, in)`` is a Linear; ``(out, in, *kernel)`` a convolution with
        ``k = prod(kernel)``; a 2-D ``(out, C*S)`` after a layer of ``C`` units is a Linear
        after a channel-major flatten of ``S`` positions (``k = S``).
        """
        shapes = [tuple(int(d) for d in s) for s in shapes]
        if len(shapes) < 2:
            raise ValueError(f"a chain needs at least 2 layers, got {len(shapes)} shapes")
        sizes, slots = [], []
        for l, shape in enumerate(shapes, start=1):
            if len(shape) < 2:
                raise ValueError(f"layer {l}: weight shape {shape} has fewer than 2 dimensions")
            if len(shape) > 2:
                fan_in, k = shape[1], math.prod(shape[2:])
            elif l == 1:
                fan_in, k = shape[1], 1
            elif shape[1] % sizes[-1] == 0:  # k = 1: a plain Linear; k > 1: after a flatten
                fan_in, k = sizes[-1], shape[1] // sizes[-1]
            else:
                raise ValueError(
                    f"layer {l}: weight shape {shape} does not follow layer {l - 1} of "
                    f"{sizes[-1]} units (in-features must be a multiple of {sizes[-1]})")
            if l == 1:
                sizes.append(fan_in)
            elif fan_in != sizes[-1]:
                raise ValueError(f"layer {l}: weight shape {shape} expects {fan_in} inputs "
                                 f"but layer {l - 1} has {sizes[-1]} units")
            sizes.append(shape[0])
            slots.append(k)
        return cls(tuple(sizes), tuple(slots), bias=bias, **skeleton)

    def he_skeleton_scale(self, share: float = HE_SKELETON_SHARE) -> tuple[float, ...]:
        """A :attr:`skeleton_scale` for He-initialised layers (skeleton guide):
        ``r_l = sqrt(2 * share / c_l)``, where ``c_l`` counts the skeleton edges in a row of
        layer ``l`` (its tau edge, and on average ``n_{l-1} / n_l`` free edges).

        Under He init a row's weights carry a variance of 2 (times the input's second
        moment); skeleton edges of magnitude ``r_l`` carry ``share`` of it, and the other
        weights scaled by ``sqrt(1 - share)`` the rest, so each layer keeps He init's
        activation scale. Rows where many free edges land (a 4096 -> 10 head) get small
        skeleton edges; elsewhere they stay of order 1, so tau paths take gentle steps.
        """
        if not 0 < share < 1:
            raise ValueError(f"share must be in (0, 1), got {share!r}")
        n, L = self.sizes, self.L
        count = [(1.0 if l < L else 0.0) + (n[l - 1] / n[l] if l >= 2 else 0.0)
                 for l in range(1, L + 1)]
        return tuple(math.sqrt(2.0 * share / c) for c in count)

    def with_skeleton_scale(self, scale: Sequence[float] | None) -> "Chain":
        """The same chain and skeleton with another :attr:`skeleton_scale`."""
        return replace(self, skeleton_scale=scale)

    # ----------------------------------------------------------------- counts
    @property
    def L(self) -> int:
        """Number of layers."""
        return len(self.sizes) - 1

    @property
    def H(self) -> int:
        """Number of hidden units (rescalable nodes), ``n_1 + ... + n_{L-1}``."""
        return sum(self.sizes[1:-1])

    @property
    def m(self) -> int:
        """Number of weights and biases."""
        return sum(self.layer_size(l) + (self.sizes[l] if self.bias[l - 1] else 0)
                   for l in range(1, self.L + 1))

    @property
    def g_space_dim(self) -> int:
        """Dimension of G-space, ``m - H`` (Corollary 3.8): the number of basis paths."""
        return self.m - self.H

    @property
    def invariant_ratio(self) -> float:
        """``H / m`` (paper §5.2)."""
        return self.H / self.m

    def layer_shape(self, l: int) -> tuple[int, int, int]:
        """The 3-D view ``(n_l, n_{l-1}, k_l)`` of layer ``l`` (1-based)."""
        return (self.sizes[l], self.sizes[l - 1], self.slots[l - 1])

    def layer_size(self, l: int) -> int:
        return math.prod(self.layer_shape(l))

    # ----------------------------------------------------------------- host metadata
    def tau_index(self, l: int) -> np.ndarray:
        """Flat indices (into layer ``l``'s 3-D view) of the tau edges, one per node of ``l``."""
        if not 1 <= l <= self.L - 1:
            return np.zeros(0, dtype=np.int64)
        n, n_prev, k = self.layer_shape(l)
        j = np.arange(n)
        return (j * n_prev + np.asarray(self.tau[l - 1])) * k + self.skeleton_slots[l - 1]

    def free_index(self, l: int) -> np.ndarray:
        """Flat indices (into layer ``l``'s view) of the free edges, one per node of ``l-1``."""
        if not 2 <= l <= self.L:
            return np.zeros(0, dtype=np.int64)
        n, n_prev, k = self.layer_shape(l)
        a = np.arange(n_prev)
        return (np.asarray(self.sigma[l - 2]) * n_prev + a) * k + self.skeleton_slots[l - 1]

    def _mask(self, l: int, index: np.ndarray) -> np.ndarray:
        mask = np.zeros(self.layer_size(l), dtype=bool)
        mask[index] = True
        return mask.reshape(self.layer_shape(l))

    def tau_mask(self, l: int) -> np.ndarray:
        """Boolean ``(n_l, n_{l-1}, k_l)`` mask of layer ``l``'s tau edges (empty for ``l = L``)."""
        return self._mask(l, self.tau_index(l))

    def free_mask(self, l: int) -> np.ndarray:
        """Boolean ``(n_l, n_{l-1}, k_l)`` mask of the free edges lying in layer ``l``."""
        return self._mask(l, self.free_index(l))

    @cached_property
    def free_masks(self) -> tuple[np.ndarray, ...]:
        """Free-edge masks of layers ``1..L`` (index ``l-1``)."""
        return self._per_layer(self.free_mask)

    @cached_property
    def tau_masks(self) -> tuple[np.ndarray, ...]:
        """Tau-edge masks of layers ``1..L`` (index ``l-1``)."""
        return self._per_layer(self.tau_mask)

    def _per_layer(self, of) -> tuple:
        """``of(l)`` for the layers ``1..L``, in order."""
        return tuple(of(l) for l in range(1, self.L + 1))

    def __str__(self) -> str:
        body = " -> ".join(str(n) for n in self.sizes)
        extra = "" if all(k == 1 for k in self.slots) else f", slots={list(self.slots)}"
        if any(r != 1.0 for r in self.skeleton_scale):
            extra += ", skeleton_scale=[" + ", ".join(f"{r:.3g}" for r in self.skeleton_scale) + "]"
        return (f"Chain({body}{extra}; m={self.m}, H={self.H}, "
                f"G-space dim={self.g_space_dim}, H/m={self.invariant_ratio:.3g})")
