"""The dense objects of the paper: structure matrix rank (Thm 3.4, Cor 3.8), the basis,
``Ã`` and the ``⊙`` operator (Def. 8.3), and the sweeps' path values against them."""

import re

import numpy as np
import pytest
from hypothesis import given

import gsgd_core as gc
from gsgd_core import reference as ref
from _helpers import Problem, assert_close
from _strategies import seeds, small_chains


@given(chain=small_chains(), seed=seeds)
def test_structure_matrix_has_rank_m_minus_H(chain, seed):
    """Thm 3.4 counted from the layer shapes, not from the chain's own ``m`` and ``H``; and
    from the sweeps: the Jacobian of ``log|V|`` (basis paths, :func:`path_values`) with
    respect to ``log|w|`` has rank ``m - H``, and its rows span every path's row of A."""
    m = sum(int(np.prod(chain.layer_shape(l))) + chain.sizes[l] * chain.bias[l - 1]
            for l in range(1, chain.L + 1))
    hidden = sum(chain.sizes[1:-1])
    A = ref.structure_matrix(chain)
    assert A.shape == (m, ref.n_paths(chain))
    assert np.linalg.matrix_rank(A) == m - hidden == chain.g_space_dim
    rng = np.random.default_rng(seed)
    w = rng.choice([-1.0, 1.0], m) * rng.uniform(0.5, 2.0, m)

    def log_values(vec):
        V, Vb = gc.path_values(chain, *ref.unflatten(chain, vec))
        return np.log(np.abs(ref.to_basis(chain, V, Vb)))

    base = log_values(w)
    J = np.stack([(log_values(w * np.where(np.arange(m) == e, 2.0, 1.0)) - base) / np.log(2.0)
                  for e in range(m)])  # J[e, p] = d log|V_p| / d log|w_e|
    assert np.linalg.matrix_rank(J, tol=1e-6) == m - hidden
    assert np.linalg.matrix_rank(np.concatenate([J, A], axis=1), tol=1e-6) == m - hidden


@given(chain=small_chains())
def test_skeleton_paths_are_a_basis_of_the_path_space(chain):
    """The basis paths are paths, independent, and span every path (Lemma 9.1)."""
    A, Ap = ref.structure_matrix(chain), ref.basis_matrix(chain)
    paths = {tuple(np.flatnonzero(c)) for c in A.T}
    assert all(tuple(np.flatnonzero(c)) in paths for c in Ap.T)
    assert np.linalg.matrix_rank(Ap) == chain.g_space_dim
    assert np.linalg.matrix_rank(np.concatenate([Ap, A], axis=1)) == chain.g_space_dim
    # Restricted to the non-free edges, A' is unit triangular in the global edge order.
    sub = Ap[ref.basis_edges(chain)]
    order = np.argsort([-e for e in ref.basis_edges(chain)])
    sub = sub[order][:, order]
    assert np.array_equal(np.diag(sub), np.ones(len(sub))) and not np.triu(sub, 1).any()


@given(chain=small_chains(), seed=seeds)
def test_odot_with_a_tilde_and_its_inverse_is_the_identity(chain, seed):
    """Def. 8.3: ``W ⊙ Ã ⊙ Ã^{-1} = W`` for weights of both signs."""
    rng = np.random.default_rng(seed)
    w = rng.choice([-1.0, 1.0], chain.m) * rng.uniform(0.5, 2.0, chain.m)
    At = ref.a_tilde(chain)
    inv = np.round(np.linalg.inv(At))
    assert np.array_equal(inv @ At, np.eye(chain.m))
    assert_close(ref.odot(ref.odot(w, At), inv), w, 1e-12)
    # The path values of the basis are the last m - H entries of w ⊙ Ã (eq. 4).
    W, b = ref.unflatten(chain, w)
    assert_close(ref.odot(w, At)[chain.H:], ref.path_values(chain, W, b), 1e-12)


@given(chain=small_chains(), seed=seeds)
def test_path_values_sweep_equals_products_along_basis_paths(hxp, chain, seed):
    pb = Problem(chain, seed)
    V, Vb = gc.path_values(chain, hxp.aslist(pb.W), hxp.aslist(pb.b))
    assert_close(ref.to_basis(chain, hxp.tolist(V), hxp.tolist(Vb)),
                 ref.path_values(chain, pb.W, pb.b), hxp.rtol)


def test_odot_real_exponents_need_positive_entries():
    """``exp(log(w) @ A)`` for real exponents, for entries below 1 too; a zero or negative
    entry has no real power and is refused."""
    A = np.array([[0.5], [1.0]])
    assert_close(ref.odot(np.array([4.0, 3.0]), A), [6.0], 1e-12)
    assert_close(ref.odot(np.array([0.25, 3.0]), A), [1.5], 1e-12)
    for w in ([-4.0, 3.0], [0.0, 3.0]):
        with pytest.raises(ValueError, match="^non-integer exponents need positive entries$"):
            ref.odot(np.array(w), A)


def test_odot_of_float32_entries_is_taken_in_float64():
    """The dense reference reads float32 weights as float64: a real power of a float32
    entry is the float64 power of its value, not one rounded to float32 first."""
    w = np.array([3.0, 2.0], dtype=np.float32)
    got = ref.odot(w, [[1 / 3], [0.5]])
    assert got.dtype == np.float64
    assert_close(got, [3.0 ** (1 / 3) * 2.0 ** 0.5], 1e-15)


def test_odot_takes_python_integers_with_negative_exponents():
    """Entries and exponents given as lists of ints are read as float64: ``2**-1`` is
    ``0.5``, where integer arrays would refuse a negative power."""
    assert np.array_equal(ref.odot([2, 3], [[1, -1], [0, 1]]), [2.0, 1.5])


def test_path_enumeration_refuses_more_paths_than_max_paths():
    """A 2-3-2 chain without biases has 12 paths: enumerated with ``max_paths=12``, refused
    below, in ``enumerate_paths``, ``structure_matrix`` and the brute-force
    ``path_sgd_gamma`` alike. The default bound is 20,000 paths (20,001 here are refused)."""
    chain = gc.Chain.mlp([2, 3, 2], bias=False)
    W = [np.ones((3, 2)), np.ones((2, 3))]
    assert len(ref.enumerate_paths(chain, max_paths=12)) == ref.n_paths(chain) == 12
    assert ref.structure_matrix(chain, max_paths=12).shape == (12, 12)
    assert ref.path_sgd_gamma(chain, W, max_paths=12).shape == (12,)
    message = f"^{re.escape(str(chain))} has 12 paths, more than max_paths=11$"
    for refused in (lambda: ref.enumerate_paths(chain, 11),
                    lambda: ref.structure_matrix(chain, 11),
                    lambda: ref.path_sgd_gamma(chain, W, max_paths=11)):
        with pytest.raises(ValueError, match=message):
            refused()
    wide = gc.Chain.mlp([1, 20_001, 1], bias=False)
    for refused in (ref.enumerate_paths, ref.structure_matrix,
                    lambda c: ref.path_sgd_gamma(c, [np.ones((20_001, 1)), np.ones((1, 20_001))])):
        with pytest.raises(ValueError, match="has 20001 paths, more than max_paths=20000$"):
            refused(wide)


@given(chain=small_chains(), seed=seeds)
def test_from_basis_is_the_inverse_of_to_basis_with_zeros_at_free_edges(chain, seed):
    """A basis vector goes to layer arrays of the chain's 3-D shapes (biases of their
    layers, ``None`` without one) holding it at the non-free edges and ``0`` at the free
    ones; :func:`to_basis` reads the same vector back."""
    v = np.random.default_rng(seed).uniform(0.5, 2.0, chain.g_space_dim)
    W, b = ref.from_basis(chain, v)
    assert [w.shape for w in W] == [chain.layer_shape(l) for l in range(1, chain.L + 1)]
    assert [None if x is None else x.shape for x in b] == [
        (n,) if has else None for n, has in zip(chain.sizes[1:], chain.bias)]
    assert np.array_equal(ref.to_basis(chain, W, b), v)
    flat = ref.flatten(chain, W, b)
    assert not flat[ref.free_edges(chain)].any() and np.all(flat[ref.basis_edges(chain)] > 0)


def test_the_exact_inverse_refuses_a_matrix_that_is_not_unimodular():
    """``Ã`` is unit triangular for every skeleton; a matrix with determinant 2 has no
    integer inverse, and the check says so instead of rounding one."""
    with pytest.raises(ArithmeticError, match="^Ã is not unimodular; the skeleton is not a basis$"):
        ref._exact_inverse(np.array([[2.0, 0.0], [0.0, 1.0]]))
    assert np.array_equal(ref._exact_inverse(np.array([[1.0, 0.0], [3.0, 1.0]])),
                          [[1.0, 0.0], [-3.0, 1.0]])


def test_flatten_reads_weights_of_any_dtype_as_float64_and_biases_may_be_left_out():
    """The edge vector is float64 whatever the weights' dtype (float32 weights of a chain
    without biases included), so the dense products are float64 products; biases default
    to none, for a chain without them."""
    chain = gc.Chain.mlp([2, 3, 2], bias=False)
    rng = np.random.default_rng(0)
    W32 = [rng.standard_normal((3, 2)).astype(np.float32),
           rng.standard_normal((2, 3)).astype(np.float32)]
    W = [w.astype(np.float64) for w in W32]
    flat = ref.flatten(chain, W32)
    assert flat.dtype == np.float64
    assert np.array_equal(flat, np.concatenate([w.reshape(-1) for w in W]))
    assert np.array_equal(ref.path_values(chain, W32), ref.path_values(chain, W, [None, None]))


@pytest.mark.skipif(np.finfo(np.longdouble).bits == 64, reason="long double is float64 here")
def test_flatten_reads_biases_of_a_wider_dtype_as_float64():
    """Biases of any dtype are read as float64 as the weights are: extended-precision
    biases do not widen the edge vector."""
    chain = gc.Chain.mlp([2, 3, 2])
    W = [np.ones((3, 2)), np.ones((2, 3))]
    b = [np.full(3, 0.1, dtype=np.longdouble), np.full(2, 0.2, dtype=np.longdouble)]
    flat = ref.flatten(chain, W, b)
    assert flat.dtype == np.float64
    assert np.array_equal(flat[6:9], np.full(3, 0.1))
