"""``find_chains``: the chains of a JAX model, proven from its jaxpr and checked numerically.

The rules are the JAX guide's. The model is traced once (``jax.make_jaxpr``), the calls it
can see through are inlined (:mod:`~gsgd_adapters.jax.program`), its weight layers are the
contractions of params leaves (:mod:`~gsgd_adapters.jax.layers`), and each layer's units are
followed to the next layer (:mod:`~gsgd_adapters.jax.walk`). Chains are runs of linked
layers in data-flow order, never in the order of names. Every claim is then checked: a
random rescaling of each chain's hidden units must leave the output unchanged (float64 where
JAX has it enabled).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

import jax
import numpy as np

from gsgd_core import Chain

from .layers import find_layers, leaf_readers
from .norms import is_normalised, is_statistic
from .leaves import ChainLeaves, key_paths, path_name
from .nnx import as_function, is_module
from .ops import default_rtol, output_changes
from .program import Program, flatten
from .walk import walk

__all__ = ["Discovery", "find_chains"]


@dataclass(frozen=True, eq=False)
class Discovery:
    """What :func:`find_chains` proved: the chains (iterate over it, or pass it to the
    :mod:`gsgd_adapters.optax` transformations), why each params leaf left out is left out
    (``reasons``, by ``"a/b/c"`` key path), where each chain stops before the model's output
    (``ends``) and each chain's relative output change in the self-check (``changes``).
    ``normalised`` holds the weights followed by a per-unit normalisation (batch norm), for
    :func:`gsgd_adapters.optax.psi_sgd`. ``print(found)`` shows it all."""

    chains: tuple
    reasons: dict = field(default_factory=dict)
    normalised: ChainLeaves = ChainLeaves(None, (), (), layouts=())
    ends: dict = field(default_factory=dict)
    changes: dict = field(default_factory=dict)

    def __iter__(self):
        return iter(self.chains)

    def __len__(self) -> int:
        return len(self.chains)

    def __getitem__(self, i: int) -> ChainLeaves:
        return self.chains[i]

    def within(self, *prefix) -> "Discovery":
        """The same claims for the subtree at key path ``prefix`` (e.g. Flax's ``"params"``,
        when the optimizer sees ``variables["params"]``): key paths without the prefix, in
        the chains and in the names of ``reasons``, ``ends`` and ``changes`` (entries
        outside the subtree are dropped)."""
        n = len(prefix)

        def inside(c: ChainLeaves) -> bool:
            return all(p is None or tuple(p[:n]) == prefix for p in c.weights + c.biases)

        def strip(c: ChainLeaves) -> ChainLeaves:
            return replace(c, weights=tuple(p[n:] for p in c.weights),
                           biases=tuple(None if p is None else p[n:] for p in c.biases))

        for c in self.chains + (self.normalised,):
            if not inside(c):
                raise ValueError(f"chain {c.name()} is not wholly under {path_name(prefix)}")
        pre = path_name(prefix) + "/"

        def names(by_name: dict) -> dict:
            # a leaf's name, or a chain's: its weights' names joined by " -> "
            out = {}
            for name, v in by_name.items():
                parts = name.split(" -> ")
                if all(p.startswith(pre) for p in parts):
                    out[" -> ".join(p[len(pre):] for p in parts)] = v
            return out

        return replace(self, chains=tuple(strip(c) for c in self.chains),
                       normalised=strip(self.normalised), reasons=names(self.reasons),
                       ends=names(self.ends), changes=names(self.changes))

    def __str__(self) -> str:
        lines = [f"{len(self.chains)} chain(s)"]
        for c in self.chains:
            lines.append(f"  {c.name()}: {c.chain}")
            if c.name() in self.ends:
                lines.append(f"    ends there: {self.ends[c.name()]}")
        if self.normalised.weights:
            lines.append("normalised per unit (PSI-SGD in psi_sgd): " + ", ".join(
                path_name(p) for p in self.normalised.weights))
        if self.reasons:
            lines.append("left out (the inner optimizer's plain update):")
            lines += [f"  {name}: {why}" for name, why in self.reasons.items()]
        return "\n".join(lines)


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def _shapes(leaves) -> str:
    return ", ".join(str(tuple(x.shape)) if _is_array(x) else type(x).__name__ for x in leaves)


def trace(apply_fn: Callable, params, args: tuple, kwargs: dict) -> tuple[Program, list, list]:
    """The flattened program of ``apply_fn(params, *args, **kwargs)``, whose first inputs are
    the params' array leaves; their indices among the params' leaves; the model's own
    outputs (not running statistics)."""
    p_leaves, p_def = jax.tree_util.tree_flatten(params)
    a_leaves, a_def = jax.tree_util.tree_flatten((args, kwargs))
    p_idx = [i for i, x in enumerate(p_leaves) if _is_array(x)]
    a_idx = [i for i, x in enumerate(a_leaves) if _is_array(x)]

    def fn(p_arrays, a_arrays):
        pl, al = list(p_leaves), list(a_leaves)
        for i, x in zip(p_idx, p_arrays):
            pl[i] = x
        for i, x in zip(a_idx, a_arrays):
            al[i] = x
        a, k = jax.tree_util.tree_unflatten(a_def, al)
        return apply_fn(jax.tree_util.tree_unflatten(p_def, pl), *a, **k)

    try:
        closed, shapes = jax.make_jaxpr(fn, return_shape=True)(
            [p_leaves[i] for i in p_idx], [a_leaves[i] for i in a_idx])
    except Exception as exc:  # any error of the user's function: say what it was given
        raise ValueError(
            f"apply_fn does not trace with params of shapes [{_shapes(p_leaves)}] and "
            f"arguments of shapes [{_shapes(a_leaves)}]: {type(exc).__name__}: {exc}") from exc
    program = flatten(closed)
    out_paths, _, _ = key_paths(shapes)
    outputs = [v for v, p in zip(program.outputs, out_paths) if not is_statistic(p)]
    return program, p_idx, outputs


def _runs(layers: dict, walks: dict, cut: set) -> list[list[int]]:
    """Maximal runs of linked layers, each in data-flow order, none through ``cut``."""
    nxt = {i: w.next for i, w in walks.items()
           if w.next is not None and not w.end and i not in cut and w.next not in cut}
    runs = []
    for i in sorted(layers):
        if i in set(nxt.values()) | cut:
            continue
        run = [i]
        while run[-1] in nxt:
            run.append(nxt[run[-1]])
        runs.append(run)
    return runs


def _end(walk_, cut: set) -> str:
    if walk_.next in cut:
        return "the next layer is followed by a per-unit normalisation (PSI-SGD's)"
    return walk_.end


def _chain_leaves(run, program, layers, walks, paths, skeleton: str) -> ChainLeaves:
    layouts = [layers[run[0]].layout] + [walks[i].layout for i in run[:-1]]
    shapes = [lay.core_shape(program.inputs[layers[i].leaf].shape)
              for lay, i in zip(layouts, run)]
    biases = tuple(None if walks[i].bias is None else paths[walks[i].bias] for i in run)
    chain = Chain.from_shapes(shapes, bias=[b is not None for b in biases])
    if skeleton == "he":
        chain = chain.with_skeleton_scale(chain.he_skeleton_scale())
    return ChainLeaves(chain, tuple(paths[layers[i].leaf] for i in run), biases,
                       layouts=tuple(layouts))


def _leaf_reason(k: int, program: Program, readers, why: dict) -> str:
    if k in why:
        return why[k]
    if not readers[k]:
        return "not used by the model"
    first = readers[k][0]
    what = "returned by the model" if first == "output" else (
        f"read by {program.eqns[first].describe()}")
    return f"{what}, not as the weight or bias of a dense or convolution layer"


def find_chains(apply_fn: Callable, params, *example_args: Any, skeleton: str = "he",
                check: bool = True, **example_kwargs: Any) -> Discovery:
    """The chains of ``apply_fn(params, *example_args, **example_kwargs)`` that its jaxpr proves.

    A chain is a run of dense or convolution layers (``dot_general`` / ``conv_general_dilated``
    of a params leaf) whose units pass from each layer to the next through operations that
    commute with a positive per-unit rescaling: ReLU in each of its jaxpr forms, leaky ReLU,
    max and average pooling, reshapes and flattens (an NHWC flatten reads position-major),
    transposes, dropout masks, sums over other axes. Kernels may be ``(..., in, out)``
    (Flax, Haiku; HWIO) or ``(out, in, ...)`` (Equinox; OIHW), applied under ``vmap`` or not.
    What is not proven ends a chain or is left out, with a reason (``print(found)``): other
    activations, normalisations, a max or sum across units, a weight read twice, a layer's
    output feeding something else, a residual addition.

    A Flax NNX module is passed alone, with its example arguments: ``find_chains(model,
    x)`` traces a copy of the module as a function of its ``nnx.Param`` variables, named by
    their pure key paths (``l1/kernel``), the form ``nnx.Optimizer`` hands the optax
    transformations (which read either form).

    Parameters
    ----------
    apply_fn : callable or flax.nnx.Module
        ``apply_fn(params, *example_args, **example_kwargs)``, e.g. a Flax module's
        ``apply``, a Haiku ``transform``'s ``apply``, or ``lambda m, x: jax.vmap(m)(x)``;
        or a Flax NNX module, called as ``model(params, *example_args, **example_kwargs)``
        (``params`` is then its first example argument).
    params : pytree
        The parameters (a Flax variables dict, a Haiku params dict, an Equinox module).
        Leaf key paths name the chains' weights and biases.
    skeleton : {"he", "paper"}
        The units of the chains' path values (:attr:`gsgd_core.Chain.skeleton_scale`); use
        the same in :func:`skeleton_init`.
    check : bool
        Rescale each chain at random and drop (with its reason) any whose output moves by
        more than rounding: ``1e-9`` relative in float64 where JAX has it enabled, ``1e-4``
        in float32 otherwise.

    **example_kwargs
        Keyword arguments of ``apply_fn`` (``skeleton`` and ``check`` are this function's
        own).

    Returns
    -------
    Discovery
        The chains (an iterable of :class:`ChainLeaves`) and the reasons for the rest.
        A model where nothing is proven gets no chains, never an exception.

    Raises
    ------
    ValueError
        When ``apply_fn`` does not trace with these params and arguments (the message
        gives their shapes).
    """
    if is_module(apply_fn):
        model_fn, model_params = as_function(apply_fn)
        return find_chains(model_fn, model_params, params, *example_args, skeleton=skeleton,
                           check=check, **example_kwargs)
    if skeleton not in ("he", "paper"):
        raise ValueError(f"skeleton must be 'he' or 'paper', got {skeleton!r}")
    all_paths, _, _ = key_paths(params)
    program, p_idx, outputs = trace(apply_fn, params, example_args, example_kwargs)
    paths = [all_paths[i] for i in p_idx]
    n = len(paths)
    readers = leaf_readers(program, n)
    layers, why = find_layers(program, n, readers)
    walks = {i: walk(program, layer, layers, n, readers) for i, layer in layers.items()}
    cut = {i for i, layer in layers.items()
           if walks[i].end and walks[i].bias is None
           and is_normalised(program, layer, outputs)}
    chains, reasons, ends = [], {}, {}
    for run in _runs(layers, walks, cut):
        if len(run) == 1:
            end = _end(walks[run[0]], cut) or "no layer before it passes its units on to it"
            for k in (layers[run[0]].leaf, walks[run[0]].bias):
                if k is not None:
                    why[k] = f"its layer is in no chain of two or more layers: {end}"
            continue
        chains.append(_chain_leaves(run, program, layers, walks, paths, skeleton))
        if _end(walks[run[-1]], cut):
            ends[chains[-1].name()] = _end(walks[run[-1]], cut)
    changes = {}
    if check and chains:
        changes = output_changes(apply_fn, params, example_args, example_kwargs, chains)
        for c in [c for c in chains if not changes[c.name()] <= default_rtol()]:
            chains.remove(c)
            for p in c.weights + c.biases:
                if p is not None:
                    reasons[path_name(p)] = (
                        f"the self-check found that a random rescaling of chain {c.name()} "
                        f"changes the output by {changes[c.name()]:.3g} (relative)")
    normalised = ChainLeaves(None, tuple(paths[layers[i].leaf] for i in sorted(cut)), (),
                             layouts=tuple(layers[i].layout for i in sorted(cut)))
    claimed = {p for c in chains + [normalised] for p in c.weights + c.biases if p is not None}
    for k, p in enumerate(paths):
        if p not in claimed and path_name(p) not in reasons:
            reasons[path_name(p)] = _leaf_reason(k, program, readers, why)
    return Discovery(tuple(chains), reasons, normalised, ends, changes)
