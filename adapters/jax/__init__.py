"""Chains of JAX models (Flax, Equinox, Haiku, plain functions), proven from their jaxpr.

::

    found = find_chains(model.apply, variables, x)     # print(found) says what and why
    opt = gsgd_adapters.optax.gsgd(0.1, found, momentum=0.9)

:func:`find_chains` returns a :class:`Discovery` (the chains as :class:`ChainLeaves`, each
weight with its :class:`Layout`, and a reason for every leaf left out) that the
:mod:`gsgd_adapters.optax` transformations take. :func:`skeleton_init`,
:func:`random_rescale` and :func:`check_invariance` act on a params pytree and its chains;
:func:`skeleton_state` says whether its skeleton was initialised (and trained since).
"""

from .discovery import Discovery, find_chains
from .leaves import ChainLeaves, Layout
from .ops import check_invariance, random_rescale, skeleton_init, skeleton_state

__all__ = ["ChainLeaves", "Discovery", "Layout", "check_invariance", "find_chains",
           "random_rescale", "skeleton_init", "skeleton_state"]
