"""The in-place layer (gsgd_backends) for path-space rules and its generic path: what the fast
path declines is computed by the core and written back whole (weights, biases, every array
of the state), and the helpers write what they promise."""

import numpy as np
import pytest

import gsgd_backends as gb
import gsgd_core as gc
from _helpers import Problem, assert_close

CHAIN = gc.Chain.mlp([3, 5, 4, 2])


def _data(ns, seed=0):
    pb = Problem(CHAIN, seed)
    G, Gb = pb.grads()
    return pb, ns.aslist(pb.W), ns.aslist(pb.b), ns.aslist(G), ns.aslist(Gb)


def test_path_update_in_place_equals_the_core(hxp):
    if hxp.name == "jax":
        pytest.skip("JAX arrays are immutable: the in-place layer refuses them")
    pb, A, Ab, G, Gb = _data(hxp)
    rule = gc.adamw_rule(0.01, amsgrad=True)
    state = gc.path_init(CHAIN, rule, A, Ab)
    E, Eb = hxp.aslist(pb.W), hxp.aslist(pb.b)  # the core's own copies
    es = gc.path_init(CHAIN, rule, E, Eb)
    ids = [id(a) for a in A]
    for _ in range(2):
        assert gb.path_update_(CHAIN, rule, state, A, Ab, G, Gb) is True
        E, Eb, es = gc.path_update(CHAIN, rule, es, E, Eb, G, Gb)
    assert [id(a) for a in A] == ids and int(hxp.to_numpy(state.count)) == 2
    tol = 1e-12 if hxp.is_f64 else 1e-5
    for a, e in zip(A + Ab + [x for bufs in state.buffers for x in bufs],
                    E + Eb + [x for bufs in es.buffers for x in bufs]):
        assert_close(hxp.to_numpy(a), hxp.to_numpy(e), tol)


def _fortran(ns, arrays):
    """The same values in arrays that are not C-contiguous: the fast paths decline them."""
    return [ns.asarray(np.asfortranarray(ns.to_numpy(a))) if ns.name == "numpy" else a
            for a in arrays]


def test_declined_steps_go_to_the_core_and_write_everything_back(xp):
    if xp.name != "numpy":
        pytest.skip("NumPy arrays in Fortran order are the declined case drawn here")
    pb, A, Ab, G, Gb = _data(xp, 1)
    A = _fortran(xp, A)
    assert not A[1].flags["C_CONTIGUOUS"]
    rule = gc.adam_rule(0.01)
    state = gc.path_init(CHAIN, rule, A, Ab)
    state = gc.RuleState(tuple(tuple(_fortran(xp, bufs)) for bufs in state.buffers),
                         np.asarray(0, dtype=np.int32))
    E, Eb, es = gc.path_update(CHAIN, rule, gc.path_init(CHAIN, rule, A, Ab), A, Ab, G, Gb)
    assert gb.path_update_(CHAIN, rule, state, A, Ab, G, Gb) is True
    for a, e in zip(A + Ab + [x for bufs in state.buffers for x in bufs],
                    E + Eb + [x for bufs in es.buffers for x in bufs]):
        np.testing.assert_array_equal(a, e)
    assert int(state.count) == 1
    W2 = _fortran(xp, xp.aslist(pb.W))
    EW, Eb2 = gc.gsgd_step(CHAIN, W2, xp.aslist(pb.b), G, Gb, 0.1)
    b2 = xp.aslist(pb.b)
    assert gb.gsgd_update_(CHAIN, None, W2, b2, G, Gb, lr=0.1) is True
    for a, e in zip(W2 + b2, EW + Eb2):
        np.testing.assert_array_equal(a, e)
    # a learning rate given as an array never reaches the fast path: the core, and True
    assert gb.gsgd_update_(CHAIN, None, W2, b2, G, Gb, lr=np.asarray(0.1)) is True


def test_in_place_helpers_write_weights_and_biases(xp):
    if xp.name == "jax":
        pytest.skip("JAX arrays are immutable: the in-place layer refuses them")
    pb, A, Ab, G, Gb = _data(xp, 2)
    EW, Eb = gc.path_sgd_step(CHAIN, A, Ab, G, Gb, 0.1)
    gb.path_sgd_step_(CHAIN, A, Ab, G, Gb, 0.1)
    for a, e in zip(A + Ab, EW + Eb):
        np.testing.assert_array_equal(xp.to_numpy(a), xp.to_numpy(e))
    gb.skeleton_init_(CHAIN, A)  # rest_scale defaults to 1: the other weights are kept
    for l, (a, e) in enumerate(zip(xp.tolist(A), xp.tolist(EW)), start=1):
        rest = ~(CHAIN.free_mask(l) | CHAIN.tau_mask(l)).reshape(a.shape)
        np.testing.assert_array_equal(a[rest], e[rest])


class Sign:
    """A rule of the user's, not elementwise-declared: Delta = lr * sign(D) (signSGD)."""

    def init(self, values):
        return ()

    def update(self, grads, state, values):
        import array_api_compat
        xp = array_api_compat.array_namespace(*grads)
        return tuple(0.01 * xp.sign(d) for d in grads), state


def test_any_rule_and_chains_without_biases_in_place(xp):
    if xp.name == "jax":
        pytest.skip("JAX arrays are immutable: the in-place layer refuses them")
    chain = gc.Chain.mlp([3, 5, 2], bias=False)
    pb = Problem(chain, 3)
    G, _ = pb.grads()
    for rule in (Sign(), gc.adam_rule(0.01)):
        A, E, AG = xp.aslist(pb.W), xp.aslist(pb.W), xp.aslist(G)
        E, _, _ = gc.path_update(chain, rule, gc.path_init(chain, rule, E), E, None, AG)
        state = gc.path_init(chain, rule, A)
        assert gb.path_update_(chain, rule, state, A, None, AG, None) is True
        for a, e in zip(A, E):
            assert_close(xp.to_numpy(a), xp.to_numpy(e), 1e-12 if xp.is_f64 else 1e-5)


def test_half_precision_in_place_takes_the_core():
    torch = pytest.importorskip("torch")
    pb = Problem(CHAIN, 0)
    G, Gb = pb.grads()
    half = lambda xs: [torch.tensor(x, dtype=torch.float16) for x in xs]  # noqa: E731
    A, Ab = half(pb.W), half(pb.b)
    rule = gc.adam_rule(0.01)
    state = gc.path_init(CHAIN, rule, A, Ab)
    E, Eb, _ = gc.path_update(CHAIN, rule, gc.path_init(CHAIN, rule, A, Ab), half(pb.W),
                              half(pb.b), half(G), half(Gb))
    assert gb.path_update_(CHAIN, rule, state, A, Ab, half(G), half(Gb)) is True
    for a, e in zip(A + Ab, E + Eb):
        assert a.dtype == torch.float16 and torch.equal(a, e)


class Wrapped:
    """Adam by composition: a PathRule whose state is a RuleState but which is no
    ElementwiseRule (so no fast path may apply it block by block)."""

    def __init__(self):
        self.inner = gc.adam_rule(0.01)

    def init(self, values):
        return self.inner.init(values)

    def update(self, grads, state, values):
        return self.inner.update(grads, state, values)


def test_a_rule_state_without_an_elementwise_rule_takes_the_core(xp):
    if xp.name == "jax":
        pytest.skip("JAX arrays are immutable: the in-place layer refuses them")
    pb, A, Ab, G, Gb = _data(xp, 4)
    rule = Wrapped()
    E, Eb, _ = gc.path_update(CHAIN, rule, gc.path_init(CHAIN, rule, A, Ab), xp.aslist(pb.W),
                              xp.aslist(pb.b), G, Gb)
    assert gb.path_update_(CHAIN, rule, gc.path_init(CHAIN, rule, A, Ab), A, Ab, G, Gb)
    for a, e in zip(A + Ab, E + Eb):
        np.testing.assert_array_equal(xp.to_numpy(a), xp.to_numpy(e))
