"""Chain structure: the default skeleton of DESIGN §2, counts, shape inference, validation."""

import re

import numpy as np
import pytest

from gsgd_core import Chain


@pytest.mark.parametrize("h, weights, H, ratio", [
    (8, 536, 16, 1.49e-2), (16, 1200, 32, 1.33e-2), (32, 2912, 64, 1.10e-2),
    (64, 7872, 128, 8.13e-3), (128, 23936, 256, 5.35e-3), (256, 80640, 512, 3.17e-3),
    (512, 292352, 1024, 1.75e-3), (1024, 1108992, 2048, 9.23e-4)])
def test_counts_match_paper_table_6(h, weights, H, ratio):
    chain = Chain.mlp([49, h, h, 10], bias=False)
    assert (chain.m, chain.H, chain.g_space_dim) == (weights, H, weights - H)
    # Table 6 prints h/m in its "invariant ratio" row, half the H/m that §5.2 defines
    # (16/536 = 2.99e-2, the table says 1.49e-2 = 8/536). We keep the definition.
    assert chain.invariant_ratio == pytest.approx(2 * ratio, rel=5e-3)


def test_default_skeleton_is_the_papers_for_equal_widths():
    d, h, K = 5, 4, 3
    chain = Chain.mlp([d, h, h, h, K], bias=False)
    L = chain.L
    for j in range(h):  # W_1[j, j mod d] is a tau edge, W_L[j mod K, j] a free edge
        assert chain.tau_mask(1)[j, j % d, 0] and chain.free_mask(L)[j % K, j, 0]
    for l in range(2, L):  # in between, the diagonal is both the tau and the free edge
        diag = np.eye(h, dtype=bool)[:, :, None]
        assert np.array_equal(chain.tau_mask(l), diag)
        assert np.array_equal(chain.free_mask(l), diag)
    assert not chain.free_mask(1).any() and not chain.tau_mask(L).any()
    assert sum(int(m.sum()) for m in chain.free_masks) == chain.H


def test_default_skeleton_unequal_widths_and_kernel_centre():
    chain = Chain((3, 5, 2, 4), (9, 4, 1), bias=True)
    assert chain.tau == ((0, 1, 2, 0, 1), (0, 1))
    assert chain.sigma == ((0, 1, 0, 1, 0), (0, 1))
    assert chain.skeleton_slots == (4, 2, 0)
    n, n_prev, k = chain.layer_shape(2)
    for a in range(n_prev):  # free edge of node a of layer 1 lies in W_2 at (a mod 2, a, 2)
        assert chain.free_mask(2)[a % 2, a, 2]
    assert chain.m == 5 * 3 * 9 + 5 + 2 * 5 * 4 + 2 + 4 * 2 + 4
    assert chain.H == 7


def test_from_shapes_conv_flatten_linear():
    shapes = [(8, 3, 3, 3), (16, 8, 3, 3), (10, 16 * 4 * 4), (5, 10)]
    chain = Chain.from_shapes(shapes, bias=[True, True, True, False])
    assert chain.sizes == (3, 8, 16, 10, 5)
    assert chain.slots == (9, 9, 16, 1)
    assert chain.skeleton_slots == (4, 4, 8, 0)


def test_chain_is_hashable_and_compares_by_structure():
    a, b = Chain.mlp([3, 4, 2]), Chain((3, 4, 2), (1, 1), bias=True)
    _ = a.free_masks  # cached metadata must not affect equality or hashing
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != Chain.mlp([3, 4, 2], bias=False)
    custom = Chain((3, 4, 2), tau=[[2, 2, 1, 0]], sigma=[[1, 1, 0, 0]])
    assert custom != a and custom.tau == ((2, 2, 1, 0),)


@pytest.mark.parametrize("kwargs, message", [
    (dict(sizes=(3, 4)), "at least 2 layers"),
    (dict(sizes=(3, 0, 2)), "at least one unit"),
    (dict(sizes=(3, 4, 2), slots=(1,)), "slots has 1 entries for 2 layers"),
    (dict(sizes=(3, 4, 2), slots=(1, 0)), "at least one slot"),
    (dict(sizes=(3, 4, 2), bias=(True,)), "bias has 1 flags for 2 layers"),
    (dict(sizes=(3, 4, 2), tau=[[0, 1, 2, 3]]), r"tau of hidden layer 1: values \[3\]"),
    (dict(sizes=(3, 4, 2), sigma=[[0, 1]]), "sigma of hidden layer 1 has 2 entries"),
    (dict(sizes=(3, 4, 2), tau=[[0] * 4, [0] * 2]), "one map per hidden layer"),
    (dict(sizes=(3, 4, 2), slots=(3, 1), skeleton_slots=(3, 0)), "layer 1: skeleton slot 3"),
    (dict(sizes=(3, 4.0, 2)), r"sizes\[1\] must be an int"),
])
def test_invalid_chains_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Chain(**kwargs)


def test_from_shapes_rejects_mismatched_layers():
    with pytest.raises(ValueError, match=r"layer 2: weight shape \(4, 7\) does not follow"):
        Chain.from_shapes([(3, 2), (4, 7)])
    with pytest.raises(ValueError, match="expects 5 inputs but layer 1 has 3 units"):
        Chain.from_shapes([(3, 2, 3), (4, 5, 3)])


def test_str_reports_dimensions():
    assert str(Chain.mlp([2, 3, 1], bias=False)) == (
        "Chain(2 -> 3 -> 1; m=9, H=3, G-space dim=6, H/m=0.333)")


def test_he_skeleton_scale_counts_skeleton_edges_per_row():
    """DESIGN §11: r_l = sqrt(2 share / c_l), c_l = [l < L] (the tau edge) + [l >= 2]
    n_{l-1}/n_l (free edges landing per row), worked out by hand for 4 -> 8 -> 6 -> 2."""
    chain = Chain.mlp([4, 8, 6, 2])
    counts = [1.0, 1.0 + 8 / 6, 6 / 2]
    for share in (0.25, 0.5):
        want = [np.sqrt(2 * share / c) for c in counts]
        assert chain.he_skeleton_scale(share) == pytest.approx(want, rel=1e-15)
    assert chain.he_skeleton_scale() == chain.he_skeleton_scale(0.25)
    for bad in (0.0, 1.0, -0.5):
        with pytest.raises(ValueError, match="share must be in"):
            chain.he_skeleton_scale(bad)


@pytest.mark.parametrize("scale, message", [
    ("ab", "skeleton_scale must be a sequence of 2 floats"),
    (0.5, "skeleton_scale must be a sequence"),
    ((1.0, True), r"skeleton_scale\[1\] must be a number"),
    (("2", 1.0, 1.0), r"skeleton_scale\[0\] must be a number"),
    ((1.0, "2"), r"skeleton_scale\[1\] must be a number"),
    ((1.0, 0.0), "layer 2: skeleton scale must be finite and > 0, got 0.0"),
    ((-1.0, 1.0), "layer 1: skeleton scale must be finite and > 0"),
    ((1.0, float("nan")), "layer 2: skeleton scale must be finite"),
    ((1.0, float("inf")), "layer 2: skeleton scale must be finite"),
    ((1.0, 1.0, 1.0), "skeleton_scale has 3"),
])
def test_invalid_skeleton_scales_raise_clear_errors(scale, message):
    with pytest.raises(ValueError, match=message):
        Chain.mlp([3, 4, 2]).with_skeleton_scale(scale)


def test_skeleton_scale_accepts_numpy_and_int_numbers():
    chain = Chain.mlp([3, 4, 2]).with_skeleton_scale([np.float32(0.5), 2])
    assert chain.skeleton_scale == (0.5, 2.0)
    assert all(type(r) is float for r in chain.skeleton_scale)


def test_chain_caches_never_affect_equality_hash_or_str():
    import gsgd_core as gc
    a, b = Chain.mlp([3, 4, 2]), Chain.mlp([3, 4, 2])
    gc.path_values(a, [np.ones((4, 3)), np.ones((2, 4))], [np.ones(4), np.ones(2)])
    assert a._cache and not b._cache  # per-namespace metadata cached on a only
    assert a == b and hash(a) == hash(b) and str(a) == str(b) and repr(a) == repr(b)
    assert "_cache" not in repr(a)


def test_str_reports_slots_and_skeleton_scale():
    chain = Chain((2, 3, 1), (4, 1), bias=False).with_skeleton_scale([0.5, 2.0])
    assert str(chain) == ("Chain(2 -> 3 -> 1, slots=[4, 1], skeleton_scale=[0.5, 2]; m=27, "
                          "H=3, G-space dim=24, H/m=0.111)")


def test_from_shapes_infers_linear_flatten_and_first_layer():
    """A 2-D first layer is a Linear whatever its fan-in; a 2-D layer reading C*S features
    after C units is a flatten of S positions; reading exactly C, a plain Linear."""
    chain = Chain.from_shapes([(6, 12), (5, 6 * 4), (3, 5)])
    assert chain.sizes == (12, 6, 5, 3) and chain.slots == (1, 4, 1)
    chain = Chain.from_shapes([(4, 2, 3, 3), (7, 4 * 9)])
    assert chain.sizes == (2, 4, 7) and chain.slots == (9, 9)
    chain = Chain.from_shapes([(6, 12), (5, 6), (3, 5 * 4)])  # flatten after a narrower layer
    assert chain.sizes == (12, 6, 5, 3) and chain.slots == (1, 1, 4)


def test_biases_are_on_by_default():
    assert Chain((3, 4, 2)).bias == (True, True)
    assert Chain.from_shapes([(4, 3), (2, 4)]).bias == (True, True)
    assert Chain.mlp([3, 4, 2]).bias == (True, True)


def test_tau_and_free_indices_of_boundary_layers_are_empty():
    chain = Chain.mlp([3, 4, 2])
    assert chain.tau_index(2).size == 0 and chain.tau_index(0).size == 0
    assert chain.tau_index(1).size == 4


@pytest.mark.parametrize("kwargs, message", [
    (dict(sizes=(2, 3, 4), slots=(1, "a")), "slots[1] must be an int, got 'a'"),
    (dict(sizes=(2, True, 4)), "sizes[1] must be an int, got True"),
    (dict(sizes=(2, 3, 4), slots=(1,)), "slots has 1 entries for 2 layers (sizes=[2, 3, 4])"),
    (dict(sizes=(2, 3, 4), slots=(2, 2), skeleton_slots=(1, "x")),
     "skeleton_slots[1] must be an int, got 'x'"),
    (dict(sizes=(2, 3, 4), slots=(2, 2), skeleton_slots=(1,)),
     "skeleton_slots has 1 entries for 2 layers"),
    (dict(sizes=(2, 3, 4), slots=(3, 2), skeleton_slots=(3, 0)),
     "layer 1: skeleton slot 3 outside 0..2"),
    (dict(sizes=(2, 3, 4, 2), tau=((0, 1, 0),)), "tau needs one map per hidden layer (2), got 1"),
    (dict(sizes=(2, 3, 4), tau=((0, 1, "a"),)), "tau[0][2] must be an int, got 'a'"),
    (dict(sizes=(2, 3, 5), sigma=((5, 0, 1),)), "sigma of hidden layer 1: values [5] outside 0..4"),
    (dict(sizes=(2, 7, 5), sigma=((5, 6, 7, 8, 9, 10, 0),)),
     "sigma of hidden layer 1: values [5, 6, 7, 8, 9] outside 0..4"),
])
def test_each_bad_argument_is_refused_with_its_whole_message(kwargs, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        Chain(**kwargs)


@pytest.mark.parametrize("shapes, message", [
    ([(3, 2)], "a chain needs at least 2 layers, got 1 shapes"),
    ([(3, 2), (4,)], "layer 2: weight shape (4,) has fewer than 2 dimensions"),
    ([(3, 2), (4, 3, 2), (5, 7)], "layer 3: weight shape (5, 7) does not follow layer 2 of 4 "
                                  "units (in-features must be a multiple of 4)"),
    ([(3, 2), (4, 3, 2), (5, 7, 1)], "layer 3: weight shape (5, 7, 1) expects 7 inputs but "
                                     "layer 2 has 4 units"),
])
def test_from_shapes_refuses_shapes_that_form_no_chain_with_the_whole_message(shapes, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        Chain.from_shapes(shapes)


def test_fields_are_normalised_and_from_shapes_passes_bias_and_skeleton_on():
    chain = Chain([np.int64(2), 3, 5], sigma=[[4, 0, 1]])
    assert chain.sizes == (2, 3, 5) and chain.sigma == ((4, 0, 1),)   # a unit of layer 2
    assert Chain.from_shapes([(3, 2), (4, 3)], bias=[True, False], tau=[[1, 0, 1]]) == Chain(
        (2, 3, 4), bias=(True, False), tau=((1, 0, 1),))


def test_tau_masks_hold_one_edge_per_unit_at_its_tau_and_skeleton_slot():
    tau, sk = ((1, 0, 1), (2, 0, 1, 2)), (2, 1, 0)
    chain = Chain((2, 3, 4, 2), slots=(3, 2, 1), tau=tau, skeleton_slots=sk)
    for l in (1, 2):
        mask = chain.tau_mask(l)
        assert mask.dtype == bool and mask.sum() == chain.sizes[l]
        assert all(mask[j, tau[l - 1][j], sk[l - 1]] for j in range(chain.sizes[l]))
    assert not chain.tau_mask(3).any()


def test_free_masks_hold_one_edge_per_unit_below_at_its_sigma_and_skeleton_slot():
    """Each unit ``a`` of layer ``l-1`` has its free edge ``(sigma(a), a, s_l)`` in layer
    ``l``: at the skeleton slot of that layer, which G-SGD never changes."""
    sigma, sk = ((1, 3, 0), (0, 1, 0, 1)), (2, 1, 0)
    chain = Chain((2, 3, 4, 2), slots=(3, 2, 2), sigma=sigma, skeleton_slots=sk)
    for l in (2, 3):
        mask = chain.free_mask(l)
        assert mask.dtype == bool and mask.sum() == chain.sizes[l - 1]
        assert all(mask[sigma[l - 2][a], a, sk[l - 1]] for a in range(chain.sizes[l - 1]))
    assert not chain.free_mask(1).any()
