"""The inverse chain rule (eq. 3) against a dense solve and against autograd in path space."""

import numpy as np
import pytest
import torch
from hypothesis import given

import gsgd_core as gc
from gsgd_core import reference as ref
from _helpers import Problem, assert_all_close, assert_close
from _namespaces import assert_same_bits_in_float32_namespaces
from _nets import loss_fn
from _strategies import chains, seeds, small_chains


@given(chain=small_chains(), seed=seeds)
def test_icr_equals_dense_solution_of_eq3(hxp, chain, seed):
    pb = Problem(chain, seed)
    G, Gb = pb.grads()
    D, Db = gc.icr(chain, hxp.aslist(pb.W), hxp.aslist(pb.b), hxp.aslist(G), hxp.aslist(Gb))
    dense = ref.icr(chain, pb.W, pb.b, G, Gb)
    assert_close(ref.to_basis(chain, hxp.tolist(D), hxp.tolist(Db)), dense, hxp.rtol, "dL/dv")
    for l, d in enumerate(hxp.tolist(D), start=1):  # zero at free edges
        assert not np.any(d.reshape(chain.layer_shape(l))[chain.free_mask(l)])


@given(chain=small_chains(), seed=seeds)
def test_every_column_of_eq3_holds_free_columns_too(hxp, chain, seed):
    """``G^T dL/dv = dL/dw`` on all m edges: the gradient is orthogonal to the group orbit."""
    pb = Problem(chain, seed)
    G, Gb = pb.grads()
    D, Db = gc.icr(chain, hxp.aslist(pb.W), hxp.aslist(pb.b), hxp.aslist(G), hxp.aslist(Gb))
    d = ref.to_basis(chain, hxp.tolist(D), hxp.tolist(Db))
    J = ref.path_jacobian(chain, pb.W, pb.b)
    assert_close(J.T @ d, ref.flatten(chain, G, Gb), hxp.rtol, "eq. (3)")


@given(chain=chains(), seed=seeds)
def test_icr_equals_autograd_of_loss_as_function_of_path_values(hxp, chain, seed):
    """Write the loss as a function of basis-path values (free weights fixed, Thm 3.6) and
    differentiate it with torch autograd in float64; ICR, in every namespace and dtype, must
    give the same gradient."""
    pb = Problem(chain, seed)
    G, Gb = pb.grads()
    D, Db = gc.icr(chain, hxp.aslist(pb.W), hxp.aslist(pb.b), hxp.aslist(G), hxp.aslist(Gb))
    D, Db = hxp.tolist(D), hxp.tolist(Db)
    V, Vb = gc.path_values(chain, pb.W, pb.b)
    Vt = [torch.tensor(v, requires_grad=True) for v in V]
    Vbt = [None if v is None else torch.tensor(v, requires_grad=True) for v in Vb]
    Wt, bt = gc.weights_from_path_values(chain, Vt, Vbt, [torch.tensor(w) for w in pb.W])
    loss_fn(chain, Wt, bt, torch.tensor(pb.x), torch.tensor(pb.y)).backward()
    assert_all_close(D, [v.grad.numpy() for v in Vt], hxp.rtol, "dL/dV")
    assert_all_close(Db, [None if v is None else v.grad.numpy() for v in Vbt], hxp.rtol,
                     "dL/dVb")


@pytest.mark.parametrize("widths", [[2, 2, 2], [2, 1, 2, 2], [3, 1, 2, 2, 2]])
def test_icr_and_the_step_are_float32_arithmetic_alike_in_every_namespace(widths):
    """float32 weights: the sweeps compute in float32, never in a wider default dtype. Every
    hidden unit has two edges out, one of them free, so each sum of the backward sweep has
    at most two non-zero terms and no order of summation changes its bits: each namespace's
    ICR and G-SGD step give the same bits as NumPy's. Widening from one unit to two leaves
    a tau edge above layer 1 that is not free, so the allocation's ratios ``R / rho`` are
    formed there too."""
    chain = gc.Chain.mlp(widths)

    def sweeps(ns):
        out = {}
        for seed in range(5):
            pb = Problem(chain, seed)
            G, Gb = pb.grads()
            args = [ns.aslist(a) for a in (pb.W, pb.b, G, Gb)]
            D, Db = gc.icr(chain, *args)
            W, b = gc.gsgd_step(chain, *args, lr=0.1)
            out[f"seed {seed}"] = [ns.to_numpy(a) for a in D + Db + W + b]
        return out

    assert_same_bits_in_float32_namespaces(sweeps)


@given(chain=small_chains(), seed=seeds)
def test_path_values_are_zero_at_free_edges_and_match_the_dense_basis(chain, seed):
    """A free edge is no basis path of its own: its entry of ``path_values`` is 0; the
    others are the basis paths' values (the dense reference's)."""
    pb = Problem(chain, seed)
    V, Vb = gc.path_values(chain, pb.W, pb.b)
    for l, v in enumerate(V, start=1):
        assert not np.any(v.reshape(chain.layer_shape(l))[chain.free_mask(l)])
    assert_close(ref.to_basis(chain, V, Vb), ref.path_values(chain, pb.W, pb.b), 1e-12,
                 "basis path values")
