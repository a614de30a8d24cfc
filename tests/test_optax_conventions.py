"""The optax conventions a JAX user relies on, for every transformation of
:mod:`gsgd_adapters.optax`: ``inject_hyperparams``, ``MultiSteps``, schedules, ``jax.jit``
of the whole update, ``jax.vmap`` over an ensemble, state pytrees that survive
``jax.device_get`` and ``pickle``, and a step skipped whole when a gradient is not finite."""

import pickle

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402

import gsgd_core as gc  # noqa: E402
from gsgd_adapters.optax import (ChainLeaves, chains_from_pairs, gsgd,  # noqa: E402
                                 in_path_space, path_sgd, psi_sgd)

SIZES = [4, 5, 3, 2]
PSI = [("net", 0, 0), ("net", 1, 0)]  # the first two weights, as if normalised


def make_params(seed=0, dtype=jnp.float64):
    """A chain of three layers under ``"net"`` and a leaf outside it (a temperature)."""
    rng = np.random.default_rng(seed)
    W = [rng.standard_normal((o, i)) * np.sqrt(2 / i) for i, o in zip(SIZES[:-1], SIZES[1:])]
    # skeleton edges at 1 (paper §11.2, keeping signs): learning rates mean what they do for
    # SGD, and trajectories stay well conditioned
    W, _ = gc.skeleton_init(gc.Chain.from_shapes([w.shape for w in W]), W, keep_signs=True)
    net = [(jnp.asarray(w, dtype), jnp.asarray(0.1 * rng.standard_normal(w.shape[0]), dtype))
           for w in W]
    return {"net": net, "t": jnp.asarray([1.5, -0.5], dtype)}


def chains_of(params):
    return [ChainLeaves(c.chain, tuple(("net",) + w for w in c.weights),
                        tuple(("net",) + v for v in c.biases))
            for c in chains_from_pairs(params["net"])]


_rng = np.random.default_rng(1)
X, Y = _rng.standard_normal((8, SIZES[0])), _rng.standard_normal((8, SIZES[-1]))


def loss(p, x=X, y=Y):
    h = x
    for i, (W, b) in enumerate(p["net"]):
        h = h @ W.T + b
        if i < len(p["net"]) - 1:
            h = jax.nn.relu(h)
    return jnp.mean((h * p["t"][0] - y) ** 2) + jnp.sum(p["t"] ** 2)


grad = jax.jit(jax.grad(loss))

#: name -> factory(learning_rate, chains, **hyper) with the hyperparameters it is tested at.
FACTORIES = {
    "gsgd": (gsgd, {}),
    "gsgd_momentum": (gsgd, dict(momentum=0.9, nesterov=True, weight_decay=1e-3)),
    "gsgd_dampening": (gsgd, dict(momentum=0.8, dampening=0.3, weight_decay=1e-2)),
    "psi_sgd": (lambda lr, chains, **h: psi_sgd(lr, PSI, **h), dict(momentum=0.9)),
    "path_sgd": (path_sgd, {}),
    "g_adam": (lambda lr, chains, **h: in_path_space(optax.adam(lr, **h), chains),
               dict(b1=0.8)),
}
#: every convention is tested on these; the dampening variant where hyperparameters are
NAMES = [n for n in FACTORIES if n != "gsgd_dampening"]


def make(name, lr=0.01, **override):
    factory, hyper = FACTORIES[name]
    return factory(lr, chains_of(make_params()), **{**hyper, **override})


def run(opt, params, steps, jit=True, grads=None):
    """``steps`` updates from ``opt.init(params)``: the end params, state and trace count."""
    traces = []

    def step(p, s, g):
        traces.append(1)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(step) if jit else step
    state = opt.init(params)
    for k in range(steps):
        params, state = step(params, state, grad(params) if grads is None else grads[k])
    return params, state, len(traces)


def leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def assert_trees_close(a, b, rtol, what=""):
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb), what
    for i, (x, y) in enumerate(zip(la, lb)):
        assert x.shape == y.shape and x.dtype == y.dtype, (what, i, x.dtype, y.dtype)
        scale = float(np.max(np.abs(y), initial=0.0)) + 1.0
        err = float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)), initial=0.0))
        assert err <= rtol * scale, f"{what} leaf {i}: error {err:.3g}"


def assert_trees_equal(a, b, what=""):
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb), what
    for i, (x, y) in enumerate(zip(la, lb)):
        assert x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True), (what, i)


def moved(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(leaves(a), leaves(b)))


# ------------------------------------------------------------------ jit
@pytest.mark.parametrize("name", NAMES)
def test_jit_of_the_whole_update_traces_once_and_equals_eager(name):
    params = make_params()
    jitted, s_jit, traces = run(make(name), params, 2)
    eager, s_eager, _ = run(make(name), params, 2, jit=False)
    assert traces == 1
    assert moved(jitted, params) > 1e-3  # the steps did move the parameters
    assert_trees_close(jitted, eager, 1e-12, "params")
    assert_trees_close(s_jit, s_eager, 1e-12, "state")


# ------------------------------------------------------------------ inject_hyperparams
def _injected(name, lr, dtype=None, **hyper):
    """``optax.inject_hyperparams`` of the transformation (of the inner Adam for G-Adam),
    with hyperparameters of ``dtype`` (by default the params' widest)."""
    factory, _ = FACTORIES[name]
    if name == "g_adam":
        return in_path_space(optax.inject_hyperparams(optax.adam, hyperparam_dtype=dtype)(
            learning_rate=lr, **hyper), chains_of(make_params()))
    if name == "psi_sgd":
        return optax.inject_hyperparams(psi_sgd, hyperparam_dtype=dtype)(
            learning_rate=lr, normalised=PSI, **hyper)
    return optax.inject_hyperparams(factory, hyperparam_dtype=dtype)(
        learning_rate=lr, chains=chains_of(make_params()), **hyper)


def _hyperparams(state):
    """The injected hyperparameters (of the inner state for ``in_path_space``)."""
    return state.inner.hyperparams if hasattr(state, "inner") else state.hyperparams


SECOND = {"gsgd": dict(weight_decay=0.1), "gsgd_momentum": dict(momentum=0.5),
          "gsgd_dampening": dict(dampening=0.7), "psi_sgd": dict(momentum=0.3),
          "path_sgd": {}, "g_adam": dict(b1=0.5)}


@pytest.mark.parametrize("name", list(FACTORIES))
def test_inject_hyperparams_steps_as_the_plain_transformation_and_follows_its_state(name):
    """Every numeric hyperparameter injected as a traced array: the first jitted step is
    the plain transformation's (a hyperparameter at its default 0, such as ``gsgd``'s
    momentum, is not mistaken for a missing state). Then hyperparameters are changed in the
    state (as a user's callback would): each one alone changes the second step, all
    together give the step of the plain transformation built with the new constants from
    the same inner state, and none of this traces the update again."""
    params = make_params()
    hyper = FACTORIES[name][1]
    opt, traces = _injected(name, 0.01, **hyper), []

    @jax.jit
    def step(g, s, p):
        traces.append(1)
        return opt.update(g, s, p)

    state = opt.init(params)
    u, state = step(grad(params), state, params)
    plain = make(name)
    ref, _ = plain.update(grad(params), plain.init(params), params)
    assert_trees_close(u, ref, 1e-12, "first step")
    assert all(isinstance(v, jax.Array) for v in _hyperparams(state).values())
    p1 = optax.apply_updates(params, u)
    g1 = grad(p1)
    kept, _ = step(g1, state, p1)
    changes = dict(learning_rate=0.004, **SECOND[name])
    hp = _hyperparams(state)
    old = dict(hp)
    for k, v in changes.items():
        hp[k] = jnp.asarray(v, hp[k].dtype)
        alone, _ = step(g1, state, p1)
        hp.update(old)
        assert moved(alone, kept) > 1e-9, f"{k} did not reach the step"
    hp.update({k: jnp.asarray(v, hp[k].dtype) for k, v in changes.items()})
    changed, _ = step(g1, state, p1)
    lr = changes.pop("learning_rate")
    if name == "g_adam":  # the inner Adam's own state, under in_path_space's
        inner = state._replace(inner=state.inner.inner_state)
    else:
        inner = state.inner_state
    ref, _ = make(name, lr, **changes).update(g1, inner, p1)
    assert_trees_close(changed, ref, 1e-12, "changed step")
    assert len(traces) == 1


def test_inject_hyperparams_of_gsgd_with_default_momentum_is_the_reported_call():
    """``optax.inject_hyperparams(gsgd)(learning_rate=0.1, chains=chains)``, jitted and
    eager, steps as ``gsgd(0.1, chains)``."""
    params = make_params()
    chains = chains_of(params)
    opt = optax.inject_hyperparams(gsgd)(learning_rate=0.1, chains=chains)
    for jit in (False, True):
        ours, _, _ = run(opt, params, 2, jit=jit)
        ref, _, _ = run(gsgd(0.1, chains), params, 2, jit=jit)
        assert_trees_close(ours, ref, 1e-12, f"jit={jit}")


@pytest.mark.parametrize("name", ["gsgd_momentum", "psi_sgd"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_injected_wider_hyperparameters_keep_the_leaves_dtype(name, dtype):
    """Hyperparameters wider than the leaves (``hyperparam_dtype``, or the widest dtype of
    mixed-precision params): updates and state keep each leaf's dtype (a jitted loop would
    otherwise retrace, and a buffer widen)."""
    params = make_params(dtype=dtype)
    opt = _injected(name, 0.01, jnp.float64, **FACTORIES[name][1])
    state = opt.init(params)
    g = jax.tree_util.tree_map(lambda x: x.astype(dtype), grad(make_params()))
    u, state2 = jax.jit(opt.update)(g, state, params)
    assert [x.dtype for x in jax.tree_util.tree_leaves(u)] == [dtype] * 7
    assert ([x.dtype for x in jax.tree_util.tree_leaves(state2)]
            == [x.dtype for x in jax.tree_util.tree_leaves(state)])


# ------------------------------------------------------------------ schedules
@pytest.mark.parametrize("name", NAMES)
def test_a_schedule_gives_step_k_the_learning_rate_of_step_k(name):
    """An optax schedule as learning rate: step ``k`` is the step of the transformation
    built with the constant ``schedule(k)``, from the same state."""
    schedule = optax.piecewise_constant_schedule(0.02, {1: 0.5, 2: 0.25})
    params = make_params()
    ours, _, _ = run(make(name, schedule), params, 3)
    p, state = params, make(name).init(params)
    for k in range(3):
        u, state = make(name, float(schedule(k))).update(grad(p), state, p)
        p = optax.apply_updates(p, u)
    assert_trees_close(ours, p, 1e-12, "params")


# ------------------------------------------------------------------ MultiSteps
@pytest.mark.parametrize("name", NAMES)
def test_multisteps_steps_on_the_mean_of_k_gradients(name):
    """``optax.MultiSteps(opt, 2)`` over four micro-batches is two steps of ``opt`` on the
    mean gradient of each pair (parameters unchanged between the two of a pair)."""
    params = make_params()
    xs = np.random.default_rng(5).standard_normal((4, 8, SIZES[0]))
    multi = optax.MultiSteps(make(name), every_k_schedule=2)
    state, p = multi.init(params), params
    update = jax.jit(multi.update)
    for k in range(4):
        u, state = update(jax.grad(loss)(p, xs[k]), state, p)
        p = optax.apply_updates(p, u)
        if k == 0:
            assert moved(p, params) == 0.0
    ref_opt = make(name)
    ref_state, q = ref_opt.init(params), params
    for k in (0, 2):
        g = jax.tree_util.tree_map(lambda a, b: (a + b) / 2, jax.grad(loss)(q, xs[k]),
                                   jax.grad(loss)(q, xs[k + 1]))
        u, ref_state = ref_opt.update(g, ref_state, q)
        q = optax.apply_updates(q, u)
    # optax accumulates the micro-batch gradients in float32
    assert_trees_close(p, q, 1e-6, "params")


# ------------------------------------------------------------------ vmap
@pytest.mark.parametrize("name", NAMES)
def test_vmap_over_an_ensemble_equals_each_members_own_run(name):
    members = [make_params(seed) for seed in (0, 1)]
    batch = jax.tree_util.tree_map(lambda *x: jnp.stack(x), *members)
    opt = make(name)

    def step(p, s):
        u, s = opt.update(grad(p), s, p)
        return optax.apply_updates(p, u), s

    batched, alone_step = jax.jit(jax.vmap(step)), jax.jit(step)
    state = jax.vmap(opt.init)(batch)
    for _ in range(3):
        batch, state = batched(batch, state)
    for i, member in enumerate(members):
        alone, alone_state = member, opt.init(member)
        for _ in range(3):
            alone, alone_state = alone_step(alone, alone_state)
        assert_trees_close(jax.tree_util.tree_map(lambda x, i=i: x[i], batch), alone, 1e-12,
                           f"member {i}")
        assert_trees_close(jax.tree_util.tree_map(lambda x, i=i: x[i], state), alone_state,
                           1e-12, f"state of member {i}")


# ------------------------------------------------------------------ device_get, pickle
@pytest.mark.parametrize("name", NAMES)
def test_state_survives_device_get_and_pickle(name):
    """The state after two steps, fetched to the host and pickled, gives the next step of
    the original state bit for bit."""
    params = make_params()
    opt = make(name)
    step = jax.jit(opt.update)
    p, state = params, opt.init(params)
    for _ in range(2):
        u, state = step(grad(p), state, p)
        p = optax.apply_updates(p, u)
    host = pickle.loads(pickle.dumps(jax.device_get(state)))
    assert all(isinstance(x, (np.ndarray, np.generic)) for x in jax.tree_util.tree_leaves(host))
    assert jax.tree_util.tree_structure(host) == jax.tree_util.tree_structure(state)
    u, s = step(grad(p), state, p)
    u2, s2 = step(grad(p), host, p)
    assert_trees_equal(u2, u, "updates")
    assert_trees_equal(s2, s, "state")


# ------------------------------------------------------------------ non-finite gradients
@pytest.mark.parametrize("name", NAMES)
def test_a_nan_or_inf_in_any_gradient_skips_the_step(name):
    """A NaN, +Inf or -Inf at one entry of any leaf's gradient (chain weights, chain biases,
    the leaf outside the chain): zero updates and the state unchanged (count included), and
    the step after it is the step the skipped one would have been."""
    params = make_params()
    opt = make(name)
    step = jax.jit(opt.update)
    u, state = step(grad(params), opt.init(params), params)
    p = optax.apply_updates(params, u)
    g = grad(p)
    good_u, good_s = step(g, state, p)
    flat, treedef = jax.tree_util.tree_flatten(g)
    rng = np.random.default_rng(7)
    for i, leaf in enumerate(flat):
        for bad in (np.nan, np.inf, -np.inf):
            at = tuple(int(rng.integers(n)) for n in leaf.shape)
            poisoned = list(flat)
            poisoned[i] = leaf.at[at].set(bad)
            u, s = step(jax.tree_util.tree_unflatten(treedef, poisoned), state, p)
            assert all(np.all(x == 0) for x in leaves(u)), (i, bad)
            assert_trees_equal(s, state, f"state after a {bad} in leaf {i}")
            u, s = step(g, s, p)
            assert_trees_equal(u, good_u, "the step after a skipped one")
            assert_trees_equal(s, good_s, "the state after a skipped one")
