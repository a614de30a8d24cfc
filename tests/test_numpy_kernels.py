"""NumPy's eager kernels (``gsgd_backends.numpy.ArrayKernels``) one by one: the namespace,
block sizes, in-place views and writes, column sums on both layouts, the total; and a step
under a user's strict floating-point errors."""

import numpy as np
import pytest

import gsgd_backends.numpy as gbn
import gsgd_core as gc
from gsgd_backends import gsgd_update_
from gsgd_backends.numpy import ROWWISE, ArrayKernels


def test_numpy_kernels_compute_in_the_cheap_namespace():
    assert ArrayKernels(np, 8).xp is gbn.NAMESPACE


def test_block_rows_fit_the_chunk_with_at_least_one_row():
    W = np.zeros((5, 3, 2))  # 6 weights per row
    assert ArrayKernels(np, 12).block_rows(W) == 2
    assert ArrayKernels(np, 17).block_rows(W) == 2
    assert ArrayKernels(np, 1).block_rows(W) == 1
    assert ArrayKernels(np, 1000).block_rows(W) == 5
    assert ArrayKernels(np, None).block_rows(W) == 5


def test_put_writes_the_flat_indices_or_everything():
    k, dst = ArrayKernels(np, None), np.zeros((2, 3))
    k.put_(dst, np.array([1, 4]), np.array([7.0, 8.0]))
    np.testing.assert_array_equal(dst, [[0, 7, 0], [0, 8, 0]])
    k.put_(dst, None, 5.0)
    np.testing.assert_array_equal(dst, np.full((2, 3), 5.0))


def test_view3_shares_memory_and_declines_what_cannot_be_written():
    k, w = ArrayKernels(np, None), np.arange(6.0)
    k.view3(w, (2, 3, 1))[1, 0, 0] = 9.0
    assert w[3] == 9.0
    assert k.view3(np.arange(12.0)[::2], (2, 3, 1)) is None  # not contiguous
    frozen = np.arange(6.0)
    frozen.flags.writeable = False
    assert k.view3(frozen, (2, 3, 1)) is None
    assert k.view3(frozen, (2, 3, 1), writable=False).shape == (2, 3, 1)


def test_column_sums_on_both_layouts_and_the_total_is_an_array():
    rng, k = np.random.default_rng(0), ArrayKernels(np, None)
    for shape in [(4, 3, 1), (4, 3, 5), (4, ROWWISE // 8 + 1, 2)]:  # the last: row-wise
        W, G = rng.standard_normal(shape), rng.standard_normal(shape)
        np.testing.assert_allclose(k.colsum(W, G), (W * G).sum(axis=(0, 2)), rtol=1e-12)
    total = k.total(np.ones((2, 3)))
    assert isinstance(total, np.ndarray) and total.shape == () and float(total) == 6.0


@pytest.mark.parametrize("scale", [1e-160, 1e160], ids=["underflows", "overflows"])
def test_a_step_runs_under_a_users_strict_floating_point_errors(scale):
    """A user's ``np.errstate(all="raise")`` reaches no operation of the step: path
    products that under- or overflow are the core's rules' business, and the step equals
    the core's."""
    chain = gc.Chain.mlp([4, 8, 3])
    rng = np.random.default_rng(0)
    W = [rng.standard_normal((8, 4)) * scale, rng.standard_normal((3, 8)) * scale]
    b = [np.zeros(8), np.zeros(3)]
    G = [rng.standard_normal(w.shape) for w in W]
    Gb = [rng.standard_normal(x.shape) for x in b]
    with np.errstate(all="ignore"):
        eW, eb, _ = gc.gsgd_update(chain, gc.gsgd_init(chain, W, b), W, b, G, Gb, lr=0.1)
    with np.errstate(all="raise"):
        gsgd_update_(chain, None, W, b, G, Gb, lr=0.1)
    for got, want in zip(W + b, [*eW, *eb]):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
