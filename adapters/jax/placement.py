"""Where the leaves of a params pytree live, checked before a step touches them.

Under ``jax.jit`` XLA places every intermediate of a step, so the step follows any
``NamedSharding`` of its inputs on a mesh whose axes are ``Auto`` (``jax.sharding.Mesh``'s
default; ``jax.make_mesh`` makes ``Explicit`` ones unless given ``axis_types``): replicated,
sharded over units or inputs, over one mesh axis or two. What it cannot follow is refused
here with the leaf's key path and both placements:

- leaves on different devices, or on the same devices in another order (two meshes): JAX
  cannot compute with them together;
- a chain leaf sharded over an ``Explicit`` mesh axis (sharding in types): JAX then asks each
  gather of the step for its output sharding, which an Array API step cannot name.

:func:`follow` places optimizer state made under ``jax.jit`` like the params it belongs to.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding

from .leaves import Path, path_name


def _devices(x):
    """The ordered devices a committed, concrete array lives on, else ``None`` (an array
    JAX may move, or a traced one, which its compiler places)."""
    if isinstance(x, jax.core.Tracer) or not getattr(x, "committed", False):
        return None
    sharding = x.sharding
    if isinstance(sharding, NamedSharding):
        return tuple(sharding.mesh.devices.flat)
    return tuple(sorted(sharding.device_set, key=lambda d: d.id))


def _explicit_axes(x) -> tuple:
    """The ``Explicit`` mesh axes ``x`` is sharded over (traced or not)."""
    sharding = jax.typeof(x).sharding
    types = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_types))
    used = [a for entry in sharding.spec if entry is not None
            for a in (entry if isinstance(entry, tuple) else (entry,))]
    return tuple(a for a in used if types.get(a) == AxisType.Explicit)


def _where(x) -> str:
    return str(getattr(x, "sharding", None) or jax.typeof(x).sharding)


def check_placement(paths: Sequence[Path], leaves: Sequence, claimed=frozenset(),
                    grads: Sequence | None = None) -> None:
    """``ValueError`` naming the first leaf of ``leaves`` (params at key ``paths``) or of
    ``grads`` (their gradients) that is not on the devices of the first placed leaf, or a
    chain leaf (its position in ``claimed``) sharded over an ``Explicit`` mesh axis; both
    placements are printed."""
    named = [("params", i, p, x) for i, (p, x) in enumerate(zip(paths, leaves))]
    named += [("grads", i, p, g) for i, (p, g) in enumerate(zip(paths, grads or ()))]
    first = None
    for what, _, path, x in named:
        devices = _devices(x)
        if devices is None:
            continue
        if first is None:
            first = (what, path, x, devices)
        elif devices != first[3]:
            raise ValueError(
                f"{what} leaf {path_name(path)} is on devices {[d.id for d in devices]} "
                f"({_where(x)}), but {first[0]} leaf {path_name(first[1])} is on "
                f"{[d.id for d in first[3]]} ({_where(first[2])}): every leaf must be on "
                f"one mesh's devices, in its order")
    for what, i, path, x in named:
        axes = i in claimed and _explicit_axes(x)
        if axes:
            raise ValueError(
                f"{what} leaf {path_name(path)} is sharded over the Explicit mesh axes "
                f"{axes} ({_where(x)}): G-SGD's step follows shardings over Auto axes "
                f"(jax.make_mesh(..., axis_types=(AxisType.Auto, ...)))")


def _tied(new, like):
    """``new`` placed as ``like`` (an array of its shape; else ``new`` as it is).

    Traced: ``new`` plus a zero computed from ``like``, the same numbers (up to the sign of
    a zero), which XLA then places as ``like``, since its sharding propagation follows
    data. Concrete: ``new`` put on ``like``'s sharding where ``like`` is committed to one.
    """
    if getattr(new, "shape", None) != getattr(like, "shape", None):
        return new
    if not isinstance(like, jax.core.Tracer):
        return jax.device_put(new, like.sharding) if getattr(like, "committed", False) else new
    if not (jnp.issubdtype(new.dtype, jnp.inexact) and jnp.issubdtype(like.dtype, jnp.inexact)):
        return new
    # like * 0 is NaN where like is not finite, so XLA keeps the product (a constant zero
    # would depend on no input, and jit would put it on one device)
    zero = jnp.where(jnp.isfinite(like), like * 0, 0)
    return new + zero.astype(new.dtype)


def follow(state, like):
    """``state`` with each subtree structured as ``like`` (``state`` itself included) tied
    leaf by leaf to ``like``'s arrays of the same shape, so that under ``jax.jit`` XLA
    places each like its array: an optimizer's buffers sharded as the params they belong
    to, as an eager ``zeros_like`` places them.

    Without it, arrays of an ``init`` under ``jit`` depend on no input, and JAX makes them
    on one device (the whole state there, optax's own transformations' too); outside
    ``jit`` an inner transformation's buffers would be placed like the path values it is
    given, which XLA may shard otherwise. Scalars (step counts) are left as made: JAX
    replicates them over the devices the computation runs on.
    """
    structure = jax.tree_util.tree_structure(like)

    def shaped_like(node) -> bool:
        return jax.tree_util.tree_structure(node) == structure

    return jax.tree_util.tree_map(
        lambda node: jax.tree_util.tree_map(_tied, node, like) if shaped_like(node) else node,
        state, is_leaf=shaped_like)
