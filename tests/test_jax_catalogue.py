"""JAX chain discovery on a catalogue of Flax, Equinox and Haiku layouts (tests/_jax_catalogue).

Each layout has an expected verdict: the chains claimed, the leaves refused and a word of
why. Wherever a chain is claimed, float64 checks show that a random positive rescaling
leaves the output unchanged and that rescaled twins train identically under ``gsgd`` with
momentum and under ``in_path_space(optax.adam)``.
"""

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
for _name in ("flax", "equinox", "haiku"):
    pytest.importorskip(_name)
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402

from _jax_catalogue import CATALOGUE  # noqa: E402
from gsgd_adapters.jax import (check_invariance, find_chains, random_rescale,  # noqa: E402
                               skeleton_init)
from gsgd_adapters.jax.leaves import key_paths, path_name  # noqa: E402
from gsgd_adapters.optax import gsgd, in_path_space, psi_sgd  # noqa: E402

NAMES = sorted(CATALOGUE)
CLAIMED = [n for n in NAMES if CATALOGUE[n].chains]


def float64(tree):
    return jax.tree_util.tree_map(
        lambda x: x.astype(jnp.float64) if isinstance(x, jax.Array)
        and jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def jitter(tree):
    """Float leaves moved by ``0.1 N(0, 1)``: no bias stays at its zero init, so a bias
    that a rescaling forgets shows."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    keys = jax.random.split(jax.random.PRNGKey(5), len(leaves))
    return jax.tree_util.tree_unflatten(treedef, [
        x + 0.1 * jax.random.normal(k, x.shape, x.dtype)
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating) else x
        for k, x in zip(keys, leaves)])


@functools.lru_cache(maxsize=None)
def found(name):
    apply, params, args, kwargs = float64(CATALOGUE[name].build())
    params = jitter(params)
    return apply, params, args, kwargs, find_chains(apply, params, *args, **kwargs)


def output(apply, params, args, kwargs):
    out = apply(params, *args, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def relative_change(a, b):
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def test_the_catalogue_holds_claims_and_refusals():
    refused = [n for n in NAMES if not CATALOGUE[n].chains]
    assert len(NAMES) >= 20 and len(CLAIMED) >= 10 and len(refused) >= 8


@pytest.mark.parametrize("name", NAMES)
def test_discovery_verdict(name):
    case = CATALOGUE[name]
    *_, f = found(name)
    assert [[path_name(p) for p in c.weights] for c in f] == case.chains
    assert [path_name(p) for p in f.normalised.weights] == case.normalised
    for leaf, fragment in case.refused.items():
        assert fragment in f.reasons[leaf], (leaf, f.reasons[leaf])
    claimed = {path_name(p) for c in list(f) + [f.normalised] for p in c.weights + c.biases
               if p is not None}
    paths, _, _ = key_paths(found(name)[1])
    # every leaf is claimed or says why not, and print(found) shows it
    assert {path_name(p) for p in paths} == claimed | set(f.reasons)
    assert not claimed & set(f.reasons)
    for leaf, why in f.reasons.items():
        assert why and f"{leaf}: {why}" in str(f)


@pytest.mark.parametrize("name", CLAIMED)
def test_random_rescale_keeps_the_output(name):
    apply, params, args, kwargs, f = found(name)
    twin = random_rescale(params, f, jax.random.PRNGKey(7), 1.0)
    moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in
                zip(jax.tree_util.tree_leaves(twin), jax.tree_util.tree_leaves(params)))
    assert moved > 1e-3   # the twin really is rescaled
    assert relative_change(output(apply, twin, args, kwargs),
                           output(apply, params, args, kwargs)) <= 1e-12
    assert max(check_invariance(apply, params, *args, chains=f, **kwargs).values()) <= 1e-12


def _train(opt, apply, twins, args, kwargs, target, steps=3):
    """``steps`` jitted steps of ``opt`` from each of ``twins`` (one compiled step for all);
    the outputs at the end."""
    def loss(p):
        return jnp.sum((output(apply, p, args, kwargs) - target) ** 2)

    @jax.jit
    def step(p, s):
        u, s = opt.update(jax.grad(loss)(p), s, p)
        return optax.apply_updates(p, u), s

    outs = []
    for params in twins:
        state = opt.init(params)
        for _ in range(steps):
            params, state = step(params, state)
        outs.append(output(apply, params, args, kwargs))
    return outs


@pytest.mark.parametrize("name", [n for n in CLAIMED if CATALOGUE[n].trains])
def test_rescaled_twins_train_identically(name):
    apply, params, args, kwargs, f = found(name)
    params = skeleton_init(params, f)
    twin = random_rescale(params, f, jax.random.PRNGKey(8), 1.0)
    ref = output(apply, params, args, kwargs)
    target = jax.random.normal(jax.random.PRNGKey(9), ref.shape, ref.dtype)
    for opt in (gsgd(0.01, f, momentum=0.9), in_path_space(optax.adam(0.01), f)):
        a, b = _train(opt, apply, (params, twin), args, kwargs, target)
        assert relative_change(a, ref) > 1e-4   # it trained
        assert relative_change(b, a) <= 1e-8


@pytest.mark.parametrize("name", [n for n in NAMES if CATALOGUE[n].normalised])
def test_normalised_rows_are_scale_invariant_and_take_psi_sgd(name):
    apply, params, args, kwargs, f = found(name)
    group = f.normalised
    paths, leaves, treedef = key_paths(params)
    index = {p: i for i, p in enumerate(paths)}
    scaled = list(leaves)
    for i, p in enumerate(group.weights):
        W = group.view(i, leaves[index[p]])
        c = jnp.exp(jax.random.normal(jax.random.PRNGKey(i), (W.shape[0],), W.dtype))
        scaled[index[p]] = group.leaf(i, W * c[:, None, None], leaves[index[p]].shape)
    scaled = jax.tree_util.tree_unflatten(treedef, scaled)
    # batch norm's eps makes the invariance approximate
    assert relative_change(output(apply, scaled, args, kwargs),
                           output(apply, params, args, kwargs)) <= 1e-3
    # PSI-SGD scales each output unit's gradient by its row's squared norm
    # the optimizer sees Flax's params without the batch statistics
    prefix = ("params",) if name.startswith("flax") else ()
    sub = params[prefix[0]] if prefix else params
    opt = psi_sgd(0.1, f.within(*prefix))
    psi = f.within(*prefix).normalised
    updates, _ = opt.update(jax.tree_util.tree_map(jnp.ones_like, sub), opt.init(sub), sub)
    u_paths, u_leaves, _ = key_paths(updates)
    u = dict(zip(u_paths, u_leaves))
    s_paths, s_leaves, _ = key_paths(sub)
    w = dict(zip(s_paths, s_leaves))
    for i, p in enumerate(psi.weights):
        W = psi.view(i, w[p])
        rows = jnp.sum(W ** 2, axis=(1, 2))
        np.testing.assert_allclose(psi.view(i, u[p]), -0.1 * rows[:, None, None]
                                   * jnp.ones_like(W), rtol=1e-12)
