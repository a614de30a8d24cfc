"""gsgd_adapters.optax: jitted, equal to the NumPy core in float64, invariant, composable."""

import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402

import gsgd_core as gc  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from _helpers import Problem, assert_close  # noqa: E402
from _strategies import chains, examples, fixed_shapes, seeds  # noqa: E402
from gsgd_adapters.optax import (ChainLeaves, chains_from_dict,  # noqa: E402
                                 chains_from_pairs, gsgd, in_path_space, path_sgd, psi_sgd)

SIZES = [6, 7, 5, 3]


def make_params(seed=0):
    rng = np.random.default_rng(seed)
    return [(jnp.asarray(rng.standard_normal((o, i)) * np.sqrt(2 / i)),
             jnp.asarray(0.1 * rng.standard_normal(o))) for i, o in zip(SIZES[:-1], SIZES[1:])]


def data(seed=1):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((12, SIZES[0]))), jnp.asarray(
        rng.standard_normal((12, SIZES[-1])))


def forward(params, x):
    for i, (W, b) in enumerate(params):
        x = x @ W.T + b
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    return x


X, Y = data()
loss = jax.jit(lambda p: jnp.mean((forward(p, X) - Y) ** 2))
grad = jax.jit(jax.grad(lambda p: jnp.mean((forward(p, X) - Y) ** 2)))


def run(opt, params, steps, g=grad):
    """``steps`` jitted steps of ``opt`` with gradients ``g``; the end point and the number
    of traces."""
    state = opt.init(params)
    traces = []

    @jax.jit
    def step(p, s):
        traces.append(1)
        u, s = opt.update(g(p), s, p)
        return optax.apply_updates(p, u), s

    for _ in range(steps):
        params, state = step(params, state)
    return params, len(traces)


HYPER = dict(momentum=0.9, nesterov=True, weight_decay=1e-3)


def test_jitted_trajectory_equals_the_numpy_core_and_compiles_once():
    params = make_params()
    chain = chains_from_pairs(params)[0].chain
    ours, n_traces = run(gsgd(0.05, chains_from_pairs(params), **HYPER), params, 6)
    assert n_traces == 1
    W = [np.asarray(w) for w, _ in params]
    b = [np.asarray(v) for _, v in params]
    state = gc.gsgd_init(chain, W, b)
    for _ in range(6):
        g = grad([(jnp.asarray(w), jnp.asarray(v)) for w, v in zip(W, b)])
        W, b, state = gc.gsgd_update(chain, state, W, b, [np.asarray(x) for x, _ in g],
                                     [np.asarray(x) for _, x in g], lr=0.05, **HYPER)
    for (w, v), w2, v2 in zip(ours, W, b):
        assert_close(np.asarray(w), w2, 1e-12, "weights")
        assert_close(np.asarray(v), v2, 1e-12, "biases")


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_rescaled_twin_has_the_same_trajectory(momentum):
    params = make_params()
    chain = chains_from_pairs(params)[0].chain
    scales = gc.random_rescaling(chain, np.random.default_rng(3), 1.0)
    W, b = gc.rescale(chain, [w for w, _ in params], [v for _, v in params], scales)
    twin = list(zip(W, b))
    assert_close(forward(twin, X), forward(params, X), 1e-12)
    opt = gsgd(0.02, chains_from_pairs(params), momentum=momentum)
    a, _ = run(opt, params, 20)
    t, _ = run(opt, twin, 20)
    assert_close(forward(t, X), forward(a, X), 1e-8, "outputs after 20 steps")
    assert not np.allclose(forward(a, X), forward(params, X), atol=1e-3)


def test_composes_with_clipping_and_schedules():
    params = make_params()
    schedule = optax.exponential_decay(0.1, transition_steps=1, decay_rate=0.5)
    opt = optax.chain(optax.clip_by_global_norm(0.5), gsgd(schedule, chains_from_pairs(params)))
    ours, _ = run(opt, params, 3)
    chain = chains_from_pairs(params)[0].chain
    p = params
    for k in range(3):
        g = grad(p)
        norm = optax.tree.norm(g)
        scale = jnp.minimum(1.0, 0.5 / norm)
        g = jax.tree_util.tree_map(lambda x, s=scale: x * s, g)
        W, b = gc.gsgd_step(chain, [w for w, _ in p], [v for _, v in p], [x for x, _ in g],
                            [x for _, x in g], schedule(jnp.asarray(k, jnp.int32)))
        p = list(zip(W, b))
    for (w, v), (w2, v2) in zip(ours, p):
        assert_close(np.asarray(w), np.asarray(w2), 1e-12)
        assert_close(np.asarray(v), np.asarray(v2), 1e-12)


def _with_temperature():
    """Params with a leaf outside the chain (a temperature ``t``), the chain's leaves, and
    the jitted gradient of a loss that uses both."""
    params = {"net": make_params(), "t": jnp.asarray([1.5, -0.5])}
    chains = [ChainLeaves(c.chain, tuple(("net",) + w for w in c.weights),
                          tuple(("net",) + v for v in c.biases))
              for c in chains_from_pairs(params["net"])]

    def f(p):
        return jnp.mean((forward(p["net"], X) * p["t"][0] - Y) ** 2) + jnp.sum(p["t"] ** 2)

    return params, chains, jax.jit(jax.grad(f))


def test_leaves_outside_chains_take_optax_sgd():
    params, chains, g = _with_temperature()
    state = (opt := gsgd(0.05, chains, momentum=0.9)).init(params)
    ref_opt = optax.sgd(0.05, momentum=0.9)
    ref_state = ref_opt.init(params["t"])
    p, t = params, params["t"]
    for _ in range(3):
        gp = g(p)
        u, state = opt.update(gp, state, p)
        p = optax.apply_updates(p, u)
        ru, ref_state = ref_opt.update(gp["t"], ref_state)
        t = optax.apply_updates(t, ru)
    assert_close(np.asarray(p["t"]), np.asarray(t), 1e-12)


def test_dict_layout_with_transposed_kernels_equals_pairs():
    params = make_params()
    as_dict = {f"l{i}": {"w": w.T, "b": b} for i, (w, b) in enumerate(params)}
    chains = chains_from_dict(as_dict, ["l0", "l1", "l2"], transposed=True)
    assert chains[0].chain == chains_from_pairs(params)[0].chain
    g = grad(params)
    gd = {f"l{i}": {"w": gw.T, "b": gb} for i, (gw, gb) in enumerate(g)}
    opt_d, opt_p = gsgd(0.1, chains), gsgd(0.1, chains_from_pairs(params))
    ud, _ = opt_d.update(gd, opt_d.init(as_dict), as_dict)
    up, _ = opt_p.update(g, opt_p.init(params), params)
    for i, (uw, ub) in enumerate(up):
        assert_close(np.asarray(ud[f"l{i}"]["w"].T), np.asarray(uw), 1e-14)
        assert_close(np.asarray(ud[f"l{i}"]["b"]), np.asarray(ub), 1e-14)


def test_pairs_of_kernels_read_in_out_with_transposed():
    """``chains_from_pairs(..., transposed=True)``: ``(in, out)`` kernels, as Flax's and
    Haiku's, step as the ``(out, in)`` pairs they transpose."""
    params = make_params()
    kernels = [(w.T, b) for w, b in params]
    chains = chains_from_pairs(kernels, transposed=True)
    assert chains[0].chain == chains_from_pairs(params)[0].chain
    g = grad(params)
    opt_k, opt_p = gsgd(0.1, chains), gsgd(0.1, chains_from_pairs(params))
    uk, _ = opt_k.update([(gw.T, gb) for gw, gb in g], opt_k.init(kernels), kernels)
    up, _ = opt_p.update(g, opt_p.init(params), params)
    for (kw, kb), (uw, ub) in zip(uk, up):
        assert_close(np.asarray(kw.T), np.asarray(uw), 1e-14)
        assert_close(np.asarray(kb), np.asarray(ub), 1e-14)


def test_dict_layout_reads_out_in_weights_by_default_and_layers_without_a_bias():
    """Without ``transposed`` a dict's weights are ``(out, in)``, as pairs' are; a layer
    whose bias is absent or None has none in the chain, and its step equals the pairs'."""
    params = [(w, None if i == 1 else b) for i, (w, b) in enumerate(make_params())]
    as_dict = {f"l{i}": {"w": w} | ({} if i == 1 else {"b": b})
               for i, (w, b) in enumerate(params)}
    as_dict["l2"]["b"] = None
    params[2] = (params[2][0], None)
    chains = chains_from_dict(as_dict, ["l0", "l1", "l2"])
    assert chains[0].chain == chains_from_pairs(params)[0].chain
    assert chains[0].biases == (("l0", "b"), None, None)
    g = jax.grad(lambda p: jnp.mean((forward([(w, 0.0 if b is None else b) for w, b in p], X)
                                     - Y) ** 2))(params)
    gd = {"l0": {"w": g[0][0], "b": g[0][1]}, "l1": {"w": g[1][0]},
          "l2": {"w": g[2][0], "b": None}}
    opt_d, opt_p = gsgd(0.1, chains), gsgd(0.1, chains_from_pairs(params))
    ud, _ = opt_d.update(gd, opt_d.init(as_dict), as_dict)
    up, _ = opt_p.update(g, opt_p.init(params), params)
    for i, (uw, _) in enumerate(up):
        assert_close(np.asarray(ud[f"l{i}"]["w"]), np.asarray(uw), 1e-14)
    assert_close(np.asarray(ud["l0"]["b"]), np.asarray(up[0][1]), 1e-14)


def test_path_sgd_and_psi_sgd_transformations_equal_the_core():
    params = make_params()
    chain = chains_from_pairs(params)[0].chain
    g = grad(params)
    opt = path_sgd(0.1, chains_from_pairs(params))
    u, _ = opt.update(g, opt.init(params), params)
    W, b = gc.path_sgd_step(chain, [w for w, _ in params], [v for _, v in params],
                            [x for x, _ in g], [x for _, x in g], 0.1)
    for (uw, ub), w0, w1, b0, b1 in zip(u, [w for w, _ in params], W,
                                        [v for _, v in params], b):
        assert_close(np.asarray(w0 + uw), np.asarray(w1), 1e-13)
        assert_close(np.asarray(b0 + ub), np.asarray(b1), 1e-13)
    opt = psi_sgd(0.1, [(0, 0), (1, 0)], momentum=0.9)
    u, _ = opt.update(g, opt.init(params), params)
    Wp, _ = gc.psi_update(gc.psi_init([params[0][0], params[1][0]]),
                          [params[0][0], params[1][0]], [g[0][0], g[1][0]], lr=0.1,
                          momentum=0.9)
    assert_close(np.asarray(params[0][0] + u[0][0]), np.asarray(Wp[0]), 1e-13)
    assert_close(np.asarray(params[1][0] + u[1][0]), np.asarray(Wp[1]), 1e-13)
    assert_close(np.asarray(u[2][0]), np.asarray(-0.1 * g[2][0]), 1e-13)  # SGD elsewhere


def test_gsgd_without_momentum_keeps_no_state_but_its_step_count():
    """No momentum: no buffer per chain and none per leaf outside the chains (a state as
    small as optax.sgd's); with momentum, the core's state per chain."""
    params, chains, _ = _with_temperature()
    leaves = jax.tree_util.tree_leaves(gsgd(0.1, chains).init(params))
    assert len(leaves) == 1 and leaves[0].shape == () and leaves[0].dtype == jnp.int32
    state = gsgd(0.1, chains, momentum=0.9).init(params)
    assert jax.tree_util.tree_leaves(state.chains) and state.momentum[-1] is not None


def test_update_without_params_is_a_clear_error():
    params = make_params()
    opt = gsgd(0.1, chains_from_pairs(params))
    with pytest.raises(ValueError, match=r"^this transformation needs params: "
                                         r"opt\.update\(grads, state, params\)$"):
        opt.update(grad(params), opt.init(params))


def test_leaves_outside_chains_take_torch_conventions_for_dampening_and_decay():
    """Momentum with dampening and weight decay on a leaf outside every chain, against
    torch.optim.SGD's rule written out: buf = g on the first step, then
    momentum*buf + (1 - dampening)*g, with g = grad + weight_decay*p."""
    params, chains, g = _with_temperature()
    opt = gsgd(0.05, chains, momentum=0.9, dampening=0.4, weight_decay=0.1)
    state, p = opt.init(params), params
    t, buf = np.asarray(params["t"], dtype=np.float64), None
    for _ in range(3):
        gp = g(p)
        gt = np.asarray(gp["t"], dtype=np.float64) + 0.1 * t
        buf = gt if buf is None else 0.9 * buf + (1 - 0.4) * gt
        t = t - 0.05 * buf
        u, state = opt.update(gp, state, p)
        p = optax.apply_updates(p, u)
    assert_close(np.asarray(p["t"]), t, 1e-12)


# ------------------------------------------------------------------ in_path_space
def test_in_path_space_of_optax_sgd_is_gsgd():
    """``in_path_space(add_decayed_weights + sgd(momentum, nesterov))`` equals
    :func:`gsgd` on the chain and on the leaf outside it, jitted once."""
    params, chains, g = _with_temperature()
    inner = optax.chain(optax.add_decayed_weights(1e-3),
                        optax.sgd(0.05, momentum=0.9, nesterov=True))
    ours, traces = run(in_path_space(inner, chains), params, 6, g)
    ref, _ = run(gsgd(0.05, chains, **HYPER), params, 6, g)
    assert traces == 1
    for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(ref)):
        assert_close(np.asarray(a), np.asarray(b), 1e-12)


def test_in_path_space_of_optax_adam_is_the_cores_g_adam():
    """Two independent Adams (optax's on the path space, the core's rule) agree; the leaf
    outside the chain takes optax.adam itself."""
    params, chains, g = _with_temperature()
    ours, _ = run(in_path_space(optax.adam(0.01), chains), params, 5, g)
    chain = chains[0].chain
    rule = gc.adam_rule(0.01)
    W = [np.asarray(w) for w, _ in params["net"]]
    b = [np.asarray(v) for _, v in params["net"]]
    state = gc.path_init(chain, rule, W, b)
    t, t_opt = params["t"], optax.adam(0.01)
    t_state = t_opt.init(t)
    for _ in range(5):
        gp = g({"net": [(jnp.asarray(w), jnp.asarray(v)) for w, v in zip(W, b)], "t": t})
        W, b, state = gc.path_update(chain, rule, state, W, b,
                                     [np.asarray(x) for x, _ in gp["net"]],
                                     [np.asarray(x) for _, x in gp["net"]])
        u, t_state = t_opt.update(gp["t"], t_state)
        t = optax.apply_updates(t, u)
    for (w, v), w2, v2 in zip(ours["net"], W, b):
        assert_close(np.asarray(w), w2, 1e-12, "weights")
        assert_close(np.asarray(v), v2, 1e-12, "biases")
    assert_close(np.asarray(ours["t"]), np.asarray(t), 1e-12, "leaf outside the chain")


@pytest.mark.parametrize("transform", ["adam", "adamw", "lion"])
def test_in_path_space_twins_coincide_and_plain_adams_do_not(transform):
    make = {"adam": lambda: optax.adam(0.01), "adamw": lambda: optax.adamw(0.01, 0.1),
            "lion": lambda: optax.lion(0.003)}[transform]
    params = make_params()
    chain = chains_from_pairs(params)[0].chain
    scales = gc.random_rescaling(chain, np.random.default_rng(3), 1.0)
    W, b = gc.rescale(chain, [w for w, _ in params], [v for _, v in params], scales)
    twin = list(zip(W, b))
    opt = in_path_space(make(), chains_from_pairs(params))
    a, _ = run(opt, params, 20)
    t, _ = run(opt, twin, 20)
    assert_close(forward(t, X), forward(a, X), 1e-8, "outputs after 20 steps")
    assert not np.allclose(forward(a, X), forward(params, X), atol=1e-3)
    pa, _ = run(make(), params, 20)
    pt, _ = run(make(), twin, 20)
    assert np.max(np.abs(forward(pa, X) - forward(pt, X))) > 1e-4


def test_in_path_space_skips_a_step_with_a_non_finite_chain_gradient():
    params = make_params()
    opt = in_path_space(optax.adam(0.01), chains_from_pairs(params))
    state = opt.init(params)
    g = grad(params)
    _, state = opt.update(g, state, params)
    bad = [(w, v) for w, v in g]
    bad[1] = (bad[1][0].at[0, 0].set(jnp.nan), bad[1][1])
    u, state2 = jax.jit(opt.update)(bad, state, params)
    assert all(float(jnp.max(jnp.abs(x))) == 0.0 for x in jax.tree_util.tree_leaves(u))
    for n, o in zip(jax.tree_util.tree_leaves(state2), jax.tree_util.tree_leaves(state)):
        assert np.array_equal(np.asarray(n), np.asarray(o))


def test_in_path_space_reads_transposed_kernels_and_refuses_psi_groups():
    params = make_params()
    as_dict = {f"l{i}": {"w": w.T, "b": b} for i, (w, b) in enumerate(params)}
    g = grad(params)
    gd = {f"l{i}": {"w": gw.T, "b": gb} for i, (gw, gb) in enumerate(g)}
    opt_d = in_path_space(optax.adam(0.01), chains_from_dict(as_dict, ["l0", "l1", "l2"],
                                                              transposed=True))
    opt_p = in_path_space(optax.adam(0.01), chains_from_pairs(params))
    ud, _ = opt_d.update(gd, opt_d.init(as_dict), as_dict)
    up, _ = opt_p.update(g, opt_p.init(params), params)
    for i, (uw, ub) in enumerate(up):
        assert_close(np.asarray(ud[f"l{i}"]["w"].T), np.asarray(uw), 1e-14)
        assert_close(np.asarray(ud[f"l{i}"]["b"]), np.asarray(ub), 1e-14)
    with pytest.raises(ValueError, match=r"^in_path_space takes chains \(ChainLeaves with a "
                                         r"chain\), not PSI groups$"):
        in_path_space(optax.adam(0.01), [ChainLeaves(None, ((0, 0),), ())])
    with pytest.raises(ValueError, match=r"^in_path_space needs params: "
                                         r"opt\.update\(grads, state, params\)$"):
        opt_p.update(g, opt_p.init(params))


@settings(max_examples=examples(8))
@given(data=st.data(), seed=seeds)
def test_in_path_space_adam_twins_coincide_on_drawn_chains(data, seed):
    """Drawn chains (JAX's fixed shapes; drawn skeletons, slots, biases and rescalings):
    5 steps of ``in_path_space(optax.adam)`` from ``w`` and from a rescaling ``g(w)`` stay
    ``g``-related (gradients from the torch reference network)."""
    with fixed_shapes():  # JAX compiles per shape
        chain = data.draw(chains(max_depth=3))
    pb = Problem(chain, seed)
    leaves = ChainLeaves(chain, tuple((l, 0) for l in range(chain.L)),
                         tuple(None if v is None else (l, 1) for l, v in enumerate(pb.b)))
    scales = gc.random_rescaling(chain, pb.rng, 1.0)
    Wt, bt = gc.rescale(chain, pb.W, pb.b, scales)
    ends = []
    for W, b in ((pb.W, pb.b), (Wt, bt)):
        opt = in_path_space(optax.adam(0.01), [leaves])
        params = [(jnp.asarray(w), None if v is None else jnp.asarray(v)) for w, v in zip(W, b)]
        state = opt.init(params)
        for _ in range(5):
            G, Gb = pb.grads([np.asarray(w) for w, _ in params],
                             [None if v is None else np.asarray(v) for _, v in params])
            grads = [(jnp.asarray(g), None if gb is None else jnp.asarray(gb))
                     for g, gb in zip(G, Gb)]
            updates, state = opt.update(grads, state, params)
            params = optax.apply_updates(params, updates)
        ends.append(([np.asarray(w) for w, _ in params],
                     [None if v is None else np.asarray(v) for _, v in params]))
    We, be = gc.rescale(chain, *ends[0], scales)
    for a, e in zip(ends[1][0] + ends[1][1], list(We) + list(be)):
        if e is not None:
            assert_close(a, e, 1e-7, "twin after 5 steps of in_path_space(adam)")


def test_in_path_space_composes_inside_optax_chain():
    """``optax.chain(clip_by_global_norm, in_path_space(adam))`` is the clipped gradients
    handed to ``in_path_space(adam)``."""
    params = make_params()
    chains = chains_from_pairs(params)
    opt = optax.chain(optax.clip_by_global_norm(0.1), in_path_space(optax.adam(0.01), chains))
    ours, traces = run(opt, params, 3)
    assert traces == 1
    inner, p = in_path_space(optax.adam(0.01), chains), params
    state = inner.init(p)
    for _ in range(3):
        g = grad(p)
        scale = jnp.minimum(1.0, 0.1 / optax.tree.norm(g))
        u, state = inner.update(jax.tree_util.tree_map(lambda x, s=scale: x * s, g), state, p)
        p = optax.apply_updates(p, u)
    for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(p)):
        assert_close(np.asarray(a), np.asarray(b), 1e-12)


def test_path_sgd_steps_like_the_core_and_plain_sgd_elsewhere_and_keeps_no_chain_state():
    """Three steps: the chain as gsgd_core.path_sgd_step iterated; the leaf outside every
    chain as ``t - lr * g`` (no momentum, no decay: Path-SGD takes none); no state per chain."""
    params, chains, g = _with_temperature()
    opt = path_sgd(0.05, chains)
    assert jax.tree_util.tree_leaves(opt.init(params).chains) == []
    p, _ = run(opt, params, 3, g)
    ref = params
    for _ in range(3):
        gr = g(ref)
        W, b = gc.path_sgd_step(chains[0].chain, [w for w, _ in ref["net"]],
                                [v for _, v in ref["net"]], [x for x, _ in gr["net"]],
                                [x for _, x in gr["net"]], 0.05)
        ref = {"net": list(zip(W, b)), "t": ref["t"] - 0.05 * gr["t"]}
    for got, want in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(ref)):
        assert_close(np.asarray(got), np.asarray(want), 1e-12)


@pytest.mark.parametrize("momentum, max_norm", [(None, None), (0.9, 2.5)])
def test_psi_sgd_over_steps_equals_the_core_with_its_defaults_or_given_values(momentum,
                                                                               max_norm):
    """Three steps of PSI-SGD(M) on two normalised weights, against gsgd_core.psi_update
    iterated with the same momentum and max_norm (or the core's defaults when psi_sgd is
    given none), and torch's SGD(M) (dampening 0) on the leaf outside. The weights start
    with row norms near 3: a max_norm of 2.5 rescales them."""
    params, _, g = _with_temperature()
    params = {"net": [(3 * w, v) for w, v in params["net"]], "t": params["t"]}
    paths = [("net", 0, 0), ("net", 1, 0)]
    given = {k: v for k, v in (("momentum", momentum), ("max_norm", max_norm)) if v is not None}
    p, _ = run(psi_sgd(0.05, paths, **given), params, 3, g)
    ref, sgd = params, optax.sgd(0.05, momentum=momentum)
    cs, ss = gc.psi_init([w for w, _ in params["net"][:2]]), sgd.init(params)
    for _ in range(3):
        gr = g(ref)
        W, cs = gc.psi_update(cs, [w for w, _ in ref["net"][:2]],
                              [x for x, _ in gr["net"][:2]], lr=0.05, **given)
        su, ss = sgd.update(gr, ss)
        ref = optax.apply_updates(ref, su)
        ref["net"][:2] = [(w, v) for w, (_, v) in zip(W, ref["net"][:2])]
    for got, want in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(ref)):
        assert_close(np.asarray(got), np.asarray(want), 1e-12)


def test_psi_sgd_default_max_norm_is_the_cores():
    """A row of norm just above 1e4 (the core's default) is normalised; psi_sgd without a
    max_norm must rescale it as the core does."""
    params = {"w": jnp.asarray([[6000.0, 8000.5], [0.3, 0.4]]), "b": jnp.asarray([0.1, 0.2])}
    grads = {"w": jnp.asarray([[1e-12, 0.0], [0.5, -0.5]]), "b": jnp.asarray([1.0, 1.0])}
    opt = psi_sgd(0.1, [("w",)])
    u, _ = opt.update(grads, opt.init(params), params)
    (W,), _ = gc.psi_update(gc.psi_init([params["w"]]), [params["w"]], [grads["w"]], lr=0.1)
    assert float(jnp.linalg.norm(W[0])) == pytest.approx(1.0)
    assert_close(np.asarray(params["w"] + u["w"]), np.asarray(W), 1e-12)


def test_psi_sgd_without_normalised_weights_is_sgd_everywhere():
    params, _, g = _with_temperature()
    p, _ = run(psi_sgd(0.05, [], momentum=0.9), params, 3, g)
    q, _ = run(optax.sgd(0.05, momentum=0.9), params, 3, g)
    for got, want in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(q)):
        assert_close(np.asarray(got), np.asarray(want), 1e-12)


def test_psi_sgd_reads_a_discoverys_normalised_weights_through_their_layouts():
    """Given find_chains' result, PSI-SGDM acts on the output units of each normalised
    weight (the last axis of Flax's ``(..., in, out)`` kernels, not the first): two steps
    equal the core's psi_update on the layout views."""
    pytest.importorskip("flax")
    pytest.importorskip("haiku")
    pytest.importorskip("equinox")
    from _jax_catalogue import CATALOGUE
    from gsgd_adapters.jax import find_chains
    from gsgd_adapters.jax.leaves import key_paths

    apply, params, args, kwargs = CATALOGUE["flax_batch_norm"].build()
    params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float64), params)
    found = find_chains(apply, params, *args, **kwargs).within("params")
    group, sub = found.normalised, params["params"]
    assert group.weights and group.layouts is not None
    paths = key_paths(sub)[0]
    grads = jax.tree_util.tree_map(lambda x: jnp.cos(jnp.arange(x.size).reshape(x.shape)
                                                     + 1.0), sub)
    opt = psi_sgd(0.1, found, momentum=0.9)
    state, p = opt.init(sub), sub
    index = {path: i for i, path in enumerate(paths)}
    views = lambda tree: group.arrays(index, jax.tree_util.tree_leaves(tree))[0]  # noqa: E731
    W, cs = views(sub), gc.psi_init(views(sub))
    for _ in range(2):
        u, state = opt.update(grads, state, p)
        p = optax.apply_updates(p, u)
        W, cs = gc.psi_update(cs, W, views(grads), lr=0.1, momentum=0.9)
    for got, want in zip(views(p), W):
        assert_close(np.asarray(got), np.asarray(want), 1e-12)


def test_weights_that_form_no_chain_are_named_with_their_shapes():
    with pytest.raises(ValueError, match=r"^the weights \[0/0 \(6, 5\), 1/0 \(7, 4\)\] do not "
                                         r"form a chain: layer 2: weight shape \(7, 4\) does not "
                                         r"follow layer 1 of 6 units"):
        chains_from_pairs([(jnp.zeros((6, 5)), None), (jnp.zeros((7, 4)), jnp.zeros(7))])
    with pytest.raises(ValueError, match=r"^the weights \[a/w \(6, 5\), b/w \(7, 4\)\]"):
        chains_from_dict({"a": {"w": jnp.zeros((6, 5))}, "b": {"w": jnp.zeros((7, 4))}},
                         ["a", "b"])


def test_hand_described_convolutions_step_as_the_core_in_either_layout():
    """Pairs of ``(out, in, kh, kw)`` kernels and a dense ``(out, C*S)`` after a channel-major
    flatten step as the core on their ``(out, in, k)`` views; the same net as ``(kh, kw, in,
    out)`` kernels and an ``(C*S, out)`` dense with ``transposed`` steps the same."""
    rng = np.random.default_rng(4)
    shapes = [(4, 3, 2, 3), (5, 4, 3, 1), (2, 5 * 6)]
    views = [(4, 3, 6), (5, 4, 3), (2, 5, 6)]
    W = [rng.standard_normal(s) for s in shapes]
    G = [rng.standard_normal(s) for s in shapes]
    b = [rng.standard_normal(s[0]) for s in shapes]
    gb = [rng.standard_normal(s[0]) for s in shapes]
    chains = chains_from_pairs([(jnp.asarray(w), jnp.asarray(v)) for w, v in zip(W, b)])
    assert chains[0].chain == gc.Chain((3, 4, 5, 2), (6, 3, 6))
    Wc, bc = gc.gsgd_step(chains[0].chain, [w.reshape(v) for w, v in zip(W, views)], b,
                          [g.reshape(v) for g, v in zip(G, views)], gb, 0.1)
    want = [w.reshape(s) for w, s in zip(Wc, shapes)]

    def step(chains, to_leaf):
        pairs = [(jnp.asarray(to_leaf(w)), jnp.asarray(v)) for w, v in zip(W, b)]
        grads = [(jnp.asarray(to_leaf(g)), jnp.asarray(v)) for g, v in zip(G, gb)]
        opt = gsgd(0.1, chains)
        u, _ = opt.update(grads, opt.init(pairs), pairs)
        return optax.apply_updates(pairs, u)

    hwio = lambda w: w.T if w.ndim == 2 else w.transpose(2, 3, 1, 0)
    for described, to_leaf, back in (
            (chains, lambda w: w, lambda w: w),
            (chains_from_pairs([(jnp.asarray(hwio(w)), jnp.asarray(v)) for w, v in zip(W, b)],
                               transposed=True),
             hwio, lambda w: w.T if w.ndim == 2 else w.transpose(3, 2, 0, 1))):
        for (w, v), w2, v2 in zip(step(described, to_leaf), want, bc):
            assert_close(back(np.asarray(w)), w2, 1e-13)
            assert_close(np.asarray(v), v2, 1e-13)


def test_chain_leaves_without_layouts_read_2d_kernels_transposed_and_the_rest_as_the_core():
    """A hand-built ``ChainLeaves(..., transposed=True)`` without layouts reads a 2-D leaf as
    an ``(in, out)`` kernel and any other as the core's ``(out, in, k)``, both ways."""
    rng = np.random.default_rng(5)
    chain = gc.Chain((3, 4, 5, 2), (2, 1, 1), bias=False)
    W = [rng.standard_normal(s) for s in ((4, 3, 2), (5, 4), (2, 5))]
    G = [rng.standard_normal(w.shape) for w in W]
    leaf = lambda x: x if x.ndim == 3 else x.T
    params = {k: jnp.asarray(leaf(w)) for k, w in zip("cde", W)}
    grads = {k: jnp.asarray(leaf(g)) for k, g in zip("cde", G)}
    chains = [ChainLeaves(chain, (("c",), ("d",), ("e",)), (None,) * 3, transposed=True)]
    opt = gsgd(0.1, chains)
    u, _ = opt.update(grads, opt.init(params), params)
    got = optax.apply_updates(params, u)
    want, _ = gc.gsgd_step(chain, W, None, G, None, 0.1)
    for k, w in zip("cde", want):
        assert_close(np.asarray(got[k]), leaf(w), 1e-13)


def test_a_chain_naming_a_leaf_that_params_lack_is_refused_with_its_key_path():
    params = make_params()
    chains = chains_from_pairs(params)
    for wrong, path in (
            (ChainLeaves(chains[0].chain, ((0, 0), (1, 0), (3, 0)), chains[0].biases), "(3, 0)"),
            (ChainLeaves(chains[0].chain, chains[0].weights, ((0, 1), (1, 1), (2, 2))), "(2, 2)")):
        opt = gsgd(0.1, [wrong])
        other = path[:-1] + ", 'value')"   # the key path of a Flax NNX Variable-wrapped leaf
        with pytest.raises(ValueError, match=rf"^no leaf at key path {re.escape(path)} in "
                                             rf"params, nor at {re.escape(other)}: "):
            opt.update(grad(params), opt.init(params), params)
