"""The dense objects of the paper: structure matrix rank (Thm 3.4, Cor 3.8), the basis,
``Ã`` and the ``⊙`` operator (Def. 8.3), and the sweeps' path values against them."""

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
    A = np.array([[0.5], [1.0]])
    assert_close(ref.odot(np.array([4.0, 3.0]), A), [6.0], 1e-12)
    with pytest.raises(ValueError, match="positive"):
        ref.odot(np.array([-4.0, 3.0]), A)
