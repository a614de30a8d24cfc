"""G-SGD, PSI-SGD(M) and Path-SGD for JAX as ``optax.GradientTransformation``\\ s.

Parameters stay an ordinary pytree; :func:`gsgd_adapters.jax.find_chains` says which leaves
form chains, proven from the model's jaxpr (or a short description does, by hand:
:func:`chains_from_pairs`, :func:`chains_from_dict`). ``update`` requires the params.

The math is :mod:`gsgd_core` (functional, Array API), so ``update`` compiles once under
``jax.jit``: no data-dependent control flow, no host round-trips. Leaves outside chains take
plain SGD (``torch.optim.SGD``'s momentum conventions). Found chains carry each weight's
layout; hand descriptions read ``(out, in, ...)`` weights, or with ``transposed=True``
``(..., in, out)`` kernels (Flax, Haiku; HWIO for convolutions).

Every transformation skips a step whose gradients hold a NaN or Inf at any leaf: zero
updates, state unchanged (its step count included). Numeric hyperparameters may be arrays,
so ``optax.inject_hyperparams(gsgd)(learning_rate=0.1, chains=chains, momentum=0.9)`` works
(a hyperparameter given as an array keeps its state even when it holds 0).

:func:`in_path_space` runs any optax transformation in path space (G-Adam is
``in_path_space(optax.adam(1e-3), chains)``).

Examples
--------
>>> import jax, jax.numpy as jnp, optax
>>> from gsgd_adapters.optax import chains_from_dict, gsgd
>>> def mlp(p, x):
...     hidden = jax.nn.relu(x @ p["l1"]["w"].T + p["l1"]["b"])
...     return hidden @ p["l2"]["w"].T + p["l2"]["b"]
>>> k1, k2 = jax.random.split(jax.random.PRNGKey(0))
>>> w1 = jax.random.normal(k1, (8, 4)) / 2   # (out, in), as torch's
>>> w2 = jax.random.normal(k2, (3, 8)) / 3
>>> params = {"l1": {"w": w1, "b": jnp.zeros(8)},
...           "l2": {"w": w2, "b": jnp.zeros(3)}}
>>> chains = chains_from_dict(params, ["l1", "l2"])  # by hand
>>> clip = optax.clip_by_global_norm(1.0)
>>> opt = optax.chain(clip, gsgd(0.1, chains, momentum=0.9))
>>> state = opt.init(params)
>>> x, y = jnp.ones((2, 4)), jnp.zeros((2, 3))
>>> loss = lambda p: ((mlp(p, x) - y) ** 2).mean()
>>> update = jax.jit(opt.update)                # compiles once
>>> grads = jax.grad(loss)(params)
>>> updates, state = update(grads, state, params)  # params required
>>> bool(loss(optax.apply_updates(params, updates)) < loss(params))
True
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence, Union

import jax
import jax.numpy as jnp
import optax

from gsgd_core import (Chain, allocate, gsgd_init, gsgd_update, icr, path_sgd_step, path_values,
                       psi_init, psi_update)
from gsgd_core.arrays import is_off, is_real

from .jax.leaves import ChainLeaves, key_paths, layouts_for, path_name, positions
from .jax.placement import check_placement, follow

__all__ = ["ChainLeaves", "chains_from_pairs", "chains_from_dict", "gsgd", "in_path_space",
           "path_sgd", "psi_sgd"]

ScalarOrSchedule = Union[float, Callable[[Any], Any]]
Path = tuple

_flat = key_paths


def _described(shapes, weights, biases, transposed) -> list[ChainLeaves]:
    """One chain over hand-described weights: ``(out, in, ...)``, or ``(..., in, out)``."""
    shapes = [tuple(s) for s in shapes]
    try:
        chain = Chain.from_shapes([tuple(reversed(s)) if transposed else s for s in shapes],
                                  bias=[b is not None for b in biases])
    except ValueError as exc:
        leaves = ", ".join(f"{path_name(p)} {s}" for p, s in zip(weights, shapes))
        raise ValueError(f"the weights [{leaves}] do not form a chain: {exc}") from None
    return [ChainLeaves(chain, weights, biases, transposed,
                        layouts_for(chain, shapes, transposed))]


def chains_from_pairs(params: Sequence, *, transposed: bool = False) -> list[ChainLeaves]:
    """One chain over a list of ``(W, b)`` pairs (``b`` may be ``None``); ``transposed``:
    the weights are ``(..., in, out)`` kernels (Flax, Haiku)."""
    weights = tuple((i, 0) for i in range(len(params)))
    biases = tuple(None if p[1] is None else (i, 1) for i, p in enumerate(params))
    return _described([p[0].shape for p in params], weights, biases, transposed)


def chains_from_dict(params: dict, layers: Sequence[str], *, weight: str = "w",
                     bias: str = "b", transposed: bool = False) -> list[ChainLeaves]:
    """One chain over ``params[name][weight]`` / ``params[name][bias]`` for ``layers`` in order."""
    weights = tuple((n, weight) for n in layers)
    biases = tuple((n, bias) if params[n].get(bias) is not None else None for n in layers)
    return _described([params[n][weight].shape for n in layers], weights, biases, transposed)


class ChainTransformState(NamedTuple):
    count: Any            # completed updates (drives schedules)
    chains: tuple         # the core's state per chain (or None)
    momentum: tuple       # SGD momentum buffers of leaves outside chains (None inside)


def _lr(learning_rate, count):
    return learning_rate(count) if callable(learning_rate) else learning_rate


def _sgd_rest(g, p, buf, count, lr, *, momentum, dampening, nesterov, weight_decay):
    """torch.optim.SGD's update of one leaf outside the chains: returns (update, buffer)."""
    # Array hyperparameters (inject_hyperparams makes them of the params' widest dtype)
    # take the leaf's dtype, so that the update and the buffer keep it.
    lr, momentum, dampening, weight_decay = (
        h if is_real(h) else jnp.asarray(h, g.dtype)
        for h in (lr, momentum, dampening, weight_decay))
    if not is_off(weight_decay):
        g = g + weight_decay * p
    if not is_off(momentum):
        buf = jnp.where(count == 0, g, momentum * buf + (1 - dampening) * g)
        g = g + momentum * buf if nesterov else buf
    return -lr * g, buf


def _skip_unless_finite(grads, updates: list, new_state, state):
    """``(updates, new_state)``, or zero updates and the old ``state`` when a gradient
    holds a NaN or Inf: such a step is skipped whole (numerics guide: never written into the
    weights, nor into a momentum buffer), with no host round-trip."""
    ok = jnp.all(jnp.array([jnp.all(jnp.isfinite(g)) for g in grads]))
    updates = [jnp.where(ok, u, jnp.zeros_like(u)) for u in updates]
    return updates, jax.tree_util.tree_map(lambda n, o: jnp.where(ok, n, o), new_state, state)


def _transformation(learning_rate, chains, chain_init, chain_step, rest_hyper):
    chains = list(chains)
    momentum = rest_hyper.get("momentum", 0.0)

    def init(params):
        paths, leaves, _ = _flat(params)
        index = dict(zip(paths, range(len(paths))))
        claimed = positions(chains, index)
        check_placement(paths, leaves, claimed)
        states = tuple(chain_init(c, *c.arrays(index, leaves)) for c in chains)
        bufs = tuple(None if (i in claimed or is_off(momentum))
                     else follow(jnp.zeros_like(x), x) for i, x in enumerate(leaves))
        return ChainTransformState(jnp.zeros((), jnp.int32), states, bufs)

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("this transformation needs params: opt.update(grads, state, params)")
        paths, leaves, treedef = _flat(params)
        grads = treedef.flatten_up_to(updates)
        index = dict(zip(paths, range(len(paths))))
        claimed = positions(chains, index)
        check_placement(paths, leaves, claimed, grads)
        lr = _lr(learning_rate, state.count)
        out = list(grads)   # every leaf is written below: a chain's, or SGD's
        new_states = []
        for c, cs in zip(chains, state.chains):
            W, b, G, Gb = _chain_arrays(c, index, leaves, grads)
            W2, b2, cs = chain_step(c, cs, W, b, G, Gb, lr)
            new_states.append(cs)
            c.put(out, index, [w2 - w for w2, w in zip(W2, W)],
                  [None if x is None else x2 - x for x2, x in zip(b2, b)])
        bufs = list(state.momentum)
        for i in range(len(paths)):
            if i not in claimed:
                out[i], bufs[i] = _sgd_rest(grads[i], leaves[i], bufs[i], state.count, lr,
                                            **rest_hyper)
        new = ChainTransformState(state.count + 1, tuple(new_states), tuple(bufs))
        out, new = _skip_unless_finite(grads, out, new, state)
        return jax.tree_util.tree_unflatten(treedef, out), new

    return optax.GradientTransformation(init, update)


def gsgd(learning_rate: ScalarOrSchedule, chains: Sequence[ChainLeaves], *,
         momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False,
         weight_decay: float = 0.0) -> optax.GradientTransformation:
    """G-SGD on the given chains (momentum, Nesterov and weight decay in path space, as
    :func:`gsgd_core.gsgd_update`); SGD with the same hyperparameters elsewhere."""
    hyper = dict(momentum=momentum, dampening=dampening, nesterov=nesterov,
                 weight_decay=weight_decay)

    def chain_init(c, W, b):
        # An array momentum (optax.inject_hyperparams) may be nonzero: it keeps a state.
        if is_off(momentum):
            return None
        return follow(follow(gsgd_init(c.chain, W, b), tuple(W)), tuple(b))

    def chain_step(c, cs, W, b, G, Gb, lr):
        return gsgd_update(c.chain, cs, W, b, G, Gb, lr=lr, **hyper)

    return _transformation(learning_rate, chains, chain_init, chain_step, hyper)


def path_sgd(learning_rate: ScalarOrSchedule,
             chains: Sequence[ChainLeaves]) -> optax.GradientTransformation:
    """Path-SGD (Neyshabur et al. 2015) on the chains, plain SGD elsewhere."""
    def chain_step(c, cs, W, b, G, Gb, lr):
        return (*path_sgd_step(c.chain, W, b, G, Gb, lr), cs)

    return _transformation(learning_rate, chains, lambda c, W, b: None, chain_step,
                           dict(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0))


def psi_sgd(learning_rate: ScalarOrSchedule, normalised, *, momentum: float = 0.0,
            max_norm: float = 1e4) -> optax.GradientTransformation:
    """PSI-SGD(M) (seed 004, Algorithm 1) on the weights followed by a per-unit
    normalisation: those :func:`gsgd_adapters.jax.find_chains` found (pass its result; rows
    are the layout's output units), or the leaves at key paths ``normalised`` (rows = first
    axis); SGD(M) with the same lr elsewhere."""
    leaves = getattr(normalised, "normalised", None)   # a Discovery's, with their layouts
    if leaves is None:
        leaves = ChainLeaves(None, tuple(tuple(p) for p in normalised), ())
    groups = [leaves] if leaves.weights else []   # no chain: PSI acts row by row

    def chain_init(c, W, b):
        return follow(psi_init(W), tuple(W))

    def chain_step(c, cs, W, b, G, Gb, lr):
        W2, cs = psi_update(cs, W, G, lr=lr, momentum=momentum, max_norm=max_norm)
        return W2, [], cs

    return _transformation(learning_rate, groups, chain_init, chain_step,
                           dict(momentum=momentum, dampening=0.0, nesterov=False,
                                weight_decay=0.0))


class InPathSpaceState(NamedTuple):
    inner: Any            # the inner transformation's state (of path values at chain leaves)


def _chain_arrays(c: ChainLeaves, index, leaves, grads):
    """The chain's weights (as the core views them), biases and their gradients."""
    return (*c.arrays(index, leaves), *c.arrays(index, grads))


def in_path_space(inner: optax.GradientTransformation,
                  chains: Sequence[ChainLeaves]) -> optax.GradientTransformation:
    """Any optax transformation in path space: an invariant optimizer of the chains.

    ``inner`` sees, at every chain leaf, the path gradients ``D = dL/dv`` (inverse chain
    rule, paper eq. 3) as its gradients and the basis-path values ``V`` as its params (so
    ``optax.add_decayed_weights`` decays path values), and the leaves outside chains as they
    are. Its update ``u`` at chain leaves is the path step ``-Delta``: weight allocation
    (eq. 5–6) writes the weights whose path values are ``V + u``, free weights unchanged.
    Whatever ``inner`` computes from ``D`` and ``V`` alone commutes with positive rescaling,
    so ``in_path_space(optax.adam(lr), chains)`` is G-Adam and
    ``in_path_space(optax.sgd(lr, momentum), chains)`` is :func:`gsgd` (to rounding).

    Numerics as :func:`gsgd_core.path_update`: a step whose gradients (at any leaf) hold a
    NaN or Inf is skipped whole (zero updates, state kept); a path whose update is not
    finite keeps its value. Jit-compatible; composes with ``optax.chain``.
    """
    chains = list(chains)
    if any(c.chain is None for c in chains):
        raise ValueError("in_path_space takes chains (ChainLeaves with a chain), not PSI groups")

    def to_path_space(grads, params):
        """``(D tree, V tree, chain arrays, index, treedef, grads)``: path gradients and
        values at chain leaves, and the flat gradients."""
        paths, leaves, treedef = _flat(params)
        grads = treedef.flatten_up_to(grads)
        index = dict(zip(paths, range(len(paths))))
        check_placement(paths, leaves, positions(chains, index), grads)
        D, V, arrays = list(grads), list(leaves), []
        for c in chains:
            W, b, G, Gb = _chain_arrays(c, index, leaves, grads)
            c.put(D, index, *icr(c.chain, W, b, G, Gb))
            c.put(V, index, *path_values(c.chain, W, b))
            arrays.append((W, b))
        return (jax.tree_util.tree_unflatten(treedef, D),
                jax.tree_util.tree_unflatten(treedef, V), arrays, index, treedef, grads)

    def init(params):
        _, V, *_ = to_path_space(params, params)
        return InPathSpaceState(follow(inner.init(V), params))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("in_path_space needs params: opt.update(grads, state, params)")
        D, V, arrays, index, treedef, grads = to_path_space(updates, params)
        u, inner_state = inner.update(D, state.inner, V)
        u = treedef.flatten_up_to(u)
        out = list(u)
        for c, (W, b) in zip(chains, arrays):
            delta, bias_delta = ([None if x is None else -x for x in xs]
                                 for xs in c.arrays(index, u))
            W2, b2 = allocate(c.chain, W, b, delta, bias_delta)
            c.put(out, index, [w2 - w for w2, w in zip(W2, W)],
                  [None if x is None else x2 - x for x2, x in zip(b2, b)])
        out, new = _skip_unless_finite(grads, out, InPathSpaceState(inner_state), state)
        return jax.tree_util.tree_unflatten(treedef, out), new

    return optax.GradientTransformation(init, update)
