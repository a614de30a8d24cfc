"""Every public function on every namespace: same numbers (float64 to 1e-12), dtype, device
and shapes preserved, no mutation, jit-able (JAX), strict Array API (no boolean indexing, no
data-dependent shapes), and the in-place backend layer."""

import numpy as np
import pytest

import gsgd_backends as gb
import gsgd_core as gc
from gsgd_backends import kernels_for
from _helpers import Problem, assert_close

# conv 3x3 -> conv 2x2 -> flatten of 4 positions -> linear -> linear, mixed biases
SHAPES = [(4, 3, 3, 3), (5, 4, 2, 2), (6, 5 * 4), (3, 6)]
CHAIN = gc.Chain.from_shapes(SHAPES, bias=[True, False, True, True])
MLP = gc.Chain.mlp([5, 7, 1, 4, 3])


def _problem(chain, shapes=None, seed=0):
    pb = Problem(chain, seed)
    shapes = shapes or [chain.layer_shape(l) for l in range(1, chain.L + 1)]
    G, Gb = pb.grads()
    own = [w.reshape(s) for w, s in zip(pb.W, shapes)]
    return pb, own, [g.reshape(s) for g, s in zip(G, shapes)], Gb


def _run_all(ns, chain, W, b, G, Gb):
    """Every public function of the core on one namespace; results as host arrays."""
    A, Ab, AG, AGb = ns.aslist(W), ns.aslist(b), ns.aslist(G), ns.aslist(Gb)
    out = {}
    out["path_values"] = gc.path_values(chain, A, Ab)
    out["icr"] = gc.icr(chain, A, Ab, AG, AGb)
    out["gsgd_step"] = gc.gsgd_step(chain, A, Ab, AG, AGb, 0.1)
    state = gc.gsgd_init(chain, A, Ab)
    Wm, bm = A, Ab
    for _ in range(3):
        Wm, bm, state = gc.gsgd_update(chain, state, Wm, bm, AG, AGb, lr=0.05, momentum=0.9,
                                       nesterov=True, weight_decay=1e-3)
    out["gsgd_update"] = (Wm, bm, list(state.momentum), list(state.bias_momentum))
    scales = gc.random_rescaling(chain, np.random.default_rng(0), 1.0)
    out["rescale"] = gc.rescale(chain, A, Ab, scales)
    out["canonicalize"] = gc.canonicalize(chain, A, Ab)
    out["skeleton_init"] = gc.skeleton_init(chain, A, Ab)
    V, Vb = out["path_values"]
    out["weights_from_path_values"] = gc.weights_from_path_values(chain, V, Vb, A)
    out["path_sgd_gamma"] = gc.path_sgd_gamma(chain, A, Ab)
    out["path_sgd_step"] = gc.path_sgd_step(chain, A, Ab, AG, AGb, 0.1)
    psi_w, psi_state = gc.psi_update(gc.psi_init(A), A, AG, lr=0.1, momentum=0.9)
    out["psi_update"] = (psi_w, list(psi_state.momentum))
    return out


def _leaves(result):
    for part in result:
        yield from part


@pytest.mark.parametrize("chain, shapes", [(CHAIN, SHAPES), (MLP, None)], ids=["conv", "mlp"])
def test_every_function_agrees_with_numpy_and_keeps_dtype_device_shape(xp, chain, shapes):
    pb, W, G, Gb = _problem(chain, shapes)
    numpy_ns = type(xp)("numpy", "float64", _from_np=lambda a: a)
    expected = _run_all(numpy_ns, chain, W, pb.b, G, Gb)
    got = _run_all(xp, chain, W, pb.b, G, Gb)
    rtol = 1e-12 if xp.is_f64 else 2e-3
    for name, result in got.items():
        for i, (a, e) in enumerate(zip(_leaves(result), _leaves(expected[name]))):
            if e is None:
                assert a is None, name
                continue
            assert a.dtype == xp.dtype, f"{name}: dtype {a.dtype}"
            assert tuple(a.shape) == tuple(e.shape), f"{name}: shape {a.shape} != {e.shape}"
            if xp.device is not None:
                import array_api_compat
                assert array_api_compat.device(a) == xp.device, name
            assert_close(xp.to_numpy(a), e, rtol, f"{name}[{i}]")


def test_flattened_and_3d_layouts_give_the_same_step():
    pb, W, G, Gb = _problem(CHAIN, SHAPES)
    flat = gc.gsgd_step(CHAIN, W, pb.b, G, Gb, 0.1)
    W3 = [w.reshape(CHAIN.layer_shape(l)) for l, w in enumerate(W, start=1)]
    G3 = [g.reshape(CHAIN.layer_shape(l)) for l, g in enumerate(G, start=1)]
    three = gc.gsgd_step(CHAIN, W3, pb.b, G3, Gb, 0.1)
    for a, e in zip(flat[0], three[0]):
        assert np.array_equal(a.reshape(e.shape), e)


def test_inputs_are_never_mutated(hxp):
    pb, W, G, Gb = _problem(CHAIN, SHAPES)
    A, Ab, AG, AGb = hxp.aslist(W), hxp.aslist(pb.b), hxp.aslist(G), hxp.aslist(Gb)
    before = [hxp.to_numpy(a).copy() for a in A + AG + [x for x in Ab + AGb if x is not None]]
    _run_all(hxp, CHAIN, W, pb.b, G, Gb)
    gc.gsgd_update(CHAIN, gc.gsgd_init(CHAIN, A, Ab), A, Ab, AG, AGb, lr=0.1, momentum=0.5)
    after = [hxp.to_numpy(a) for a in A + AG + [x for x in Ab + AGb if x is not None]]
    assert all(np.array_equal(x, y) for x, y in zip(before, after))


def test_strict_namespace_without_boolean_indexing_or_data_dependent_shapes():
    """The proxy for jit-compatibility: no boolean-mask indexing, no data-dependent shapes."""
    xs = pytest.importorskip("array_api_strict")
    from _namespaces import available_namespaces
    ns = next(n for n in available_namespaces() if n.id == "array_api_strict-float64")
    pb, W, G, Gb = _problem(CHAIN, SHAPES)
    expected = _run_all(type(ns)("numpy", "float64", _from_np=lambda a: a), CHAIN, W, pb.b,
                        G, Gb)
    with xs.ArrayAPIStrictFlags(boolean_indexing=False, data_dependent_shapes=False):
        got = _run_all(ns, CHAIN, W, pb.b, G, Gb)
    for name in got:
        for a, e in zip(_leaves(got[name]), _leaves(expected[name])):
            if e is not None:
                assert_close(ns.to_numpy(a), e, 1e-12, name)


def test_jax_jit_compiles_once_and_matches_numpy():
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    pb, W, G, Gb = _problem(CHAIN, SHAPES)
    traces = []

    @jax.jit
    def update(state, W, b, G, Gb, lr):
        traces.append(1)
        return gc.gsgd_update(CHAIN, state, W, b, G, Gb, lr=lr, momentum=0.9)

    J = lambda xs: [None if x is None else jnp.asarray(x) for x in xs]  # noqa: E731
    Wj, bj = J(W), J(pb.b)
    state = gc.gsgd_init(CHAIN, Wj, bj)
    Wn, bn, sn = W, pb.b, gc.gsgd_init(CHAIN, W, pb.b)
    for lr in (0.1, 0.05, 0.02):  # a schedule: lr is a traced scalar, not a new trace
        Wj, bj, state = update(state, Wj, bj, J(G), J(Gb), jnp.asarray(lr))
        Wn, bn, sn = gc.gsgd_update(CHAIN, sn, Wn, bn, G, Gb, lr=lr, momentum=0.9)
    assert len(traces) == 1
    for a, e in zip(Wj + bj, Wn + bn):
        if e is not None:
            assert_close(np.asarray(a), e, 1e-12, "jit vs numpy")


def test_a_chain_first_used_under_jax_jit_steps_eagerly_afterwards():
    """Under ``jax.jit`` the chain's index arrays are tracers, even for weights closed over
    as concrete arrays: they must not be kept on the chain, or the next eager call with the
    same chain meets a tracer that outlived its trace."""
    jax = pytest.importorskip("jax")
    chain = gc.Chain.mlp([3, 4, 2])  # nothing cached on it yet
    pb = Problem(chain, 3)
    W, b, G, Gb = ([None if a is None else jax.numpy.asarray(a) for a in part]
                   for part in (pb.W, pb.b, *pb.grads()))
    traced = jax.jit(lambda lr: gc.gsgd_step(chain, W, b, G, Gb, lr))(0.1)
    eager = gc.gsgd_step(chain, W, b, G, Gb, 0.1)
    for a, e in zip(traced[0] + traced[1], eager[0] + eager[1]):
        assert_close(np.asarray(a), np.asarray(e), 1e-12, "jit vs eager")


def test_eager_jax_results_keep_their_inputs_placement():
    """Arrays made without a device (uncommitted) give uncommitted path values and state,
    arrays put on a device give arrays committed to it: the core makes its own arrays (index
    arrays, step counts) alike, since JAX compiles each eager operation anew for each mix of
    committed and uncommitted operands."""
    jax = pytest.importorskip("jax")
    chain = gc.Chain.mlp([3, 4, 2])
    pb = Problem(chain, 3)
    device = jax.devices()[0]
    for put, committed in ((jax.numpy.asarray, False),
                           (lambda a: jax.device_put(a, device), True)):
        W, b = ([None if a is None else put(a) for a in part] for part in (pb.W, pb.b))
        V, Vb = gc.path_values(chain, W, b)
        out = [a for a in [*V, *Vb, gc.gsgd_init(chain, W, b).step] if a is not None]
        assert [(a.committed, a.devices()) for a in out] == [(committed, {device})] * len(out)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_backend_in_place_update_equals_core(hxp, momentum):
    if hxp.name == "jax":
        pytest.skip("JAX arrays are immutable: the in-place layer refuses them (tested below)")
    pb, W, G, Gb = _problem(CHAIN, SHAPES)
    A, Ab, AG, AGb = hxp.aslist(W), hxp.aslist(pb.b), hxp.aslist(G), hxp.aslist(Gb)
    state = gc.gsgd_init(CHAIN, A, Ab)
    exp_W, exp_b, exp_state = A, Ab, state
    state_inplace = gc.gsgd_init(CHAIN, A, Ab)
    ids = [id(a) for a in A]
    for _ in range(2):
        exp_W, exp_b, exp_state = gc.gsgd_update(CHAIN, exp_state, exp_W, exp_b, AG, AGb,
                                                 lr=0.1, momentum=momentum)
        gb.gsgd_update_(CHAIN, state_inplace, A, Ab, AG, AGb, lr=0.1, momentum=momentum)
    assert [id(a) for a in A] == ids
    # numpy/torch steps take the fast path: the core's numbers to rounding.
    fast = kernels_for(A[0]) is not None
    for a, e in zip(A + Ab + list(state_inplace.momentum), exp_W + exp_b +
                    list(exp_state.momentum)):
        if e is None:
            continue
        if fast:
            assert_close(hxp.to_numpy(a), hxp.to_numpy(e), 1e-12 if hxp.is_f64 else 1e-5)
        else:
            assert np.array_equal(hxp.to_numpy(a), hxp.to_numpy(e))
    assert int(hxp.to_numpy(state_inplace.step)) == 2


def test_backend_refuses_immutable_jax_arrays():
    pytest.importorskip("jax")
    import jax.numpy as jnp
    pb, W, G, Gb = _problem(MLP)
    J = lambda xs: [None if x is None else jnp.asarray(x) for x in xs]  # noqa: E731
    with pytest.raises(ValueError) as refused:
        gb.gsgd_step_(MLP, J(W), J(pb.b), J(G), J(Gb), 0.1)
    # the whole message: it names both ways out
    lib = type(J(W)[0]).__module__.split(".")[0]  # jax or jaxlib, by version
    assert str(refused.value) == (
        f"{lib} arrays are immutable and cannot be updated in place: use the functional "
        "gsgd_core API (gsgd_core.gsgd_update returns new arrays), or gsgd_adapters.optax in "
        "a JAX training loop")


def test_backend_in_place_helpers(hxp):
    if hxp.name == "jax":
        pytest.skip("JAX arrays are immutable: the in-place layer refuses them (tested below)")
    pb, W, _, _ = _problem(MLP)
    A, Ab = hxp.aslist(W), hxp.aslist(pb.b)
    scales = gc.random_rescaling(MLP, np.random.default_rng(1), 1.0)
    expected = gc.canonicalize(MLP, *gc.rescale(MLP, A, Ab, scales))
    gb.rescale_(MLP, A, Ab, scales)
    gb.canonicalize_(MLP, A, Ab)
    for a, e in zip(A + Ab, expected[0] + expected[1]):
        assert np.array_equal(hxp.to_numpy(a), hxp.to_numpy(e))
    gb.skeleton_init_(MLP, A)
    for l, w in enumerate(hxp.tolist(A), start=1):
        mask = MLP.free_mask(l) | MLP.tau_mask(l)
        assert np.all(w.reshape(mask.shape)[mask] == 1.0)
