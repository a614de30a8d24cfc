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
        calls = (lambda **k: ref.enumerate_paths(chain, **k),
                 lambda **k: ref.structure_matrix(chain, **k),
                 lambda **k: ref.path_sgd_gamma(chain, W, **k))
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
