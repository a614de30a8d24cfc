"""gsgd_adapters.cupy: the optimizer object for hand-written loops. It only needs mutable
arrays, so it runs here on NumPy and, where a GPU is usable, on CuPy."""

import numpy as np
import pytest

import gsgd_core as gc
from gsgd_adapters.cupy import GSGD
from _helpers import Problem, assert_close
from _namespaces import available_namespaces

NAMESPACES = [ns for ns in available_namespaces() if ns.name in ("numpy", "cupy")]
CHAIN = gc.Chain.mlp([5, 6, 4, 3])


@pytest.fixture(params=NAMESPACES, ids=lambda ns: ns.id)
def ns(request):
    if request.param.skip_reason:
        pytest.skip(request.param.skip_reason)
    return request.param


HYPERS = [dict(), dict(momentum=0.9), dict(momentum=0.9, nesterov=True, weight_decay=1e-2),
          dict(momentum=0.5, dampening=0.3, weight_decay=1e-2), dict(weight_decay=1e-2)]


@pytest.mark.parametrize("bias", [True, False], ids=["biases", "no biases"])
@pytest.mark.parametrize("hyper", HYPERS, ids=lambda h: ",".join(f"{k}={v}" for k, v in
                                                                   h.items()) or "plain")
def test_steps_update_the_callers_arrays_like_the_core(ns, hyper, bias):
    """Every hyperparameter reaches the step; biases may be left out where the chain has
    none; a momentum state is kept only with momentum."""
    chain = CHAIN if bias else gc.Chain.mlp([5, 6, 4, 3], bias=False)
    pb = Problem(chain, 0)
    G, Gb = pb.grads()
    W = ns.aslist(pb.W)
    b = ns.aslist(pb.b) if bias else None
    opt = GSGD(chain, W, b, lr=0.1, **hyper)
    assert (opt.state is None) == (not hyper.get("momentum"))
    eW, eb = ns.aslist(pb.W), ns.aslist(pb.b)
    state = gc.gsgd_init(chain, eW, eb)
    for _ in range(3):
        opt.step(ns.aslist(G), ns.aslist(Gb) if bias else None)
        eW, eb, state = gc.gsgd_update(chain, state, eW, eb, ns.aslist(G), ns.aslist(Gb),
                                       lr=0.1, **hyper)
    assert opt.weights[0] is W[0]
    for a, e in zip(ns.tolist(W + (b or [])), ns.tolist(eW + (eb if bias else []))):
        assert_close(a, e, 1e-12 if ns.is_f64 else 1e-4)


def test_skeleton_init_and_lr_schedule(ns):
    pb = Problem(CHAIN, 1)
    W = ns.aslist(pb.W)
    opt = GSGD(CHAIN, W, ns.aslist(pb.b), lr=0.1)
    opt.skeleton_init()
    assert np.all(ns.to_numpy(W[0]).reshape(-1)[CHAIN.tau_index(1)] == 1.0)
    opt.lr = 0.0
    before = [x.copy() for x in ns.tolist(W)]
    G, Gb = pb.grads(ns.tolist(W), pb.b)
    opt.step(ns.aslist(G), ns.aslist(Gb))
    assert all(np.array_equal(x, y) for x, y in zip(before, ns.tolist(W)))


def test_bad_arguments_are_refused_up_front():
    pb = Problem(CHAIN, 2)
    with pytest.raises(ValueError, match="lr"):
        GSGD(CHAIN, pb.W, pb.b, lr=-1.0)
    with pytest.raises(ValueError, match="layers"):
        GSGD(CHAIN, pb.W[:2], pb.b[:2], lr=0.1)
    with pytest.raises(ValueError, match="nesterov"):
        GSGD(CHAIN, pb.W, pb.b, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="^weight_decay must be finite and >= 0"):
        GSGD(CHAIN, pb.W, pb.b, lr=0.1, weight_decay=-1e-3)
