"""Chains of JAX models (Flax, Equinox, Haiku, plain functions), proven from their jaxpr.

:func:`find_chains` returns a :class:`Discovery` (the chains as :class:`ChainLeaves`, each
weight with its :class:`Layout`, and a reason for every leaf left out) that the
:mod:`gsgd_adapters.optax` transformations take. :func:`skeleton_init`,
:func:`random_rescale` and :func:`check_invariance` act on a params pytree and its chains;
:func:`skeleton_state` says whether its skeleton was initialised (and trained since).

Examples
--------
>>> import jax, jax.numpy as jnp
>>> from gsgd_adapters.jax import find_chains, skeleton_init
>>> from gsgd_adapters.optax import gsgd
>>> def mlp(params, x):             # or a Flax model's apply, ...
...     hidden = jax.nn.relu(x @ params["w1"] + params["b1"])
...     return hidden @ params["w2"] + params["b2"]
>>> k1, k2 = jax.random.split(jax.random.PRNGKey(0))
>>> params = {"w1": jax.random.normal(k1, (4, 8)) / 2,
...           "w2": jax.random.normal(k2, (8, 3)) / 3,
...           "b1": jnp.zeros(8), "b2": jnp.zeros(3)}
>>> found = find_chains(mlp, params, jnp.ones((2, 4)))
>>> print(found)                    # what was found, and why
1 chain(s)
  w1 -> w2: Chain(4 -> 8 -> 3, skeleton_scale=[0.707, 0.433]; m=67,
  H=8, G-space dim=59, H/m=0.119)
>>> params = skeleton_init(params, found)   # once, before training
>>> opt = gsgd(0.1, found, momentum=0.9)
"""

from .discovery import Discovery, find_chains
from .leaves import ChainLeaves, Layout
from .ops import check_invariance, random_rescale, skeleton_init, skeleton_state

__all__ = ["ChainLeaves", "Discovery", "Layout", "check_invariance", "find_chains",
           "random_rescale", "skeleton_init", "skeleton_state"]
