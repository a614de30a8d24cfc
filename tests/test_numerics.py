"""DESIGN §6: each numerics rule driven by a case, and hostile input fuzzed.

Rules: a step whose gradients hold NaN/Inf is skipped whole; an entry whose update overflows
keeps its old value; a skeleton product of 0 (zero or underflowed skeleton weight) gives its
paths gradient 0; a path ratio R < 0 is a legitimate sign flip, R = 0 becomes machine
epsilon; pruned (zero) weights get the exact limit of the update; float16/bfloat16 are
computed in float32. Finite input never yields NaN or Inf."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gsgd_core as gc
from gsgd_core import reference as ref
from _helpers import Problem, assert_close
from _strategies import chains, random_params, seeds

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


def test_huge_learning_rate_never_writes_inf(hxp):
    pb = Problem(CHAIN, 1)
    G, Gb = pb.grads()
    W, b = hxp.aslist(pb.W), hxp.aslist(pb.b)
    for lr in (1e10, 1e30, 1e300 if hxp.is_f64 else 1e38):
        W2, b2 = gc.gsgd_step(CHAIN, W, b, hxp.aslist(G), hxp.aslist(Gb), lr)
        assert _finite(W2 + b2, hxp)
        W3, b3 = gc.path_sgd_step(CHAIN, W, b, hxp.aslist(G), hxp.aslist(Gb), lr)
        assert _finite(W3 + b3, hxp)


def test_underflowed_skeleton_products_freeze_their_paths_without_nan(hxp):
    """float32 deep chains: B*F underflows to 0. Those paths get D = 0; nothing is NaN."""
    chain = gc.Chain.mlp([3] * 9, bias=False)
    rng = np.random.default_rng(2)
    W, _ = random_params(chain, rng, 1e-6, 2e-6)  # eight layers of 1e-6: products ~1e-48
    G = [rng.standard_normal(w.shape) for w in W]
    Wx = hxp.aslist(W)
    W2, _ = gc.gsgd_step(chain, Wx, None, hxp.aslist(G), None, 0.1)
    assert _finite(W2, hxp)
    V, _ = gc.path_values(chain, W2, None)
    assert _finite(V, hxp)
    D, _ = gc.icr(chain, Wx, None, hxp.aslist(G), None)
    assert _finite(D, hxp)


@pytest.mark.parametrize("where", ["tau", "free"])
def test_zero_skeleton_weight_is_finite_and_keeps_free_weights(hxp, where):
    pb = Problem(CHAIN, 3)
    W = [w.copy() for w in pb.W]
    mask = CHAIN.tau_mask(1) if where == "tau" else CHAIN.free_mask(2)
    W[0 if where == "tau" else 1][mask] = 0.0
    G, Gb = pb.grads(W, pb.b)
    W2, b2 = gc.gsgd_step(CHAIN, hxp.aslist(W), hxp.aslist(pb.b), hxp.aslist(G),
                          hxp.aslist(Gb), 0.1)
    assert _finite(W2 + b2, hxp)
    for l, (w, w2) in enumerate(zip(W, hxp.tolist(W2)), start=1):
        free = CHAIN.free_mask(l)
        assert np.array_equal(w[free].astype(w2.dtype), w2.reshape(free.shape)[free])


def test_path_values_may_cross_zero():
    """A path ratio R < 0 is a legitimate step: the path value changes sign exactly."""
    pb = Problem(CHAIN, 4)
    G, Gb = pb.grads()
    d = ref.icr(CHAIN, pb.W, pb.b, G, Gb)
    v = ref.path_values(CHAIN, pb.W, pb.b)
    lr = 1.5 * np.max(np.abs(v / d))  # large enough to flip at least one path
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


def test_psi_row_with_non_finite_gradient_keeps_its_values():
    w = np.array([[1.0, 2.0], [3.0, -1.0]])
    g = np.array([[np.nan, 0.5], [0.1, 0.2]])
    new, state = gc.psi_update(gc.psi_init([w]), [w], [g], lr=0.1, momentum=0.9)
    assert np.array_equal(new[0][0], w[0]) and not np.array_equal(new[0][1], w[1])
    assert np.all(np.isfinite(new[0])) and np.all(np.isfinite(state.momentum[0]))


magnitudes = st.sampled_from([0.0, 1e-30, 1e-6, 1.0, 1e6, 1e30])
lrs = st.sampled_from([0.0, 1e-3, 0.1, 10.0, 1e10, 1e30])


@settings(max_examples=60)
@given(chain=chains(max_depth=4, max_width=4, max_slots=3), seed=seeds, scale=magnitudes,
       gscale=magnitudes, lr=lrs, momentum=st.sampled_from([0.0, 0.9]),
       poison=st.sampled_from([None, np.nan, np.inf]), dtype=st.sampled_from(["f4", "f8"]))
def test_fuzz_hostile_input_gives_a_clear_error_or_finite_output(chain, seed, scale, gscale, lr,
                                                                 momentum, poison, dtype):
    rng = np.random.default_rng(seed)
    W, b = random_params(chain, rng)
    W = [(w * (scale if rng.random() < 0.5 else 1.0)).astype(dtype) for w in W]
    zero = rng.random(W[0].shape) < 0.2
    W[0][zero] = 0.0  # pruned weights, maybe a zero skeleton weight
    b = [None if v is None else v.astype(dtype) for v in b]
    G = [(gscale * rng.standard_normal(w.shape)).astype(dtype) for w in W]
    Gb = [None if v is None else rng.standard_normal(v.shape).astype(dtype) for v in b]
    if poison is not None:
        G[-1].reshape(-1)[0] = poison
    if not (_all_finite(W) and _all_finite(b)):
        return  # overflowed casts: not finite input
    state = gc.gsgd_init(chain, W, b)
    W2, b2, s2 = gc.gsgd_update(chain, state, W, b, G, Gb, lr=lr, momentum=momentum)
    assert _all_finite(W2) and _all_finite(b2) and _all_finite(s2.momentum)
    assert all(x.dtype == np.dtype(dtype) for x in W2)
    if poison is not None:
        assert all(np.array_equal(x, y) for x, y in zip(W2, W))


def _all_finite(arrays):
    return all(np.all(np.isfinite(a)) for a in arrays if a is not None)


@pytest.mark.parametrize("lr, momentum", [(50.0, 0.0), (5.0, 0.9)])
def test_training_far_past_the_stability_limit_stays_finite(lr, momentum):
    """Long, unstable float32 runs through the torch optimizer never write NaN or Inf."""
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
    unstable = False
    for _ in range(200):
        idx = torch.randint(0, 256, (32,), generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        biggest = max(float(p.detach().abs().max()) for p in model.parameters())
        unstable |= not bool(torch.isfinite(loss)) or biggest > 1e3
    assert unstable, "the run stayed stable: this case does not exercise the rules"
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_in_place_step_tells_a_skip_from_a_gradient_sum_that_overflows(lib):
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
