"""The inverse chain rule (eq. 3) against a dense solve and against autograd in path space."""

import numpy as np
import torch
from hypothesis import given

import gsgd_core as gc
from gsgd_core import reference as ref
from _helpers import Problem, assert_all_close, assert_close
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
