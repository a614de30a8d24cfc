"""gsgd_adapters.cupy.GSGD(fused=True): a hand-written loop's arrays stepped by the fused
Triton kernels through DLPack views, against the same optimizer's own fast path. On CuPy's
CUDA arrays where CuPy and a GPU are (the kernels compiled), else on NumPy arrays under
Triton's interpreter, with test_fused's import discipline (whose fixture this shares).
"""

import importlib

import pytest

import gsgd_core as gc
from _helpers import Problem, assert_close, triton_interpreting
from _namespaces import _cupy, _numpy
from test_fused import CUDA, _counted_launches, _interpreter  # noqa: F401

with triton_interpreting(CUDA):
    fused = importlib.import_module("gsgd_backends.fused")
from gsgd_adapters.cupy import GSGD  # noqa: E402

CHAIN = gc.Chain.mlp([5, 6, 4, 3])


def _namespace():
    """The loop's arrays: CuPy's on a GPU (the compiled kernels), NumPy's under the
    interpreter; skipped where the kernels run compiled but CuPy is not usable."""
    if not CUDA:
        return _numpy("float64")
    pytest.importorskip("cupy")
    ns = _cupy("float64")
    if ns.skip_reason:
        pytest.skip(ns.skip_reason)
    return ns


@pytest.mark.parametrize("hyper, bias", [(dict(), True), (dict(), False),
                                         (dict(momentum=0.9, nesterov=True, weight_decay=1e-2),
                                          True)], ids=["plain", "no biases", "nesterov"])
def test_fused_steps_equal_the_fast_path_on_the_callers_arrays(monkeypatch, hyper, bias):
    """Two steps, float64: the fused step (its three launches a step) writes the caller's
    own arrays (and momentum state) in place, equal to the fast path's to rounding; a
    chain without biases is given none, and steps on its weights' gradients alone."""
    ns = _namespace()
    counting = _counted_launches(monkeypatch, fused)
    chain = CHAIN if bias else gc.Chain.mlp([5, 6, 4, 3], bias=False)
    pb = Problem(chain, 0)
    G, Gb = pb.grads()
    runs = []
    for on in (False, True):
        W, b = ns.aslist(pb.W), ns.aslist(pb.b) if bias else None
        opt = GSGD(chain, W, b, lr=0.1, fused=on, **hyper)
        for _ in range(2):
            opt.step(ns.aslist(G), ns.aslist(Gb) if bias else None)
        runs.append((W + (b or []), [] if opt.state is None else list(opt.state.momentum)))
    for x, y in zip(ns.tolist(runs[1][0] + runs[1][1]), ns.tolist(runs[0][0] + runs[0][1]),
                    strict=True):
        assert_close(x, y, 1e-12, "weights, biases and momentum")
    assert not hyper or runs[1][1]
    assert counting.launches == ["read_pass", "vector_stage", "write_pass"] * 2
