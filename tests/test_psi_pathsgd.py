"""PSI-SGD(M) (seed 004) and Path-SGD (the paper's baseline)."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import gsgd_core as gc
from gsgd_core import reference as ref
from _helpers import Problem, assert_all_close, assert_close
from _strategies import chains, seeds, small_chains


def _bn(z):
    """Batch norm without epsilon, so the loss is exactly invariant to per-unit scaling."""
    z = z - z.mean(dim=0)
    return z / torch.sqrt((z * z).mean(dim=0))


def _bn_net_grads(Ws, x, y):
    """Gradients of an MLP whose two hidden layers are batch-normalised."""
    Wt = [torch.tensor(w, requires_grad=True) for w in Ws]
    x, y = torch.tensor(x), torch.tensor(y)
    h = _bn(torch.relu(_bn(x @ Wt[0].T)) @ Wt[1].T)
    loss = 0.5 * ((h @ Wt[2].T - y) ** 2).mean()
    loss.backward()
    return [w.grad.numpy() for w in Wt]


def _psi_run(Ws, U, x, y, steps, **hyper):
    state = gc.PSIState(tuple(U))
    bn = Ws[:2]
    for _ in range(steps):
        G = _bn_net_grads(bn + [Ws[2]], x, y)
        bn, state = gc.psi_update(state, bn, G[:2], **hyper)
    return bn, state


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@given(seed=seeds, spread=st.floats(0.1, 3.0))
def test_psi_sgdm_commutes_with_per_unit_scaling(momentum, seed, spread):
    """PSI-SGD paper (seed 004) Theorem 1: from (W, U) and (T_a W, T_a U) the iterates
    stay T_a-related. The theorem is about the update itself, so the renormalisation of
    rows above ``max_norm`` (a projection onto the same function, tested below) is moved
    out of reach: the "thorough" profile drew a spread of 3, whose rows of norm ~1e4 it
    renormalised in one twin only."""
    rng = np.random.default_rng(seed)
    Ws = [rng.standard_normal((6, 4)), rng.standard_normal((5, 6)), rng.standard_normal((2, 5))]
    U = [0.01 * rng.standard_normal(w.shape) for w in Ws[:2]]
    x, y = rng.standard_normal((16, 4)), rng.standard_normal((16, 2))
    a = [np.exp(spread * rng.standard_normal((w.shape[0], 1))) for w in Ws[:2]]
    hyper = dict(lr=0.05, momentum=momentum, max_norm=1e300)
    ours, s1 = _psi_run(Ws, U, x, y, 10, **hyper)
    twin, s2 = _psi_run([Ws[0] * a[0], Ws[1] * a[1], Ws[2]], [u * s for u, s in zip(U, a)],
                        x, y, 10, **hyper)
    assert_all_close(twin, [w * s for w, s in zip(ours, a)], 1e-8, "T_a W_t")
    assert_all_close(s2.momentum, [u * s for u, s in zip(s1.momentum, a)], 1e-8, "T_a U_t")


def test_psi_renormalises_large_rows_with_their_momentum(hxp):
    w = np.array([[3e4, 4e4, 0.0], [0.3, -0.2, 0.1]])
    g = np.array([[1e-12, -2e-12, 0.0], [0.5, 0.1, -0.2]])
    W, G = hxp.aslist([w]), hxp.aslist([g])
    big, _ = gc.psi_update(gc.psi_init(W), W, G, lr=0.1, momentum=0.9, max_norm=1e30)
    new, state = gc.psi_update(gc.psi_init(W), W, G, lr=0.1, momentum=0.9)
    big, new, u = hxp.to_numpy(big[0]), hxp.to_numpy(new[0]), hxp.to_numpy(state.momentum[0])
    norm = np.linalg.norm(big[0])
    assert_close(new[0], big[0] / norm, hxp.rtol, "renormalised row")
    assert_close(np.linalg.norm(new[0]), 1.0, hxp.rtol)
    # w' = w - lr*u before renormalising, and u is divided by the norm with the row
    assert_close(-0.1 * u[0] * norm, big[0] - w[0], hxp.rtol, "momentum scaled with the row")
    assert_close(new[1], big[1], hxp.rtol, "small rows untouched")


@given(chain=small_chains(), seed=seeds)
def test_path_sgd_gamma_equals_brute_force_path_sum(hxp, chain, seed):
    pb = Problem(chain, seed)
    gamma, gamma_b = gc.path_sgd_gamma(chain, hxp.aslist(pb.W), hxp.aslist(pb.b))
    assert_close(ref.flatten(chain, hxp.tolist(gamma), hxp.tolist(gamma_b)),
                 ref.path_sgd_gamma(chain, pb.W, pb.b), hxp.rtol, "gamma")


@given(chain=chains(), seed=seeds, spread=st.floats(0.0, 1.5))
def test_path_sgd_step_commutes_with_rescaling(hxp, chain, seed, spread):
    pb = Problem(chain, seed)
    G, Gb = pb.grads()
    scales = gc.random_rescaling(chain, pb.rng, spread)
    W, b = hxp.aslist(pb.W), hxp.aslist(pb.b)
    Wt, bt = gc.rescale(chain, W, b, scales)
    Gt, Gbt = pb.grads(hxp.tolist(Wt), hxp.tolist(bt))
    W1, b1 = gc.path_sgd_step(chain, W, b, hxp.aslist(G), hxp.aslist(Gb), 0.1)
    W2, b2 = gc.path_sgd_step(chain, Wt, bt, hxp.aslist(Gt), hxp.aslist(Gbt), 0.1)
    We, be = gc.rescale(chain, W1, b1, scales)
    assert_all_close(hxp.tolist(W2), hxp.tolist(We), hxp.rtol, "weights")
    assert_all_close(hxp.tolist(b2), hxp.tolist(be), hxp.rtol, "biases")


def test_psi_step_and_path_sgd_bias_step_follow_their_formulas():
    """One PSI-SGD step is ``w - lr ||w||^2 g`` row by row (PSI paper eq. 7); a Path-SGD
    step moves each bias by ``-lr g / gamma_b`` with ``gamma_b > 0``: against its gradient."""
    w = np.array([[1.0, 2.0], [3.0, -1.0]])
    g = np.array([[0.5, -0.25], [0.1, 0.2]])
    new, _ = gc.psi_update(gc.psi_init([w]), [w], [g], lr=0.1)
    want = w - 0.1 * np.sum(w * w, axis=1, keepdims=True) * g
    np.testing.assert_allclose(new[0], want, rtol=1e-15)
    with pytest.raises(ValueError, match="share one real floating dtype"):
        gc.psi_update(gc.psi_init([w]), [w], [g.astype(np.float32)], lr=0.1)
    chain = gc.Chain.mlp([3, 4, 2])
    pb = Problem(chain, 4)
    G, Gb = pb.grads()
    _, b2 = gc.path_sgd_step(chain, pb.W, pb.b, G, Gb, 1e-3)
    for v2, v, gb in zip(b2, pb.b, Gb):
        moved = v2 - v
        assert np.all(np.sign(moved[gb != 0]) == -np.sign(gb[gb != 0]))


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
