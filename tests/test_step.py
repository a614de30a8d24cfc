"""One G-SGD step and its weight allocation: against the path-space update, the dense
``Ã^{-1}`` of eq. (6), a second projection (Thm 4.1), and the paper's closed form (App. 10.1)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gsgd_core as gc
from gsgd_core import reference as ref
from _helpers import Problem, assert_all_close, assert_close
from _nets import output
from _strategies import chains, examples, seeds, small_chains

lrs = st.sampled_from([0.01, 0.1, 0.5])


@given(chain=chains(), seed=seeds, lr=lrs)
def test_step_moves_path_values_by_lr_times_path_gradient(hxp, chain, seed, lr):
    """New path values are ``V - lr*D = V*R``; free weights are unchanged, bit for bit."""
    pb = Problem(chain, seed)
    G, Gb = pb.grads()
    W, b = hxp.aslist(pb.W), hxp.aslist(pb.b)
    D, Db = gc.icr(chain, W, b, hxp.aslist(G), hxp.aslist(Gb))
    V, Vb = gc.path_values(chain, W, b)
    W2, b2 = gc.gsgd_step(chain, W, b, hxp.aslist(G), hxp.aslist(Gb), lr)
    V2, Vb2 = gc.path_values(chain, W2, b2)
    v, d = ref.to_basis(chain, hxp.tolist(V), hxp.tolist(Vb)), ref.to_basis(
        chain, hxp.tolist(D), hxp.tolist(Db))
    expected = v - lr * d
    if np.any(expected == 0):
        return  # a path landing exactly on 0 is the documented epsilon case
    assert_close(ref.to_basis(chain, hxp.tolist(V2), hxp.tolist(Vb2)), expected, hxp.rtol,
                 "V' = V - lr*D")
    for l, (w, w2) in enumerate(zip(hxp.tolist(W), hxp.tolist(W2)), start=1):
        free = chain.free_mask(l)
        assert np.array_equal(w.reshape(free.shape)[free], w2.reshape(free.shape)[free])
    for a in W2 + [x for x in b2 if x is not None]:
        assert a.dtype == hxp.dtype


@given(chain=small_chains(), seed=seeds, lr=lrs)
def test_forward_sweep_equals_dense_weight_allocation(hxp, chain, seed, lr):
    """The sweep equals ``w * ((1..1, R) ⊙ Ã^{-1})`` (eq. 5-6) with Ã built densely."""
    pb = Problem(chain, seed)
    G, Gb = pb.grads()
    d = ref.icr(chain, pb.W, pb.b, G, Gb)
    v = ref.path_values(chain, pb.W, pb.b)
    R = (v - lr * d) / v
    if np.any(R == 0):
        return
    W2, b2 = gc.gsgd_step(chain, hxp.aslist(pb.W), hxp.aslist(pb.b), hxp.aslist(G),
                          hxp.aslist(Gb), lr)
    assert_close(ref.flatten(chain, hxp.tolist(W2), hxp.tolist(b2)),
                 ref.allocate(chain, pb.W, pb.b, R), hxp.rtol, "weights")


def _compare_projections(chain, seed, lr=0.05):
    """Run G-SGD with the sweep and with the min-norm projection; return both end points."""
    pb = Problem(chain, seed)
    Wa, ba = pb.W, pb.b
    wb = ref.flatten(chain, pb.W, pb.b)
    for _ in range(5):
        G, Gb = pb.grads(Wa, ba)
        Wa, ba = gc.gsgd_step(chain, Wa, ba, G, Gb, lr)
        Wb, bb = ref.unflatten(chain, wb)
        G, Gb = pb.grads(Wb, bb)
        D, Db = gc.icr(chain, Wb, bb, G, Gb)
        v = ref.path_values(chain, Wb, bb)
        wb = ref.allocate_min_norm(chain, Wb, bb, (v - lr * ref.to_basis(chain, D, Db)) / v)
        Wb, bb = ref.unflatten(chain, wb)
        assert_close(ref.path_values(chain, Wb, bb), ref.path_values(chain, Wa, ba), 1e-9,
                     "path values")
    assert_close(output(chain, Wb, bb, pb.x), output(chain, Wa, ba, pb.x), 1e-9, "outputs")
    return ref.flatten(chain, Wa, ba), wb


@settings(max_examples=examples(15))
@given(chain=small_chains(), seed=seeds)
def test_min_norm_projection_gives_the_same_path_values(chain, seed):
    """Theorem 4.1: another projection that keeps free-weight signs (minimum norm in log
    space, free weights move) yields the same path values and function, step after step."""
    _compare_projections(chain, seed)


def test_min_norm_projection_reaches_a_different_point_of_the_orbit():
    chain = gc.Chain((3, 4, 3, 2), (1, 2, 1), bias=(True, False, True))
    wa, wb = _compare_projections(chain, 5)
    free = ref.free_edges(chain)
    assert np.max(np.abs(wa[free] - wb[free])) > 1e-3


def _path_space_momentum(ds, lr, momentum, dampening, nesterov):
    """torch.optim.SGD's momentum rule applied to a sequence of path gradients."""
    M, steps = None, []
    for d in ds:
        M = d.copy() if M is None else momentum * M + (1 - dampening) * d
        steps.append(lr * (d + momentum * M if nesterov else M))
    return steps


@pytest.mark.parametrize("momentum, dampening, nesterov, wd", [
    (0.9, 0.0, False, 0.0), (0.9, 0.0, True, 0.0), (0.5, 0.25, False, 0.0),
    (0.9, 0.0, False, 1e-2)])
def test_momentum_is_sgd_momentum_on_path_values(momentum, dampening, nesterov, wd):
    chain = gc.Chain((3, 4, 3, 2), (1, 3, 1), bias=(True, False, True))
    pb = Problem(chain, 3)
    lr = 0.05
    W, b = pb.W, pb.b
    state = gc.gsgd_init(chain, W, b)
    M = None
    for _ in range(6):
        G, Gb = pb.grads(W, b)
        D, Db = gc.icr(chain, W, b, G, Gb)
        V, Vb = gc.path_values(chain, W, b)
        v, d = ref.to_basis(chain, V, Vb), ref.to_basis(chain, D, Db) + wd * ref.to_basis(
            chain, V, Vb)
        M = d.copy() if M is None else momentum * M + (1 - dampening) * d
        step = lr * (d + momentum * M if nesterov else M)
        W, b, state = gc.gsgd_update(chain, state, W, b, G, Gb, lr=lr, momentum=momentum,
                                     dampening=dampening, nesterov=nesterov, weight_decay=wd)
        V2, Vb2 = gc.path_values(chain, W, b)
        assert_close(ref.to_basis(chain, V2, Vb2), v - step, 1e-12, "V' = V - lr*step")
    assert int(state.step) == 6


def _paper_closed_form(W, G, lr):
    """Appendix 10.1, eq. (25)-(28), for an equal-width bias-free MLP whose free skeleton
    weights are 1, in the paper's own indexing: ``w^1(i_1 mod d, i_1)`` are the layer-1
    skeleton weights ``w_j``, the diagonals and ``w^L(i, i mod K)`` the free ``w_k``."""
    L = len(W)
    h, d = W[0].shape[:2]
    K = W[-1].shape[0]
    W1, G1 = W[0][:, :, 0], G[0][:, :, 0]
    new = [w[:, :, 0].copy() for w in W]
    # delta_{v_i} v_i = delta_{w_i} w_i for every non-skeleton w_i whose basis path passes
    # w_j: those leaving hidden node j in layers 2..L (the diagonal chain keeps index j).
    R = np.empty(h)
    for j in range(h):
        w_j, g_j = W1[j, j % d], G1[j, j % d]
        s = 0.0
        for l in range(2, L + 1):
            Wl, Gl = W[l - 1][:, :, 0], G[l - 1][:, :, 0]
            for b in range(Wl.shape[0]):
                skeleton = (b == j) if l < L else (b == j % K)
                if not skeleton:
                    s += Gl[b, j] * Wl[b, j]
        R[j] = 1 - lr * (g_j - s / w_j) / w_j                       # eq. (25)
        new[0][j, j % d] = w_j * R[j]                                # eq. (26)
    for l in range(1, L + 1):
        Wl, Gl = W[l - 1][:, :, 0], G[l - 1][:, :, 0]
        for b in range(Wl.shape[0]):
            for a in range(Wl.shape[1]):
                if l == 1 and a == b % d:
                    continue                                         # w_j, done above
                if (1 < l < L and a == b) or (l == L and b == a % K):
                    continue                                         # eq. (28): w_k kept
                v = Wl[b, a] * (W1[a, a % d] if l > 1 else 1.0)      # free weights are 1
                r = R[a] if l > 1 else 1.0                           # ratio of w_j on p^i
                new[l - 1][b, a] = (Wl[b, a] - lr * Gl[b, a] * Wl[b, a] ** 2 / v ** 2) / r
    return [w[:, :, None] for w in new]                              # eq. (27) above


@pytest.mark.parametrize("widths", [[5, 4, 4, 3], [3, 6, 6, 6, 6, 4], [4, 4, 4]])
def test_equals_papers_closed_form_after_skeleton_init(widths):
    chain = gc.Chain.mlp(widths, bias=False)
    pb = Problem(chain, 11)
    W, _ = gc.skeleton_init(chain, pb.W)
    b = [None] * chain.L
    for _ in range(4):  # later steps start from layer-1 skeleton weights != 1
        G, _ = pb.grads(W, b)
        expected = _paper_closed_form(W, G, 0.1)
        W, _ = gc.gsgd_step(chain, W, b, G, b, 0.1)
        assert_all_close(W, expected, 1e-12, "eq. (25)-(28)")


def test_momentum_state_of_a_chain_without_biases():
    """``gsgd_init`` without biases makes no bias buffers, and momentum steps with it."""
    chain = gc.Chain.mlp([3, 4, 2], bias=False)
    pb = Problem(chain, 1)
    G, _ = pb.grads()
    state = gc.gsgd_init(chain, pb.W)
    assert state.bias_momentum == (None, None) and int(state.step) == 0
    W1, b1, state = gc.gsgd_update(chain, state, pb.W, None, G, None, lr=0.1, momentum=0.9)
    W2, _ = gc.gsgd_step(chain, pb.W, None, G, None, 0.1)
    assert b1 == [None, None] and int(state.step) == 1
    for a, c in zip(W1, W2):   # the first momentum step is the plain step
        np.testing.assert_array_equal(a, c)


def test_the_first_momentum_buffer_is_the_path_gradient_where_path_values_overflow():
    """torch.optim.SGD's convention, the first buffer is the gradient, holds on float32
    weights of 1e20 whose path values overflow to Inf: weight decay being off, no
    ``0 * V`` enters the path gradients."""
    chain = gc.Chain.mlp([2, 3, 2])
    rng = np.random.default_rng(0)
    W = [(rng.standard_normal(s) * 1e20).astype(np.float32) for s in ((3, 2), (2, 3))]
    b = [np.zeros(3, np.float32), np.zeros(2, np.float32)]
    G, Gb = [np.full_like(w, 1e-3) for w in W], [np.full_like(x, 1e-3) for x in b]
    with np.errstate(over="ignore"):
        assert not np.isfinite(gc.path_values(chain, W, b)[0][1]).all()
        D, Db = gc.icr(chain, W, b, G, Gb)
        _, _, state = gc.gsgd_update(chain, gc.gsgd_init(chain, W, b), W, b, G, Gb, lr=0.1,
                                     momentum=0.9)
    assert all(np.abs(d).max() > 0 for d in D)
    for m, d in zip(state.momentum + state.bias_momentum, D + Db):
        np.testing.assert_array_equal(m, d)


def test_step_count_advances_without_momentum_and_not_on_a_skipped_step():
    chain = gc.Chain.mlp([3, 4, 2])
    pb = Problem(chain, 5)
    G, Gb = pb.grads()
    state = gc.gsgd_init(chain, pb.W, pb.b)
    W, b = pb.W, pb.b
    for n in (1, 2):
        W, b, state = gc.gsgd_update(chain, state, W, b, G, Gb, lr=0.01)
        assert int(state.step) == n
    bad = [G[0] * np.nan, G[1]]
    _, _, state = gc.gsgd_update(chain, state, W, b, bad, Gb, lr=0.01)
    assert int(state.step) == 2


def test_weight_decay_without_momentum_decays_path_values():
    """``V' = V - lr (D + weight_decay V)`` with no momentum and no state (eq. 2 with L2 on
    basis-path values), and no state comes back."""
    chain = gc.Chain.mlp([3, 4, 2])
    pb = Problem(chain, 6)
    G, Gb = pb.grads()
    lr, wd = 0.05, 0.1
    W1, b1, state = gc.gsgd_update(chain, None, pb.W, pb.b, G, Gb, lr=lr, weight_decay=wd)
    assert state is None
    D, Db = gc.icr(chain, pb.W, pb.b, G, Gb)
    V, Vb = gc.path_values(chain, pb.W, pb.b)
    V1, Vb1 = gc.path_values(chain, W1, b1)
    for new, v, d in zip(V1 + Vb1, V + Vb, D + Db):
        np.testing.assert_allclose(new, v - lr * (d + wd * v), rtol=1e-12, atol=1e-15)


def test_momentum_and_dampening_traced_under_jax_jit_take_nesterov():
    """``optax.inject_hyperparams`` hands momentum and dampening in as tracers: Nesterov's
    check cannot read them and leaves them to the user, and the step moves the weights as
    the numbers do (the first momentum step: ``V' = V - lr (D + momentum D)``)."""
    jax = pytest.importorskip("jax")
    chain = gc.Chain.mlp([3, 4, 2])
    pb = Problem(chain, 2)
    W, b, G, Gb = pb.in_jax()

    def step(W, b, G, Gb, momentum, dampening):
        state = gc.gsgd_init(chain, W, b)
        return gc.gsgd_update(chain, state, W, b, G, Gb, lr=0.5, momentum=momentum,
                              dampening=dampening, nesterov=True)[:2]

    got = jax.jit(step)(W, b, G, Gb, 0.9, 0.0)
    want = gc.gsgd_update(chain, gc.gsgd_init(chain, pb.W, pb.b), pb.W, pb.b, *pb.grads(),
                          lr=0.5, momentum=0.9, nesterov=True)[:2]
    for a, e in zip(got[0] + got[1], want[0] + want[1]):
        np.testing.assert_allclose(np.asarray(a), e, rtol=1e-5, atol=1e-6)


def test_a_learning_rate_traced_under_jax_jit_steps_as_the_number():
    """A schedule's ``lr`` under ``jax.jit`` is a tracer (optax passes one): the G-SGD step
    takes it as an array and moves the weights as the number does."""
    jax = pytest.importorskip("jax")
    chain = gc.Chain.mlp([3, 4, 2])
    pb = Problem(chain, 2)
    W, b, G, Gb = pb.in_jax()

    def step(lr):
        return gc.gsgd_step(chain, W, b, G, Gb, lr)

    got, want = jax.jit(step)(0.5), gc.gsgd_step(chain, pb.W, pb.b, *pb.grads(), 0.5)
    for a, e in zip(got[0] + got[1], want[0] + want[1]):
        np.testing.assert_allclose(np.asarray(a), e, rtol=1e-5, atol=1e-6)
