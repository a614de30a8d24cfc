"""``find_chains``: the chains of a Keras model, read from its layer graph and checked.

The chains come from the Keras layer graph (:mod:`.graph`), not from a backend's trace: the
graph is the same on every backend (JAX, torch, TensorFlow), it names the layers and their
variables directly, and the layers' own settings (``activation``, ``data_format``, pooling
axes) say where the units go, which :mod:`.units` reads. Every claim is then checked as on
the torch and JAX sides: a random rescaling of each chain's hidden units must leave
``model(x)`` unchanged to rounding, or the chain is dropped with its reason.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import keras
import numpy as np

from gsgd_core import Chain, random_rescaling, rescale

from .graph import layer_graph
from .layout import KernelLayout
from .units import follow, is_weight_layer

__all__ = ["ChainLayers", "Discovery", "find_chains", "key"]

SKELETONS = ("he", "paper")


@dataclass(frozen=True, eq=False)
class ChainLayers:
    """A chain: its layers' names, kernels and biases (Keras variables; a bias may be
    ``None``) and how each kernel reads its inputs (:class:`KernelLayout`)."""

    chain: Chain
    layers: tuple
    kernels: tuple
    biases: tuple
    layouts: tuple

    def name(self) -> str:
        return " -> ".join(self.layers)

    def spec(self) -> list:
        """The chain by variable paths and layouts (for an optimizer's config)."""
        return [{"layer": n, "kernel": key(k), "bias": None if b is None else key(b),
                 "before": lay.before, "after": lay.after}
                for n, k, b, lay in zip(self.layers, self.kernels, self.biases, self.layouts)]


def key(variable) -> str:
    """A variable's name in an optimizer's config: ``layer/variable``, the end of its path
    (the model's own name, in front, is not kept by ``model.save``)."""
    return "/".join(variable.path.split("/")[-2:])


def make_chain(layers, kernels, biases, layouts, skeleton: str) -> ChainLayers:
    """A :class:`ChainLayers` whose core chain is inferred from the kernels' shapes."""
    shapes = [lay.core_shape(tuple(k.shape)) for lay, k in zip(layouts, kernels)]
    chain = Chain.from_shapes(shapes, bias=[b is not None for b in biases])
    if skeleton == "he":
        chain = chain.with_skeleton_scale(chain.he_skeleton_scale())
    return ChainLayers(chain, tuple(layers), tuple(kernels), tuple(biases), tuple(layouts))


@dataclass(frozen=True, eq=False)
class Discovery:
    """What :func:`find_chains` found: the ``chains``, the kernels followed by batch
    normalisation (``normalised``: layer name to kernel; PSI-SGD's), why every other layer
    with trainable weights is left out (``reasons``, by layer name), and each chain's
    relative output change in the self-check (``changes``). ``print(found)`` shows it."""

    chains: tuple
    normalised: dict = field(default_factory=dict)
    reasons: dict = field(default_factory=dict)
    changes: dict = field(default_factory=dict)

    def __iter__(self):
        return iter(self.chains)

    def __len__(self) -> int:
        return len(self.chains)

    def __str__(self) -> str:
        lines = [f"{len(self.chains)} chain(s)"]
        for c in self.chains:
            lines.append(f"  {c.name()}: {c.chain}")
        if self.normalised:
            lines.append("followed by batch normalisation (PSI-SGD): "
                         + ", ".join(self.normalised))
        if self.reasons:
            lines.append("left out:")
            lines += [f"  {name}: {why}" for name, why in self.reasons.items()]
        return "\n".join(lines)


def _check_built(model) -> None:
    if not isinstance(model, keras.Model):
        raise ValueError(f"expected a keras.Model, got {type(model).__name__}")
    if not model.built or not model.weights:
        raise ValueError(f"model {model.name!r} is not built (it has no weights yet): build it "
                         "(keras.Input as its first layer, model.build(input_shape), or one "
                         "call on data) before finding its chains")


def _normalised(calls, i: int, link) -> bool:
    """Weight call ``i``'s units go straight into a batch normalisation over the units."""
    layer = calls[i].layer
    if link.stop is None or getattr(layer, "use_bias", True) or link.units.layout != KernelLayout():
        return False
    bn = calls[link.stop].layer
    if not isinstance(bn, keras.layers.BatchNormalization):
        return False
    rank = len(calls[link.stop].shape) + 1
    return bn.axis % rank == (1 if link.units.first else rank - 1)


def _runs(nxt: dict, starts) -> list[list[int]]:
    targets = set(nxt.values())
    runs = []
    for i in starts:
        if i in targets:
            continue
        run = [i]
        while run[-1] in nxt:
            run.append(nxt[run[-1]])
        runs.append(run)
    return runs


def find_chains(model, *, skeleton: str = "he", check: bool = True) -> Discovery:
    """The chains of a built Keras model, from its layer graph, each checked by rescaling.

    A chain is a run of ``Dense`` / ``Conv1D/2D/3D`` layers (kernels ``(*kernel, in, out)``;
    ``channels_last`` or ``channels_first``) whose units pass from each layer to the next
    through ReLU (``activation="relu"``, ``layers.ReLU``, ``layers.Activation("relu")``),
    ``LeakyReLU``, max and average pooling, global average or max pooling, dropout, and a
    ``Flatten`` or ``Reshape`` to one axis (position-major after a ``channels_last``
    convolution). Anything else ends a chain, with the reason in ``reasons``: other
    activations, normalisations, merges and branches, shared layers, frozen layers,
    custom layers. Nested models are read through. Kernels without a bias followed by
    ``BatchNormalization`` over their units are listed in ``normalised``.

    Parameters
    ----------
    model : keras.Model
        A built ``Sequential`` or functional model.
    skeleton : {"he", "paper"}
        The units of the chains' path values (:attr:`gsgd_core.Chain.skeleton_scale`);
        use the same in :func:`skeleton_init`.
    check : bool
        Rescale each chain's hidden units at random (``exp(N(0, 1))``) on a random input of
        the model's input shapes and drop any chain whose output moves by more than
        rounding, relative, in the least precise dtype its layers compute in (``1e-6``
        in float64, ``1e-4`` in float32, ``1e-2`` in float16, ``5e-2`` in bfloat16).

    Raises
    ------
    ValueError
        When the model is not built, or its layer graph was not traced.
    """
    if skeleton not in SKELETONS:
        raise ValueError(f"skeleton must be one of {SKELETONS}, got {skeleton!r}")
    _check_built(model)
    calls = layer_graph(model)
    counts = Counter(id(c.layer) for c in calls)
    reasons, ends, nxt, layouts = {}, {}, {}, {}
    weight_calls = [i for i, c in enumerate(calls) if is_weight_layer(c.layer)]
    for i in weight_calls:
        layer = calls[i].layer
        if counts[id(layer)] > 1:
            reasons[layer.name] = f"a shared layer (called {counts[id(layer)]} times)"
        elif not layer.trainable:
            reasons[layer.name] = "frozen (trainable=False)"
    eligible = [i for i in weight_calls if calls[i].layer.name not in reasons]
    links = {i: follow(calls, i) for i in eligible}
    normalised = {calls[i].layer.name: calls[i].layer.kernel for i in eligible
                  if _normalised(calls, i, links[i])}
    for i, link in links.items():
        target = None if link.next is None else calls[link.next].layer.name
        if target is not None and link.next in eligible and target not in normalised:
            nxt[i], layouts[link.next] = link.next, link.layout
        elif target in normalised:
            ends[i] = f"{target} is followed by batch normalisation (PSI-SGD's)"
        elif target is not None:
            ends[i] = f"{target} is {reasons[target]}"
        else:
            ends[i] = link.reason
    chains, rtol = [], {}
    for run in _runs(nxt, eligible):
        if len(run) == 1:
            if calls[run[0]].layer.name not in normalised:
                reasons[calls[run[0]].layer.name] = \
                    f"in no chain of two or more layers: {ends[run[0]]}"
            continue
        ls = [calls[i].layer for i in run]
        chains.append(make_chain([x.name for x in ls], [x.kernel for x in ls],
                                 [x.bias for x in ls],
                                 [KernelLayout()] + [layouts[i] for i in run[1:]], skeleton))
        rtol[chains[-1].name()] = _rtol(ls)
    changes = {}
    if check and chains:
        changes = {c.name(): output_change(model, c) for c in chains}
        for c in [c for c in chains if not changes[c.name()] <= rtol[c.name()]]:
            chains.remove(c)
            for n in c.layers:
                reasons[n] = (f"the self-check found that a random rescaling of chain {c.name()}"
                              f" changes the output by {changes[c.name()]:.3g} (relative)")
    claimed = {n for c in chains for n in c.layers} | set(normalised)
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if layer.trainable_weights and layer.name not in claimed | set(reasons) \
                and not isinstance(layer, keras.Model):
            reasons[layer.name] = f"{type(layer).__name__} is not a Dense or Conv layer"
    return Discovery(tuple(chains), normalised, reasons, changes)


#: The self-check's tolerance by the dtype a layer computes in. Not 1e-9 in float64: Keras
#: computes some float64 operations in float32 (matmuls on torch, average pooling on JAX).
#: A wrong claim moves the output by far more (a GELU taken for a ReLU: 0.1 or more).
_RTOL = {"float64": 1e-6, "float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}


def _rtol(layers) -> float:
    """The tolerance of a chain of ``layers``: that of the least precise dtype they compute
    in (under a mixed-precision policy float16 or bfloat16, though their kernels are
    float32)."""
    return max(_RTOL[keras.backend.standardize_dtype(ly.compute_dtype)] for ly in layers)


def example_inputs(model, seed: int = 0) -> list:
    """A random batch of two for each of the model's inputs (``None`` sizes as 8)."""
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(2, *(8 if d is None else d for d in t.shape[1:])))
            .astype(keras.backend.standardize_dtype(t.dtype)) for t in model.inputs]


def as_numpy(x) -> np.ndarray:
    """A backend array as a NumPy array (a copy where the backend needs one)."""
    return np.asarray(keras.ops.convert_to_numpy(x))


def _outputs(model, x) -> np.ndarray:
    out = model(x if len(x) > 1 else x[0], training=False)
    return np.concatenate([as_numpy(o).ravel() for o in keras.tree.flatten(out)])


def rescaled(c: ChainLayers, scales) -> tuple[list, list]:
    """The chain's kernels and biases (NumPy) with its hidden units rescaled by ``scales``."""
    W = [lay.view(as_numpy(k.value)) for lay, k in zip(c.layouts, c.kernels)]
    b = [None if x is None else as_numpy(x.value) for x in c.biases]
    W, b = rescale(c.chain, W, b, scales)
    return ([lay.kernel(w, tuple(k.shape)) for lay, w, k in zip(c.layouts, W, c.kernels)], b)


def output_change(model, c: ChainLayers, seed: int = 0) -> float:
    """The relative change of ``model(x)`` when ``c``'s hidden units are rescaled at random
    (the variables are restored afterwards)."""
    x = example_inputs(model, seed)
    before = _outputs(model, x)
    saved = [as_numpy(v.value).copy() for v in c.kernels + c.biases if v is not None]
    W, b = rescaled(c, random_rescaling(c.chain, np.random.default_rng(seed), 1.0))
    try:
        for v, value in zip([*c.kernels, *c.biases], [*W, *b]):
            if v is not None:
                v.assign(value)
        after = _outputs(model, x)
    finally:
        for v, value in zip([v for v in c.kernels + c.biases if v is not None], saved):
            v.assign(value)
    return float(np.linalg.norm(after - before) / max(np.linalg.norm(before), 1e-300))
