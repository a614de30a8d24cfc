"""Operations on a params pytree's chains, each returning new params: skeleton
initialisation, random rescaling, and the check that a rescaling keeps the function."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import gsgd_core as gc
from gsgd_core.chain import HE_SKELETON_SHARE

from .leaves import ChainLeaves, key_paths, positions
from .nnx import is_module, update_params
from .placement import check_placement

__all__ = ["DEFAULT_BOUND", "check_invariance", "random_rescale", "skeleton_init",
           "skeleton_state"]


def _map_chains(params, chains: Sequence[ChainLeaves], fn):
    """``params`` with each chain's weights and biases replaced by ``fn(k, c, W, b)``'s
    (``W``, ``b`` as the core views them)."""
    paths, leaves, treedef = key_paths(params)
    index = {p: i for i, p in enumerate(paths)}
    check_placement(paths, leaves, positions(chains, index))
    out = list(leaves)
    for k, c in enumerate(chains):
        c.put(out, index, *fn(k, c, *c.arrays(index, leaves)))
    return jax.tree_util.tree_unflatten(treedef, out)


def _chains(chains) -> list[ChainLeaves]:
    """The chains among ``chains`` (a PSI group has none)."""
    return [c for c in chains if c.chain is not None]


def skeleton_init(params, chains: Sequence[ChainLeaves], *, skeleton: str = "he"):
    """New params with every chain's skeleton initialised (paper §11.2, skeleton guide).

    ``skeleton="he"``: skeleton edges of layer ``l`` get magnitude ``r_l = sqrt(2 * share /
    c_l)`` (:meth:`gsgd_core.Chain.he_skeleton_scale`, ``share = 1/4``) and keep their signs,
    the other weights are scaled by ``sqrt(1 - share)``: each layer keeps He init's
    activation scale. ``skeleton="paper"``: every skeleton edge ``+1``. Call once after the
    usual initialisation (it changes the function); the chains' ``skeleton`` (of
    :func:`find_chains`) should be the same.

    A Flax NNX module in place of ``params`` is updated in place (as ``nnx.update`` does)
    and returned.
    """
    if is_module(params):
        update_params(params, lambda p: skeleton_init(p, chains, skeleton=skeleton))
        return params
    if skeleton not in ("he", "paper"):
        raise ValueError(f"skeleton must be 'he' or 'paper', got {skeleton!r}")
    he = skeleton == "he"
    rest = math.sqrt(1.0 - HE_SKELETON_SHARE) if he else 1.0

    def init(k, c, W, b):
        chain = c.chain.with_skeleton_scale(c.chain.he_skeleton_scale() if he else None)
        W, _ = gc.skeleton_init(chain, W, keep_signs=he, rest_scale=rest)
        return W, b

    return _map_chains(params, _chains(chains), init)


#: JAX libraries' default initialisations of a layer's weights lie within
#: ``DEFAULT_BOUND / sqrt(fan_in)``: Flax's ``lecun_normal`` (a normal truncated at two
#: standard deviations, scaled by ``1 / 0.8796``), Haiku's truncated normal (``2``) and
#: Equinox's uniform (``1``).
DEFAULT_BOUND = 2.0 / 0.87962566103423978


def skeleton_state(params, chains: Sequence[ChainLeaves]) -> list[str]:
    """Each chain's skeleton as its weights show it (:func:`gsgd_core.skeleton_state`):
    ``"initialised"`` (as :func:`skeleton_init` left it), ``"trained"`` (initialised, then
    trained by :func:`gsgd_adapters.optax.gsgd` or ``gadam``, which never move the free
    edges), ``"default"`` (a library's default initialisation, :data:`DEFAULT_BOUND`: call
    :func:`skeleton_init` before training) or ``"unknown"`` (the weights cannot tell: a model
    initialised otherwise, or skeleton-initialised and then trained by another rule).
    Nothing in the optax transformations reads it; check it before training, or after
    loading a checkpoint, without re-initialising a trained model."""
    paths, leaves, _ = key_paths(params)
    index = {p: i for i, p in enumerate(paths)}
    # read on the host: a handful of comparisons, which JAX would compile one by one
    return [gc.skeleton_state(c.chain, [np.asarray(w) for w in c.arrays(index, leaves)[0]],
                              default_bound=DEFAULT_BOUND) for c in _chains(chains)]


def random_rescale(params, chains: Sequence[ChainLeaves], key, spread: float = 1.0):
    """New params with every hidden unit of every chain rescaled by ``exp(spread * N(0, 1))``
    (``jax.random`` draws from ``key``): the same function (Theorem 3.3), unbalanced weights."""
    if not (math.isfinite(spread) and spread >= 0):
        raise ValueError(f"spread must be finite and >= 0, got {spread!r}")
    chains = _chains(chains)
    keys = jax.random.split(key, max(len(chains), 1))

    def rescale(k, c, W, b):
        draws = jax.random.split(keys[k], c.chain.L - 1)
        scales = [jnp.exp(spread * jax.random.normal(d, (n,), W[0].dtype))
                  for d, n in zip(draws, c.chain.sizes[1:-1])]
        return gc.rescale(c.chain, W, b, scales)

    return _map_chains(params, chains, rescale)


def _float64(tree):
    """Floating arrays of ``tree`` (JAX's or NumPy's, and floats) in float64 where JAX has it
    enabled; anything else (strings, integers, objects) as it is."""
    if not jax.config.jax_enable_x64:
        return tree
    return jax.tree_util.tree_map(
        lambda x: jnp.asarray(x, jnp.float64) if _is_float(x) else x, tree)


def _is_float(x) -> bool:
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return jnp.issubdtype(x.dtype, jnp.floating)
    return isinstance(x, float)


def _outputs(out) -> list:
    return [jnp.asarray(x) for x in jax.tree_util.tree_leaves(out)
            if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]


def output_changes(apply_fn: Callable, params, args: tuple, kwargs: dict,
                   chains: Sequence[ChainLeaves], *, spread: float = 1.0,
                   seed: int = 0) -> dict[str, float]:
    """Each chain's relative output change (``max |out' - out| / max |out|``) when its
    hidden units alone are rescaled at random (float64 where enabled)."""
    params, args, kwargs = _float64((params, args, kwargs))
    ref = _outputs(apply_fn(params, *args, **kwargs))
    size = max((float(jnp.max(jnp.abs(r))) for r in ref if r.size), default=0.0)
    changes = {}
    for k, c in enumerate(_chains(chains)):
        twin = random_rescale(params, [c], jax.random.fold_in(jax.random.PRNGKey(seed), k),
                              spread)
        got = _outputs(apply_fn(twin, *args, **kwargs))
        diff = max((float(jnp.max(jnp.abs(a - b))) for a, b in zip(got, ref) if a.size),
                   default=0.0)
        changes[c.name()] = diff / max(size, 1e-300) if math.isfinite(diff) else math.inf
    return changes


def default_rtol() -> float:
    """The self-check's tolerance: rounding in float64, or in float32 without it."""
    return 1e-9 if jax.config.jax_enable_x64 else 1e-4


def check_invariance(apply_fn: Callable, params, *args: Any, chains: Sequence[ChainLeaves],
                     spread: float = 1.0, seed: int = 0, rtol: float | None = None,
                     **kwargs: Any) -> dict[str, float]:
    """Check on example arguments that every chain of ``chains`` really is one.

    For each chain (found by :func:`find_chains`, or described by hand), its hidden units
    are rescaled by ``exp(spread * N(0, 1))`` (:func:`random_rescale`), which must leave
    ``apply_fn(params, *args, **kwargs)`` unchanged (Theorem 3.3). Returns each chain's
    relative output change (``max |out' - out| / max |out|``, in float64 where JAX has it
    enabled) and raises ``ValueError`` naming the first chain whose change exceeds ``rtol``
    (``1e-9`` in float64, ``1e-4`` otherwise).
    """
    rtol = default_rtol() if rtol is None else rtol
    changes = output_changes(apply_fn, params, args, kwargs, chains, spread=spread, seed=seed)
    for name, change in changes.items():
        if not change <= rtol:
            raise ValueError(
                f"chain {name} is not a chain of this model: a random positive rescaling of "
                f"its hidden units changes the output by {change:.3g} (relative); describe "
                "it without the layers that break it")
    return changes
