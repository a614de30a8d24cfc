"""DESIGN §6: each numerics rule driven by a case, and hostile input fuzzed.

Rules: a step whose gradients hold NaN/Inf is skipped whole; an entry whose update overflows
keeps its old value; a skeleton product of 0 (zero or underflowed skeleton weight) gives its
paths gradient 0; a path ratio R < 0 is a legitimate sign flip, R = 0 becomes machine
epsilon; pruned (zero) weights get the exact limit of the update; float16/bfloat16 are
computed in float32. Finite input never yields NaN or Inf."""

import warnings
from typing import Any, NamedTuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gsgd_core as gc
from gsgd_core import reference as ref
from gsgd_core.arrays import guard_tree
from gsgd_backends._dispatch import FAST
from _helpers import Problem, assert_close
from _namespaces import available_namespaces
from _strategies import chains, examples, random_params, seeds

CHAIN = gc.Chain((3, 4, 2, 3), (1, 2, 1), bias=(True, False, True))


def _finite(arrays, ns):
    return all(np.all(np.isfinite(ns.to_numpy(a))) for a in arrays if a is not None)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("where", ["weight", "bias"])
def test_non_finite_gradient_skips_the_whole_step(hxp, bad, momentum, where):
    """A NaN or Inf in any gradient, a weight's or a bias's, leaves everything as it was
    (G-SGD and Path-SGD)."""
    pb = Problem(CHAIN, 0)
    G, Gb = pb.grads()
    if where == "weight":
        G[1] = G[1].copy()
        G[1][0, 1, 0] = bad
    else:
        layer = next(i for i, g in enumerate(Gb) if g is not None)
        Gb[layer] = Gb[layer].copy()
        Gb[layer][0] = bad
    W, b = hxp.aslist(pb.W), hxp.aslist(pb.b)
    state = gc.gsgd_init(CHAIN, W, b)
    W2, b2, s2 = gc.gsgd_update(CHAIN, state, W, b, hxp.aslist(G), hxp.aslist(Gb), lr=0.1,
                                momentum=momentum)
    for x, y in zip(W2 + b2 + list(s2.momentum), W + b + list(state.momentum)):
        if x is not None:
            assert np.array_equal(hxp.to_numpy(x), hxp.to_numpy(y))
    assert int(hxp.to_numpy(s2.step)) == 0
    P2, _ = gc.path_sgd_step(CHAIN, W, b, hxp.aslist(G), hxp.aslist(Gb), 0.1)
    assert all(np.array_equal(hxp.to_numpy(x), hxp.to_numpy(y)) for x, y in zip(P2, W))


def test_huge_learning_rate_moves_path_values_exactly_or_keeps_overflowed_entries(hxp):
    """lr = 1e10: an ordinary step, ``V' = V - lr*D`` on every basis path. lr near the
    dtype's maximum: each layer-1 weight whose update ``w - lr*g/F^2`` (``B_0 = 1``)
    overflows keeps its old value, every other one takes it (DESIGN §6)."""
    pb = Problem(CHAIN, 1)
    G, Gb = pb.grads()
    W, b = hxp.aslist(pb.W), hxp.aslist(pb.b)
    Gx, Gbx = hxp.aslist(G), hxp.aslist(Gb)
    V, Vb = gc.path_values(CHAIN, W, b)
    D, Db = gc.icr(CHAIN, W, b, Gx, Gbx)
    W2, b2 = gc.gsgd_step(CHAIN, W, b, Gx, Gbx, 1e10)
    V2, Vb2 = gc.path_values(CHAIN, W2, b2)
    for v2, v, d in zip(hxp.tolist(V2) + hxp.tolist(Vb2), hxp.tolist(V) + hxp.tolist(Vb),
                        hxp.tolist(D) + hxp.tolist(Db)):
        if v is not None:
            assert_close(v2, v - 1e10 * d.astype(np.float64), hxp.rtol, "V' = V - lr*D")
    tau = CHAIN.tau_mask(1)
    rest = ~(tau | CHAIN.free_mask(1))
    G[0] = G[0].copy()
    G[0][rest] *= np.logspace(-3, 3, int(rest.sum()))  # some updates overflow, some fit
    Gx = hxp.aslist(G)
    big = float(np.finfo(hxp.dtype_name).max)
    lr = big / 4
    W2, b2 = gc.gsgd_step(CHAIN, W, b, Gx, Gbx, lr)
    assert _finite(W2 + b2, hxp)
    w, g = hxp.to_numpy(W[0]).astype(np.float64), hxp.to_numpy(Gx[0]).astype(np.float64)
    F = (hxp.to_numpy(V[0]).astype(np.float64)[tau] / w[tau]).reshape(-1, 1, 1)
    with np.errstate(over="ignore"):
        want = w - lr * g / F**2
    overflow = rest & (np.abs(want) / 2 > big)
    moves = rest & (np.abs(want) < big / 2)
    assert overflow.any() and moves.any(), "lr does not exercise both cases"
    got = hxp.to_numpy(W2[0]).astype(np.float64)
    assert np.array_equal(got[overflow], w[overflow]), "overflowed entries keep their values"
    assert_close(got[moves], want[moves], hxp.rtol, "entries that fit take the update")
    W3, b3 = gc.path_sgd_step(CHAIN, W, b, Gx, Gbx, lr)
    assert _finite(W3 + b3, hxp)
    assert not all(np.array_equal(hxp.to_numpy(x), hxp.to_numpy(y)) for x, y in zip(W3, W))


def test_a_step_is_formed_so_that_it_overflows_only_where_its_value_does(hxp):
    """``lr * num / den`` (:func:`gsgd_core.rules.scaled_div`): with ``lr < 1`` the quotient
    alone may overflow and with ``lr > 1`` the product alone, while the value fits; both
    give the value. A value beyond the range is not finite, and a zero ``den`` gives 0."""
    xp, big = hxp.xp, float(np.finfo(hxp.dtype_name).max)
    num = hxp.asarray([big / 2, big / 10, big / 2, 1.0, big / 1.25])
    den = hxp.asarray([1e-3, 1e3, 1e-3, 0.0, 10.0])
    for lr, want in [(1e-4, [big / 20, big * 1e-8, big / 20, 0.0, big * 8e-6]),
                     (100.0, [np.inf, big / 100, np.inf, 0.0, np.inf]),
                     (0.5, [np.inf, big / 2e4, np.inf, 0.0, big / 25]),
                     (1.5, [np.inf, big * 1.5e-4, np.inf, 0.0, big * 0.12])]:
        for rate in (lr, hxp.asarray(lr)):  # a Python number or a 0-d array (traced)
            with np.errstate(over="ignore"):  # the other order's overflows (where selects)
                got = gc.rules.scaled_div(xp, rate, num, den)
            got = hxp.to_numpy(got).astype(np.float64)
            np.testing.assert_allclose(got, want, rtol=hxp.rtol, err_msg=f"lr={lr}")


def test_an_update_whose_path_gradient_quotient_overflows_but_fits_is_written():
    """A float32 step with lr = 1e-3 on weights of 1e-6 and gradients of 1e30 (found by the
    thorough profile): ``D / F`` of a layer-1 weight overflows, ``lr * D / F`` does not. The
    weight takes the update float64 computes, as the fast path writes it; the entries whose
    update overflows keep their values."""
    chain = gc.Chain(sizes=(2, 1, 3, 4, 1), slots=(1, 1, 1, 1), bias=(False,) * 4,
                     tau=((0,), (0, 0, 0), (0, 0, 0, 0)), sigma=((0,), (0, 0, 0), (0, 0, 0, 0)),
                     skeleton_slots=(0, 0, 0, 0),
                     skeleton_scale=(0.7071067811865476, 0.6123724356957945,
                                     0.5345224838248488, 0.3535533905932738))
    W = [np.array([[[7.6978671e-07], [5.4097353e-07]]]),
         np.array([[[-1.4127556]], [[-1.1066358]], [[-1.2294966]]]),
         np.full((4, 3, 1), 1.1), np.full((1, 4, 1), -1.1855420e-06)]
    G = [np.full(w.shape, 1.4934311e+30) for w in W]
    f32 = [w.astype(np.float32) for w in W]
    W32, _ = gc.gsgd_step(chain, f32, None, [g.astype(np.float32) for g in G], None, 1e-3)
    W64, _ = gc.gsgd_step(chain, [w.astype(np.float64) for w in f32], None, G, None, 1e-3)
    fits = np.abs(W64[0]) < np.finfo(np.float32).max
    assert fits.any() and not fits.all()
    np.testing.assert_allclose(W32[0][fits], W64[0][fits], rtol=1e-6)
    np.testing.assert_array_equal(W32[0][~fits], f32[0][~fits])


def test_underflowed_skeleton_products_freeze_their_paths_without_nan(hxp):
    """Weights of magnitude c ~ 1e-6 (float32) or 1e-45 (float64) in a chain of depth 8: the
    skeleton product ``F B`` of every weight path leaves the dtype's range and its gradient
    ``D`` would overflow, so D = 0 and those weights stay; bias paths near the output keep
    their gradients and move. D is homogeneous, ``D(c W) = D(W) / c^(L-1)`` for weight paths
    and ``Db_l(c W) = Db_l(W) / c^(L-l)``, so the exact values come from unscaled weights."""
    chain = gc.Chain.mlp([3] * 9)
    L, lr = chain.L, 0.1
    c = 1e-6 if hxp.dtype_name == "float32" else 1e-45
    rng = np.random.default_rng(2)
    W0, b = random_params(chain, rng)
    G = [rng.standard_normal(w.shape) for w in W0]
    Gb = [rng.standard_normal(v.shape) for v in b]
    D0, Db0 = gc.icr(chain, W0, b, G, Gb)
    _, F0 = gc.path_values(chain, W0, [np.ones_like(v) for v in b])  # F_l of each bias
    Wx = hxp.aslist([w * c for w in W0])
    D, Db = gc.icr(chain, Wx, hxp.aslist(b), hxp.aslist(G), hxp.aslist(Gb))
    W2, b2 = gc.gsgd_step(chain, Wx, hxp.aslist(b), hxp.aslist(G), hxp.aslist(Gb), lr)
    top = np.log10(float(np.finfo(hxp.dtype_name).max))
    for d in hxp.tolist(D):  # |D| ~ 1e40 (float32), ~1e313 (float64): frozen
        assert np.all(d == 0)
    for w2, w in zip(hxp.tolist(W2), hxp.tolist(Wx)):
        assert np.array_equal(w2, w)
    alive = 0
    for l, (db, db0, f0, v2, v) in enumerate(zip(hxp.tolist(Db), Db0, F0, hxp.tolist(b2), b),
                                             start=1):
        size = np.log10(np.abs(db0)) - (L - l) * np.log10(c)  # log10 |Db_l(c W)|
        frozen, ok = size > top + 1, size < top - 1
        assert np.all(db[frozen] == 0)
        with np.errstate(over="ignore", divide="ignore"):  # the expectations may overflow
            assert_close(db[ok], (db0 / c ** (L - l))[ok], hxp.rtol, f"Db_{l}")
            want = v - lr * db0 / f0 / c ** (2 * (L - l))  # b - lr * Db / F
            kept = frozen | (ok & ~np.isfinite(want.astype(v2.dtype)))  # overflowed: kept
        moved = ok & (np.abs(want) < 10 ** (top - 1))
        assert np.array_equal(v2[kept], v.astype(v2.dtype)[kept]), f"b_{l} kept"
        assert_close(v2[moved], want[moved], hxp.rtol, f"b_{l}")
        alive += int(moved.sum())
    assert alive >= 2 * 3, "the top bias paths should keep their gradients"
    assert _finite(W2 + b2, hxp)


@pytest.mark.parametrize("where", ["tau", "free"])
def test_zero_skeleton_weight_freezes_exactly_the_paths_through_it(hxp, where):
    """Zero tau edges into layer 1 make ``B_1 = 0``: every weight path above layer 1 has
    skeleton product 0, so its D is 0 and those layers keep their weights, while layer 1 and
    the biases move. Zero free edges out of layer 1 make ``F_1 = 0``: layer 1's paths and
    bias are frozen instead; in this chain those edges are also layer 2's tau edges, so
    ``B_2 = 0`` freezes layer 3 too, and layer 2 moves. Nothing is NaN (DESIGN §6)."""
    pb = Problem(CHAIN, 3)
    W = [w.copy() for w in pb.W]
    mask = CHAIN.tau_mask(1) if where == "tau" else CHAIN.free_mask(2)
    W[0 if where == "tau" else 1][mask] = 0.0
    G, Gb = pb.grads(W, pb.b)
    args = hxp.aslist(W), hxp.aslist(pb.b), hxp.aslist(G), hxp.aslist(Gb)
    D, Db = gc.icr(CHAIN, *args)
    W2, b2 = gc.gsgd_step(CHAIN, *args, 0.1)
    assert _finite(W2 + b2 + D + Db, hxp)
    assert np.all(CHAIN.free_mask(2)[CHAIN.tau_mask(2)])  # what the docstring relies on
    frozen = {"tau": [2, 3], "free": [1, 3]}[where]
    for l, (w, w2, d) in enumerate(zip(W, hxp.tolist(W2), hxp.tolist(D)), start=1):
        w = w.astype(w2.dtype).reshape(w2.shape)
        free = CHAIN.free_mask(l).reshape(w2.shape)
        assert np.array_equal(w[free], w2[free])
        if l in frozen:
            assert np.all(d == 0) and np.array_equal(w2, w), f"layer {l} should be frozen"
        else:
            assert np.any(d != 0) and not np.array_equal(w2, w), f"layer {l} should move"
    db1, b1 = hxp.to_numpy(Db[0]), hxp.to_numpy(b2[0])
    if where == "free":
        assert np.all(db1 == 0) and np.array_equal(b1, pb.b[0].astype(b1.dtype))
    else:
        assert np.any(db1 != 0) and not np.array_equal(b1, pb.b[0].astype(b1.dtype))


def test_path_values_may_cross_zero():
    """A path ratio R < 0 is a legitimate step: the path value changes sign exactly."""
    pb = Problem(CHAIN, 4)
    G, Gb = pb.grads()
    d = ref.icr(CHAIN, pb.W, pb.b, G, Gb)
    v = ref.path_values(CHAIN, pb.W, pb.b)
    moves = d != 0  # free edges: no path
    lr = 1.5 * np.max(np.abs(v[moves] / d[moves]))  # large enough to flip at least one path
    W2, b2 = gc.gsgd_step(CHAIN, pb.W, pb.b, G, Gb, lr)
    v2 = ref.path_values(CHAIN, W2, b2)
    assert np.any(np.sign(v2) != np.sign(v))
    assert_close(v2, v - lr * d, 1e-12, "V' = V - lr*D across zero")


@pytest.mark.parametrize("path", ["core", "numpy fast path", "torch fast path"])
def test_path_landing_exactly_on_zero_takes_epsilon(path):
    chain = gc.Chain.mlp([1, 1, 1], bias=False)  # one tau edge, one free edge
    W = [np.array([[2.0]]), np.array([[1.0]])]
    G = [np.array([[4.0]]), np.array([[0.0]])]  # R = 1 - 0.5 * 4 / 2 = 0
    if path == "core":
        W2, _ = gc.gsgd_step(chain, W, None, G, None, 0.5)
    else:
        import gsgd_backends as gb
        wrap = np.array if path.startswith("numpy") else pytest.importorskip("torch").tensor
        W2, G2 = [wrap(w) for w in W], [wrap(g) for g in G]
        assert gb.gsgd_update_(chain, None, W2, None, G2, None, lr=0.5)
        W2 = [np.asarray(w) for w in W2]
    assert W2[0][0, 0] == 2.0 * np.finfo(np.float64).eps and W2[1][0, 0] == 1.0


def test_pruned_weight_gets_the_exact_limit_of_its_update():
    """eq. (27) without dividing by the weight: a zero non-skeleton weight moves by the limit
    of ``(w - lr*g*w^2/v^2) / r`` as ``w -> 0``, i.e. ``-lr*g/(F B)^2 / r``."""
    pb = Problem(CHAIN, 5)
    G, Gb = pb.grads()
    nonskel = ~(CHAIN.free_mask(2) | CHAIN.tau_mask(2))
    idx = tuple(np.argwhere(nonskel)[0])
    results = []
    for w0 in (0.0, 1e-200):
        W = [w.copy() for w in pb.W]
        W[1][idx] = w0
        W2, _ = gc.gsgd_step(CHAIN, W, pb.b, G, Gb, 0.1)
        results.append(W2[1][idx])
    assert results[0] != 0.0 and np.isfinite(results[0])
    assert results[0] == pytest.approx(results[1], rel=1e-12)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_is_computed_in_float32_and_written_back(dtype):
    torch = pytest.importorskip("torch")
    half = getattr(torch, dtype)
    pb = Problem(CHAIN, 6)
    G, Gb = pb.grads()
    t = lambda xs, dt: [None if x is None else torch.tensor(x).to(dt) for x in xs]  # noqa
    W, b, Gh, Gbh = t(pb.W, half), t(pb.b, half), t(G, half), t(Gb, half)
    W2, b2 = gc.gsgd_step(CHAIN, W, b, Gh, Gbh, 0.1)
    f32 = lambda xs: [None if x is None else x.float() for x in xs]  # noqa: E731
    We, be = gc.gsgd_step(CHAIN, f32(W), f32(b), f32(Gh), f32(Gbh), 0.1)
    for x, e in zip(W2 + b2, We + be):
        if x is not None:
            assert x.dtype == half and torch.equal(x, e.to(half))


def test_mixed_devices_are_refused():
    xs = pytest.importorskip("array_api_strict")
    pb = Problem(CHAIN, 7)
    G, Gb = pb.grads()
    other = xs.Device("device1")
    W = [xs.asarray(w) for w in pb.W]
    b = [None if v is None else xs.asarray(v) for v in pb.b]
    Gx = [xs.asarray(g, device=other) for g in G]
    Gbx = [None if g is None else xs.asarray(g) for g in Gb]
    with pytest.raises(ValueError, match="on the weights' device"):
        gc.gsgd_step(CHAIN, W, b, Gx, Gbx, 0.1)
    # the first weight's device is the weights' device: a second weight elsewhere is named
    W[1] = xs.asarray(pb.W[1], device=other)
    with pytest.raises(ValueError) as err:
        gc.path_values(CHAIN, W, b)
    assert str(err.value) == (
        f"all arrays must be on the weights' device {xs.Device('CPU_DEVICE')}; found an array "
        f"of shape {pb.W[1].shape} on {other}")


def _two_momentum_steps(W, b, G, Gb, hypers):
    """Two G-SGD steps from fresh state: the second one reads the momentum buffers."""
    W1, b1, state = gc.gsgd_update(CHAIN, gc.gsgd_init(CHAIN, W, b), W, b, G, Gb, **hypers)
    return gc.gsgd_update(CHAIN, state, W1, b1, G, Gb, **hypers)[:2]


def test_hyperparameters_given_as_float64_arrays_step_in_the_weights_dtype():
    """A hyperparameter given as a 0-d array of another dtype (a schedule's float64 value)
    is cast to the weights' dtype: float32 weights step bit for bit as with the Python
    numbers, in G-SGD with momentum, dampening and weight decay and in Path-SGD."""
    hypers = dict(lr=0.1, momentum=0.9, dampening=0.25, weight_decay=1e-3)
    as_arrays = {k: np.asarray(v, dtype=np.float64) for k, v in hypers.items()}
    for seed in range(5):
        pb = Problem(CHAIN, seed)
        W, b, (G, Gb) = pb.W, pb.b, pb.grads()
        W, b, G, Gb = ([None if a is None else a.astype(np.float32) for a in arrays]
                       for arrays in (W, b, G, Gb))
        W1, b1 = _two_momentum_steps(W, b, G, Gb, hypers)
        W2, b2 = _two_momentum_steps(W, b, G, Gb, as_arrays)
        W3, b3 = gc.path_sgd_step(CHAIN, W, b, G, Gb, 0.1)
        W4, b4 = gc.path_sgd_step(CHAIN, W, b, G, Gb, as_arrays["lr"])
        for x, y in zip(W1 + b1 + W3 + b3, W2 + b2 + W4 + b4):
            assert x is None and y is None or (y.dtype == np.float32 and np.array_equal(x, y))


class _Moments(NamedTuple):
    m: Any
    count: Any


@pytest.mark.parametrize("name", ["numpy", "array_api_strict"])
def test_a_skipped_step_keeps_every_leaf_of_a_rule_state(name):
    """The skip rule over a path rule's state of dicts, tuples, lists and named tuples
    (``guard_tree``): where the step is skipped every array leaf keeps its old value; where
    it is taken a floating leaf keeps its old value only where the new one is not finite,
    and an integer or boolean leaf takes the new one. ``None`` stays, a leaf that is not an
    array (a Python number) is the new one, and every container keeps its type."""
    xp = pytest.importorskip(name)

    def state(vec, m, count, flag, number):
        return {"buffers": (xp.asarray(vec), [_Moments(xp.asarray(m), xp.asarray(
            count, dtype=xp.int32))]), "flag": xp.asarray(flag), "none": None, "lr": number}
    new = state([1.0, np.inf, np.nan], [2.0], 3, True, 0.5)
    old = state([-1.0, -2.0, -3.0], [-2.0], 2, False, 0.1)
    for ok, want in ((True, state([1.0, -2.0, -3.0], [2.0], 3, True, 0.5)),
                     (False, state([-1.0, -2.0, -3.0], [-2.0], 2, False, 0.5))):
        got = guard_tree(xp, xp.asarray(ok), new, old)
        (vec, [moments]), (want_vec, [want_moments]) = got["buffers"], want["buffers"]
        assert type(got["buffers"]) is tuple and type(moments) is _Moments
        assert got["none"] is None and got["lr"] == want["lr"]
        for g, w in ((vec, want_vec), (moments.m, want_moments.m),
                     (moments.count, want_moments.count), (got["flag"], want["flag"])):
            assert g.dtype == w.dtype and np.array_equal(np.asarray(g), np.asarray(w))


def test_psi_row_with_non_finite_gradient_keeps_its_values():
    w = np.array([[1.0, 2.0], [3.0, -1.0]])
    g = np.array([[np.nan, 0.5], [0.1, 0.2]])
    new, state = gc.psi_update(gc.psi_init([w]), [w], [g], lr=0.1, momentum=0.9)
    assert np.array_equal(new[0][0], w[0]) and not np.array_equal(new[0][1], w[1])
    assert np.all(np.isfinite(new[0])) and np.all(np.isfinite(state.momentum[0]))


magnitudes = st.sampled_from([0.0, 1e-30, 1e-6, 1.0, 1e6, 1e30])
lrs = st.sampled_from([0.0, 1e-3, 0.1, 10.0, 1e10, 1e30])


MISTAKES = [None, "gradient shape", "gradient count", "negative lr", "negative momentum"]


@settings(max_examples=examples(60))
@given(chain=chains(max_depth=4, max_width=4, max_slots=3), seed=seeds, scale=magnitudes,
       gscale=magnitudes, lr=lrs, momentum=st.sampled_from([0.0, 0.9]),
       poison=st.sampled_from([None, np.nan, np.inf]), dtype=st.sampled_from(["f4", "f8"]),
       mistake=st.sampled_from(MISTAKES), data=st.data())
def test_fuzz_hostile_input_gives_a_clear_error_or_finite_output(chain, seed, scale, gscale, lr,
                                                                 momentum, poison, dtype,
                                                                 mistake, data):
    """Extreme magnitudes, pruned weights, a NaN/Inf in any layer's weight or bias gradient,
    and malformed calls: a ValueError naming what is wrong, or a finite step (skipped
    whole when a gradient is poisoned) in the input's dtype."""
    rng = np.random.default_rng(seed)
    W, b = random_params(chain, rng)
    W = [(w * (scale if rng.random() < 0.5 else 1.0)).astype(dtype) for w in W]
    zero = rng.random(W[0].shape) < 0.2
    W[0][zero] = 0.0  # pruned weights, maybe a zero skeleton weight
    b = [None if v is None else v.astype(dtype) for v in b]
    G = [(gscale * rng.standard_normal(w.shape)).astype(dtype) for w in W]
    Gb = [None if v is None else rng.standard_normal(v.shape).astype(dtype) for v in b]
    if not (_all_finite(W) and _all_finite(b)):
        return  # overflowed casts: not finite input
    if poison is not None:
        targets = [g for g in G + Gb if g is not None]
        target = targets[data.draw(st.integers(0, len(targets) - 1), label="poisoned")]
        target.reshape(-1)[data.draw(st.integers(0, target.size - 1), label="entry")] = poison
    state = gc.gsgd_init(chain, W, b)
    call = dict(lr=lr, momentum=momentum)
    if mistake is not None:
        layer = data.draw(st.integers(0, chain.L - 1), label="layer")
        if mistake == "gradient shape":
            G[layer] = np.zeros((G[layer].shape[0] + 1,) + G[layer].shape[1:], dtype=dtype)
            match = f"layer {layer + 1}"
        elif mistake == "gradient count":
            del G[layer]
            match = f"grads has {chain.L - 1} entries"
        else:
            call = dict(lr=-lr - 1.0, momentum=momentum) if mistake == "negative lr" else dict(
                lr=lr, momentum=-0.5)
            match = "lr" if mistake == "negative lr" else "momentum"
        with pytest.raises(ValueError, match=match):
            gc.gsgd_update(chain, state, W, b, G, Gb, **call)
        return
    W2, b2, s2 = gc.gsgd_update(chain, state, W, b, G, Gb, **call)
    assert _all_finite(W2) and _all_finite(b2) and _all_finite(s2.momentum)
    assert all(x.dtype == np.dtype(dtype) for x in W2)
    if poison is not None:
        assert all(np.array_equal(x, y) for x, y in zip(W2 + b2, W + b) if x is not None)
        assert int(s2.step) == 0


def _all_finite(arrays):
    return all(np.all(np.isfinite(a)) for a in arrays if a is not None)


@pytest.mark.parametrize("lr, momentum", [(50.0, 0.0), (5.0, 0.9)])
def test_training_far_past_the_stability_limit_keeps_stepping(lr, momentum):
    """Long, unstable float32 runs through the torch optimizer: the loss blows up to ~1e9, yet
    every one of the 200 steps is taken (no step skipped, every step moves the weights),
    and neither the loss nor any weight is ever NaN or Inf."""
    torch = pytest.importorskip("torch")
    from gsgd_adapters.torch import GSGD, skeleton_init_

    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 16, generator=gen), torch.randint(0, 4, (256,), generator=gen)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4))
    skeleton_init_(model, skeleton="paper")  # the paper's recipe goes unstable at these lrs
    opt = GSGD(model, lr=lr, momentum=momentum, skeleton="paper")
    biggest_loss, frozen_steps = 0.0, 0
    for _ in range(200):
        idx = torch.randint(0, 256, (32,), generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        before = [p.detach().clone() for p in model.parameters()]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a skipped step warns: fail on it
            opt.step()
        frozen_steps += all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        assert bool(torch.isfinite(loss)), "the loss became NaN or Inf"
        biggest_loss = max(biggest_loss, float(loss.detach()))
    assert biggest_loss > 1e5, "the run stayed stable: this case does not exercise the rules"
    assert frozen_steps == 0, f"{frozen_steps} of 200 steps left every weight as it was"
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_in_place_step_tells_a_skip_from_a_gradient_check_that_overflows(lib):
    """The in-place layer skips a step with a NaN gradient without running the core, but
    finite float32 gradients whose sum overflows are a normal step: the core's result."""
    import gsgd_backends as gb
    chain = gc.Chain.mlp([3, 4, 2])
    pb = Problem(chain, 5)
    W = [w.reshape(w.shape[0], -1).astype(np.float32) for w in pb.W]
    b = [v.astype(np.float32) for v in pb.b]
    huge = [np.full(w.shape, 3e38, dtype=np.float32) for w in W]  # sums overflow to inf
    huge[1][0, 0] = -3e38
    small_b = [np.full(v.shape, 1e-3, dtype=np.float32) for v in b]
    want_W, want_b = gc.gsgd_step(chain, W, b, huge, small_b, 1e-40)
    conv = (lambda a: a.copy()) if lib == "numpy" else pytest.importorskip("torch").tensor
    back = (lambda a: a) if lib == "numpy" else (lambda a: a.numpy())
    Wl, bl = [conv(w) for w in W], [conv(v) for v in b]
    assert gb.gsgd_update_(chain, None, Wl, bl, [conv(g) for g in huge],
                           [conv(g) for g in small_b], lr=1e-40)
    for got, want in zip(Wl + bl, list(want_W) + list(want_b)):
        np.testing.assert_array_equal(back(got), want)
    nan = [g.copy() for g in huge]
    nan[0][1, 1] = np.nan
    before = [back(w).copy() for w in Wl]
    assert not gb.gsgd_update_(chain, None, Wl, bl, [conv(g) for g in nan],
                               [conv(g) for g in small_b], lr=1e-40)
    for got, old in zip(Wl, before):
        np.testing.assert_array_equal(back(got), old)


@pytest.fixture(params=[n for n in available_namespaces()
                        if n.name in FAST and not n.is_f64], ids=lambda n: n.id)
def f32(request):
    """The float32 namespaces with a fast path."""
    if request.param.skip_reason:
        pytest.skip(request.param.skip_reason)
    return request.param


def test_a_tau_edge_whose_new_value_overflows_keeps_it_and_the_weights_above_follow(f32):
    """A case the thorough profile drew (float32: weights of 1e-6, gradients of 1e30): a
    tau path ratio overflows, so the tau weight keeps its value, and its node's ``rho`` is
    then its source's, not the infinite ``R``, which divided every weight above to -0 in
    the fast path while the core kept them. Fast path and core agree (to float32 rounding);
    the weights above are not zeroed."""
    import gsgd_backends as gb
    chain = gc.Chain((4, 2, 2), (1, 1), bias=(False, True), tau=((0, 0),), sigma=((0, 0),),
                     skeleton_scale=(0.5 ** 0.5, 0.5 ** 0.5))
    rng = np.random.default_rng(215)
    W, b = random_params(chain, rng)
    W = [w * (1e-6 if rng.random() < 0.5 else 1.0) for w in W]
    W[0][rng.random(W[0].shape) < 0.2] = 0.0
    G = [1e30 * rng.standard_normal(w.shape) for w in W]
    Gb = [None if v is None else rng.standard_normal(v.shape) for v in b]
    A, Ab = f32.aslist(W), f32.aslist(b)
    gb.gsgd_step_(chain, A, Ab, f32.aslist(G), f32.aslist(Gb), 1e-3)
    eW, eb = gc.gsgd_step(chain, f32.aslist(W), f32.aslist(b), f32.aslist(G), f32.aslist(Gb),
                          1e-3)
    for a, e in zip(f32.tolist(A + Ab), f32.tolist(eW + eb)):
        if e is not None:
            assert np.all(np.isfinite(a)) and np.allclose(a, e, rtol=1e-6, atol=0)
    W2 = f32.tolist(A)[1].reshape(chain.layer_shape(2))
    assert np.all(W2[~chain.free_mask(2)] != 0)


def test_a_tau_edge_that_would_overflow_keeps_its_value_and_the_paths_above_still_move():
    """``w' = w R`` overflows (``w = 100``, ``R = -1e307``, from a free weight of 1e-150):
    the tau weight keeps its value, its node's ``rho`` is its source's (1), and the non-tau
    path above still moves by exactly ``-lr D`` (``rho = R`` would shrink that weight to
    ~1e-307 and the path with it); in the core and in place."""
    import gsgd_backends as gb
    chain = gc.Chain.mlp([1, 1, 2], bias=False)
    W = [np.array([[100.0]]), np.array([[1e-150], [1.0]])]  # W2[0, 0] is the free edge
    G = [np.array([[1e-3]]), np.array([[0.0], [1e-9]])]
    lr = 1e12
    V, _ = gc.path_values(chain, W)
    D, _ = gc.icr(chain, W, None, G, None)
    new, _ = gc.gsgd_step(chain, W, None, G, None, lr)
    inplace = [w.copy() for w in W]
    gb.gsgd_step_(chain, inplace, None, G, None, lr)
    for got in (new, inplace):
        assert got[0][0, 0] == W[0][0, 0]  # kept
        V2, _ = gc.path_values(chain, got)
        assert_close(V2[1][1, 0], V[1][1, 0] - lr * D[1][1, 0], 1e-12, "the path above")


def test_the_guarded_functions_raise_no_floating_point_error_where_numpy_would():
    """Under ``np.errstate(all="raise")``, the steps and ICR run on weights whose path
    products underflow and whose paths through a zero weight have a zero product, and
    Adam without an epsilon runs on gradients whose squares underflow (a quotient of a
    zero denominator): each is handled by the numerical rules, not an error, and every
    result is finite."""
    chain = gc.Chain((3, 4, 2), (1, 3), bias=(True, False))
    W = [np.full((4, 3), 1e-200), np.full((2, 4, 3), 1e-200)]
    W[0][0, 0] = W[1][0, 0, 0] = 0.0
    b, G, Gb = [np.zeros(4), None], [np.ones((4, 3)), np.ones((2, 4, 3))], [np.ones(4), None]
    rng = np.random.default_rng(0)
    V, c = [rng.standard_normal(w.shape) for w in W], [rng.standard_normal(4), None]
    tiny = [np.full(w.shape, 1e-170) for w in W]
    adam = gc.adam_rule(0.01, eps=0.0)
    calls = [lambda: gc.icr(chain, W, b, G, Gb),
             lambda: gc.gsgd_update(chain, gc.gsgd_init(chain, W, b), W, b, G, Gb, lr=0.1,
                                    momentum=0.9)[:2],
             lambda: gc.path_sgd_step(chain, W, b, G, Gb, 0.1),
             lambda: gc.path_update(chain, adam, gc.path_init(chain, adam, V, c), V, c, tiny,
                                    [np.full(4, 1e-170), None])[:2]]
    for call in calls:
        with np.errstate(all="raise"):
            out = call()
        assert all(np.all(np.isfinite(a)) for part in out for a in part if a is not None)
