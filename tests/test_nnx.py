"""Flax NNX's own training loop: ``find_chains(model, x)``, ``skeleton_init(model, found)``
and the optax transformations inside ``nnx.Optimizer`` (and ``nnx.ModelAndOptimizer``)
under ``nnx.jit``, which hands them pure params (``nnx.as_pure``) after initialising them
from ``Variable``-wrapped ones. Float64 checks on an NNX MLP and an NNX CNN with batch norm
(tests/_jax_catalogue.py); each transformation is built once, so each step compiles once."""

import functools
import re
import sys

import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
nnx = pytest.importorskip("flax.nnx")
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402

from _jax_catalogue import IMAGES, X, NnxCNN, NnxMLP  # noqa: E402
from gsgd_adapters.jax import ChainLeaves, find_chains, random_rescale, skeleton_init  # noqa: E402
from gsgd_adapters.jax.leaves import path_name  # noqa: E402
from gsgd_adapters.optax import gsgd, in_path_space, psi_sgd  # noqa: E402

INPUTS = {"mlp": X.astype(jnp.float64), "cnn": IMAGES.astype(jnp.float64)}
MODELS = {"mlp": NnxMLP, "cnn": NnxCNN}
TARGET = jax.random.normal(jax.random.PRNGKey(9), (X.shape[0], 3), jnp.float64)
TARGETS = {"mlp": TARGET, "cnn": TARGET[:IMAGES.shape[0]]}


def model(name):
    """A fresh float64 model, its skeleton initialised (the same every call)."""
    m = MODELS[name](nnx.Rngs(0), jnp.float64)
    return skeleton_init(m, found(name))


@functools.lru_cache(maxsize=None)
def found(name):
    return find_chains(MODELS[name](nnx.Rngs(0), jnp.float64), INPUTS[name])


@functools.lru_cache(maxsize=None)
def split_found():
    """The explicit form on the MLP: chains named by ``Variable``-wrapped key paths."""
    graphdef, state = nnx.split(NnxMLP(nnx.Rngs(0), jnp.float64), nnx.Param)
    return find_chains(lambda s, x: nnx.merge(graphdef, s)(x), state, INPUTS["mlp"])


@functools.lru_cache(maxsize=None)
def transform(name, kind, form="module"):
    f = found(name) if form == "module" else split_found()
    return {"gsgd": lambda: gsgd(0.01, f, momentum=0.9),
            "g-adam": lambda: in_path_space(optax.adam(0.01), f),
            "psi": lambda: psi_sgd(0.01, f, momentum=0.9)}[kind]()


def loss(out, target):
    return jnp.sum((out - target) ** 2)


@nnx.jit
def nnx_step(m, opt, x, target):
    grads = nnx.grad(lambda m: loss(m(x), target))(m)
    if isinstance(opt, nnx.ModelAndOptimizer):
        opt.update(grads)
    else:
        opt.update(m, grads)


@nnx.jit
def forward(m, x):
    return m(x)


def train_nnx(m, tx, x, target, optimizer=nnx.Optimizer, steps=3):
    opt = optimizer(m, tx, wrt=nnx.Param)
    for _ in range(steps):
        nnx_step(m, opt, x, target)
    return m


def train_pure(m, tx, x, target, steps=3):
    """The same training as pure functions of pure params (``model.apply``-style): the
    module's other variables (batch statistics) are threaded through by hand."""
    graphdef, params, rest = nnx.split(m, nnx.Param, ...)
    params, rest = nnx.as_pure(params), nnx.as_pure(rest)

    def loss_fn(p, rest):
        copy = nnx.merge(graphdef, p, rest, copy=True)
        return loss(copy(x), target), nnx.as_pure(nnx.state(copy, nnx.Not(nnx.Param)))

    @jax.jit
    def step(p, rest, s):
        g, rest = jax.grad(loss_fn, has_aux=True)(p, rest)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), rest, s

    state = tx.init(params)
    for _ in range(steps):
        params, rest, state = step(params, rest, state)
    return params, rest


def pure_state(m, which=nnx.Param):
    return nnx.as_pure(nnx.state(m, which))


def max_diff(a, b) -> float:
    pairs = zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    return max((float(jnp.max(jnp.abs(x - y))) for x, y in pairs), default=0.0)


def test_find_chains_takes_a_module_names_its_pure_params_and_leaves_it_alone():
    m = MODELS["cnn"](nnx.Rngs(0), jnp.float64)
    before = nnx.as_pure(nnx.state(m))
    f = find_chains(m, INPUTS["cnn"])
    assert [[path_name(p) for p in c.weights] for c in f] == [
        ["c2/kernel", "c3/kernel", "l1/kernel", "l2/kernel"]]
    assert [path_name(p) for p in f.normalised.weights] == ["c1/kernel"]
    # the trace ran the batch norm in training mode on a copy: the statistics are untouched
    assert max_diff(nnx.as_pure(nnx.state(m)), before) == 0
    # the explicit form finds the same chains, named by Variable-wrapped key paths
    assert [c.weights for c in split_found()] == [
        tuple(p + ("value",) for p in c.weights) for c in found("mlp")]


def test_find_chains_of_a_module_takes_the_skeleton_recipe_and_check_asked_for():
    """``skeleton=`` and ``check=`` reach the module's own discovery: its chain's units are
    the recipe's, a recipe misspelt is refused, and ``check=False`` rescales nothing."""
    m = MODELS["mlp"](nnx.Rngs(0), jnp.float64)
    (he,), (paper,) = found("mlp"), find_chains(m, INPUTS["mlp"], skeleton="paper")
    assert paper.weights == he.weights and paper.chain != he.chain
    assert paper.chain.with_skeleton_scale(paper.chain.he_skeleton_scale()) == he.chain
    with pytest.raises(ValueError, match="^skeleton must be 'he' or 'paper', got 'HE'$"):
        find_chains(m, INPUTS["mlp"], skeleton="HE")
    unchecked = find_chains(m, INPUTS["mlp"], check=False)
    assert found("mlp").changes and unchecked.changes == {}
    assert [c.chain for c in unchecked] == [he.chain]


@pytest.mark.parametrize("name, kind, form, optimizer", [
    ("mlp", "gsgd", "split", nnx.Optimizer),            # the chains of nnx.split's state
    ("mlp", "g-adam", "module", nnx.Optimizer),
    ("cnn", "gsgd", "module", nnx.Optimizer),
    ("cnn", "psi", "module", nnx.ModelAndOptimizer),
])
def test_nnx_optimizer_trains_as_the_pure_functions(name, kind, form, optimizer):
    x, target = INPUTS[name], TARGETS[name]
    want, want_rest = train_pure(model(name), transform(name, kind), x, target)
    got = train_nnx(model(name), transform(name, kind, form), x, target, optimizer)
    assert max_diff(want, pure_state(model(name))) > 1e-3   # it trained
    assert max_diff(pure_state(got), want) <= 1e-12
    assert max_diff(pure_state(got, nnx.Not(nnx.Param)), want_rest) <= 1e-12


@pytest.mark.parametrize("name, kind", [("cnn", "gsgd"), ("mlp", "g-adam")])
def test_rescaled_nnx_twins_train_together(name, kind):
    x, target = INPUTS[name], TARGETS[name]
    m, twin = model(name), model(name)
    # the chains' pure key paths read the Variable-wrapped state of nnx.state
    nnx.update(twin, random_rescale(nnx.state(twin, nnx.Param), found(name),
                                    jax.random.PRNGKey(8)))
    assert max_diff(pure_state(twin), pure_state(m)) > 1e-3
    start = forward(m, x)
    a = forward(train_nnx(m, transform(name, kind), x, target), x)
    b = forward(train_nnx(twin, transform(name, kind), x, target), x)
    assert float(jnp.max(jnp.abs(a - start))) > 1e-3
    assert float(jnp.max(jnp.abs(b - a)) / jnp.max(jnp.abs(a))) <= 1e-8


def test_skeleton_init_updates_a_module_in_place():
    m = MODELS["mlp"](nnx.Rngs(0), jnp.float64)
    before = pure_state(m)
    assert skeleton_init(m, found("mlp")) is m
    want = skeleton_init(before, found("mlp"))
    assert max_diff(pure_state(m), want) == 0 and max_diff(want, before) > 1e-3


def test_a_leaf_in_neither_form_is_named_with_both():
    params = nnx.state(MODELS["mlp"](nnx.Rngs(0), jnp.float64), nnx.Param)
    (c,) = found("mlp")
    for wrong, other in ((("l9", "kernel"), ("l9", "kernel", "value")),
                         (("l9", "kernel", "value"), ("l9", "kernel"))):
        chains = [ChainLeaves(c.chain, (c.weights[0], wrong), c.biases, layouts=c.layouts)]
        for state in (params, nnx.as_pure(params)):
            with pytest.raises(ValueError, match=re.escape(f"no leaf at key path {wrong} in "
                                                           f"params, nor at {other}:")):
                gsgd(0.1, chains).init(state)


def test_plain_params_need_no_flax(monkeypatch):
    """Without Flax NNX imported, params that are no module are taken as they are."""
    params = pure_state(MODELS["mlp"](nnx.Rngs(0), jnp.float64))
    want = skeleton_init(params, found("mlp"))
    monkeypatch.delitem(sys.modules, "flax.nnx")
    assert max_diff(skeleton_init(params, found("mlp")), want) == 0
