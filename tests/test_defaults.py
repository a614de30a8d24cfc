"""Defaults and bounds that the public API states: hyperparameter defaults, PSI's
renormalisation threshold, the dense references' path limits, and the immutability of the
metadata the core caches on a chain and shares between calls."""

import dataclasses

import numpy as np
import pytest

import gsgd_core as gc
from gsgd_core import reference as ref
from gsgd_core.arrays import layer_meta, prepare
from gsgd_core.gsgd import check_update_hypers


def test_update_hyperparameters_default_to_plain_sgd():
    check_update_hypers(0.1)  # momentum, dampening, weight decay 0 and no Nesterov: valid
    check_update_hypers(0.1, momentum=0.9, nesterov=True)  # dampening defaults to 0
    with pytest.raises(ValueError, match="nesterov needs momentum > 0"):
        check_update_hypers(0.1, nesterov=True)  # momentum defaults to 0


def test_psi_renormalises_rows_just_above_the_default_max_norm_and_not_at_it():
    """Rows with ``||w|| > max_norm`` (default 1e4) are divided by their norm; a row at the
    threshold exactly is not."""
    w = np.array([[1e4 + 0.5, 0.0], [3.0, 4.0]])
    zero = np.zeros_like(w)
    (new,), _ = gc.psi_update(gc.psi_init([w]), [w], [zero], lr=0.0)
    np.testing.assert_array_equal(new, [[1.0, 0.0], [3.0, 4.0]])
    (kept,), _ = gc.psi_update(gc.psi_init([w]), [w], [zero], lr=0.0, max_norm=5.0)
    np.testing.assert_array_equal(kept[1], [3.0, 4.0])  # norm 5 == max_norm: kept


def test_dense_references_refuse_more_paths_than_max_paths():
    """The default limit is 20,000 paths; a chain with exactly ``max_paths`` paths is
    accepted."""
    big = gc.Chain.mlp([20_001, 1, 1], bias=False)  # exactly 20,001 paths
    small = gc.Chain.mlp([2, 3, 1], bias=False)      # exactly 6
    assert ref.n_paths(big) == 20_001 and ref.n_paths(small) == 6
    for chain in (big, small):
        W = [np.ones((n, n_prev)) for n_prev, n in zip(chain.sizes[:-1], chain.sizes[1:])]
        calls = (lambda chain=chain, **k: ref.enumerate_paths(chain, **k),
                 lambda chain=chain, **k: ref.structure_matrix(chain, **k),
                 lambda chain=chain, W=W, **k: ref.path_sgd_gamma(chain, W, **k))
        for call in calls:
            if chain is big:
                with pytest.raises(ValueError, match="more than max_paths=20000"):
                    call()
            else:
                assert len(call(max_paths=6)) > 0
                with pytest.raises(ValueError, match="more than max_paths=5"):
                    call(max_paths=5)


def test_cached_metadata_is_immutable():
    chain = gc.Chain.mlp([3, 4, 2], bias=False)
    W = [np.ones((4, 3)), np.ones((2, 4))]
    meta = layer_meta(chain, prepare(chain, W).xp, "cpu")[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.tau_idx = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        prepare(chain, W).dtype = np.float32


def test_rescale_reads_scales_given_as_python_numbers_as_float64():
    """Host scales may be lists of Python numbers of any kind: ints (one beyond int64's
    range too, which NumPy alone would keep as objects) and floats act as the same float64
    scales given as arrays."""
    chain = gc.Chain.mlp([2, 3, 2])
    rng = np.random.default_rng(0)
    W = [rng.standard_normal((3, 2)), rng.standard_normal((2, 3))]
    b = [rng.standard_normal(3), rng.standard_normal(2)]
    want = gc.rescale(chain, W, b, [np.array([3.0, 2.0**64, 0.5])])
    got = gc.rescale(chain, W, b, [[3, 2**64, 0.5]])
    for g, w in zip(got[0] + got[1], want[0] + want[1]):
        np.testing.assert_array_equal(g, w)


def test_skeleton_init_scales_the_other_weights_by_rest_scale():
    chain = gc.Chain.mlp([3, 4, 2], bias=False)
    W = [np.full((4, 3), 0.5), np.full((2, 4), -0.25)]
    for scale in (1.0, 2.0):
        new, _ = gc.skeleton_init(chain, W, rest_scale=scale)
        for l, (w, w2) in enumerate(zip(W, new), start=1):
            skel = (chain.free_mask(l) | chain.tau_mask(l)).reshape(w.shape)
            np.testing.assert_array_equal(w2[~skel], scale * w[~skel])
            np.testing.assert_array_equal(w2[skel], np.ones(int(skel.sum())))


def test_from_shapes_reads_a_chain_of_linears_of_unequal_widths():
    chain = gc.Chain.from_shapes([(6, 12), (5, 6), (3, 5)])
    assert chain.sizes == (12, 6, 5, 3) and chain.slots == (1, 1, 1)


def test_rule_defaults_are_the_reference_optimizers_and_rules_are_frozen():
    """``SGDRule()``, ``adam_rule()`` and ``adamw_rule()`` default to ``torch.optim.SGD``'s,
    ``Adam``'s and ``AdamW``'s hyperparameters; rules are frozen (a jit static argument)."""
    torch = pytest.importorskip("torch")
    p = [torch.zeros(1)]
    sgd = torch.optim.SGD(p).defaults
    rule = gc.SGDRule()
    assert (rule.lr, rule.momentum, rule.dampening, rule.nesterov, rule.weight_decay) == (
        sgd["lr"], sgd["momentum"], sgd["dampening"], sgd["nesterov"], sgd["weight_decay"])
    for make, cls, decoupled in ((gc.adam_rule, torch.optim.Adam, False),
                                 (gc.AdamRule, torch.optim.Adam, False),
                                 (gc.adamw_rule, torch.optim.AdamW, True)):
        rule, ref_ = make(), cls(p).defaults
        assert (rule.lr, rule.betas, rule.eps, rule.weight_decay, rule.amsgrad) == (
            ref_["lr"], tuple(ref_["betas"]), ref_["eps"], ref_["weight_decay"],
            ref_["amsgrad"])
        assert rule.decoupled is decoupled
        with pytest.raises(dataclasses.FrozenInstanceError):
            rule.lr = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        gc.SGDRule().lr = 1.0


def _mlp_problem(seed):
    """An MLP 3-4-4-2 with random weights, biases and gradients (host float64)."""
    chain = gc.Chain.mlp([3, 4, 4, 2])
    rng = np.random.default_rng(seed)
    W = [rng.standard_normal((o, i)) for i, o in zip(chain.sizes[:-1], chain.sizes[1:])]
    b = [rng.standard_normal(o) for o in chain.sizes[1:]]
    return (chain, W, b, [rng.standard_normal(w.shape) for w in W],
            [rng.standard_normal(x.shape) for x in b])


def test_weight_decay_without_momentum_acts_on_path_values():
    """``V' = V - lr (D + wd V)`` with no momentum buffer at all."""
    chain, W, b, G, Gb = _mlp_problem(0)
    D, Db = gc.icr(chain, W, b, G, Gb)
    V, Vb = gc.path_values(chain, W, b)
    W2, b2, _ = gc.gsgd_update(chain, None, W, b, G, Gb, lr=0.01, weight_decay=0.5)
    V2, Vb2 = gc.path_values(chain, W2, b2)
    for v2, v, d in zip(V2 + Vb2, V + Vb, D + Db):
        np.testing.assert_allclose(v2, v - 0.01 * (d + 0.5 * v), rtol=1e-12, atol=1e-14)


def test_gsgd_init_without_biases():
    chain = gc.Chain.mlp([3, 4, 2], bias=False)
    state = gc.gsgd_init(chain, [np.ones((4, 3)), np.ones((2, 4))])
    assert state.bias_momentum == (None, None) and int(state.step) == 0


def test_path_sgd_gamma_without_biases_in_the_weights_dtype_and_on_their_device():
    """``biases`` defaults to none: every ``gamma_b`` is ``None``, as is that of a layer
    without a bias among layers with one. With every weight 1 on a 3-4-2 chain,
    ``gamma_1 = beta_1 = 2`` (two output edges) and ``gamma_2 = alpha_1 = 3`` (three input
    edges), in float32 when the weights are (array-api-strict refuses to mix dtypes) and on
    a torch ``meta`` tensor's device."""
    import array_api_strict as xs

    chain = gc.Chain.mlp([3, 4, 2], bias=False)
    gamma, gamma_b = gc.path_sgd_gamma(chain, [xs.ones((4, 3), dtype=xs.float32),
                                               xs.ones((2, 4), dtype=xs.float32)])
    assert gamma_b == [None, None] and [g.dtype for g in gamma] == [xs.float32] * 2
    assert [np.unique(np.asarray(g)).tolist() for g in gamma] == [[2.0], [3.0]]
    _, gamma_b = gc.path_sgd_gamma(gc.Chain.mlp([3, 4, 2], bias=[False, True]),
                                   [np.ones((4, 3)), np.ones((2, 4))], [None, np.zeros(2)])
    assert gamma_b[0] is None and gamma_b[1].tolist() == [1.0, 1.0]
    torch = pytest.importorskip("torch")
    meta = [torch.ones(4, 3, device="meta"), torch.ones(2, 4, device="meta")]
    assert {g.device.type for g in gc.path_sgd_gamma(chain, meta)[0]} == {"meta"}


def test_path_sgd_gamma_of_float32_weights_is_float32_arithmetic():
    """The node sums ``alpha`` and ``beta`` of float32 weights are float32 sums, bit for bit
    those of NumPy's float32 arithmetic (no float64 vector of ones promotes them)."""
    rng = np.random.default_rng(0)
    chain = gc.Chain.mlp([5, 7, 6, 3])
    W = [rng.standard_normal(s).astype(np.float32) for s in [(7, 5), (6, 7), (3, 6)]]
    b = [rng.standard_normal(n).astype(np.float32) for n in (7, 6, 3)]
    a1 = np.sum(W[0] ** 2, axis=1) + b[0] ** 2
    a2 = np.sum(W[1] ** 2 * a1[None, :], axis=1) + b[1] ** 2
    b2 = np.sum(W[2] ** 2, axis=0)
    b1 = np.sum(W[1] ** 2 * b2[:, None], axis=0)
    gamma, gamma_b = gc.path_sgd_gamma(chain, W, b)
    want = [np.broadcast_to(b1[:, None], (7, 5)), b2[:, None] * a1[None, :],
            np.broadcast_to(a2[None, :], (3, 6))]
    for got, w in zip(gamma + gamma_b, want + [b1, b2, np.ones(3, np.float32)]):
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, w)


def test_path_sgd_moves_every_weight_by_minus_lr_g_over_gamma():
    """Path-SGD's step itself (Neyshabur et al. 2015): ``w - lr g / gamma`` on weights and
    biases, with the core's gamma."""
    chain, W, b, G, Gb = _mlp_problem(1)
    gamma, gamma_b = gc.path_sgd_gamma(chain, W, b)
    W2, b2 = gc.path_sgd_step(chain, W, b, G, Gb, 0.01)
    for new, old, g, gm in zip(W2 + b2, W + b, G + Gb, list(gamma) + list(gamma_b)):
        np.testing.assert_allclose(new, old - 0.01 * g / gm, rtol=1e-14)


def test_adam_refuses_betas_above_one():
    with pytest.raises(ValueError, match=r"betas\[0\]"):
        gc.adam_rule(betas=(1.5, 0.999))


def test_psi_init_makes_zero_buffers_of_each_weights_dtype_and_device():
    """One zero momentum buffer per weight, of its shape and dtype (a float32 weight among
    float64 ones keeps float32) and on its device (a torch ``meta`` tensor stands for a
    GPU's)."""
    state = gc.psi_init([np.ones((2, 3), np.float32), np.ones((4, 1))])
    assert [(m.shape, m.dtype) for m in state.momentum] == [((2, 3), np.float32),
                                                            ((4, 1), np.float64)]
    assert not any(np.any(m) for m in state.momentum)
    torch = pytest.importorskip("torch")
    (m,) = gc.psi_init([torch.ones(2, 3, dtype=torch.float16, device="meta")]).momentum
    assert (m.shape, m.dtype, m.device.type) == ((2, 3), torch.float16, "meta")


def test_psi_update_defaults_to_no_momentum():
    """Without ``momentum`` each step is a plain PSI-SGD step, with no memory of the steps
    before, and PSI-SGD keeps no buffer (it stays as psi_init made it)."""
    w = np.array([[1.0, 2.0], [3.0, -1.0]])
    g = np.array([[0.5, -0.25], [0.1, 0.2]])
    state = gc.psi_init([w])
    (w1,), state = gc.psi_update(state, [w], [g], lr=0.1)
    (w2,), state = gc.psi_update(state, [w1], [g], lr=0.1)
    sq = np.sum(w1 * w1, axis=1, keepdims=True)
    np.testing.assert_array_equal(state.momentum[0], np.zeros_like(w))
    np.testing.assert_allclose(w2, w1 - 0.1 * sq * g, rtol=1e-15)


def test_psi_refuses_what_is_not_an_array_or_has_no_rows():
    w = np.ones((2, 3))
    state = gc.psi_init([w])
    with pytest.raises(ValueError, match="weight 0: weights and grads must be arrays"):
        gc.psi_update(state, [w], [[1.0, 2.0, 3.0]], lr=0.1)
    with pytest.raises(ValueError, match="weight 0: weights and grads must be arrays"):
        gc.psi_update(state, [w.tolist()], [w], lr=0.1)
    scalar = np.asarray(2.0)
    with pytest.raises(ValueError, match=r"weight 0: weights has shape \(\)"):
        gc.psi_init([scalar])


def test_odot_real_exponents_accept_every_positive_entry_and_refuse_zero():
    A = np.array([[0.5], [1.0]])
    np.testing.assert_allclose(ref.odot(np.array([0.25, 3.0]), A), [1.5], rtol=1e-14)
    with pytest.raises(ValueError, match="positive"):
        ref.odot(np.array([0.0, 3.0]), A)


def test_psi_takes_a_vector_as_one_entry_per_row():
    """Rows are indexed by the first axis, so a 1-D weight is a column of one-entry rows:
    ``w_i - lr w_i^2 g_i``."""
    w, g = np.array([2.0, -1.0, 0.5]), np.array([0.1, 0.2, -0.4])
    (new,), _ = gc.psi_update(gc.psi_init([w]), [w], [g], lr=0.5)
    np.testing.assert_allclose(new, w - 0.5 * w * w * g, rtol=1e-15)
