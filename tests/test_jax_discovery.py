"""find_chains beyond the catalogue: the jaxpr forms it sees through, its self-check, bad
input, models with nothing to prove, layouts, hand descriptions checked like found ones."""

import math
from dataclasses import replace
import re
import warnings

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
nn = pytest.importorskip("flax.linen")
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402
from jax.experimental import io_callback  # noqa: E402

import gsgd_core as gc  # noqa: E402
from gsgd_adapters.jax import (ChainLeaves, Discovery, Layout, check_invariance,  # noqa: E402
                               discovery, find_chains, random_rescale, skeleton_init,
                               skeleton_state, units)
from gsgd_adapters.jax.leaves import key_paths, path_name  # noqa: E402
from gsgd_adapters.jax.ops import DEFAULT_BOUND  # noqa: E402
from gsgd_adapters.optax import (chains_from_dict, chains_from_pairs, gsgd, path_sgd,  # noqa: E402
                                 psi_sgd)

X = jax.random.normal(jax.random.PRNGKey(1), (4, 5))
SIZES = [(5, 6), (6, 4), (4, 3)]


def pairs(key=0):
    ks = jax.random.split(jax.random.PRNGKey(key), 3)
    return [(jax.random.normal(k, (o, i)), 0.1 * jax.random.normal(k, (o,)))
            for k, (i, o) in zip(ks, SIZES)]


@jax.custom_vjp
def vjp_relu(x):
    return jnp.maximum(x, 0.0)


vjp_relu.defvjp(lambda x: (vjp_relu(x), x), lambda x, g: (g * (x > 0),))


TYPED_KEY = jax.random.key(3)
MASK = jnp.arange(4 * 6).reshape(4, 6) % 3 > 0
ACTIVATIONS = {
    "jax.nn.relu": jax.nn.relu,                       # custom_jvp_call around max
    "jit": jax.jit(lambda x: jnp.maximum(x, 0.0)),    # a pjit body
    "checkpoint": jax.checkpoint(jax.nn.relu),        # remat
    "custom_vjp": vjp_relu,
    "where": lambda x: jnp.where(x >= 0, x, 0.0),     # select_n
    "clip": lambda x: jnp.clip(x, 0.0),               # max with a broadcast zero
    # select_n on a test of the batch size, fixed when traced: the ReLU, not the constant
    "where on a static test": lambda x: jnp.where(jnp.asarray(x.shape[0]) - 1 > 0,
                                                  jax.nn.relu(x), 0.5),
    # a test of a loop's count (a primitive of several results), fixed when traced
    "where on a loop's count": lambda x: jnp.where(
        jax.lax.fori_loop(0, 2, lambda i, c: c + 1.0, 0.0) > 1.0, jax.nn.relu(x), 0.5),
    # dropout by a captured typed key (a constant with no NumPy value); a constant mask
    "dropout, captured key": lambda x: jnp.where(jax.random.bernoulli(
        TYPED_KEY, 0.9, x.shape), jax.nn.relu(x) / 0.9, 0.0),
    # dropout by a key made from a seed when traced (a scalar with no NumPy value)
    "dropout, key from a seed": lambda x: jnp.where(jax.random.bernoulli(
        jax.random.key(3), 0.9, x.shape), jax.nn.relu(x) / 0.9, 0.0),
    "where on a constant mask": lambda x: jnp.where(MASK[:, :x.shape[1]], jax.nn.relu(x), 0.0),
    # a constant mask's halves swapped: a primitive of several results on constants
    "where on a split constant mask": lambda x: jnp.where(jnp.concatenate(
        jnp.split(MASK[0, :x.shape[1]], 2)[::-1]), jax.nn.relu(x), 0.0),
    # a mask computed from constants when traced (iota < 3), not a scalar test
    "where on an iota mask": lambda x: jnp.where(jnp.arange(x.shape[1]) < 3, jax.nn.relu(x),
                                                 0.0),
    # a value with no shape (a token) in the program
    "relu(x), a token made and dropped": lambda x: (jax.lax.create_token(), jax.nn.relu(x))[1],
    "where, zero first": lambda x: jnp.where(x < 0, 0.0, x),   # select_n(x < 0, x, 0)
    "flip of the batch": lambda x: jnp.flip(jax.nn.relu(x), 0),
    "-min(-x, 0)": lambda x: -jnp.minimum(-x, 0.0),
    # sign tests: of one value, or between two of the same units
    "where(x > x / 2, x, 0)": lambda x: jnp.where(x > x / 2, x, 0.0),
    "x * (sign(x) > 0)": lambda x: x * (jnp.sign(x) > 0),
    # along the batch, not the units: cumulative sums, slices and zero padding
    "cumsum over the batch": lambda x: jnp.cumsum(jax.nn.relu(x), 0),
    "every other example": lambda x: jax.nn.relu(x)[::2],
    "all examples but the first": lambda x: jax.nn.relu(x)[1:],   # a slice without strides
    "zero-padded batch": lambda x: jnp.pad(jax.nn.relu(x), ((1, 0), (0, 0))),
    "relu(x)[:, None] squeezed": lambda x: jnp.squeeze(jax.nn.relu(x)[:, None, :], 1),
    "relu(x) + zeros": lambda x: jax.nn.relu(x) + jnp.zeros(x.shape[-1]),
    "relu(x) - zeros": lambda x: jax.nn.relu(x) - jnp.zeros_like(x),
    # dead code (make_jaxpr keeps it) cannot change the output
    "relu(x), tanh(x) unused": lambda x: (jnp.tanh(x), jax.nn.relu(x))[1],
    # the gradient of |h|**2 / 2 at relu(x): its cotangents meet in add_any
    "grad of sum(h * h) / 2 at relu(x)": lambda x: jax.grad(
        lambda h: 0.5 * jnp.sum(h * h))(jax.nn.relu(x)),
}


@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_relu_in_each_jaxpr_form_passes(act):
    found = find_chains(lambda p, x: _mlp(p, x, ACTIVATIONS[act]), pairs(), X)
    assert [[path_name(p) for p in c.weights] for c in found] == [["0/0", "1/0", "2/0"]]
    assert [path_name(p) for p in found[0].biases] == ["0/1", "1/1", "2/1"]


def test_the_self_check_drops_an_unsound_claim(monkeypatch):
    def apply(params, x):
        return jnp.tanh(x @ params[0][0].T) @ params[1][0].T
    params = pairs()[:2]
    assert len(find_chains(apply, params, X)) == 0
    # a rule that wrongly passes tanh: the claim is made, and the self-check refuses it
    monkeypatch.setattr(units, "ELEMENTWISE", units.ELEMENTWISE | {"tanh"})
    claimed = find_chains(apply, params, X, check=False)
    assert len(claimed) == 1
    with pytest.raises(ValueError, match="0/0 -> 1/0 is not a chain"):
        check_invariance(apply, params, X, chains=claimed)
    found = find_chains(apply, params, X)
    assert len(found) == 0 and "self-check" in found.reasons["0/0"]
    # a dropped chain's biases are left out for the same reason as its weights
    found = find_chains(_tanh_net, params, X)
    why = "the self-check found that a random rescaling of chain 0/0 -> 1/0 changes"
    assert len(found) == 0 and set(found.reasons) == {"0/0", "0/1", "1/0", "1/1"}
    assert all(r.startswith(why) for r in found.reasons.values()), found.reasons


def _mlp(params, x, act=jax.nn.relu):
    """``x @ w.T + b`` for each ``(w, b)``, with ``act`` between the layers."""
    for i, (w, b) in enumerate(params):
        x = x @ w.T + b
        x = act(x) if i < len(params) - 1 else x
    return x


def _tanh_net(params, x):
    return jnp.tanh(x @ params[0][0].T + params[0][1]) @ params[1][0].T + params[1][1]


def _changes_by_hand(apply, params, chains, spread, seed):
    """Each chain's ``max |out' - out| / max |out|`` with its hidden units rescaled by
    ``random_rescale`` under ``fold_in(PRNGKey(seed), k)`` for the ``k``-th chain."""
    ref = apply(params, X)
    return {c.name(): float(jnp.max(jnp.abs(apply(random_rescale(
        params, [c], jax.random.fold_in(jax.random.PRNGKey(seed), k), spread), X) - ref))
        / jnp.max(jnp.abs(ref))) for k, c in enumerate(chains)}


def test_the_self_check_rescales_each_chain_by_its_spread_and_seed(monkeypatch):
    """``check_invariance`` draws chain ``k``'s scales from ``fold_in(PRNGKey(seed), k)``
    with ``spread`` (defaults 1 and 0), and so does ``find_chains``' self-check."""
    params = pairs()[:2]
    chains = chains_from_pairs(params)
    got = {kw: check_invariance(_tanh_net, params, X, chains=chains, rtol=math.inf,
                                **dict(kw)) for kw in ((), (("spread", 0.5), ("seed", 3)))}
    assert got[()] == pytest.approx(_changes_by_hand(_tanh_net, params, chains, 1.0, 0), 1e-12)
    assert got[(("spread", 0.5), ("seed", 3))] == pytest.approx(
        _changes_by_hand(_tanh_net, params, chains, 0.5, 3), 1e-12)
    assert abs(got[()]["0/0 -> 1/0"] / got[(("spread", 0.5), ("seed", 3))]["0/0 -> 1/0"]
               - 1) > 0.1   # the two draws differ
    monkeypatch.setattr(units, "ELEMENTWISE", units.ELEMENTWISE | {"tanh"})
    found = find_chains(_tanh_net, params, X)
    assert found.changes == pytest.approx(got[()], 1e-12) and not found.chains


def test_find_chains_keeps_a_chain_whose_change_is_its_rtol_and_drops_one_above(monkeypatch):
    rtol = discovery.default_rtol()
    for change, kept in ((rtol, 1), (rtol * (1 + 1e-9), 0)):
        monkeypatch.setattr(discovery, "output_changes",
                            lambda *a, c=change: {"0/0 -> 1/0 -> 2/0": c})
        found = find_chains(_mlp, pairs(), X)
        assert len(found) == kept and found.changes == {"0/0 -> 1/0 -> 2/0": change}
    assert find_chains(_mlp, pairs(), X, check=False).changes == {}


def test_a_chain_ends_where_its_last_layer_stops_passing_its_units_on():
    def apply(p, x):
        return jnp.tanh(_mlp(p[:3], x)) @ p[3][0].T
    params = pairs() + [(jnp.ones((2, 3)), None)]
    found = find_chains(apply, params, X)
    assert [c.name() for c in found] == ["0/0 -> 1/0 -> 2/0"]
    assert list(found.ends) == ["0/0 -> 1/0 -> 2/0"] and "tanh" in found.ends["0/0 -> 1/0 -> 2/0"]


def test_a_second_bias_added_to_a_layer_ends_its_chain():
    """A layer holds one bias: a second leaf laid out along the units, added after the
    first, ends the chain (a claim with the first bias alone would not be invariant)."""
    params = {"w1": pairs()[0][0].T, "w2": pairs()[1][0].T, "b": pairs()[0][1],
              "b2": pairs(1)[0][1]}
    for check in (False, True):
        found = find_chains(lambda p, x: jax.nn.relu(x @ p["w1"] + p["b"] + p["b2"]) @ p["w2"],
                            params, X, check=check)
        assert len(found) == 0 and found.reasons["w1"].endswith(
            "it is added to a value that does not carry its unit scales in add (a constant, a "
            "residual or another branch)"), found.reasons["w1"]


def test_a_layer_whose_active_units_the_model_returns_stays_in_its_chain():
    """Which units of a layer are active (``h > 0``), returned beside the output, does not
    change under a positive rescaling of the units: the layer keeps its chain."""
    def apply(p, x):
        h = x @ p["w1"]
        return jax.nn.relu(h) @ p["w2"], h > 0
    params = {"w1": pairs()[0][0].T, "w2": pairs()[1][0].T}
    for check in (False, True):
        found = find_chains(apply, params, X, check=check)
        assert [[path_name(p) for p in c.weights] for c in found] == [["w1", "w2"]]


def test_the_self_check_passes_a_change_of_rtol_and_names_what_fails():
    params = pairs()[:2]
    chains = chains_from_pairs(params)
    change = check_invariance(_tanh_net, params, X, chains=chains, rtol=math.inf)["0/0 -> 1/0"]
    assert change > 1e-3
    assert check_invariance(_tanh_net, params, X, chains=chains, rtol=change) == {
        "0/0 -> 1/0": change}
    with pytest.raises(ValueError, match="^" + re.escape(
            f"chain 0/0 -> 1/0 is not a chain of this model: a random positive rescaling of "
            f"its hidden units changes the output by {change:.3g} (relative); describe it "
            "without the layers that break it") + "$"):
        check_invariance(_tanh_net, params, X, chains=chains, rtol=change * (1 - 1e-9))


def test_the_self_check_computes_in_float64_where_enabled_and_in_float32_otherwise():
    """float32 params are checked in float64 where JAX has it (rounding far below its
    1e-9); without it, in float32 against 1e-4, where an unsound chain still fails."""
    params = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), pairs())
    chains = chains_from_pairs(params)
    x = X.astype(jnp.float32)
    assert check_invariance(_mlp, params, x, chains=chains)["0/0 -> 1/0 -> 2/0"] < 1e-12
    with jax.enable_x64(False):
        assert check_invariance(_mlp, params, x, chains=chains)["0/0 -> 1/0 -> 2/0"] < 1e-4
        with pytest.raises(ValueError, match="is not a chain of this model"):
            check_invariance(_tanh_net, params[:2], x, chains=chains_from_pairs(params[:2]))


def test_the_self_check_reads_the_float_outputs_only():
    """A key or an integer among the outputs is not compared (a key has no difference); a
    model with no float output changes by 0."""
    params = pairs()
    chains = chains_from_pairs(params)

    def apply(params, x):
        y = _mlp(params, x)
        return y, jax.random.key(0), jnp.argmax(y, 1)
    assert check_invariance(apply, params, X, chains=chains)["0/0 -> 1/0 -> 2/0"] < 1e-12
    assert check_invariance(lambda p, x: apply(p, x)[1:], params, X, chains=chains) == {
        "0/0 -> 1/0 -> 2/0": 0.0}


def test_the_self_check_is_relative_to_the_output_and_calls_a_nan_inf():
    """The change is relative: scaling the output leaves it; a rescaling that makes the
    output NaN is an infinite change, named so in the reason."""
    params = pairs()[:2]
    chains = chains_from_pairs(params)
    change = check_invariance(_tanh_net, params, X, chains=chains, rtol=math.inf)
    small = check_invariance(lambda p, x: 1e-3 * _tanh_net(p, x), params, X, chains=chains,
                             rtol=math.inf)
    assert small == pytest.approx(change, 1e-9)
    w0 = pairs()[0][0]

    def apply(p, x):   # NaN as soon as the first weight moves
        return _mlp(p, x) + jnp.sum(jnp.sqrt(-(p[0][0] - w0) ** 2))
    params, chains = pairs(), chains_from_pairs(pairs())
    assert check_invariance(apply, params, X, chains=chains, rtol=math.inf) == {
        "0/0 -> 1/0 -> 2/0": math.inf}
    with pytest.raises(ValueError, match=r"changes the output by inf \(relative\)"):
        check_invariance(apply, params, X, chains=chains)


def test_the_self_check_tolerates_float64_rounding_only_where_enabled():
    """A chain that changes the output by about 1e-6 fails in float64 (1e-9) and passes
    in float32 (1e-4)."""
    def apply(p, x):
        return _mlp(p, x) + 1e-6 * jnp.tanh(x @ p[0][0].T).sum()
    params, chains = pairs(), chains_from_pairs(pairs())
    with pytest.raises(ValueError, match="is not a chain of this model"):
        check_invariance(apply, params, X, chains=chains)
    p32 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), params)
    with jax.enable_x64(False):
        assert check_invariance(apply, p32, X.astype(jnp.float32), chains=chains)


def test_the_self_check_without_float64_passes_a_float_on_and_warns_of_nothing():
    """Without float64, the arguments go to the model as given: a float stays a float (no
    float32 array in its place, with JAX's warning that float64 is not available)."""
    def apply(p, x, gain):
        assert isinstance(gain, float)
        return gain * _mlp(p, x)
    p32 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), pairs())
    with jax.enable_x64(False), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_invariance(apply, p32, X.astype(jnp.float32), 2.0,
                                chains=chains_from_pairs(p32))["0/0 -> 1/0 -> 2/0"] < 1e-4


def test_numpy_float32_parameters_are_checked_in_float64_as_jaxs_are():
    """With float64 on, NumPy float32 weights are rescaled and compared in float64, as JAX
    float32 weights are: float32 rounding would fail the float64 tolerance."""
    params = [(np.asarray(w, np.float32), np.asarray(b, np.float32)) for w, b in pairs()]
    found = find_chains(_mlp, params, X.astype(jnp.float32))
    assert len(found) == 1, found.reasons


def test_the_self_check_passes_non_array_arguments_on_and_skips_empty_outputs():
    """A string argument reaches the model as it is; an empty float output (nothing to
    compare) neither counts nor fails."""
    def apply(p, x, act="tanh"):
        y = _mlp(p, x, getattr(jax.nn, act))
        return y, y[:0], jnp.zeros((0, 3))
    params, chains = pairs(), chains_from_pairs(pairs())
    change = check_invariance(apply, params, X, "relu", chains=chains)
    assert change["0/0 -> 1/0 -> 2/0"] < 1e-12
    assert check_invariance(apply, params, X, chains=chains, act="relu") == change
    assert check_invariance(lambda p, x: apply(p, x, "relu")[1:], params, X,
                            chains=chains) == {"0/0 -> 1/0 -> 2/0": 0.0}


def test_non_array_leaves_of_the_params_and_arguments_reach_the_model_as_they_are():
    """A string among the params (a setting kept with the weights) and a string argument
    are passed on untraced: the chain is found, and the setting is no leaf to explain."""
    params = {"layers": pairs(), "act": "relu"}

    def apply(p, x, act, *, scale):
        return scale * _mlp(p["layers"], x, getattr(jax.nn, p["act"] if act is None else act))
    for found in (find_chains(apply, params, X, None, scale=2.0),
                  find_chains(apply, params, X, "relu", scale=2.0)):
        assert [[path_name(p) for p in c.weights] for c in found] == [
            ["layers/0/0", "layers/1/0", "layers/2/0"]]
        assert found.reasons == {}


@pytest.mark.parametrize("skeleton", ["he", "paper"])
def test_skeleton_init_is_the_cores_on_each_chains_view(skeleton):
    """"he" (the default): skeleton edges of magnitude ``he_skeleton_scale`` with their
    signs, the rest times ``sqrt(1 - 1/4)``; "paper": skeleton edges 1, the rest kept."""
    params = pairs()
    found = find_chains(_mlp, params, X)
    c, he = found[0], skeleton == "he"
    chain = c.chain.with_skeleton_scale(c.chain.he_skeleton_scale() if he else None)
    want, _ = gc.skeleton_init(chain, [w for w, _ in params], keep_signs=he,
                               rest_scale=math.sqrt(0.75) if he else 1.0)
    got = (skeleton_init(params, found) if he else
           skeleton_init(params, found, skeleton=skeleton))
    for (w, b), (_, b0), expected in zip(got, params, want):
        np.testing.assert_array_equal(w, expected)
        np.testing.assert_array_equal(b, b0)
    with pytest.raises(ValueError, match="^skeleton must be 'he' or 'paper', got 'HE'$"):
        skeleton_init(params, found, skeleton="HE")


def _equal_trees(a, b) -> bool:
    return jax.tree_util.tree_all(jax.tree_util.tree_map(lambda x, y: bool(jnp.all(x == y)),
                                                         a, b))


def test_skeleton_init_updates_an_nnx_module_in_place_by_the_recipe_asked_for():
    nnx = pytest.importorskip("flax.nnx")

    class MLP(nnx.Module):   # pairs() as NNX params (no initialiser to compile)
        def __init__(self, params):
            self.w = nnx.List([nnx.Param(w) for w, _ in params])
            self.b = nnx.List([nnx.Param(b) for _, b in params])

        def __call__(self, x):
            return _mlp([(w[...], b[...]) for w, b in zip(self.w, self.b)], x)
    model = MLP(pairs())
    found = find_chains(model, X, skeleton="paper", check=False)
    want = skeleton_init(nnx.as_pure(nnx.state(model, nnx.Param)), found, skeleton="paper")
    assert skeleton_init(model, found, skeleton="paper") is model
    assert _equal_trees(nnx.as_pure(nnx.state(model, nnx.Param)), want)


def test_skeleton_state_takes_weights_within_the_jax_libraries_defaults_as_default():
    """Flax's ``lecun_normal`` reaches ``DEFAULT_BOUND / sqrt(fan_in)``, Haiku's truncated
    normal ``2 / sqrt(fan_in)``: past torch's ``1 / sqrt(fan_in)``, still a default
    initialisation; past ``DEFAULT_BOUND`` it is none."""
    params = pairs()
    chains = chains_from_pairs(params)

    def reaching(bound):   # each layer's largest weight at bound / sqrt(fan_in)
        return [(w * (bound / math.sqrt(w.shape[1]) / jnp.max(jnp.abs(w))), b)
                for w, b in params]
    assert skeleton_state(reaching(2.0), chains) == ["default"]
    assert skeleton_state(reaching(1.01 * DEFAULT_BOUND), chains) == ["unknown"]
    init = skeleton_init(reaching(2.0), chains, skeleton="paper")   # the chains' recipe
    assert skeleton_state(init, chains) == ["initialised"]


def test_a_psi_group_among_the_chains_is_no_chain_to_the_chain_operations():
    """A PSI-SGD group (``chain`` None, as ``Discovery.normalised``) passed with the chains
    is left to ``psi_sgd``: no skeleton, rescaling, state or self-check of its weights."""
    params = pairs()
    chains = chains_from_pairs(params)
    mixed = chains + [ChainLeaves(None, ((1, 0),), ())]
    key = jax.random.PRNGKey(0)
    for got, want in ((skeleton_init(params, mixed), skeleton_init(params, chains)),
                      (random_rescale(params, mixed, key), random_rescale(params, chains, key))):
        assert _equal_trees(got, want)
    assert skeleton_state(params, mixed) == skeleton_state(params, chains) == ["unknown"]
    assert list(check_invariance(_mlp, params, X, chains=mixed)) == ["0/0 -> 1/0 -> 2/0"]


def _log_scales(params, twin):
    """Each hidden unit's log scale, read from its first incoming weight."""
    return np.log(np.asarray(twin[0][0][:, 0] / params[0][0][:, 0]))


def test_random_rescale_draws_log_scales_of_spread_sigma_per_chain():
    """Each hidden unit's scale is ``exp(spread * N(0, 1))`` (spread 1 by default), drawn
    apart for each chain; the function stays the same (Theorem 3.3)."""
    ks = jax.random.split(jax.random.PRNGKey(5), 2)
    one = [(jax.random.normal(ks[0], (3000, 3)), jnp.zeros(3000)),
           (jax.random.normal(ks[1], (2, 3000)), jnp.zeros(2))]
    params = {"a": one, "b": one}
    chains = [replace(c, weights=tuple((k,) + w for w in c.weights),
                      biases=tuple((k,) + b for b in c.biases))
              for k in "ab" for c in chains_from_pairs(one)]
    for kw, spread in (({}, 1.0), ({"spread": 0.5}, 0.5)):
        twin = random_rescale(params, chains, jax.random.PRNGKey(0), **kw)
        a, b = _log_scales(params["a"], twin["a"]), _log_scales(params["b"], twin["b"])
        for s in (a, b):
            assert abs(s.mean()) < 0.1 * spread and abs(s.std() / spread - 1) < 0.1
        assert abs(np.corrcoef(a, b)[0, 1]) < 0.1
        np.testing.assert_allclose(_mlp(twin["a"], X[:, :3]), _mlp(one, X[:, :3]), rtol=1e-9,
                                   atol=1e-9)
    # float32 stays float32 (with JAX's float64 enabled)
    typed = jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), one)
    twin = random_rescale(typed, chains_from_pairs(typed), jax.random.PRNGKey(0))
    assert {x.dtype for x in jax.tree_util.tree_leaves(twin)} == {jnp.dtype(jnp.float32)}
    same = random_rescale(params, chains, jax.random.PRNGKey(0), spread=0.0)
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(
        lambda x, y: bool(jnp.all(x == y)), same, params))
    for spread in (-0.5, math.inf, math.nan):
        with pytest.raises(ValueError, match=f"^spread must be finite and >= 0, got {spread}$"):
            random_rescale(params, chains, jax.random.PRNGKey(0), spread=spread)


def test_bad_input_says_what_it_was_given():
    with pytest.raises(ValueError, match=r"does not trace.*\(6, 5\).*\(4, 7\)"):
        find_chains(lambda p, x: x @ p[0][0].T, pairs(), jnp.ones((4, 7)))
    message = ("apply_fn does not trace with params of shapes [int, (6, 5)] and arguments of "
               "shapes [(4, 7), str]: TypeError: ")
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        find_chains(lambda p, x, s: x @ p["w"], {"w": jnp.ones((6, 5)), "k": 3},
                    jnp.ones((4, 7)), "s")
    with pytest.raises(ValueError, match="does not trace.*KeyError"):
        find_chains(lambda p, x: x @ p["dense"], {"other": jnp.ones((5, 3))}, X)
    with pytest.raises(ValueError, match=r"weights \[0/0 \(6, 5\)\].*at least 2 layers"):
        chains_from_pairs(pairs()[:1])


def test_a_leaf_the_model_never_reads_is_left_out_as_unused():
    params = {"net": pairs(), "spare": jnp.ones(3)}
    found = find_chains(lambda p, x: _mlp(p["net"], x), params, X)
    assert found.reasons == {"spare": "not used by the model"} and len(found) == 1


def test_a_model_of_one_layer_has_no_chain_and_says_why():
    found = find_chains(lambda p, x: x @ p["w"] + p["b"],
                        {"w": jnp.ones((5, 3)), "b": jnp.ones(3)}, X)
    why = ("its layer is in no chain of two or more layers: no layer before it passes its "
           "units on to it")
    assert len(found) == 0 and found.reasons == {"b": why, "w": why}


@pytest.mark.parametrize("skeleton", ["he", "paper"])
def test_a_found_chain_takes_the_skeleton_recipe_asked_for(skeleton):
    (found,) = find_chains(_mlp, pairs(), X, skeleton=skeleton)
    chain = gc.Chain.mlp([5, 6, 4, 3])
    if skeleton == "he":
        chain = chain.with_skeleton_scale(chain.he_skeleton_scale())
    assert found.chain == chain
    assert (found.chain.skeleton_scale == gc.Chain.mlp([5, 6, 4, 3]).skeleton_scale) == (
        skeleton == "paper")
    with pytest.raises(ValueError, match="^skeleton must be 'he' or 'paper', got 'HE'$"):
        find_chains(_mlp, pairs(), X, skeleton="HE")


class NormalisedMiddle(nn.Module):
    """Two chains around a batch-normalised layer; the first chain's last layer has no bias
    (Flax names the last two layers in the order they are built: Dense_4 feeds Dense_3)."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(6)(x))
        x = nn.relu(nn.Dense(5, use_bias=False)(x))
        x = nn.relu(nn.BatchNorm(use_running_average=False)(nn.Dense(4, use_bias=False)(x)))
        return nn.Dense(3)(nn.relu(nn.Dense(4)(x)))


def test_within_strips_the_prefix_from_every_name_and_refuses_a_chain_outside():
    model = NormalisedMiddle()
    variables = model.init(jax.random.PRNGKey(1), X)
    found = find_chains(lambda v, x: model.apply(v, x, mutable=["batch_stats"]), variables, X)
    sub = found.within("params")
    first, second = "Dense_0/kernel -> Dense_1/kernel", "Dense_4/kernel -> Dense_3/kernel"
    assert [c.weights for c in sub] == [(("Dense_0", "kernel"), ("Dense_1", "kernel")),
                                        (("Dense_4", "kernel"), ("Dense_3", "kernel"))]
    assert [c.biases for c in sub] == [(("Dense_0", "bias"), None),
                                       (("Dense_4", "bias"), ("Dense_3", "bias"))]
    assert [c.chain for c in sub] == [c.chain for c in found]
    assert sub.normalised.weights == (("Dense_2", "kernel"),)
    assert found.normalised.layouts == sub.normalised.layouts == (Layout(1, 0),)
    assert sub.reasons == {k[len("params/"):]: v for k, v in found.reasons.items()
                           if k.startswith("params/")}
    assert set(sub.reasons) == {"BatchNorm_0/bias", "BatchNorm_0/scale"}
    end = "the next layer is followed by a per-unit normalisation (PSI-SGD's)"
    assert found.ends == {"params/Dense_0/kernel -> params/Dense_1/kernel": end}
    assert sub.ends == {first: end}
    assert sub.changes == {first: found.changes["params/Dense_0/kernel -> params/Dense_1/kernel"],
                           second: found.changes["params/Dense_4/kernel -> params/Dense_3/kernel"]}
    assert f"  {first}: {sub[0].chain}\n    ends there: the next layer" in str(sub)
    with pytest.raises(ValueError, match=r"^chain params/Dense_0/kernel -> params/Dense_1/kernel "
                                         r"is not wholly under batch_stats$"):
        found.within("batch_stats")
    # a chain the self-check dropped keeps its change, under the subtree or not at all
    dropped = Discovery((), {"params/a": "why"}, changes={"params/a -> other/b": 0.5,
                                                          "params/a -> params/b": 0.1})
    assert dropped.within("params").changes == {"a -> b": 0.1}


def _split_net(p, x):
    """A batch-normalised layer ``n``, then a chain whose weights sit under ``w`` and whose
    biases sit under ``b``."""
    h = x @ p["n"].T
    m = jnp.mean(h, 0)
    h = jax.nn.relu((h - m) / jnp.sqrt(jnp.mean((h - m) ** 2, 0) + 1e-5))
    h = jax.nn.relu(h @ p["w"][0].T + p["b"][0])
    return h @ p["w"][1].T + p["b"][1]


def test_within_refuses_a_chain_or_normalised_weight_not_wholly_under_the_prefix():
    """The prefix must hold every weight and bias of every chain, and the normalised
    weights: stripped from a leaf outside it, a key path would name another leaf."""
    ks = jax.random.split(jax.random.PRNGKey(2), 3)
    params = {"n": jax.random.normal(ks[0], (6, 5)),
              "w": [jax.random.normal(ks[1], (4, 6)), jax.random.normal(ks[2], (3, 4))],
              "b": [0.1 * jnp.ones(4), 0.1 * jnp.ones(3)]}
    found = find_chains(_split_net, params, X)
    assert [c.name() for c in found] == ["w/0 -> w/1"]
    assert found.normalised.weights == (("n",),)
    assert found.within().chains == found.chains
    for prefix in ("w", "b", "n"):
        with pytest.raises(ValueError, match="^chain w/0 -> w/1 is not wholly under "
                                             f"{prefix}$"):
            found.within(prefix)
    chainless = replace(found, chains=())
    assert chainless.within("n").normalised.weights == ((),)
    with pytest.raises(ValueError, match="^chain n is not wholly under w$"):
        chainless.within("w")


def test_print_of_a_discovery_shows_chains_ends_normalised_weights_and_reasons():
    chain = gc.Chain.mlp([2, 3, 2])
    found = Discovery((ChainLeaves(chain, (("a",), ("b",)), (None, None)),),
                      {"c": "why c", "d/e": "why d"},
                      ChainLeaves(None, (("n", "w"), ("m", "w")), (), layouts=()),
                      {"a -> b": "its end"})
    assert str(found) == "\n".join([
        "1 chain(s)", f"  a -> b: {chain}", "    ends there: its end",
        "normalised per unit (PSI-SGD in psi_sgd): n/w, m/w",
        "left out (the inner optimizer's plain update):", "  c: why c", "  d/e: why d"])
    assert str(Discovery(())) == "0 chain(s)"


def test_a_model_with_nothing_proven_gets_no_chains_and_trains_as_sgd():
    class Gelu(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(nn.gelu(nn.Dense(6)(x)))
    model = Gelu()
    variables = model.init(jax.random.PRNGKey(0), X)
    found = find_chains(model.apply, variables, X)
    assert len(found) == 0 and len(found.reasons) == 4 and "left out" in str(found)
    grads = jax.tree_util.tree_map(jnp.ones_like, variables)
    for opt in (gsgd(0.1, found), gsgd(0.1, [])):
        updates, _ = opt.update(grads, opt.init(variables), variables)
        assert all(bool(jnp.all(u == -0.1)) for u in jax.tree_util.tree_leaves(updates))


@pytest.mark.parametrize("layout,shape", [
    (Layout(0, 1, (2, 3)), (4, 3, 2, 5)),      # OIHW
    (Layout.in_out(4), (2, 5, 3, 4)),          # HWIO
    (Layout(1, 0, P=6), (6 * 3, 4)),           # a Dense after an NHWC flatten
    (Layout(0, 1, Q=6), (4, 3 * 6)),           # a Linear after a CHW flatten
])
def test_layout_views_are_the_units_and_invert(layout, shape):
    x = jnp.arange(np.prod(shape), dtype=jnp.float64).reshape(shape)
    v = layout.view(x)
    assert v.shape == layout.core_shape(shape)
    assert bool(jnp.all(layout.leaf(v, shape) == x))
    # output unit j's row of the view holds exactly the leaf's entries on axis `out` = j
    for j in range(v.shape[0]):
        assert sorted(np.asarray(v[j]).ravel()) == sorted(
            np.asarray(jnp.take(x, j, axis=layout.out)).ravel())


@pytest.mark.parametrize("layout,shape", [
    (Layout(0, 1), (4, 3, 2)),                 # an axis the layout does not name
    (Layout(0, 1, (2, 3)), (4, 3, 2)),         # a slot past the weight's axes
    (Layout(1, 0, P=4), (6, 5)),               # 6 inputs do not split into 4 positions
    (Layout(0, 1, Q=4), (5, 6)),
])
def test_a_layout_that_does_not_fit_its_weight_is_refused_by_name(layout, shape):
    message = re.escape(f"layout {layout} does not fit a weight of shape {shape}")
    for call in (layout.core_shape, lambda s: layout.view(jnp.zeros(s)),
                 lambda s: layout.leaf(jnp.zeros(6), s)):
        with pytest.raises(ValueError, match=f"^{message}$"):
            call(shape)


def f64(tree):
    return jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), tree)


class FlaxCNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(3, (3, 3))(x))
        x = nn.relu(nn.Conv(4, (3, 3))(x))
        return nn.Dense(2)(x.reshape((x.shape[0], -1)))


def test_hand_descriptions_are_checked_like_found_chains():
    model, x = FlaxCNN(), jax.random.normal(jax.random.PRNGKey(2), (2, 5, 5, 2))
    params = f64(model.init(jax.random.PRNGKey(0), x))["params"]
    apply = lambda p, x: model.apply({"params": p}, x)
    # HWIO kernels by hand (transposed: (..., in, out)) are right: same chain as found
    convs = chains_from_dict(params, ["Conv_0", "Conv_1"], weight="kernel", bias="bias",
                             transposed=True)
    assert check_invariance(apply, params, x, chains=convs)
    found = find_chains(apply, params, x)
    assert found[0].chain.sizes == (2, 3, 4, 2) and found[0].chain.slots == (9, 9, 25)
    assert found.changes[found[0].name()] <= 1e-12
    # the Dense after the NHWC flatten, described by hand, reads it channel-major: wrong
    whole = chains_from_dict(params, ["Conv_0", "Conv_1", "Dense_0"], weight="kernel",
                             bias="bias", transposed=True)
    with pytest.raises(ValueError, match="is not a chain of this model"):
        check_invariance(apply, params, x, chains=whole)


def test_skeleton_init_and_random_rescale_act_through_layouts():
    model, x = FlaxCNN(), jax.random.normal(jax.random.PRNGKey(2), (2, 5, 5, 2))
    variables = f64(model.init(jax.random.PRNGKey(0), x))
    found = find_chains(model.apply, variables, x, skeleton="paper")
    c = found[0]
    init = skeleton_init(variables, found, skeleton="paper")
    flat = leaf_dict(init)
    for i, (p, mask) in enumerate(zip(c.weights, c.chain.tau_masks)):
        W = np.asarray(c.view(i, flat[p]))
        skeleton = mask | c.chain.free_masks[i]
        assert np.all(W[skeleton] == 1.0)
    twin = random_rescale(init, found, jax.random.PRNGKey(3))
    V = gc.path_values(c.chain, *views(c, init))
    V2 = gc.path_values(c.chain, *views(c, twin))
    for a, b in zip(V[0], V2[0]):
        np.testing.assert_allclose(a, b, rtol=1e-10)


def leaf_dict(tree):
    paths, leaves, _ = key_paths(tree)
    return dict(zip(paths, leaves))


def views(c, tree):
    flat = leaf_dict(tree)
    return ([c.view(i, flat[p]) for i, p in enumerate(c.weights)],
            [None if p is None else flat[p] for p in c.biases])


def test_path_sgd_and_psi_sgd_take_a_discovery():
    model, x = FlaxCNN(), jax.random.normal(jax.random.PRNGKey(2), (2, 5, 5, 2))
    params = f64(model.init(jax.random.PRNGKey(0), x))
    found = find_chains(model.apply, params, x, skeleton="paper")
    assert len(found) == 1
    params = skeleton_init(params, found, skeleton="paper")
    twin = random_rescale(params, found, jax.random.PRNGKey(4))
    assert float(jnp.max(jnp.abs(twin["params"]["Conv_1"]["kernel"]
                                 - params["params"]["Conv_1"]["kernel"]))) > 1e-3
    loss = lambda p: jnp.sum(model.apply(p, x) ** 2)
    opt = path_sgd(1e-3, found)
    outs = []
    for p in (params, twin):
        updates, _ = opt.update(jax.grad(loss)(p), opt.init(p), p)
        outs.append(model.apply(optax.apply_updates(p, updates), x))
    assert float(jnp.max(jnp.abs(outs[0] - model.apply(params, x)))) > 1e-6
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-9, atol=1e-12)
    # no normalised weights: PSI-SGD is SGD on every leaf
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    updates, _ = psi_sgd(0.5, found).update(grads, psi_sgd(0.5, found).init(params), params)
    assert all(bool(jnp.all(u == -0.5)) for u in jax.tree_util.tree_leaves(updates))


def _over_mean_abs(f):
    """``f(h, x)`` divided by its mean magnitude over the batch: degree 0 wherever
    ``f(h, x)`` has one degree per unit."""
    def norm(h, x):
        s = f(h, x)
        return s / jnp.mean(jnp.abs(s), 0)
    return norm


def _outer(h, x):
    """``h_i * h_j / mean(h_j**2)`` summed over ``i``: scales as ``c_i / c_j``, not per unit
    (the product holds the units on two axes)."""
    return (h[:, :, None] * h[:, None, :] / jnp.mean(h * h, 0)).sum(1)


def _relu_by_where(h, x):
    r = jnp.where(h > 0, h, 0.0)   # a sign test (no degree) selects a value of degree 1
    return r * jax.lax.rsqrt(jnp.mean(r * r, 0) + 1e-5)


NORMS_BY_DEGREE = {  # of the first layer's output h (x: the input), per unit over the batch
    "(h - mean) / sqrt(var + eps)": (lambda h, x: (h - h.mean(0)) / jnp.sqrt(
        ((h - h.mean(0)) ** 2).mean(0) + 1e-5), True),
    "h * (1 / sqrt(mean(h**2)))": (lambda h, x: h * (1.0 / jnp.sqrt(jnp.mean(h ** 2, 0))),
                                   True),
    "h * h / mean(h**2)": (lambda h, x: h * h / jnp.mean(h ** 2, 0), True),
    # jnp.var selects the variance or NaN on the sample count, a test fixed when traced
    "(h - mean) / sqrt(jnp.var + eps)": (lambda h, x: (h - h.mean(0)) / jnp.sqrt(
        jnp.var(h, 0) + 1e-5), True),
    "h / jnp.std": (lambda h, x: h / jnp.std(h, 0), True),
    "where(static test, h, h*h) / mean|h|": (lambda h, x: jnp.where(
        jnp.asarray(h.shape[0]) > 0, h, h * h) / jnp.mean(jnp.abs(h), 0), True),
    "h / 2": (lambda h, x: h / 2.0, False),
    "2 / h": (lambda h, x: 2.0 / h, False),
    "h / mean(h**2)": (lambda h, x: h / jnp.mean(h ** 2, 0), False),
    "h**3 / mean(|h|**3)": (lambda h, x: h ** 3 / jnp.mean(jnp.abs(h) ** 3, 0), True),
    "h**3 / mean(h**2)": (lambda h, x: h ** 3 / jnp.mean(h ** 2, 0), False),
    "where(h > 0, h, 0), normalised": (_relu_by_where, True),
    "sum over i of h_i * h_j / mean(h_j**2)": (_outer, False),
    # sums and extrema: of one degree, or with a zero or an eps, they keep it
    "(h + 2h) / mean|.|": (_over_mean_abs(lambda h, x: h + 2.0 * h), True),
    "max(h, 2h) / mean|.|": (_over_mean_abs(lambda h, x: jnp.maximum(h, 2.0 * h)), True),
    "(h + h*h) / mean|.|": (_over_mean_abs(lambda h, x: h + h * h), False),
    "(h - h*h) / mean|.|": (_over_mean_abs(lambda h, x: h - h * h), False),
    "max(h, h*h) / mean|.|": (_over_mean_abs(lambda h, x: jnp.maximum(h, h * h)), False),
    "min(h, h*h) / mean|.|": (_over_mean_abs(lambda h, x: jnp.minimum(h, h * h)), False),
    "(h - 1) / mean|.|": (_over_mean_abs(lambda h, x: h - 1.0), False),
    # a scalar constant is an eps only beside a statistic (a value reduced over the batch)
    "(h + 1) / mean|.|": (_over_mean_abs(lambda h, x: h + 1.0), False),
    "h / (mean|h| + eps)": (lambda h, x: h / (jnp.mean(jnp.abs(h), 0) + 1e-5), True),
    "(h - mean) / (std + eps)": (lambda h, x: (h - h.mean(0)) / (jnp.sqrt(
        ((h - h.mean(0)) ** 2).mean(0)) + 1e-5), True),
    "(h + sum(x)) / mean|.|": (_over_mean_abs(lambda h, x: h + x.sum()), False),
    # an eps is a scalar computed from constants only: a captured key's draw is one, a
    # constant per unit or a scalar of the input is not
    "h / (mean|h| + eps drawn from a captured key)": (lambda h, x: h / (jnp.mean(
        jnp.abs(h), 0) + 1e-5 * jax.random.uniform(TYPED_KEY)), True),
    "h / (mean|h| + eps per unit)": (lambda h, x: h / (jnp.mean(jnp.abs(h), 0) + np.full(
        h.shape[1], 1e-5, h.dtype)), False),
    "h / (mean|h| + sum(x)**2)": (lambda h, x: h / (jnp.mean(jnp.abs(h), 0) + x.sum() ** 2),
                                  False),
    # a power multiplies the degree it is given (2 here), not the layer's 1
    "(h*h)**2 / mean(h**4)": (lambda h, x: (h * h) ** 2 / jnp.mean(h ** 4, 0), True),
    # a scalar constant first in a max is no where's fixed test: h keeps degree 1
    "max(-1, h)": (lambda h, x: jnp.maximum(-1.0, h), False),
    # a statistic's eps is added to it, never subtracted or taken as a floor
    "h / max(std, eps)": (lambda h, x: h / jnp.maximum(jnp.std(h, 0), 1e-5), False),
    "h / (mean|h| - eps)": (lambda h, x: h / (jnp.mean(jnp.abs(h), 0) - 1e-5), False),
}


@pytest.mark.parametrize("name", sorted(NORMS_BY_DEGREE))
def test_a_normalisation_is_found_by_the_degree_of_its_value(name):
    """A value scales as ``c**degree`` in its layer's unit scales: products add degrees,
    quotients subtract them (a constant has 0), powers multiply them, sums and extrema need
    one degree (or a zero, or ``eps``). The layer (without a bias, as before a batch norm,
    and the program's first equation) is PSI's only where its output's degree reaches 0 per
    unit before any layer or output reads it."""
    norm, normalised = NORMS_BY_DEGREE[name]

    def apply(params, x):
        (w0, _), (w1, b1), (w2, b2) = params
        h = norm(jax.lax.dot_general(x, w0, (((1,), (1,)), ((), ()))), x)   # x @ w0.T
        return jax.nn.relu(jax.nn.relu(h) @ w1.T + b1) @ w2.T + b2

    found = find_chains(apply, pairs(), X)
    assert [path_name(p) for p in found.normalised.weights] == (["0/0"] if normalised else [])


def _max_pool(h, window, stride, padding="VALID", dilation=None):
    """``h``'s max over windows of its two axes (batch, units), without padding unless
    given; ``dilation``: of ``h`` (entries spread apart, padding between them)."""
    return jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, window, stride, padding,
                                 base_dilation=dilation)


def _inner(h):
    return jnp.tanh(h)


def _outer(h):
    return jax.jit(_inner)(h)


@jax.custom_vjp
def _tanh_vjp(h):
    return jnp.tanh(h)


_tanh_vjp.defvjp(lambda h: (jnp.tanh(h), h), lambda h, g: (g * (1 - jnp.tanh(h) ** 2),))
# its call has no name of its own: a reason names the call's primitive
_VJP_CALL = jax.make_jaxpr(_tanh_vjp)(jnp.ones(2)).eqns[0].primitive.name


def _callback_test():
    """``True``, read through a callback with effects: not fixed when the model is traced."""
    return io_callback(lambda: np.bool_(True), jax.ShapeDtypeStruct((), jnp.bool_))


C = jnp.linspace(-1.0, 1.0, 6)   # a model input laid out like a bias
BIASES = {  # the first layer's output h, its bias leaf b and the input c -> the value (and
    # one more term of the model's output), b's shape, whether b joins the layer
    "h + b": (lambda h, b, c: h + b, (6,), True),
    "b + h": (lambda h, b, c: b + h, (6,), True),
    "h + b of shape (1, n)": (lambda h, b, c: h + b, (1, 6), True),
    "one unit, h + b of shape (1,)": (lambda h, b, c: h + b, (1,), True),
    # not a bias of the layer: the add ends the chain
    "h + scalar b": (lambda h, b, c: h + b, (), False),
    "h + scalar b broadcast to h's shape": (lambda h, b, c: h + jnp.broadcast_to(b, h.shape),
                                            (), False),
    # b's long axis is the batch axis of h (4 examples) once transposed
    "as many units as examples, h + b.T, b of shape (1, 4)": (lambda h, b, c: h + b.T, (1, 4),
                                                              False),
    "h + b of shape (2, 3), flattened": (lambda h, b, c: h + b.reshape(6), (2, 3), False),
    "h + b cast to integers": (lambda h, b, c: h + b.astype(jnp.int32), (6,), False),
    "h + b.T, b of shape (6, 1)": (lambda h, b, c: h + b.T, (6, 1), False),
    "h + b of shape (4, 1), along the batch": (lambda h, b, c: h + b, (4, 1), False),
    "relu(h) + b": (lambda h, b, c: jax.nn.relu(h) + b, (6,), False),
    "h + b + b": (lambda h, b, c: h + b + b, (6,), False),
    "2h + b": (lambda h, b, c: 2.0 * h + b, (6,), False),
    "h + zeros + b": (lambda h, b, c: h + jnp.zeros(6) + b, (6,), False),
    "copy(h) + b": (lambda h, b, c: jnp.copy(h) + b, (6,), True),
    "-h + b": (lambda h, b, c: -h + b, (6,), False),
    "h + 2b": (lambda h, b, c: h + 2.0 * b, (6,), False),   # a leaf scaled: no bias as it is
    "h + b * 2": (lambda h, b, c: h + b * 2.0, (6,), False),
    "|h| + b": (lambda h, b, c: jnp.abs(h) + b, (6,), False),
    "sum over the batch + b": (lambda h, b, c: h.sum(0) + b, (6,), False),
    "cumsum over the batch + b": (lambda h, b, c: jnp.cumsum(h, 0) + b, (6,), False),
    "h[1:] + b": (lambda h, b, c: h[1:] + b, (6,), False),
    "zero-padded batch + b": (lambda h, b, c: jnp.pad(h, ((1, 0), (0, 0))) + b, (6,), False),
    "h + h + b": (lambda h, b, c: h + h + b, (6,), False),
    "where(h > 0, h, 0) + b": (lambda h, b, c: jnp.where(h > 0, h, 0.0) + b, (6,), False),
    "max-pool of the batch + b": (lambda h, b, c: _max_pool(h, (2, 1), (1, 1)) + b, (6,),
                                  False),
    "h + b, b read again by the output": (lambda h, b, c: (h + b, jnp.sum(b)), (6,), False),
    "h + c, an input": (lambda h, b, c: h + c, (6,), False),
}


@pytest.mark.parametrize("name", sorted(BIASES))
def test_a_bias_joins_its_layer_only_as_the_guide_says(name):
    """A leaf laid out along the units (one axis of them, through reshapes, broadcasts and
    float casts), added to the layer's output before any other operation and read nowhere
    else, is the layer's bias; anything else added there ends the chain, claimed or not
    (``check=False``) and whatever side of the addition it is on."""
    form, shape, joined = BIASES[name]
    width = math.prod(shape) if name.startswith(("one unit", "as many units")) else 6

    def apply(p, x, c):
        h = form(x @ p["w1"], p["b"], c[:width])
        h, term = h if isinstance(h, tuple) else (h, 0.0)
        return jax.nn.relu(h) @ p["w2"] + term

    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"w1": jax.random.normal(ks[0], (5, width)), "w2": jax.random.normal(
        ks[1], (width, 3)), "b": 0.1 + jax.random.uniform(ks[2], shape)}
    for check in (False, True):
        found = find_chains(apply, params, X, C, check=check)
        assert [[path_name(p) for p in c.weights] for c in found] == (
            [["w1", "w2"]] if joined else [])
        if joined:
            assert [None if p is None else path_name(p) for p in found[0].biases] == [
                "b", None]
        else:
            assert "b" in found.reasons and "w1" in found.reasons


DEGREE_2 = "of two values that carry its units is not of degree 1 in their scales"
ENDS = {  # what follows the first layer's output h -> a fragment of the first weight's reason
    "h @ w2 + h @ w4": (lambda h, p: h @ p["w2"] + h @ p["w4"],
                        "its output feeds two layers (a branch)"),
    "w3.T @ h": (lambda h, p: p["w3"].T @ h,
                 "the next layer does not contract its units (they stay a free axis)"),
    "h @ a constant": (lambda h, p: h @ jnp.ones((6, 3)),
                       "its output goes to dot_general, which is not a layer that can be in a "
                       "chain (see the reason given for its weight)"),
    "h @ h.T @ w3": (lambda h, p: h @ h.T @ p["w3"], "its output goes to dot_general"),
    "(h @ w2, h)": (lambda h, p: (h @ p["w2"], h),
                    "its output is returned by the model and also feeds the next layer"),
    "nothing read": (lambda h, p: jnp.ones(3), "its output is not used"),
    "flip of the units": (lambda h, p: jnp.flip(h, 1) @ p["w2"],
                          "reverses its units"),
    "where(h > 0, h, 1)": (lambda h, p: jnp.where(h > 0, h, 1.0) @ p["w2"],
                           "chooses between it and a value that does not carry its scales"),
    "tanh in nested jits": (lambda h, p: jax.jit(_outer)(h) @ p["w2"],
                            "its output goes to tanh (inside _outer/_inner), which is not "
                            "positively homogeneous per unit"),
    # units between two position axes (P = Q = 2) are not a convolution's input channels
    "a conv over units flattened between positions": (
        lambda h, p: jax.lax.conv_general_dilated(
            (h[:, None, :, None] * POSITIONS[:, None, None] * POSITIONS).reshape(4, 1, 24),
            p["w5"], (1,), "VALID", dimension_numbers=("NWC", "WIO", "NWC")),
        "the next convolution does not read its units as input channels"),
    "tanh in a custom_vjp": (lambda h, p: _tanh_vjp(h) @ p["w2"],
                             f"its output goes to tanh (inside {_VJP_CALL}), which is not "
                             "positively homogeneous per unit"),
    "where on a callback's value": (
        lambda h, p: jnp.where(_callback_test(), h, 2.0) @ p["w2"],
        "select_n (inside _where) chooses between it and a value that does not carry its "
        "scales"),
    "max-pool of 2 units, stride 1": (lambda h, p: _max_pool(h, (1, 2), (1, 1)) @ p["w2"][:5],
                                      "pools across its units (it mixes units)"),
    "max-pool of 1 unit, stride 2": (lambda h, p: _max_pool(h, (1, 1), (1, 2)) @ p["w2"][:3],
                                     "pools across its units (it mixes units)"),
    "max-pool of 1 unit, padded": (lambda h, p: _max_pool(h, (1, 1), (1, 1), ((0, 0), (1, 0)))
                                   @ jnp.ones((7, 3)), "pools across its units (it mixes units)"),
    "max-pool of 1 unit, units dilated": (
        lambda h, p: _max_pool(h, (1, 1), (1, 1), "VALID", (1, 2)) @ jnp.ones((11, 3)),
        "pools across its units (it mixes units)"),
    "where between two flattens of h": (
        lambda h, p: jnp.where(jnp.arange(12) % 2 > 0,
                               (h[:, None, :] * POSITIONS[:, None]).reshape(4, 12),
                               (h[:, :, None] * POSITIONS).reshape(4, 12)) @ jnp.ones((12, 3)),
        "chooses between values with their units on different axes"),
    "argmax over the batch": (lambda h, p: (h * jnp.argmax(h, 0)) @ p["w2"],
                              "its output goes to argmax, which is not positively"),
    "argmin over the batch": (lambda h, p: (h * jnp.argmin(h, 0)) @ p["w2"],
                              "its output goes to argmin, which is not positively"),
    "cumsum along the units": (lambda h, p: jnp.cumsum(h, 1) @ p["w2"],
                               "its output goes to cumsum"),
    "the first units": (lambda h, p: h[:, :3] @ p["w2"][:3], "slice drops some of its units"),
    "the last units": (lambda h, p: h[:, 3:] @ p["w2"][3:], "slice drops some of its units"),
    "every other unit": (lambda h, p: h[:, ::2] @ p["w2"][::2], "slice drops some of its units"),
    "the batch padded with ones": (lambda h, p: jnp.pad(h, ((1, 0), (0, 0)),
                                                        constant_values=1.0) @ p["w2"],
                                   "pads it with a value other than zero or along its units"),
    "zero-padded units": (lambda h, p: jnp.pad(h, ((0, 0), (1, 0))) @ jnp.ones((7, 3)),
                          "pads it with a value other than zero or along its units"),
    "where(h > 1, h, 0)": (lambda h, p: jnp.where(h > 1.0, h, 0.0) @ p["w2"],
                           "it is compared with a non-zero value in gt"),
    "h * (h_i > h_j for some j)": (
        lambda h, p: (h * (h[:, :, None] > h[:, None, :]).any(2)) @ p["w2"],
        "it meets a value with its units on another axis in gt"),
    "h written into zeros": (
        lambda h, p: jax.lax.dynamic_update_slice(jnp.zeros((4, 6)), h, (0, 0)) @ p["w2"],
        "its output goes to dynamic_update_slice, which is not positively homogeneous"),
    # a primitive of several results, each read
    "the batch's halves swapped": (lambda h, p: jnp.concatenate(jnp.split(h, 2)[::-1]) @ p["w2"],
                                   "its output goes to split, which is not positively"),
    "top 2 of h": (lambda h, p: jax.lax.top_k(h, 2)[0] @ p["w2"][:2],
                   "its output goes to top_k, which is not positively homogeneous"),
    "h cast to integers": (lambda h, p: h.astype(jnp.int32) @ p["w2"].astype(jnp.int32),
                           "it is converted to int32 (rounding is not homogeneous)"),
    "1 / h": (lambda h, p: (1.0 / h) @ p["w2"],
              "its output goes to div, which is not positively homogeneous per unit"),
    "atan2(h, 0)": (lambda h, p: jnp.arctan2(h, 0.0) @ p["w2"],
                    "its output goes to atan2, which is not positively homogeneous per unit"),
    "h * h": (lambda h, p: (h * h) @ p["w2"], "mul of two values that carry its units is "
              "not of degree 1 in their scales"),
    "h ** h": (lambda h, p: (h ** h) @ p["w2"], DEGREE_2),
    "atan2(h, h)": (lambda h, p: jnp.arctan2(h, h) @ p["w2"], DEGREE_2),
    "h % h": (lambda h, p: (h % h) @ p["w2"], DEGREE_2),
    "sum over i of h_i * h_j": (lambda h, p: (h[:, :, None] * h[:, None, :]).sum(1) @ p["w2"],
                                "it meets a value with its units on another axis in mul"),
    "h - c": (lambda h, p: (h - C) @ p["w2"],
              "it is added to a value that does not carry its unit scales in sub"),
    # ones made from zeros: only some operations keep a constant zero
    "h + cos(zeros)": (lambda h, p: (h + jnp.cos(jnp.zeros(6))) @ p["w2"],
                       "it is added to a value that does not carry its unit scales in add"),
    "h + c, an input": (lambda h, p: (h + C) @ p["w2"],
                        "it is added to a value that does not carry its unit scales"),
}


@pytest.mark.parametrize("name", sorted(ENDS))
def test_a_layer_whose_units_stop_says_where(name):
    """The first layer's units reach no single next layer that reads them as its input
    units: it is in no chain, and its weight's reason says where its units stop."""
    then, why = ENDS[name]
    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    params = {"w1": jax.random.normal(ks[0], (5, 6)), "w2": jax.random.normal(ks[1], (6, 3)),
              "w3": jax.random.normal(ks[2], (4, 3)), "w4": jax.random.normal(ks[3], (6, 3)),
              "w5": jax.random.normal(ks[4], (1, 24, 3))}
    for check in (False, True):
        found = find_chains(lambda p, x: then(jax.nn.relu(x @ p["w1"]), p), params, X,
                            check=check)
        assert "w1" not in {path_name(p) for c in found for p in c.weights}
        reason = found.reasons["w1"]
        prefix, end = reason[:48], reason[48:]
        assert prefix == "its layer is in no chain of two or more layers: " and (
            end.startswith(why) or end.endswith(why)), reason


POSITIONS = jnp.array([1.0, -2.0])
FLATTENS = {  # the first layer's output h (4, 6) spread over two positions and flattened
    "channel-major": (lambda h: (h[:, :, None] * POSITIONS).reshape(4, 12), 1, 2),
    "position-major": (lambda h: (h[:, None, :] * POSITIONS[:, None]).reshape(4, 12), 2, 1),
    # reshaped again, to (4, 1, 12): the two position blocks stay before the units
    "position-major, then an axis added": (
        lambda h: (h[:, None, :] * POSITIONS[:, None]).reshape(4, 12).reshape(4, 1, 12), 2, 1),
}


@pytest.mark.parametrize("name", sorted(FLATTENS))
def test_a_flatten_gives_the_next_layer_its_units_positions(name):
    """After a flatten, unit ``j`` of the next layer's input sits at ``(p * n + j) * Q + q``:
    ``Q`` positions after each unit (channel-major, as Equinox flattens CHW), ``P`` blocks
    of all units (position-major, as Flax flattens HWC); the chain holds and checks."""
    flat, P, Q = FLATTENS[name]
    ks = jax.random.split(jax.random.PRNGKey(0), 2)
    params = {"w1": jax.random.normal(ks[0], (5, 6)), "w2": jax.random.normal(ks[1], (12, 3))}
    found = find_chains(lambda p, x: flat(jax.nn.relu(x @ p["w1"])) @ p["w2"], params, X)
    assert [[path_name(p) for p in c.weights] for c in found] == [["w1", "w2"]]
    assert found[0].layouts[1] == Layout(1, 0, P=P, Q=Q)
    assert found[0].chain.sizes == (5, 6, 3) and found[0].chain.slots[1] == 2


def test_a_layer_contracting_several_axes_of_its_weight_takes_the_others_as_slots():
    """A dense layer over two axes (``einsum("bij,ijo->bo")``) reads its units on one and
    parallel edges on the other: first in a chain (its input units are the last contracted
    axis), and next, where its input units are whichever axis the units arrive on."""
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"w1": jax.random.normal(ks[0], (5, 2, 6)), "w2": jax.random.normal(ks[1], (6, 2, 3))}

    def apply(p, x):
        h = jax.nn.relu(jnp.einsum("bij,ijo->bo", jnp.stack([x, -x], 2), p["w1"]))
        return jnp.einsum("bnp,npo->bo", h[:, :, None] * POSITIONS, p["w2"])
    found = find_chains(apply, params, X)
    assert [[path_name(p) for p in c.weights] for c in found] == [["w1", "w2"]]
    assert found[0].layouts == (Layout(2, 1, (0,)), Layout(2, 0, (1,)))
    assert found[0].chain.sizes == (2, 6, 3) and found[0].chain.slots == (5, 2)


def test_a_weight_on_the_left_of_its_product_gives_units_on_the_first_axis():
    """``w @ h`` with features first (``(units, batch)``): each layer's units are the
    output's first axis, and the next ``w @ .`` contracts them."""
    params = {"w1": pairs()[0][0], "w2": pairs()[1][0]}
    found = find_chains(lambda p, x: p["w2"] @ jax.nn.relu(p["w1"] @ x.T), params, X)
    assert [[path_name(p) for p in c.weights] for c in found] == [["w1", "w2"]]
    assert found[0].layouts == (Layout(0, 1), Layout(0, 1))


def test_a_contraction_without_a_leaf_is_no_layer_and_hides_none_after_it():
    found = find_chains(lambda p, x: _mlp(p, x @ jnp.eye(5)), pairs(), X)
    assert [[path_name(p) for p in c.weights] for c in found] == [["0/0", "1/0", "2/0"]]


def test_a_weight_refused_as_a_layer_hides_no_layer_after_it():
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"u": jax.random.normal(ks[0], (5, 2, 3)), "w1": jax.random.normal(ks[1], (6, 4)),
              "w2": jax.random.normal(ks[2], (4, 3))}
    found = find_chains(lambda p, x: jax.nn.relu(
        jnp.einsum("bi,ijk->bjk", x, p["u"]).reshape(4, 6) @ p["w1"]) @ p["w2"], params, X)
    assert [[path_name(p) for p in c.weights] for c in found] == [["w1", "w2"]]
    assert "has 2 output axes" in found.reasons["u"]


def test_a_layer_whose_output_selects_between_values_ends_its_chain():
    """An integer layer whose ReLU output is the index of a ``select_n`` picks by its
    values, which a rescaling of its units changes: no chain, and the reason says so."""
    params = {"w1": jnp.arange(30, dtype=jnp.int32).reshape(5, 6) % 2,
              "w2": jnp.ones((6, 3), jnp.int32)}

    def apply(p, x):
        h = jnp.maximum(x @ p["w1"], 0)
        return jax.lax.select_n(h, jnp.zeros_like(h), h) @ p["w2"]
    found = find_chains(apply, params, jnp.arange(20, dtype=jnp.int32).reshape(4, 5) % 3,
                        check=False)
    assert len(found) == 0 and found.reasons["w1"].endswith("it selects by value in select_n")


def test_a_squeeze_of_the_units_axis_ends_the_chain():
    params = {"w1": jnp.ones((5, 1)), "w2": jnp.ones((1, 3))}
    found = find_chains(lambda p, x: jnp.squeeze(jax.nn.relu(x @ p["w1"]), 1)[:, None]
                        @ p["w2"], params, X)
    assert len(found) == 0 and "squeeze removes its unit axis" in found.reasons["w1"]


def _conv(x, k, groups=1):
    """An NCHW convolution by an OIHW kernel ``k`` (stride 1, no padding)."""
    return jax.lax.conv_general_dilated(x, k, (1, 1), "VALID", feature_group_count=groups)


IMAGES = jax.random.normal(jax.random.PRNGKey(3), (2, 4, 5, 5))   # NCHW


def test_a_kernel_transposed_before_its_convolution_keeps_its_layout_on_the_leaf():
    """An HWIO leaf transposed to OIHW for the convolution: the layout names the leaf's
    axes (``O`` = 3, ``I`` = 2, kernel positions 0 and 1), and the chain checks."""
    ks = jax.random.split(jax.random.PRNGKey(0), 2)
    params = {"k1": jax.random.normal(ks[0], (3, 3, 4, 6)),
              "k2": jax.random.normal(ks[1], (2, 6, 3, 3))}

    def apply(p, x):
        return _conv(jax.nn.relu(_conv(x, jnp.transpose(p["k1"], (3, 2, 0, 1)))), p["k2"])
    found = find_chains(apply, params, IMAGES)
    assert [[path_name(p) for p in c.weights] for c in found] == [["k1", "k2"]]
    assert found[0].layouts == (Layout(3, 2, (0, 1)), Layout(0, 1, (2, 3)))


def test_hand_described_one_dimensional_kernels_read_their_units():
    """Haiku's and Flax's ``Conv1D`` kernels (WIO) described by hand (``transposed``): the
    last axis holds a layer's units, the one before its inputs, the first its kernel
    positions; the chain checks on the model."""
    def conv(x, k):
        return jax.lax.conv_general_dilated(x, k, (1,), "VALID",
                                            dimension_numbers=("NWC", "WIO", "NWC"))
    ks = jax.random.split(jax.random.PRNGKey(4), 3)
    params = {"c1": {"w": jax.random.normal(ks[0], (3, 2, 4))},
              "c2": {"w": jax.random.normal(ks[1], (3, 4, 3))}}
    (c,) = chains_from_dict(params, ["c1", "c2"], transposed=True)
    assert c.chain.sizes == (2, 4, 3) and c.chain.slots == (3, 3)
    apply = lambda p, x: conv(jax.nn.relu(conv(x, p["c1"]["w"])), p["c2"]["w"])
    assert check_invariance(apply, params, jax.random.normal(ks[2], (2, 7, 2)), chains=[c])


REFUSED = {  # a model of w (and v) -> the reason that w is in no chain
    "grouped conv": (lambda p, x: _conv(jax.nn.relu(_conv(x, p["w"], 2)), p["v"]),
                     (6, 2, 3, 3), (3, 6, 1, 1),
                     "grouped or depthwise convolution (feature_group_count=2, "
                     "batch_group_count=1)"),
    "the weight as the convolution's input": (
        lambda p, x: _conv(p["w"], x[:1, :, :3, :3]).sum() + _conv(x, p["v"]).sum(),
        (1, 4, 5, 5), (3, 4, 1, 1), "its weight is the convolution's input, not its kernel"),
    "a weight per example": (lambda p, x: jnp.einsum("bi,bij->bj", x.reshape(2, -1)[:, :4],
                                                     p["w"]) @ p["v"], (2, 4, 6), (6, 3),
                             "its weight has batch dimensions in dot_general"),
    "two output axes": (lambda p, x: jnp.einsum("bi,ijk->bjk", x.reshape(2, -1)[:, :4],
                                                p["w"]).reshape(2, 6) @ p["v"], (4, 2, 3),
                        (6, 3), "its weight (4, 2, 3) has 2 output axes and 1 contracted ones"),
    "read twice": (lambda p, x: jax.nn.relu(x.reshape(2, -1)[:, :4] @ p["w"]) @ p["v"]
                   + jnp.sum(p["w"]), (4, 6), (6, 3),
                   "the weight is read 2 times (a layer applied twice, tied weights, or a "
                   "weight read outside its layer)"),
    # a leaf returned by the model is read once more, even through a view
    "read and returned": (lambda p, x: (jax.nn.relu(x.reshape(2, -1)[:, :4] @ p["w"])
                                        @ p["v"], p["w"].T), (4, 6), (6, 3),
                          "the weight is read 2 times (a layer applied twice, tied weights, "
                          "or a weight read outside its layer)"),
    "returned only": (lambda p, x: (jnp.sum(x), p["w"], p["v"]), (4, 6), (6, 3),
                      "returned by the model, not as the weight or bias of a dense or "
                      "convolution layer"),
    "a product of two leaves": (lambda p, x: x.reshape(2, -1)[:, :4] @ (p["w"] @ p["v"]),
                                (4, 6), (6, 3), "read by dot_general, not as the weight"),
    "units on a spatial axis of the next conv": (
        lambda p, x: _conv(jax.nn.relu(x.reshape(2, -1)[:, :4] @ p["w"]).reshape(2, 1, 6, 1),
                           p["v"]), (4, 6), (3, 1, 1, 1),
        "the next convolution does not read its units as input channels"),
    # a dense layer flattened over two positions, then read as a 1x1 image's channels: the
    # convolution's channel c is no unit c (layouts of convolutions have no P or Q)
    "units spread channel-major into the next conv's channels": (
        lambda p, x: _conv(FLATTENS["channel-major"][0](jax.nn.relu(
            x.reshape(4, -1)[:, :4] @ p["w"])).reshape(4, 12, 1, 1), p["v"]), (4, 6),
        (3, 12, 1, 1), "the next convolution does not read its units as input channels"),
    "units spread position-major into the next conv's channels": (
        lambda p, x: _conv(FLATTENS["position-major"][0](jax.nn.relu(
            x.reshape(4, -1)[:, :4] @ p["w"])).reshape(4, 12, 1, 1), p["v"]), (4, 6),
        (3, 12, 1, 1), "the next convolution does not read its units as input channels"),
    "batch-grouped conv": (
        lambda p, x: _conv(jax.nn.relu(jax.lax.conv_general_dilated(
            x, p["w"], (1, 1), "VALID", batch_group_count=2)), p["v"]), (6, 4, 3, 3),
        (3, 6, 1, 1), "grouped or depthwise convolution (feature_group_count=1, "
        "batch_group_count=2)"),
    "an outer product": (lambda p, x: jax.nn.relu(jnp.einsum(
        "bi,j->bij", x.reshape(2, -1)[:, :4], p["w"])).reshape(2, 24) @ p["v"], (6,), (24, 3),
        "its weight (6,) has 1 output axes and 0 contracted ones in dot_general"),
    # one cast of the weight (mixed precision) read by both layers of a tied autoencoder
    "tied through one cast": (lambda p, x: (lambda w: jax.nn.relu(
        x.reshape(2, -1)[:, :4] @ w) @ w.T)(p["w"].astype(jnp.float32)), (4, 6), (6, 3),
        "the weight is read 2 times"),
    "returned through a view only": (lambda p, x: (jnp.sum(x), p["w"].T, p["v"]), (4, 6),
                                     (6, 3), "returned by the model, not as the weight"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_weight_that_is_no_layer_of_a_chain_says_why(name):
    model, w_shape, v_shape, why = REFUSED[name]
    ks = jax.random.split(jax.random.PRNGKey(0), 2)
    params = {"w": jax.random.normal(ks[0], w_shape), "v": jax.random.normal(ks[1], v_shape)}
    found = find_chains(model, params, IMAGES)
    reason = found.reasons["w"]
    assert len(found) == 0 and (reason.startswith(why) or reason.endswith(why)), reason


def test_a_float_cast_passes_the_units():
    """A cast to another float type keeps each unit's entries (up to rounding, which the
    self-check in float64 would see: the claim is read without it)."""
    params = {"w1": jnp.ones((5, 6)), "w2": jnp.ones((6, 3))}
    found = find_chains(lambda p, x: jax.nn.relu(x @ p["w1"]).astype(jnp.float32)
                        @ p["w2"].astype(jnp.float32), params, X, check=False)
    assert [[path_name(p) for p in c.weights] for c in found] == [["w1", "w2"]]
