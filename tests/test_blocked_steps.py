"""Every fast step in blocks of 1, 2 and 7 rows and in its default blocks against the core,
float64, NumPy and torch, on the degenerate skeletons (every tau edge from one source unit,
every free edge into one target unit) and on gradients with exact zeros: dead units, whose
rows and columns of the gradient are 0, and live units that carry gradient only along their
tau edge, whose ``D_tau`` cancels to rounding (the ill-conditioned regime of
:mod:`_conditioning`). Each rule: G-SGD (plain, momentum, Nesterov, weight decay) through
both fast paths, Adam, AdamW and AMSGrad in path space, and PSI-SGD(M)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import gsgd_backends as gb
import gsgd_core as gc
from _conditioning import (assert_paths_close, gradient_rounding, step_tolerance,
                          synced_gsgd_steps)
from _helpers import Problem
from _namespaces import available_namespaces
from test_rule_fast_path import CANCELLING, _synced_steps

RULES = {
    "sgd": lambda: gc.sgd_rule(0.05),
    "momentum": lambda: gc.sgd_rule(0.05, momentum=0.9),
    "nesterov": lambda: gc.sgd_rule(0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam": lambda: gc.adam_rule(0.01),
    "adamw": lambda: gc.adamw_rule(0.01),
    "amsgrad": lambda: gc.adam_rule(0.01, amsgrad=True),
}
BLOCKS = [1, 2, 7, None]  # rows per block; None: the library's own blocks


def _one_source_chain() -> gc.Chain:
    """Conv (kernel 3) -> Linear -> conv (kernel 2) -> Linear, every tau edge from unit 0
    of the layer below and every free edge into unit 0 of the layer above."""
    sizes, slots = (3, 4, 5, 6, 3), (3, 1, 2, 1)
    same = [[0] * sizes[l] for l in range(1, 4)]
    return gc.Chain(sizes, slots, bias=(True, False, True, True), tau=same, sigma=same)


class _DeadUnits(Problem):
    """A problem whose first hidden layer has one live unit (the others' biases push them
    below 0 on every input): the gradient rows of the dead units and the columns reading
    them are exactly 0, and each unit of layer 2 whose tau edge comes from the live unit
    carries gradient only along it."""

    def __init__(self, chain, seed):
        super().__init__(chain, seed)
        self.W[0] = np.abs(self.W[0])
        self.b[0] = np.full_like(self.b[0], -1e3)
        self.b[0][0] = 0.0
        self.x = np.abs(self.x)


PROBLEMS = {"cancelling": lambda: Problem(CANCELLING, 16117),
            "one source, dead units": lambda: _DeadUnits(_one_source_chain(), 3)}


@contextlib.contextmanager
def _rows(kernels, rows: int | None):
    """Blocks of ``rows`` rows in every layer (torch's eager kernels on every layer, not
    NumPy's for the small ones); the library's own blocks for ``None``."""
    if rows is None:
        yield
        return
    saved = {k: getattr(kernels, k) for k in ("block_rows", "_cpu_block_rows", "small")
             if k in vars(kernels) or hasattr(kernels, k)}
    kernels.block_rows = lambda W: min(W.shape[0], rows)
    if "_cpu_block_rows" in saved:
        kernels._cpu_block_rows = kernels.block_rows
    if "small" in saved:
        kernels.small = 0
    try:
        yield
    finally:
        for k in ("block_rows", "_cpu_block_rows"):
            vars(kernels).pop(k, None)
        if "small" in saved:
            kernels.small = saved["small"]


@pytest.fixture(params=[n for n in available_namespaces()
                        if n.id in ("numpy-float64", "torch-float64")], ids=lambda n: n.id)
def ns(request):
    if request.param.skip_reason:
        pytest.skip(request.param.skip_reason)
    return request.param


@pytest.fixture(params=list(PROBLEMS))
def problem(request):
    return PROBLEMS[request.param]()


def test_the_cancelling_problem_reaches_the_ill_conditioned_regime():
    """A tau path whose ``D`` is 0 in exact arithmetic is computed as rounding, within the
    bound of :mod:`_conditioning` (which this checks), and G-Adam turns that bound into a
    step difference far above rounding, so the comparisons below depend on the bound."""
    pb = PROBLEMS["cancelling"]()
    G, Gb = pb.grads()
    D, dD, V = gradient_rounding(pb.chain, pb.W, pb.b, G, Gb)
    cancelled = (np.abs(D[1]) <= dD[1]) & pb.chain.tau_mask(2) & (dD[1] > 0)
    assert np.any(cancelled), "no tau path of layer 2 cancels"
    zeros = tuple(tuple(np.zeros_like(v) for v in V) for _ in range(2))
    tol, _ = step_tolerance(RULES["adam"](), 0, D, dD, V, zeros)
    assert np.max(tol[1][cancelled]) > 1e-11
    assert np.max(tol[1]) < 1e-3 * RULES["adam"]().lr  # yet far below a step: bugs show


def test_the_dead_units_problem_has_zero_gradient_rows_and_columns():
    pb = PROBLEMS["one source, dead units"]()
    G, _ = pb.grads()
    assert np.all(G[0][1:] == 0) and np.any(G[0][0] != 0)   # dead units' rows
    assert np.all(G[1][:, 1:] == 0) and np.any(G[1][:, 0] != 0)  # the columns reading them


@pytest.mark.parametrize("rows", BLOCKS, ids=lambda r: f"rows={r}")
@pytest.mark.parametrize("name", list(RULES))
def test_rule_steps_equal_the_core(ns, problem, name, rows):
    """gsgd_backends.rule_step: three steps, each from the core's state."""
    kernels = gb.kernels_for(ns.asarray(np.zeros(1)))
    with _rows(kernels, rows):
        assert _synced_steps(ns, problem.chain, problem, RULES[name](), 3)


@pytest.mark.parametrize("rows", BLOCKS, ids=lambda r: f"rows={r}")
@pytest.mark.parametrize("hyper", [{}, dict(momentum=0.9),
                                   dict(momentum=0.9, nesterov=True, weight_decay=1e-3)],
                         ids=["plain", "momentum", "nesterov"])
def test_gsgd_steps_equal_the_core(ns, problem, hyper, rows):
    """gsgd_backends.fast (G-SGD's own fast path): three steps, each from the core's state;
    the tolerance of :mod:`_conditioning` with G-SGD's rule (slope ``lr``)."""
    synced_gsgd_steps(ns, problem.chain, problem, hyper, 3, lr=0.05, rtol=1e-12,
                      blocks=lambda kernels: _rows(kernels, rows))


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_psi_steps_equal_the_core(ns, momentum):
    """PSI-SGD(M) (one row at a time, no blocks): rows of zero gradient and a row of zero
    weights, three steps from the core's state."""
    rng = np.random.default_rng(0)
    shapes = [(4, 3), (5, 4, 3, 3), (3, 6)]
    W = [rng.standard_normal(s) for s in shapes]
    W[1][2] = 0.0
    U = [np.zeros(s) for s in shapes]
    for step in range(3):
        G = [rng.standard_normal(s) * 0.1 for s in shapes]
        G[0][1] = 0.0
        G[1][[0, 3]] = 0.0
        A, M = ns.aslist(W), ns.aslist(U)
        gb.psi_update_(gc.PSIState(tuple(M)), A, ns.aslist(G), lr=0.1, momentum=momentum)
        W, state = gc.psi_update(gc.PSIState(tuple(U)), W, G, lr=0.1, momentum=momentum)
        U = list(state.momentum)
        for a, e in zip(ns.tolist(A) + ns.tolist(M), W + U):
            assert_paths_close(a, e, 1e-12, 0.0, f"step {step}")
