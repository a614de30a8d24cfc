"""Invariance under the positive-scaling group: Theorems 3.3 and 3.6, canonical form, and
G-SGD trajectories that commute with rescaling (with and without momentum)."""

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import gsgd_core as gc
from _conditioning import gsgd_tolerance, ill_conditioned
from _helpers import Problem, assert_all_close, assert_close
from _namespaces import assert_same_bits_in_float32_namespaces
from _nets import output
from _strategies import chains, examples, seeds

spreads = st.floats(0.0, 1.5)


@given(chain=chains(), seed=seeds, spread=spreads)
def test_function_and_path_values_invariant_under_rescaling(hxp, chain, seed, spread):
    pb = Problem(chain, seed)
    c = gc.random_rescaling(chain, pb.rng, spread)
    W, b = hxp.aslist(pb.W), hxp.aslist(pb.b)
    W2, b2 = gc.rescale(chain, W, b, c)
    V, Vb = gc.path_values(chain, W, b)
    V2, Vb2 = gc.path_values(chain, W2, b2)
    assert_all_close(hxp.tolist(V2), hxp.tolist(V), hxp.rtol, "path values (Thm 3.3)")
    assert_all_close(hxp.tolist(Vb2), hxp.tolist(Vb), hxp.rtol, "bias path values")
    out = output(chain, hxp.tolist(W), hxp.tolist(b), pb.x)
    out2 = output(chain, hxp.tolist(W2), hxp.tolist(b2), pb.x)
    assert_close(out2, out, hxp.rtol, "network function (Thm 3.3)")


@given(chain=chains(), seed=seeds, spread=spreads)
def test_weights_from_path_values_inverts_path_values(hxp, chain, seed, spread):
    """Theorem 3.6: basis-path values plus the free weights determine the weights."""
    pb = Problem(chain, seed)
    W, b = hxp.aslist(pb.W), hxp.aslist(pb.b)
    V, Vb = gc.path_values(chain, W, b)
    W2, b2 = gc.weights_from_path_values(chain, V, Vb, W)
    assert_all_close(hxp.tolist(W2), pb.W, hxp.rtol, "weights")
    assert_all_close(hxp.tolist(b2), pb.b, hxp.rtol, "biases")
    # From a rescaled twin's free weights, the same path values give the twin itself.
    Wt, bt = gc.rescale(chain, W, b, gc.random_rescaling(chain, pb.rng, spread))
    W3, b3 = gc.weights_from_path_values(chain, V, Vb, Wt)
    assert_all_close(hxp.tolist(W3), hxp.tolist(Wt), hxp.rtol, "twin weights")
    assert_all_close(hxp.tolist(b3), hxp.tolist(bt), hxp.rtol, "twin biases")


@given(chain=chains(), seed=seeds, spread=spreads)
def test_canonical_form_is_idempotent_and_constant_on_orbits(hxp, chain, seed, spread):
    pb = Problem(chain, seed)
    W, b = hxp.aslist(pb.W), hxp.aslist(pb.b)
    Wc, bc = gc.canonicalize(chain, W, b)
    # every free weight is exactly +-r_l, with its sign: g_c scales by c > 0
    for l, (w, w0) in enumerate(zip(hxp.tolist(Wc), pb.W), start=1):
        free = w.reshape(chain.layer_shape(l))[chain.free_mask(l)]
        sign = np.sign(np.reshape(w0, chain.layer_shape(l))[chain.free_mask(l)])
        r = np.asarray(chain.skeleton_scale[l - 1], dtype=free.dtype)
        assert np.array_equal(free, sign.astype(free.dtype) * r)
    Wcc, bcc = gc.canonicalize(chain, Wc, bc)
    for a, c in zip(hxp.tolist(Wcc) + hxp.tolist(bcc), hxp.tolist(Wc) + hxp.tolist(bc)):
        if hxp.name == "jax":
            # XLA's vectorised CPU division is not correctly rounded (x / x can be 1 - ulp),
            # so on JAX ``w / r`` of a canonical free weight may miss 1 by an ulp per layer.
            assert (a is None and c is None) or np.allclose(a, c, rtol=64 * np.finfo(
                a.dtype).eps, atol=0), "not idempotent"
        else:
            assert (a is None and c is None) or np.array_equal(a, c), "not idempotent"
    Wt, bt = gc.rescale(chain, W, b, gc.random_rescaling(chain, pb.rng, spread))
    Wtc, btc = gc.canonicalize(chain, Wt, bt)
    assert_all_close(hxp.tolist(Wtc), hxp.tolist(Wc), hxp.rtol, "canonical weights")
    assert_all_close(hxp.tolist(btc), hxp.tolist(bc), hxp.rtol, "canonical biases")


def _trajectory(ns, chain, pb, W, b, steps, **hyper):
    """G-SGD in namespace ``ns`` (gradients on the host in float64); returns host copies of
    the weights and biases after each step."""
    W, b = ns.aslist(W), ns.aslist(b)
    state = gc.gsgd_init(chain, W, b)
    out = []
    for _ in range(steps):
        G, Gb = pb.grads(ns.tolist(W), ns.tolist(b))
        W, b, state = gc.gsgd_update(chain, state, W, b, ns.aslist(G), ns.aslist(Gb), **hyper)
        out.append((ns.tolist(W), ns.tolist(b)))
    return out


HYPERS = [dict(lr=0.05), dict(lr=0.02, momentum=0.9),
          dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=1e-3),
          dict(lr=0.02, momentum=0.5, dampening=0.3)]


@pytest.mark.parametrize("hyper", HYPERS, ids=lambda h: ",".join(f"{k}={v}" for k, v in h.items()))
@settings(max_examples=examples(10))
@given(chain=chains(max_depth=4), seed=seeds)
def test_gsgd_trajectories_of_rescaled_twins_coincide(hxp, hyper, chain, seed):
    """20 steps from w and from a random rescaling g(w): the iterates stay g-related.
    Rounding differences between the twins grow with every step of an unstable run (by
    ~1e8 over 20 steps on some drawn chains), so over many steps they measure the run's
    stability, not the theorem: float64 to 1e-6, float32 over 3 steps to 1e-3, and only
    while the run stays bounded (weights within 100 times their start; the "thorough"
    profile found a drawn run reaching 6e6) and well conditioned (:func:`_ill_conditioned`).
    Plain SGD's twins
    differ by more than 1e-3 (the control below)."""
    pb = Problem(chain, seed)
    scales = gc.random_rescaling(chain, pb.rng, 1.0)
    Wt, bt = gc.rescale(chain, pb.W, pb.b, scales)
    steps, tol = (20, 1e-6) if hxp.is_f64 else (3, 1e-3)
    ours = _trajectory(hxp, chain, pb, pb.W, pb.b, steps, **hyper)
    twin = _trajectory(hxp, chain, pb, Wt, bt, steps, **hyper)
    bound = 100 * max(float(np.max(np.abs(w))) for w in pb.W)
    start = (hxp.tolist(hxp.aslist(pb.W)), hxp.tolist(hxp.aslist(pb.b)))
    for step, ((W, b), (W2, b2)) in enumerate(zip(ours, twin)):
        W64 = [w.astype(np.float64) for w in W]
        b64 = [None if v is None else v.astype(np.float64) for v in b]
        if max(float(np.max(np.abs(w))) for w in W) > bound or _ill_conditioned(
                hxp, chain, pb, ours[step - 1] if step else start, (W64, b64), step, hyper):
            assume(step > 0)  # nothing to compare
            ours = ours[:step]
            break
        # Free weights never move, so the same group element relates the two at every step.
        We, be = gc.rescale(chain, W64, b64, scales)
        assert_all_close(W2, We, tol, "twin weights")
        assert_all_close(b2, be, tol, "twin biases")
    W, b = ours[-1]
    W2, b2 = twin[len(ours) - 1]
    assert_close(output(chain, W2, b2, pb.x), output(chain, W, b, pb.x), tol, "outputs")


def _ill_conditioned(ns, chain, pb, before, after, count, hyper) -> bool:
    """:func:`_conditioning.ill_conditioned` of G-SGD's step from ``before`` to ``after``
    (the thorough profile drew float32 runs 2e-3 apart after 3 steps)."""
    G, Gb = (ns.tolist(ns.aslist(g)) for g in pb.grads(*before))
    rest = {k: v for k, v in hyper.items() if k != "lr"}
    tol, _ = gsgd_tolerance(chain, rest, hyper["lr"], count, *before, G, Gb,
                            gc.gsgd_init(chain, *before))  # SGD's slope needs no buffer
    return ill_conditioned(chain, tol, gc.path_values(chain, *before)[0],
                           gc.path_values(chain, *after)[0])


def test_sgd_trajectories_of_rescaled_twins_differ():
    """The control: plain SGD does not commute with rescaling, so the test above can fail."""
    chain = gc.Chain.mlp([4, 5, 5, 3])
    pb = Problem(chain, 7)
    scales = gc.random_rescaling(chain, pb.rng, 1.0)
    Wt, bt = gc.rescale(chain, pb.W, pb.b, scales)
    outs = []
    for W, b in ((pb.W, pb.b), (Wt, bt)):
        for _ in range(20):
            G, Gb = pb.grads(W, b)
            W = [w - 0.05 * g for w, g in zip(W, G)]
            b = [v - 0.05 * g for v, g in zip(b, Gb)]
        outs.append(output(chain, W, b, pb.x))
    assert np.max(np.abs(outs[0] - outs[1])) > 1e-3


@given(chain=chains(custom=True), seed=seeds, keep_signs=st.booleans())
def test_skeleton_init_sets_every_skeleton_edge_to_one(hxp, chain, seed, keep_signs):
    """Skeleton edges of layer l become +r_l (the chain's skeleton scale; 1 in the paper's
    units), or keep their signs; then |B| = |F| = 1 and path values are the weights. Every
    namespace, in the weights' dtype."""
    pb = Problem(chain, seed)
    W0, b0 = hxp.aslist(pb.W), hxp.aslist(pb.b)
    W, b = gc.skeleton_init(chain, W0, b0, keep_signs=keep_signs)
    assert b is not None and all(x is y for x, y in zip(b, b0))
    W_nobias, none = gc.skeleton_init(chain, W0, keep_signs=keep_signs)  # biases optional
    assert none is None and all(w.dtype == hxp.dtype for w in W + W_nobias)
    host = hxp.tolist(W)
    for l, (w, w2, w0) in enumerate(zip(host, hxp.tolist(W_nobias), hxp.tolist(W0)), start=1):
        skel = chain.free_mask(l) | chain.tau_mask(l)
        r = w0.dtype.type(chain.skeleton_scale[l - 1])
        want = np.where(w0 < 0, -r, r) if keep_signs else np.full_like(w0, r)
        assert np.array_equal(w[skel], want[skel]) and np.array_equal(w[~skel], w0[~skel])
        assert np.array_equal(w, w2)
    V, _ = gc.path_values(chain, W, b)
    # XLA's vectorised CPU division can miss r / r = 1 by an ulp (see the canonical form).
    rtol = 64 * np.finfo(host[0].dtype).eps if hxp.name == "jax" else 0
    for l, (v, w) in enumerate(zip(hxp.tolist(V), host), start=1):
        nonfree = ~chain.free_mask(l)
        assert np.allclose(np.abs(v[nonfree]), np.abs(w[nonfree]), rtol=rtol, atol=0)
        if not keep_signs:
            assert np.allclose(v[nonfree], w[nonfree], rtol=rtol, atol=0)


@settings(max_examples=examples(25))
@given(chain=chains(scaled=True), seed=seeds, lr=st.sampled_from([0.01, 0.3]))
def test_first_step_from_a_scaled_skeleton_is_sgds_where_no_tau_ratio_intervenes(chain, seed,
                                                                                 lr):
    """DESIGN §11: from skeleton edges of magnitude r_l, G-SGD moves layer 1's non-skeleton
    weights and every bias by exactly SGD's step -lr*g; above layer 1 a weight also takes
    the tau ratio of its column's source (allocation), W' = (W - lr*g) / rho."""
    pb = Problem(chain, seed)
    W, b = gc.skeleton_init(chain, pb.W, pb.b, keep_signs=True)
    G, Gb = pb.grads(W, b)
    Wn, bn = gc.gsgd_step(chain, W, b, G, Gb, lr=lr)
    skel = chain.free_mask(1) | chain.tau_mask(1)
    assert_close(Wn[0][~skel], (W[0] - lr * G[0])[~skel], 1e-12, "layer 1")
    for l, (x, y, g) in enumerate(zip(bn, b, Gb), start=1):
        if y is not None:
            assert_close(x, y - lr * g, 1e-12, f"bias {l}")


def test_group_helpers_defaults_and_edge_cases():
    """Defaults and corner cases of the group's helpers: the default spread is 1; scales
    may be host lists; skeleton_init writes +r by default and, keeping signs, +r where a
    skeleton weight is exactly 0; a node whose free chain holds a zero weight keeps scale 1
    in the canonical form."""
    chain = gc.Chain((3, 4, 2, 3), (1, 2, 1), bias=(True, False, True))
    pb = Problem(chain, 21)
    got = gc.random_rescaling(chain, np.random.default_rng(5))
    rng = np.random.default_rng(5)
    want = [np.exp(rng.standard_normal(n)) for n in chain.sizes[1:-1]]
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    rng = np.random.default_rng(5)
    half = [np.exp(0.5 * rng.standard_normal(n)) for n in chain.sizes[1:-1]]
    assert all(np.array_equal(a, b) for a, b in
               zip(gc.random_rescaling(chain, np.random.default_rng(5), 0.5), half))
    as_lists = gc.rescale(chain, pb.W, pb.b, [list(s) for s in got])
    as_arrays = gc.rescale(chain, pb.W, pb.b, got)
    assert all(np.array_equal(a, b) for a, b in zip(as_lists[0], as_arrays[0]))
    W = [w.copy() for w in pb.W]
    W[0][chain.tau_mask(1)] = 0.0
    for keep in (False, True):
        Ws, _ = gc.skeleton_init(chain, W, keep_signs=keep) if keep else gc.skeleton_init(
            chain, W)
        assert np.all(Ws[0][chain.tau_mask(1)] == 1.0)  # +r where the weight was 0
        signs = np.sign(W[1][chain.tau_mask(2) | chain.free_mask(2)])
        skel = Ws[1][chain.tau_mask(2) | chain.free_mask(2)]
        assert np.array_equal(skel, signs if keep else np.ones_like(skel))
    Wr, _ = gc.skeleton_init(chain, pb.W, rest_scale=0.5)
    for l, (w, w0) in enumerate(zip(Wr, pb.W), start=1):
        rest = ~(chain.tau_mask(l) | chain.free_mask(l))
        assert np.array_equal(w[rest], w0[rest] * 0.5)
    with pytest.raises(ValueError, match="rest_scale must be finite"):
        gc.skeleton_init(chain, pb.W, rest_scale=-1.0)
    W = [w.copy() for w in pb.W]
    W[2][chain.free_mask(3)] = 0.0  # every free edge out of layer 2: F_2 = 0, F_1 = 0
    Wc, _ = gc.canonicalize(chain, W, pb.b)
    for l in (1, 2, 3):  # no node of layers 1, 2 has a group element: scale 1 everywhere
        assert np.array_equal(Wc[l - 1], W[l - 1]), f"layer {l}"


def _group_moves(ns, chain, pb, bias):
    """The group's four moves on float32 arrays of ``ns``; host arrays back. Without biases
    in the chain, every bias argument is left out (``None``)."""
    A, Ab = ns.aslist(pb.W), ns.aslist(pb.b) if bias else None
    V, Vb = gc.path_values(chain, pb.W, pb.b)
    moves = {
        "rescale": gc.rescale(chain, A, Ab, gc.random_rescaling(chain, np.random.default_rng(3))),
        "canonicalize": gc.canonicalize(chain, A, Ab),
        "skeleton_init": gc.skeleton_init(chain, A, Ab, keep_signs=True, rest_scale=0.5),
        "weights_from_path_values": gc.weights_from_path_values(
            chain, ns.aslist(V), ns.aslist(Vb) if bias else None, A)}
    return {name: [ns.to_numpy(a) for a in W] + ([] if b is None else ns.tolist(b))
            for name, (W, b) in moves.items()}


@pytest.mark.parametrize("bias", [True, False], ids=["biases", "no biases"])
def test_the_group_moves_are_the_weights_dtype_arithmetic_alike_in_every_namespace(bias):
    """Elementwise float32 arithmetic (products, quotients, signs) is correctly rounded in
    every namespace, so float32 weights give the same bits in each: the moves compute in
    the weights' dtype, never in a wider default one, and biases may be left out."""
    chain = gc.Chain((5, 6, 4, 3), (1, 2, 1), bias=bias)
    pb = Problem(chain, 8)
    assert_same_bits_in_float32_namespaces(lambda ns: _group_moves(ns, chain, pb, bias))


def test_rescale_takes_scales_traced_under_jax_jit():
    """Scales of the weights' namespace are never read on the host: under ``jax.jit`` they
    are tracers, and the moved weights equal those from host scales."""
    jax = pytest.importorskip("jax")
    chain = gc.Chain((3, 4, 2, 3), (1, 2, 1), bias=(True, False, True))
    pb = Problem(chain, 4)
    scales = gc.random_rescaling(chain, pb.rng)
    W, b = [jax.numpy.asarray(w) for w in pb.W], [None if v is None else jax.numpy.asarray(v)
                                                  for v in pb.b]
    moved = jax.jit(lambda W, b, s: gc.rescale(chain, W, b, s))(
        W, b, [jax.numpy.asarray(s) for s in scales])
    want = gc.rescale(chain, pb.W, pb.b, scales)
    for a, e in zip(moved[0] + moved[1], want[0] + want[1]):
        assert (a is None and e is None) or np.allclose(np.asarray(a), e, rtol=1e-12, atol=0)
