"""The fast G-SGD step of each library (gsgd_backends.fast and its kernels) against the
generic core: the same numbers on every drawn chain, the numerics rules on hostile input,
and the cases it must hand back to the core (non-finite gradients, views it cannot write)."""

import contextlib
import copy
import re
import sys
import warnings

import array_api_compat
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import gsgd_backends as gb
import gsgd_backends.fast as fast
from gsgd_backends.plan import Scratch
import gsgd_core as gc
from gsgd_backends._dispatch import assign
from _conditioning import synced_gsgd_steps
from _helpers import Problem, assert_close, reverse_axes
from _strategies import chains, examples, random_params, seeds

CHAIN = gc.Chain.from_shapes([(4, 3, 3, 3), (5, 4, 2, 2), (6, 5 * 4), (3, 6)],
                             bias=[True, False, True, True])


def _tol(ns):
    return 1e-12 if ns.is_f64 else 2e-4


@contextlib.contextmanager
def _chunk(kernels, chunk):
    """Blocks of ``chunk`` elements, so that small layers cross block boundaries too. With a
    chunk, torch's eager kernels keep every layer (no small layer goes to NumPy's kernels):
    both of their paths are tested."""
    old, small = kernels.chunk, getattr(kernels, "small", None)
    kernels.chunk = old if chunk is None or old is None else chunk
    if chunk is not None and small is not None:
        kernels.small = 0
    try:
        yield
    finally:
        kernels.chunk = old
        if small is not None:
            kernels.small = small


def _fast(ns, chain, W, b, G, Gb, lr, chunk=None, plan=None):
    """One fast step on copies in ``ns``; returns (ran fast, weights, biases) on the host."""
    A, Ab = ns.aslist(W), ns.aslist(b)
    kernels = gb.kernels_for(A[0])
    with _chunk(kernels, chunk):
        ran = fast.fast_step_(kernels, chain, A, Ab, ns.aslist(G), ns.aslist(Gb), lr, plan=plan)
    return ran, ns.tolist(A), ns.tolist(Ab)


def _core(ns, chain, W, b, G, Gb, lr):
    W2, b2 = gc.gsgd_step(chain, ns.aslist(W), ns.aslist(b), ns.aslist(G), ns.aslist(Gb), lr)
    return ns.tolist(W2), ns.tolist(b2)


def _assert_same(ns, got, expected, what):
    for i, (a, e) in enumerate(zip(got, expected)):
        assert_close(a, e, _tol(ns), f"{what}[{i}]")


@given(chain=chains(), seed=seeds, lr=st.sampled_from([0.01, 0.1, 0.5]),
       chunk=st.sampled_from([None, 1, 7]))
def test_fast_step_equals_the_core_on_every_chain(fxp, chain, seed, lr, chunk):
    """Custom skeletons, slots, biases, unequal widths; blocks of 1 and 7 elements too.
    Compared as :mod:`_conditioning` says: path values, and the weights wherever no tau
    path ratio nears 0 (the weights above such a node carry rounding divided by it)."""
    synced_gsgd_steps(fxp, chain, Problem(chain, seed), {}, 1, lr=lr, rtol=_tol(fxp),
                      blocks=lambda kernels: _chunk(kernels, chunk))


def test_fast_step_keeps_free_weights_bit_for_bit_and_writes_in_place(fxp):
    pb = Problem(CHAIN, 0)
    G, Gb = pb.grads()
    A = fxp.aslist(pb.W)
    before = [x.copy() for x in fxp.tolist(A)]
    ids = [id(a) for a in A]
    gb.gsgd_step_(CHAIN, A, fxp.aslist(pb.b), fxp.aslist(G), fxp.aslist(Gb), 0.1)
    assert [id(a) for a in A] == ids
    for l, (w0, w1) in enumerate(zip(before, fxp.tolist(A)), start=1):
        free = CHAIN.free_mask(l)
        assert np.array_equal(w0.reshape(free.shape)[free], w1.reshape(free.shape)[free])
        assert not np.array_equal(w0, w1)


def test_dispatch_takes_the_fast_path_for_hyperparameters_given_as_numbers(fxp, monkeypatch):
    import gsgd_backends.inplace as inplace
    calls = []
    real = inplace.fast_step_
    monkeypatch.setattr(inplace, "fast_step_", lambda *a, **k: calls.append(1) or real(*a, **k))
    pb = Problem(CHAIN, 1)
    G, Gb = pb.grads()
    A, Ab, AG, AGb = fxp.aslist(pb.W), fxp.aslist(pb.b), fxp.aslist(G), fxp.aslist(Gb)
    gb.gsgd_update_(CHAIN, None, A, Ab, AG, AGb, lr=0.1)
    state = gc.gsgd_init(CHAIN, A, Ab)
    gb.gsgd_update_(CHAIN, state, A, Ab, AG, AGb, lr=0.1, momentum=0.9)
    gb.gsgd_update_(CHAIN, None, A, Ab, AG, AGb, lr=0.1, weight_decay=1e-3)
    assert calls == [1, 1, 1]
    gb.gsgd_update_(CHAIN, None, A, Ab, AG, AGb, lr=fxp.asarray(0.1))  # an array: the core's
    assert calls == [1, 1, 1]
    with pytest.raises(ValueError, match="lr"):
        gb.gsgd_update_(CHAIN, None, A, Ab, AG, AGb, lr=-1.0)
    with pytest.raises(ValueError, match="nesterov"):
        gb.gsgd_update_(CHAIN, None, A, Ab, AG, AGb, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="state"):
        gb.gsgd_update_(CHAIN, None, A, Ab, AG, AGb, lr=0.1, momentum=0.9)


_HYPERS = st.sampled_from([
    dict(momentum=0.9), dict(momentum=0.9, nesterov=True), dict(weight_decay=0.05),
    dict(momentum=0.5, dampening=0.3, weight_decay=1e-2),
    dict(momentum=0.9, nesterov=True, weight_decay=1e-3)])


def _momentum_steps(ns, chain, seed, hyper, steps, fast_kernels=None, chunk=None,
                    buffers=False):
    """``steps`` updates of one problem through the fast path (asserted to run) and through
    the core; returns both results as host (weights, biases, buffers, bias buffers).
    ``buffers``: start both from the same random buffers, past the first step."""
    pb = Problem(chain, seed)
    A, Ab = ns.aslist(pb.W), ns.aslist(pb.b)
    state = gc.gsgd_init(chain, A, Ab)
    W, b, core = pb.W, pb.b, gc.gsgd_init(chain, pb.W, pb.b)
    if buffers:
        rng = np.random.default_rng(seed)
        M = [rng.standard_normal(w.shape) for w in pb.W]
        Mb = [None if x is None else rng.standard_normal(x.shape) for x in pb.b]
        core = gc.GSGDState(tuple(M), tuple(Mb), np.asarray(1))
        state = state._replace(momentum=tuple(ns.aslist(M)), bias_momentum=tuple(ns.aslist(Mb)))
        assign(state.step, state.step + 1)
    kernels = fast_kernels or gb.kernels_for(A[0])
    for _ in range(steps):
        G, Gb = pb.grads(W, b)
        with _chunk(kernels, chunk):
            assert fast.fast_step_(kernels, chain, A, Ab, ns.aslist(G), ns.aslist(Gb), 0.1,
                                   state, **hyper)
        assign(state.step, state.step + 1)
        W, b, core = gc.gsgd_update(chain, core, W, b, G, Gb, lr=0.1, **hyper)
    got = [ns.tolist(x) for x in (A, Ab, state.momentum, state.bias_momentum)]
    return got, [W, b, list(core.momentum), list(core.bias_momentum)]


@settings(max_examples=examples(30))
@given(chain=chains(), seed=seeds, hyper=_HYPERS, chunk=st.sampled_from([None, 1, 7]))
def test_momentum_and_weight_decay_steps_equal_the_core(fxp, chain, seed, hyper, chunk):
    """Three steps (the first sets the buffers), each from the core's state: path values and
    buffers, the special edges' and the biases' included, are the core's, and so are the
    weights wherever no tau path ratio nears 0 (:mod:`_conditioning`: a drawn run can
    diverge to weights of 1e12 through ratios near 0, where the weights above carry
    rounding divided by ``R``)."""
    synced_gsgd_steps(fxp, chain, Problem(chain, seed), hyper, 3, lr=0.1, rtol=_tol(fxp),
                      blocks=lambda kernels: _chunk(kernels, chunk))


@pytest.mark.parametrize("hyper", [dict(momentum=0.9, nesterov=True),
                                   dict(momentum=0.5, dampening=0.3, weight_decay=1e-2)])
def test_momentum_steps_from_buffers_that_are_not_zero_equal_the_core(fxp, hyper):
    """Buffers a state brings along (loaded, or carried over): those at free edges, which
    carry no path gradient, decay as the core's, and Nesterov's direction there too."""
    got, expected = _momentum_steps(fxp, CHAIN, 8, hyper, 2, buffers=True)
    for what, g, e in zip(("weights", "biases", "buffers", "bias buffers"), got, expected):
        _assert_same(fxp, g, e, what)


def test_momentum_step_with_a_non_finite_gradient_leaves_the_state_alone(fxp):
    pb = Problem(CHAIN, 5)
    G, Gb = pb.grads()
    A, Ab = fxp.aslist(pb.W), fxp.aslist(pb.b)
    state = gc.gsgd_init(CHAIN, A, Ab)
    gb.gsgd_update_(CHAIN, state, A, Ab, fxp.aslist(G), fxp.aslist(Gb), lr=0.1, momentum=0.9)
    before = [fxp.tolist(x) for x in (A, state.momentum)]
    G[1] = G[1].copy()
    G[1].reshape(-1)[0] = np.nan
    gb.gsgd_update_(CHAIN, state, A, Ab, fxp.aslist(G), fxp.aslist(Gb), lr=0.1, momentum=0.9)
    after = [fxp.tolist(x) for x in (A, state.momentum)]
    assert int(fxp.to_numpy(state.step)) == 1
    for x, y in zip(sum(before, []), sum(after, [])):
        assert np.array_equal(x, y)


def test_array_api_strict_takes_the_generic_path():
    xs = pytest.importorskip("array_api_strict")
    assert gb.kernels_for(xs.asarray([1.0])) is None


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("layer", [0, 1, 3])
def test_non_finite_gradient_is_handed_to_the_core_before_any_write(fxp, bad, layer):
    """Layer 0's gradients are not in any backward sum: they are checked on their own."""
    pb = Problem(CHAIN, 2)
    G, Gb = pb.grads()
    G[layer] = G[layer].copy()
    G[layer].reshape(-1)[3] = bad
    ran, W, b = _fast(fxp, CHAIN, pb.W, pb.b, G, Gb, 0.1)
    assert ran is False  # a bool, as documented: not merely a falsy value
    for x, y in zip(W + b, fxp.tolist(fxp.aslist(pb.W + pb.b))):
        assert x is None or np.array_equal(x, y)
    A = fxp.aslist(pb.W)
    gb.gsgd_step_(CHAIN, A, fxp.aslist(pb.b), fxp.aslist(G), fxp.aslist(Gb), 0.1)
    assert all(np.array_equal(x, y) for x, y in zip(fxp.tolist(A), fxp.tolist(fxp.aslist(pb.W))))


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_non_finite_bias_gradient_is_handed_to_the_core(fxp, momentum):
    """The fast path declines; the in-place step then does what the core does with it: the
    whole step skipped (weights, biases, buffers and step count as they were)."""
    pb = Problem(CHAIN, 2)
    G, Gb = pb.grads()
    Gb[2] = Gb[2].copy()
    Gb[2][0] = np.nan
    assert not _fast(fxp, CHAIN, pb.W, pb.b, G, Gb, 0.1)[0]
    A, Ab = fxp.aslist(pb.W), fxp.aslist(pb.b)
    state = gc.gsgd_init(CHAIN, A, Ab)
    state = state._replace(momentum=[fxp.asarray(np.full(w.shape, 0.25)) for w in pb.W])
    eW, eb, es = gc.gsgd_update(CHAIN, state, A, Ab, fxp.aslist(G), fxp.aslist(Gb), lr=0.1,
                                momentum=momentum)
    eM = fxp.tolist(es.momentum)
    assert not gb.gsgd_update_(CHAIN, state, A, Ab, fxp.aslist(G), fxp.aslist(Gb), lr=0.1,
                               momentum=momentum)
    for got, want in zip(fxp.tolist(A) + fxp.tolist(Ab) + fxp.tolist(state.momentum),
                         fxp.tolist(eW) + fxp.tolist(eb) + eM):
        assert (got is None and want is None) or np.array_equal(got, want)
    assert int(fxp.to_numpy(state.step)) == int(fxp.to_numpy(es.step)) == 0


def test_overflowing_block_is_recomputed_by_the_core_rules(fxp, monkeypatch):
    """A huge step overflows some entries: those keep their values, the rest move, exactly as
    in the core, and only the blocks holding an overflow take the slow rules."""
    calls = []
    real = fast.rows_by_rules
    monkeypatch.setattr(fast, "rows_by_rules", lambda *a, **k: calls.append(1) or real(*a, **k))
    pb = Problem(CHAIN, 3)
    G, Gb = pb.grads()
    lr = 1e308 if fxp.is_f64 else 3e38
    ran, W, b = _fast(fxp, CHAIN, pb.W, pb.b, G, Gb, lr, chunk=4)
    assert ran and calls
    assert all(np.all(np.isfinite(x)) for x in W)
    eW, eb = _core(fxp, CHAIN, pb.W, pb.b, G, Gb, lr)
    for a, e in zip(W + b, eW + eb):
        if e is not None:  # entries are either kept or moved by ~lr: compare them exactly
            same = a == e
            assert np.all(same | np.isclose(a, e, rtol=_tol(fxp), atol=0))


class _Counting:
    """A module whose function ``name`` logs its calls in ``log``."""

    def __init__(self, mod, name: str, log: list) -> None:
        self._mod, self._name, self._log = mod, name, log

    def __getattr__(self, attr: str):
        f = getattr(self._mod, attr)
        if attr != self._name:
            return f
        return lambda *a, **k: self._log.append(attr) or f(*a, **k)


@pytest.mark.parametrize("momentum", [False, True])
@pytest.mark.parametrize("case", ["ordinary", "tiny rho", "huge entries"])
def test_block_loops_divide_into_the_weights_only_when_it_cannot_overflow(fxp, case, momentum):
    """The eager block loops (:func:`fast.plain_rows_`, :func:`fast.momentum_rows_`) write
    ``block / rho`` into the weights unchecked when every ``|rho| >= 4/sqrt(max)`` and the
    block's squares sum finitely. A ``rho`` below that bound, or entries whose squares
    overflow, send the block to the checked path: its overflowing quotients keep their
    weights, as in the core's rules, instead of an Inf (with momentum: bit for bit, buffers
    too)."""
    from gsgd_core.rules import StepRule

    big = float(np.finfo(np.float64 if fxp.is_f64 else np.float32).max)
    W = np.array([[1.0, -2.0, 0.5], [3.0, 0.25, -1.0]])
    G = np.array([[0.5, 1.0, -1.0], [2.0, -0.5, 1.0]])
    F, B, R = np.array([1.0, 2.0]), np.array([0.5, 1.0, 2.0]), np.array([0.75, 1.25, 0.5])
    if case == "tiny rho":  # W's squares are finite, but W / rho overflows
        R[1], W[:, 1] = (1e-300 if fxp.is_f64 else 1e-30), 1e10
    elif case == "huge entries":  # rho is ordinary, but W[0, 2] / rho overflows
        W[0] = [big / 4, big / 8, big / 1.5]
    kernels = copy.copy(gb.kernels_for(fxp.asarray(W)))
    checks = []  # the checked path's sums of quotients
    kernels.mod = _Counting(kernels.mod, "sum", checks)
    Wx, Gx, Mx, Fx, Bx, Rx = (fxp.asarray(a) for a in (W, G, G[::-1] * 3, F, B, R))
    rule = StepRule(None, 0.9, 0.0, False, fxp.xp.asarray(False, device=fxp.device))
    rule = rule if momentum else None
    Mx = Mx if momentum else None
    with kernels.context():
        expected = [None if e is None else fxp.to_numpy(e) for e in
                    fast.rows_by_rules(kernels.xp, Wx, Gx, Mx, F=Fx, B_cols=Bx, rho_cols=Rx,
                                       lr=0.1, rule=rule)]
        if momentum:
            fast.momentum_rows_(kernels, Wx, Gx, Mx, F=Fx, B_cols=Bx, rho_cols=Rx, lr=0.1,
                                rule=rule, scratch=Scratch())
        else:
            fast.plain_rows_(kernels, Wx, Gx, F=Fx, B_prev=Bx, rho=Rx, lr=0.1, scratch=Scratch(),
                             squares=fast.bulk_factors(kernels.xp, Fx, Bx, 0.1))
    assert bool(checks) == (case != "ordinary"), "an ordinary block is written unchecked"
    got = fxp.to_numpy(Wx)
    assert np.all(np.isfinite(got))
    with np.errstate(over="ignore"):  # the overflows are the point
        overflowed = np.abs(W.astype(got.dtype) / R.astype(got.dtype)) > big / 2
    assert overflowed.any() == (case != "ordinary")
    np.testing.assert_array_equal(got[overflowed], W.astype(got.dtype)[overflowed])
    if momentum:
        np.testing.assert_array_equal(got, expected[0])
        np.testing.assert_array_equal(fxp.to_numpy(Mx), expected[1])
    else:
        np.testing.assert_allclose(got, expected[0], rtol=_tol(fxp), atol=0)


@pytest.mark.parametrize("case", ["zero tau", "zero free", "underflow", "huge gradient"])
def test_degenerate_skeletons_match_the_core(fxp, case):
    """Zero skeleton weights (safe division: frozen paths), skeleton products that underflow,
    and gradients whose dL/dv overflows (frozen) give the core's numbers."""
    chain = gc.Chain.mlp([3] * 6, bias=True) if case == "underflow" else CHAIN
    pb = Problem(chain, 4)
    W = [w.copy() for w in pb.W]
    if case == "zero tau":
        W[0][chain.tau_mask(1)] = 0.0
    elif case == "zero free":
        W[1][chain.free_mask(2)] = 0.0
    elif case == "underflow":
        tiny = 1e-70 if fxp.is_f64 else 1e-9
        W = [w * tiny for w in W]
    G, Gb = pb.grads(W, pb.b)
    if case == "huge gradient":
        W = [w * 1e-3 for w in W]
        big = np.finfo(np.float64 if fxp.is_f64 else np.float32).max / 4
        G = [g / np.max(np.abs(g)) * big for g in G]
    ran, fW, fb = _fast(fxp, chain, W, pb.b, G, Gb, 0.1, chunk=5)
    eW, eb = _core(fxp, chain, W, pb.b, G, Gb, 0.1)
    assert all(np.all(np.isfinite(x)) for x in fW + fb if x is not None)
    _assert_same(fxp, fW, eW, f"{case}, ran fast={ran}: weights")
    _assert_same(fxp, fb, eb, f"{case}: biases")


@settings(max_examples=examples(40))
@given(chain=chains(max_depth=4, max_width=4, max_slots=3), seed=seeds,
       scale=st.sampled_from([0.0, 1e-30, 1e-6, 1.0, 1e6, 1e30]),
       gscale=st.sampled_from([0.0, 1e-30, 1.0, 1e6, 1e30]),
       lr=st.sampled_from([0.0, 1e-3, 0.1, 10.0, 1e10, 1e30]))
# Found by the thorough profile: in float32 a layer-1 weight's D / F overflows where
# lr * D / F fits (the core formed the step in that order and kept the weight).
@example(chain=gc.Chain(sizes=(2, 1, 3, 4, 1), slots=(1, 1, 1, 1), bias=(False,) * 4,
                        tau=((0,), (0, 0, 0), (0, 0, 0, 0)),
                        sigma=((0,), (0, 0, 0), (0, 0, 0, 0)), skeleton_slots=(0, 0, 0, 0),
                        skeleton_scale=(0.7071067811865476, 0.6123724356957945,
                                        0.5345224838248488, 0.3535533905932738)),
         seed=0, scale=1e-6, gscale=1e30, lr=1e-3)
def test_fuzz_hostile_input_through_the_dispatch_equals_the_core(fxp, chain, seed, scale,
                                                                 gscale, lr):
    """Whatever the fast path does with hostile magnitudes (run, recompute blocks, or hand
    the step to the core), the result is the core's, and finite."""
    rng = np.random.default_rng(seed)
    W, b = random_params(chain, rng)
    W = [w * (scale if rng.random() < 0.5 else 1.0) for w in W]
    W[0][rng.random(W[0].shape) < 0.2] = 0.0
    G = [gscale * rng.standard_normal(w.shape) for w in W]
    Gb = [None if v is None else rng.standard_normal(v.shape) for v in b]
    host = fxp.tolist(fxp.aslist(W + b + G + Gb))
    if not all(x is None or np.all(np.isfinite(x)) for x in host):
        return  # float32 casts overflowed: not finite input
    A, Ab = fxp.aslist(W), fxp.aslist(b)
    gb.gsgd_step_(chain, A, Ab, fxp.aslist(G), fxp.aslist(Gb), lr)
    eW, eb = _core(fxp, chain, W, b, G, Gb, lr)
    got = fxp.tolist(A + Ab)
    assert all(x is None or np.all(np.isfinite(x)) for x in got)
    for a, e in zip(got, eW + eb):
        if e is not None:
            scale_ = np.maximum(np.abs(e), 1.0)
            assert np.all(np.abs(a - e) <= _tol(fxp) * 10 * scale_)


def test_weights_that_are_not_contiguous_take_the_core_and_are_still_updated():
    torch = pytest.importorskip("torch")
    chain = gc.Chain.mlp([4, 5, 3])
    pb = Problem(chain, 5)
    G, Gb = pb.grads()
    W2d, G = [w[..., 0] for w in pb.W], [g[..., 0] for g in G]
    A = [torch.tensor(w.T.copy()).T for w in W2d]  # transposed storage: not contiguous
    kernels = gb.kernels_for(A[0])
    T = lambda xs: [None if x is None else torch.tensor(x) for x in xs]  # noqa: E731
    assert not fast.fast_step_(kernels, chain, A, T(pb.b), T(G), T(Gb), 0.1)
    gb.gsgd_step_(chain, A, T(pb.b), T(G), T(Gb), 0.1)
    eW, _ = gc.gsgd_step(chain, W2d, pb.b, G, Gb, 0.1)
    for a, e in zip(A, eW):
        assert_close(a.numpy(), e, 1e-12)


def test_momentum_buffers_that_are_not_contiguous_take_the_core_and_are_still_updated():
    """The buffers, like the weights, are written in place: one that is not contiguous sends
    the step to the core before anything is written, and the in-place step then writes the
    core's weights and buffers into the caller's tensors."""
    torch = pytest.importorskip("torch")
    chain = gc.Chain.mlp([4, 5, 3])
    pb = Problem(chain, 5)
    G, Gb = pb.grads()
    W, G = [w[..., 0] for w in pb.W], [g[..., 0] for g in G]
    T = lambda xs: [None if x is None else torch.tensor(x) for x in xs]  # noqa: E731
    A, Ab = T(W), T(pb.b)
    M0 = [np.full(w.shape, 0.5) for w in W]
    state = gc.gsgd_init(chain, A, Ab)
    state = state._replace(momentum=[torch.tensor(M0[0]),  # transposed storage
                                     torch.tensor(M0[1].T.copy()).T],
                           step=torch.tensor(1))
    before = [x.clone() for x in A + Ab + list(state.momentum)]
    assert fast.fast_step_(gb.kernels_for(A[0]), chain, A, Ab, T(G), T(Gb), 0.1, state,
                           momentum=0.9) is False
    assert all(torch.equal(x, y) for x, y in zip(A + Ab + list(state.momentum), before))
    core = gc.GSGDState(tuple(M0), tuple(np.zeros_like(x) for x in pb.b), np.asarray(1))
    eW, eb, es = gc.gsgd_update(chain, core, W, pb.b, G, Gb, lr=0.1, momentum=0.9)
    gb.gsgd_update_(chain, state, A, Ab, T(G), T(Gb), lr=0.1, momentum=0.9)
    for a, e in zip(A + Ab + list(state.momentum), list(eW) + list(eb) + list(es.momentum)):
        assert_close(a.numpy(), e, 1e-12)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_takes_the_core(dtype):
    """The fast path declines half precision; the in-place step then writes the core's
    result (computed in float32, DESIGN §6) into the half-precision tensors, bit for bit."""
    torch = pytest.importorskip("torch")
    half = getattr(torch, dtype)
    chain = gc.Chain.mlp([4, 5, 3])
    pb = Problem(chain, 9)
    G, Gb = pb.grads()
    T = lambda xs: [torch.tensor(x.reshape(x.shape[0], -1) if x.ndim == 3 else x).to(half)
                    for x in xs]  # noqa: E731
    A, Ab, Gh, Gbh = T(pb.W), T(pb.b), T(G), T(Gb)
    assert fast.fast_step_(gb.kernels_for(A[0]), chain, [a.clone() for a in A],
                           [a.clone() for a in Ab], Gh, Gbh, 0.1) is False
    eW, eb = gc.gsgd_step(chain, A, Ab, Gh, Gbh, 0.1)
    assert gb.gsgd_update_(chain, None, A, Ab, Gh, Gbh, lr=0.1)
    for got, want, old in zip(A + Ab, list(eW) + list(eb), T(pb.W) + T(pb.b)):
        assert got.dtype == half and torch.equal(got, want) and not torch.equal(got, old)


def test_torch_parameters_with_autograd_are_updated_without_a_graph():
    torch = pytest.importorskip("torch")
    chain = gc.Chain.mlp([4, 5, 3])
    pb = Problem(chain, 6)
    G, Gb = pb.grads()
    P = [torch.nn.Parameter(torch.tensor(x)) for x in pb.W + pb.b]
    gb.gsgd_step_(chain, P[:2], P[2:], [torch.tensor(g) for g in G],
                  [torch.tensor(g) for g in Gb], 0.1)
    eW, eb = gc.gsgd_step(chain, pb.W, pb.b, G, Gb, 0.1)
    for a, e in zip(P, eW + eb):
        assert a.grad_fn is None and a.requires_grad
        assert_close(a.detach().numpy(), e, 1e-12)


def test_compiled_torch_bulk_runs_and_equals_the_core(threads):
    """torch.compile on one fixed chain (it compiles per shape): the compiled kernel really
    ran (dynamo's counters), and the step equals the core's, through the optimizer too."""
    torch = pytest.importorskip("torch")
    import torch._dynamo.utils as dynamo_utils

    import gsgd_backends.torch as bt
    from gsgd_adapters.torch import GSGD, SkeletonWarning

    pb = Problem(CHAIN, 7)
    G, Gb = pb.grads()
    T = lambda xs: [None if x is None else torch.tensor(x) for x in xs]  # noqa: E731
    A, Ab = T(pb.W), T(pb.b)
    frames = dynamo_utils.counters["stats"]["unique_graphs"]
    gb.gsgd_step_(CHAIN, A, Ab, T(G), T(Gb), 0.1, kernels=bt.COMPILED)
    if not torch._dynamo.config.disable:  # TORCH_COMPILE_DISABLE=1 runs every stage eagerly
        assert dynamo_utils.counters["stats"]["unique_graphs"] > frames
    eW, eb = gc.gsgd_step(CHAIN, pb.W, pb.b, G, Gb, 0.1)
    for a, e in zip(A + Ab, eW + eb):
        if e is not None:
            assert_close(a.numpy(), e, 1e-12)
    layers = [torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3)]
    model = torch.nn.Sequential(*layers).double()
    with warnings.catch_warnings():  # compared with the core from the default init
        warnings.simplefilter("ignore", SkeletonWarning)
        opt = GSGD(model, lr=0.1, compile=True, skeleton="paper")
    model(torch.randn(8, 5, dtype=torch.float64)).square().sum().backward()
    chain = gc.Chain.mlp([5, 4, 3])
    W = [model[0].weight.detach().numpy().copy(), model[2].weight.detach().numpy().copy()]
    b = [model[0].bias.detach().numpy().copy(), model[2].bias.detach().numpy().copy()]
    G = [model[0].weight.grad.numpy(), model[2].weight.grad.numpy()]
    Gb = [model[0].bias.grad.numpy(), model[2].bias.grad.numpy()]
    eW, eb = gc.gsgd_step(chain, W, b, G, Gb, 0.1)
    opt.step()
    assert_close(model[2].weight.detach().numpy(), eW[1], 1e-12)
    assert_close(model[0].bias.detach().numpy(), eb[0], 1e-12)


def test_compiled_step_follows_a_learning_rate_schedule_without_recompiling():
    """The learning rate reaches the compiled stages as a tensor: dynamo would compile anew
    for every distinct Python float (each step of a schedule), and stop after a few."""
    torch = pytest.importorskip("torch")
    import torch._dynamo.utils as dynamo_utils

    from gsgd_adapters.torch import GSGD, SkeletonWarning

    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(),
                                torch.nn.Linear(5, 3)).double()
    with warnings.catch_warnings():  # compared with the core from the default init
        warnings.simplefilter("ignore", SkeletonWarning)
        opt = GSGD(model, lr=0.1, compile=True, skeleton="paper")
    chain = gc.Chain.mlp([6, 5, 3])
    x = torch.randn(8, 6, dtype=torch.float64)
    for step, lr in enumerate([0.1, 0.05, 0.02, 0.013]):
        opt.zero_grad()
        model(x).square().sum().backward()
        W = [model[i].weight.detach().numpy().copy() for i in (0, 2)]
        b = [model[i].bias.detach().numpy().copy() for i in (0, 2)]
        G = [model[i].weight.grad.numpy() for i in (0, 2)]
        Gb = [model[i].bias.grad.numpy() for i in (0, 2)]
        opt.param_groups[0]["lr"] = lr
        opt.step()
        if step == 0:
            graphs = dynamo_utils.counters["stats"]["unique_graphs"]
        eW, eb = gc.gsgd_step(chain, W, b, G, Gb, lr)
        assert_close(model[2].weight.detach().numpy(), eW[1], 1e-12)
        assert_close(model[0].bias.detach().numpy(), eb[0], 1e-12)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs


def test_validation_is_not_skipped_after_a_valid_step(fxp):
    """The step's plan remembers the last validated signature; a call whose arrays differ
    from it (a wrong shape, another dtype) is validated again."""
    pb = Problem(CHAIN, 9)
    G, Gb = pb.grads()
    like = fxp.asarray(pb.W[0])
    plan = gb.kernels_for(like).plan(CHAIN, like)
    ran, *_ = _fast(fxp, CHAIN, pb.W, pb.b, G, Gb, 0.1, plan=plan)
    assert ran
    bad = list(Gb)
    bad[0] = np.ones(CHAIN.sizes[1] + 1)
    with pytest.raises(ValueError, match="layer 1"):
        _fast(fxp, CHAIN, pb.W, pb.b, G, bad, 0.1, plan=plan)
    ran, W, b = _fast(fxp, CHAIN, pb.W, pb.b, G, Gb, 0.1, plan=plan)
    _assert_same(fxp, W + b, sum(_core(fxp, CHAIN, pb.W, pb.b, G, Gb, 0.1), []), "after")


@pytest.mark.parametrize("dtype, hyper", [
    ("float64", dict(momentum=0.9, nesterov=True, weight_decay=1e-2)),
    ("float32", dict(momentum=0.9, nesterov=True, weight_decay=1e-2)),
    ("float64", dict(momentum=0.9, dampening=0.1, weight_decay=0.1))])
def test_compiled_momentum_step_equals_the_core(dtype, hyper):
    """Weight decay and momentum (Nesterov's, or with dampening) inside the compiled stages,
    through three steps; hyperparameters that float32 cannot hold (0.1) are the weights'
    dtype there."""
    pytest.importorskip("torch")
    import gsgd_backends.torch as bt
    from _namespaces import available_namespaces as names

    ns = next(n for n in names() if n.name == "torch" and n.dtype_name == dtype)
    got, expected = _momentum_steps(ns, CHAIN, 11, hyper, 3, fast_kernels=bt.COMPILED)
    for what, g, e in zip(("weights", "biases", "buffers", "bias buffers"), got, expected):
        _assert_same(ns, g, e, what)


# Around both dtypes' tame bounds too: 4 sqrt(tiny) ~ 4e-19 and sqrt(max) / 4 ~ 5e18 (float32).
_EXTREME = st.sampled_from([0.0, 1e-300, 1e-150, 1e-30, 1e-20, 1e-3, 1.0, 1e3, 1e20, 1e30,
                            1e150, 1e300])


@settings(max_examples=examples(60))
@given(seed=seeds, f=_EXTREME, beta=_EXTREME, rho=_EXTREME, g=_EXTREME,
       lr=st.sampled_from([1e-3, 0.1, 10.0, 1e30]),
       dtype=st.sampled_from([np.float64, np.float32]))
def test_reciprocal_bulk_equals_the_core_rules_on_tame_vectors(seed, f, beta, rho, g, lr,
                                                               dtype):
    """``recip_rows`` (no division per entry) equals ``exact_rows`` wherever ``_tame``
    admits the node vectors; the magnitudes drawn also make ``_tame`` refuse them."""
    rng = np.random.default_rng(seed)
    with np.errstate(all="ignore"):
        cast = lambda a: np.asarray(a, dtype=np.float64).astype(dtype)  # noqa: E731
        W, G = cast(rng.standard_normal((4, 3, 2))), cast(g * rng.standard_normal((4, 3, 2)))
        F = cast(f * rng.uniform(0.5, 2, 4) * (rng.random(4) < 0.8))
        B = cast(beta * rng.uniform(0.5, 2, 3) * (rng.random(3) < 0.8))
        R = cast((rho or 1.0) * rng.uniform(0.5, 2, 3))
        if not all(np.all(np.isfinite(a)) for a in (W, G, F, B, R)) or np.any(R == 0):
            return
        tame = bool(fast._tame(np, F, True) & fast._tame(np, B, True) & fast._tame(np, R, False))
        exact = fast.exact_rows(np, W, G, F=F, B_prev=B, rho=R, lr=lr)
        recip = fast.recip_rows(np, W.reshape(4, 6), G.reshape(4, 6),
                                fast.reciprocals(np, F, B, R, 2), lr).reshape(W.shape)
    assert np.all(np.isfinite(exact)) and np.all(np.isfinite(recip))
    if tame:
        # Each form rounds a few times over the terms it subtracts, ``W`` and the step, so
        # its error is a few units of their size: far more than of the result where the
        # step nearly cancels ``W`` (a drawn step of 0.49 on a weight of 0.5).
        fb = F.astype(np.float64)[:, None, None] * B.astype(np.float64)[None, :, None]
        with np.errstate(all="ignore"):
            g64 = G.astype(np.float64)
            step = np.where((fb == 0) | (g64 == 0), 0.0, np.abs(lr * g64) / fb / fb)
            terms = (np.abs(W.astype(np.float64)) + step) / np.abs(R.astype(np.float64))[
                None, :, None]
        assert np.all(np.abs(recip.astype(np.float64) - exact) <= 8 * np.finfo(dtype).eps * terms)


@pytest.mark.parametrize("value, tame32, tame64", [
    (1e-20, False, True), (1e-18, True, True), (1e18, True, True), (1e20, False, True),
    (1e-160, False, False)])
def test_tame_bounds_are_the_vectors_own_dtype(value, tame32, tame64):
    """float32 vectors are judged by float32's range: 1e-20 squared underflows there."""
    for dtype, want in ((np.float32, tame32), (np.float64, tame64)):
        v = np.array([value, 1.0], dtype=dtype)
        assert bool(fast._tame(np, v, False)) is want, (dtype, value)


def test_tame_refuses_vectors_whose_products_underflow():
    """What ``_tame`` guards against: with ``F`` tiny, ``1/F`` overflows where ``F*B`` does
    not, and the reciprocal rule would keep a weight that the core moves."""
    W, G = np.ones((1, 1, 1)), np.ones((1, 1, 1))
    F, B, R = np.array([1e-310]), np.array([1e300]), np.ones(1)
    assert not bool(fast._tame(np, F, True))
    with np.errstate(all="ignore"):
        exact = fast.exact_rows(np, W, G, F=F, B_prev=B, rho=R, lr=1e-3)
        recip = fast.recip_rows(np, W[0], G[0], fast.reciprocals(np, F, B, R, 1), 1e-3)[None]
    assert exact[0, 0, 0] != 1.0 and recip[0, 0, 0] == 1.0


@pytest.mark.parametrize("dtype, scale", [("float64", 1.0), ("float64", 1e-100),
                                          ("float64", 1e100), ("float32", 1.0),
                                          ("float32", 1e-13), ("float32", 1e13)])
def test_compiled_torch_step_on_extreme_magnitudes_equals_the_core(dtype, scale):
    """Weights scaled so that the skeleton products leave the tame range of their dtype
    (those layers take the core's per-entry rules inside the compiled stage): the step still
    equals the core's, weights compared relative to their scale."""
    torch = pytest.importorskip("torch")
    import gsgd_backends.torch as bt

    pb = Problem(CHAIN, 8)
    W = [(w * scale).astype(dtype) for w in pb.W]
    G, Gb = pb.grads()
    G = [g.astype(dtype) for g in G]
    b, Gb = [None if v is None else v.astype(dtype) for v in pb.b], [
        None if v is None else v.astype(dtype) for v in Gb]
    T = lambda xs: [None if x is None else torch.tensor(x) for x in xs]  # noqa: E731
    A, Ab = T(W), T(b)
    assert fast.fast_step_(bt.COMPILED, CHAIN, A, Ab, T(G), T(Gb), 0.1)
    eW, eb = gc.gsgd_step(CHAIN, W, b, G, Gb, 0.1)
    tol = 1e-12 if dtype == "float64" else 2e-4
    for a, e in zip(A, eW):
        assert a.dtype == getattr(torch, dtype)
        assert_close(a.numpy().astype(np.float64) / scale, e.astype(np.float64) / scale, tol)
    for a, e in zip(Ab, eb):
        if e is not None:
            assert_close(a.numpy(), e, tol)


def test_compiled_reciprocal_bulk_keeps_its_finite_checks():
    """The compiled ``recip_rows`` tests finiteness as ``x - x == 0``; a compiler that folded
    ``x - x`` to 0 would write infinities. Row 0's ``D`` overflows (frozen: ``W * r``), row
    1's new weights overflow (kept), row 2 is ordinary: each as the core's rules say."""
    torch = pytest.importorskip("torch")
    import array_api_compat.torch as compat

    W = np.array([[1.0, -2.0], [1e308, -1e308], [0.5, 0.25]])
    G = np.array([[1e300, -1e300], [1.0, 1.0], [1.0, -1.0]])
    F, B, R = np.array([1e-10, 1.0, 2.0]), np.array([1e-10, 1.0]), np.array([0.5, 0.25])
    with np.errstate(all="ignore"):
        exact = fast.exact_rows(np, W[:, :, None], G[:, :, None], F=F, B_prev=B, rho=R,
                                lr=0.1)[:, :, 0]
    assert np.array_equal(exact[:2], [[2.0, -8.0], [1e308, -1e308]])
    recips = [torch.tensor(v) for v in fast.reciprocals(np, F, B, R, 1)]
    compiled = torch.compile(fast.recip_rows, dynamic=False)
    got = compiled(compat, torch.tensor(W), torch.tensor(G), recips,
                   torch.tensor(0.1, dtype=torch.float64)).numpy()
    np.testing.assert_allclose(got, exact, rtol=1e-15, atol=0)


@settings(max_examples=examples(40))
@given(seed=seeds, hyper=_HYPERS, first=st.booleans(), zero_f=st.booleans(),
       direct=st.booleans(), lr=st.sampled_from([0.1, 1.0, 1.5]))
def test_in_place_momentum_block_is_the_core_rule_bit_for_bit(fxp, seed, hyper, first, zero_f,
                                                              direct, lr):
    """The eager kernels' in-place block (four scratch buffers) gives exactly
    ``rows_by_rules``'s numbers, its quotient by ``rho`` written into the weights directly
    or checked first; with a zero ``F`` (a frozen path, ``G/0``) it writes nothing and hands
    the block to the rules. ``lr * dir / fb`` is formed in the core's order either side of
    ``|lr| = 1``."""
    from gsgd_core.rules import StepRule

    rng = np.random.default_rng(seed)
    W, G, M = (rng.standard_normal((5, 6)) for _ in range(3))
    F, B, R = rng.uniform(0.5, 2, 5), rng.uniform(0.5, 2, 6), rng.uniform(0.5, 2, 6)
    F[2] = 0.0 if zero_f else F[2]
    mu = hyper.get("momentum", 0.0)
    rule = StepRule(hyper.get("weight_decay") or None, mu or None,
                    hyper.get("dampening", 0.0), hyper.get("nesterov", False),
                    fxp.xp.asarray(first, device=fxp.device))  # as state.step == 0 gives it
    kernels = gb.kernels_for(fxp.asarray(W))
    Wx, Gx, Mx = (fxp.asarray(a) for a in (W, G, M))
    Mx = Mx if mu else None
    Fx, Bx, Rx = (fxp.asarray(a) for a in (F, B, R))
    expected = fast.rows_by_rules(kernels.xp, Wx, Gx, Mx, F=Fx, B_cols=Bx, rho_cols=Rx, lr=lr,
                                  rule=rule)
    before = [fxp.to_numpy(a).copy() for a in (Wx, Mx) if a is not None]
    with kernels.context():
        wrote = fast.momentum_block_(kernels, Wx, Gx, Mx, F=Fx, B_cols=Bx, rho_cols=Rx, lr=lr,
                                     rule=rule, scratch=Scratch(), direct=direct)
    assert wrote == (not zero_f)
    after = [fxp.to_numpy(a) for a in (Wx, Mx) if a is not None]
    targets = [fxp.to_numpy(e) for e in expected if e is not None] if wrote else before
    for a, e in zip(after, targets):
        np.testing.assert_array_equal(a, e)


def test_fast_step_on_large_layers_with_every_core_equals_the_core(threads):
    """Layers above ATen's parallel grain size (32,768 elements), on every core: the column
    sums and the bulk update run ATen's multi-threaded loops (the suite runs on one thread)."""
    torch = pytest.importorskip("torch")
    assert torch.get_num_threads() == threads >= 2
    chain = gc.Chain.mlp([64, 256, 256, 10])
    pb = Problem(chain, 11)
    G3, Gb = pb.grads()
    W, G = ([x.reshape(x.shape[0], -1) for x in xs] for xs in (pb.W, G3))
    for hyper in (dict(lr=0.05), dict(lr=0.05, momentum=0.9, weight_decay=1e-3)):
        Wt, bt = [torch.tensor(w) for w in W], [torch.tensor(v) for v in pb.b]
        state = gc.gsgd_init(chain, Wt, bt) if "momentum" in hyper else None
        eW, eb, _ = gc.gsgd_update(chain, None if state is None else gc.gsgd_init(
            chain, W, pb.b), W, pb.b, G, Gb, **hyper)
        assert gb.gsgd_update_(chain, state, Wt, bt, [torch.tensor(g) for g in G],
                               [torch.tensor(g) for g in Gb], **hyper)
        for got, want in zip(Wt + bt, list(eW) + list(eb)):
            assert_close(got.numpy(), np.asarray(want).reshape(got.shape), 1e-12)


@pytest.mark.parametrize("conv", [(40, 8, 3, 3), (200, 8, 3, 3)], ids=["below", "above"])
def test_conv_column_sums_either_side_of_the_rowwise_form_equal_the_core(fxp, conv):
    """NumPy's column sum of a conv layer (``k > 1``) takes the row-wise ``einsum`` from
    :data:`gsgd_backends.numpy.ROWWISE` weights (below and above it here); the step equals
    the core either way."""
    from gsgd_backends.numpy import ROWWISE
    assert (np.prod(conv) >= ROWWISE) == (conv[0] == 200)
    chain = gc.Chain.from_shapes([(8, 3, 3, 3), conv, (10, conv[0])], bias=True)
    pb = Problem(chain, 3)
    G, Gb = pb.grads()
    ran, W, b = _fast(fxp, chain, pb.W, pb.b, G, Gb, 0.1, None)
    assert ran
    eW, eb = _core(fxp, chain, pb.W, pb.b, G, Gb, 0.1)
    _assert_same(fxp, W, eW, "weights")
    _assert_same(fxp, b, eb, "biases")


def test_cupy_kernels_scatter_through_cupy_add_at(monkeypatch):
    """Without a GPU: the CuPy kernels imported over a stand-in ``cupy`` (NumPy, with
    ``add.at`` recorded). A step of a chain whose tau edges are also free edges carries sums
    down through ``scatter_add``; it must go through the stand-in's ``add.at`` (so through
    CuPy's on a GPU) and equal the core's step."""
    import importlib
    import types

    calls = []

    class RecordedAdd:
        def __call__(self, *args, **kwargs):
            return np.add(*args, **kwargs)

        def at(self, a, i, v):
            calls.append(1)
            np.add.at(a, i, v)

    cupy = types.ModuleType("cupy")
    cupy.__dict__.update(vars(np))
    cupy.add = RecordedAdd()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.delitem(sys.modules, "gsgd_backends.cupy", raising=False)
    try:
        kernels = importlib.import_module("gsgd_backends.cupy").KERNELS
    finally:  # the stand-in module must not outlive this test
        sys.modules.pop("gsgd_backends.cupy", None)
        monkeypatch.delattr(gb, "cupy", raising=False)
    chain = gc.Chain.mlp([3, 3, 3, 2])
    pb = Problem(chain, 12)
    G, Gb = pb.grads()
    W, b = [w.copy() for w in pb.W], [v.copy() for v in pb.b]
    assert fast.fast_step_(kernels, chain, W, b, G, Gb, 0.1)
    assert calls, "the CuPy kernels did not scatter through cupy.add.at"
    eW, eb = gc.gsgd_step(chain, pb.W, pb.b, G, Gb, 0.1)
    for got, want in zip(W + b, eW + eb):
        assert_close(got, want, 1e-12)


def test_tame_bounds_are_inclusive_and_exactly_where_stated():
    """``_tame`` admits ``[4 sqrt(tiny), sqrt(max) / 4]`` with both ends, nothing above."""
    for dtype in (np.float32, np.float64):
        fi = np.finfo(dtype)
        lo, hi = dtype(4 * np.sqrt(fi.smallest_normal)), dtype(np.sqrt(fi.max) / 4)
        assert bool(fast._tame(np, np.array([lo, hi], dtype=dtype), False))
        for out in (np.nextafter(lo, dtype(0)), np.nextafter(hi, dtype(np.inf)),
                    dtype(np.sqrt(fi.max))):
            assert not bool(fast._tame(np, np.array([out], dtype=dtype), False)), (dtype, out)


def test_gradients_that_are_not_contiguous_take_the_fast_path_and_equal_the_core(fxp):
    pb = Problem(CHAIN, 8)
    G, Gb = pb.grads()
    A, Ab = fxp.aslist(pb.W), fxp.aslist(pb.b)
    # each gradient a view with its axes reversed, of a copy with its axes reversed: same
    # values, not contiguous
    Gnc = [reverse_axes(fxp.asarray(np.ascontiguousarray(g.T))) for g in G]
    assert not all(g.is_contiguous() if hasattr(g, "is_contiguous") else g.flags["C_CONTIGUOUS"]
                   for g in Gnc)
    kernels = gb.kernels_for(A[0])
    assert fast.fast_step_(kernels, CHAIN, A, Ab, Gnc, fxp.aslist(Gb), 0.1)
    eW, eb = _core(fxp, CHAIN, pb.W, pb.b, G, Gb, 0.1)
    _assert_same(fxp, fxp.tolist(A), eW, "weights")
    _assert_same(fxp, fxp.tolist(Ab), eb, "biases")


def test_momentum_block_with_an_overflow_writes_the_cores_buffers(fxp):
    """A huge step overflows some entries of a momentum step: the block is recomputed by the
    per-entry rules, weights and momentum buffers both (the buffers keep the core's values)."""
    pb = Problem(CHAIN, 3)
    lr = 1e308 if fxp.is_f64 else 3e38
    A, Ab = fxp.aslist(pb.W), fxp.aslist(pb.b)
    W, b = fxp.aslist(pb.W), fxp.aslist(pb.b)
    state, core = gc.gsgd_init(CHAIN, A, Ab), gc.gsgd_init(CHAIN, W, b)
    kernels = gb.kernels_for(A[0])
    for step_lr in (0.1, lr):  # a buffer with history, then the huge step
        G, Gb = (fxp.aslist(x) for x in pb.grads(fxp.tolist(W), fxp.tolist(b)))
        with _chunk(kernels, 4):
            assert fast.fast_step_(kernels, CHAIN, A, Ab, G, Gb, step_lr, state, momentum=0.9)
        assign(state.step, state.step + 1)
        W, b, core = gc.gsgd_update(CHAIN, core, W, b, G, Gb, lr=step_lr, momentum=0.9)
    _assert_same(fxp, fxp.tolist(state.momentum), fxp.tolist(core.momentum), "buffers")
    for a, e in zip(fxp.tolist(A), fxp.tolist(W)):  # kept or moved by ~lr
        assert np.all((a == e) | np.isclose(a, e, rtol=_tol(fxp), atol=0))


def test_weight_decay_step_that_overflows_keeps_the_cores_values(fxp):
    """Weight decay without momentum (no buffers): a huge step overflows some entries, and
    the blocks holding them are recomputed by the per-entry rules and written back, the
    weights only."""
    pb = Problem(CHAIN, 3)
    G, Gb = pb.grads()
    lr = 1e308 if fxp.is_f64 else 3e38
    A, Ab = fxp.aslist(pb.W), fxp.aslist(pb.b)
    kernels = gb.kernels_for(A[0])
    with _chunk(kernels, 4):
        assert fast.fast_step_(kernels, CHAIN, A, Ab, fxp.aslist(G), fxp.aslist(Gb), lr,
                               weight_decay=0.1)
    eW, eb, _ = gc.gsgd_update(CHAIN, None, fxp.aslist(pb.W), fxp.aslist(pb.b),
                               fxp.aslist(G), fxp.aslist(Gb), lr=lr, weight_decay=0.1)
    moved = False
    for a, e, old in zip(fxp.tolist(A), fxp.tolist(eW), pb.W):  # kept or moved by ~lr
        assert np.all((a == e) | np.isclose(a, e, rtol=_tol(fxp), atol=0))
        moved |= bool(np.any(a != old.reshape(a.shape)))
    assert moved
    _assert_same(fxp, fxp.tolist(Ab), fxp.tolist(eb), "biases")


def test_tau_edges_that_overflow_along_a_deep_tau_chain_are_allocated_as_the_core():
    """Every tau edge from unit 1 below (so tau chains run the whole depth) and a step huge
    enough that tau edges' new values overflow: each such edge keeps its value and its node
    takes its source's ``rho``, which the layers above then divide by, five inner layers
    deep, as the core's layer-by-layer sweep does."""
    sizes = (3, 4, 5, 6, 5, 4, 3)
    inner = range(1, len(sizes) - 1)
    chain = gc.Chain(sizes, (1,) * (len(sizes) - 1), tau=[[1] * sizes[l] for l in inner],
                     sigma=[[0] * sizes[l] for l in inner])
    pb = Problem(chain, 1)
    pb.W = [w * 100 for w in pb.W]
    G, Gb = pb.grads()
    A, Ab = [w.copy() for w in pb.W], [None if x is None else x.copy() for x in pb.b]
    with np.errstate(all="ignore"):  # the overflows are the point
        assert fast.fast_step_(gb.kernels_for(A[0]), chain, A, Ab, G, Gb, 1e308)
        eW, eb = gc.gsgd_step(chain, pb.W, pb.b, G, Gb, 1e308)
    for l, (a, e) in enumerate(zip(A + Ab, eW + eb)):
        if e is not None:
            assert_close(a, e, 1e-12, f"layer {l}")


def test_remembered_hyperparameters_are_checked_when_they_change():
    """A plan remembers the last hyperparameters it checked: a changed value (a negative
    learning rate set after valid steps, Nesterov without momentum, ``True`` after ``1.0``)
    is refused as on the first call, before anything is written, and the valid ones step as
    the core."""
    from gsgd_backends import gsgd_update_, step_plan

    pb = Problem(CHAIN, 5)
    G, Gb = pb.grads()
    W, b = [w.copy() for w in pb.W], [None if x is None else x.copy() for x in pb.b]
    plan = step_plan(CHAIN, W)
    arrays = W + [x for x in b if x is not None]
    for hyper in (dict(lr=0.1), dict(lr=0.1), dict(lr=-0.1), dict(lr=0.05),
                  dict(lr=0.05, nesterov=True), dict(lr=0.05), dict(lr=float("nan")),
                  dict(lr=1.0), dict(lr=True)):  # True == 1.0, but not a learning rate
        before = [a.copy() for a in arrays]
        try:
            expected = gc.gsgd_update(CHAIN, None, W, b, G, Gb, **hyper)
        except ValueError as exc:
            with pytest.raises(ValueError, match=str(exc).split(",")[0]):
                gsgd_update_(CHAIN, None, W, b, G, Gb, plan=plan, **hyper)
            assert all(np.array_equal(x, y) for x, y in zip(arrays, before))
            continue
        gsgd_update_(CHAIN, None, W, b, G, Gb, plan=plan, **hyper)
        for got, want in zip(W + b, expected[0] + expected[1]):
            if got is not None:
                assert_close(got, want, 1e-12)


def test_a_plan_checks_the_same_hyperparameters_once():
    """The memo itself: a call with the names, types and values of the last one is not
    checked again; any change is."""
    from gsgd_backends import step_plan

    plan = step_plan(CHAIN, Problem(CHAIN, 5).W)
    seen = []

    def check(hyper):
        seen.append(dict(hyper))
        return len(seen)

    for hyper, checks in ((dict(lr=0.1), 1), (dict(lr=0.1), 1), (dict(lr=0.2), 2),
                          (dict(lr=0.2, momentum=0.0), 3), (dict(lr=0.2, momentum=0), 4),
                          (dict(lr=0.2, momentum=0), 4)):
        assert plan.checked(hyper, check) == checks
        assert len(seen) == checks


def test_the_fast_step_checks_its_arrays_and_its_plan_as_the_core_does(fxp):
    """Before anything is read: gradients and momentum buffers of the weights' shapes (the
    core's messages), one dtype, and a given plan that fits the weights."""
    pb = Problem(CHAIN, 3)
    G, Gb = pb.grads()
    A, Ab, Gx, Gbx = (fxp.aslist(x) for x in (pb.W, pb.b, G, Gb))
    kernels = gb.kernels_for(A[0])
    state = gc.gsgd_init(CHAIN, A, Ab)
    bad = state._replace(momentum=[state.momentum[0], fxp.asarray(np.zeros((5, 4))),
                                   *state.momentum[2:]])
    with pytest.raises(ValueError, match=r"^layer 2: momentum\[1\] has shape \(5, 4\), but "
                       r"the weight has shape \(5, 4, 4\)$"):
        fast.fast_step_(kernels, CHAIN, A, Ab, Gx, Gbx, 0.1, bad, momentum=0.9)
    with pytest.raises(ValueError, match=r"^layer 3: grads\[2\] has shape \(6, 4\), but the "
                       r"weight has shape \(6, 5, 4\)$"):
        fast.fast_step_(kernels, CHAIN, A, Ab, Gx[:2] + [fxp.asarray(np.zeros((6, 4)))]
                        + Gx[3:], Gbx, 0.1)
    plan = gb.step_plan(CHAIN, A)
    other = gc.Chain.mlp([3, 4, 2])
    with pytest.raises(ValueError, match=rf"^{re.escape(str(plan))} does not fit this step: "
                       rf"chain {re.escape(str(other))}, weights of dtype "
                       rf"{re.escape(str(A[0].dtype))} on "
                       rf"{re.escape(str(array_api_compat.device(A[0])))}$"):
        fast.fast_step_(kernels, other, A, Ab, Gx, Gbx, 0.1, plan=plan)
    xp = fxp.xp
    mixed = A[:1] + [xp.astype(A[1], xp.float32 if fxp.is_f64 else xp.float64)] + A[2:]
    with pytest.raises(ValueError, match="^all arrays must share the weights' dtype"):
        fast.fast_step_(kernels, CHAIN, mixed, Ab, Gx, Gbx, 0.1, plan=plan)
    with pytest.raises(ValueError, match=rf"weights of dtype {re.escape(str(A[0].dtype))} on "
                       rf"{re.escape(str(array_api_compat.device(A[0])))}$"):
        fast.fast_step_(kernels, other, mixed, Ab, Gx, Gbx, 0.1, plan=plan)  # the first's


@pytest.mark.parametrize("scales, grad_scale", [
    ((1, 1, 1, 1), 1), ((1e160, 1, 1, 1), 1), ((1, 1e-160, 1, 1), 1), ((1, 1, 1e160, 1), 1),
    ((1, 1, 1, 1e-160), 1), ((1, 1, 1, 0), 1), ((0, 1, 1, 1), 1), ((1, 1, 1, 1), 1e156),
    ((1, 1, 1e-310, 1e300), 1), ((1, 1e-310, 1, 1e160), 1), ((1, 1e-310, 1e300, 1), 1),
    ((1, 1, 1e-310, 1), 1), ((1, 1e-310, 1e-160, 1e300), 1)])
def test_a_layer_is_tame_when_its_three_node_vectors_are(monkeypatch, scales, grad_scale):
    """Traced kernels flag layer ``l`` for :func:`recip_rows` exactly when ``F_l`` and
    ``B_{l-1}`` (zeros allowed: a frozen path) and ``rho_{l-1}`` lie in ``[4 sqrt(tiny),
    sqrt(max) / 4]``: layers' weights scaled far out of range (or zero: ``F = 0`` below),
    or the first layer's gradients (``rho`` out of range above), move some layers' vectors
    out and leave others in, and the step still equals the core's (with a subnormal ``F``
    and a huge ``B`` the reciprocal rule would not)."""
    torch = pytest.importorskip("torch")
    import gsgd_backends.torch as bt

    fi = np.finfo(np.float64)
    lo, hi = 4 * np.sqrt(fi.smallest_normal), np.sqrt(fi.max) / 4

    def inside(v, zero_ok):
        a = np.abs(v.numpy())
        return bool(np.all(((a >= lo) & (a <= hi)) | (zero_ok & (a == 0))))

    seen = []
    special_vectors = fast.special_vectors
    monkeypatch.setattr(fast, "special_vectors", lambda *a, **k: seen.append(
        special_vectors(*a, **k)) or seen[-1])
    kernels = bt.TorchKernels(bt.CHUNK, compiled=True)
    kernels.compile = lambda fn: fn  # traced kernels' stages, run eagerly
    pb = Problem(CHAIN, 8)
    G, Gb = pb.grads()
    pb.W = [w * s for w, s in zip(pb.W, scales)]
    G[0] = G[0] * grad_scale
    A, Ab = [torch.tensor(w) for w in pb.W], [None if b is None else torch.tensor(b)
                                              for b in pb.b]
    assert fast.fast_step_(kernels, CHAIN, A, Ab, [torch.tensor(g) for g in G],
                           [None if g is None else torch.tensor(g) for g in Gb], 0.1)
    v = seen[0]
    flags = [bool(f) for f in v.flags.tolist()[1:]]
    assert flags == [inside(v.F[l], True) and inside(v.B[l - 1], True)
                     and inside(v.rho[l - 1], False) for l in range(1, CHAIN.L + 1)]
    if set(scales) - {0, 1} or grad_scale != 1:
        assert 0 < sum(flags) < CHAIN.L  # the case tells the layers apart
    eW, eb = gc.gsgd_step(CHAIN, pb.W, pb.b, G, Gb, 0.1)
    for a, e in zip(A + Ab, eW + eb):
        if e is not None:
            np.testing.assert_allclose(a.numpy(), e, rtol=1e-12, atol=0)


def _eager_traced(**options):
    """Traced torch kernels whose stages run eagerly (fast, no compiler)."""
    import gsgd_backends.torch as bt

    kernels = bt.TorchKernels(bt.CHUNK, compiled=True, **options)
    kernels.compile = lambda fn: fn
    return kernels


@pytest.mark.parametrize("traced", [True, False])
def test_two_stage_bulk_gets_reciprocals_of_tame_layers_only_when_traced(monkeypatch, traced):
    """The kernel interface (:class:`gsgd_backends.LayerKernels`): traced kernels' ``bulk_``
    gets :func:`fast.reciprocals` on exactly the layers whose node vectors are tame (flagged
    by the vector stage), ``None`` on the others, and no scratch buffer; eager kernels get
    no reciprocals and the plan's scratch buffers. The step is the core's."""
    torch = pytest.importorskip("torch")
    import gsgd_backends.torch as bt

    kernels = (_eager_traced(one_graph=False) if traced
               else bt.TorchKernels(bt.CHUNK, host=False))  # its own kernels on every layer
    seen, calls = [], []
    special_vectors, bulk = fast.special_vectors, kernels.bulk_
    monkeypatch.setattr(fast, "special_vectors", lambda *a, **k: seen.append(
        special_vectors(*a, **k)) or seen[-1])

    def recording_bulk(W, G, **k):
        calls.append((W.shape, k.get("recips"), k.get("scratch")))  # the defaults: None
        bulk(W, G, **k)

    kernels.bulk_ = recording_bulk
    pb = Problem(CHAIN, 8)
    G, Gb = pb.grads()
    pb.W[1] = pb.W[1] * 1e-160  # F_1, B_2, B_3 near 1e-160: only layer 2 stays tame
    T = lambda xs: [None if x is None else torch.tensor(x) for x in xs]  # noqa: E731
    A, Ab = T(pb.W), T(pb.b)
    plan = kernels.plan(CHAIN, A[0])
    assert fast.fast_step_(kernels, CHAIN, A, Ab, T(G), T(Gb), 0.1, plan=plan)
    tame = [bool(f) for f in seen[0].flags.tolist()[1:]]
    assert tame == ([False, True, False, False] if traced else [])
    calls.reverse()  # the bulk runs from the top layer down
    assert [shape[0] for shape, _, _ in calls] == list(CHAIN.sizes[1:])
    for l, (_, recips, scratch) in enumerate(calls, start=1):
        assert scratch is (None if traced else plan.scratch)
        assert (recips is not None) == (traced and tame[l - 1]), f"layer {l}"
    eW, eb = gc.gsgd_step(CHAIN, pb.W, pb.b, G, Gb, 0.1)
    for a, e in zip(A + Ab, eW + eb):
        if e is not None:
            np.testing.assert_allclose(a.numpy(), e, rtol=1e-12, atol=0)


def test_one_graph_step_with_weight_decay_alone_equals_the_core():
    """Weight decay without momentum in the one-graph stage (no buffers to write): two
    steps, each compiled as that one function (``Kernels.one_graph``), weights and biases
    as the core's."""
    pytest.importorskip("torch")
    from _namespaces import available_namespaces as names

    ns = next(n for n in names() if n.name == "torch" and n.dtype_name == "float64")
    kernels, staged = _eager_traced(), []
    kernels.compile = lambda fn: staged.append(fn.__name__) or fn
    got, expected = _momentum_steps(ns, CHAIN, 11, dict(weight_decay=0.05), 2,
                                    fast_kernels=kernels)
    assert set(staged) == {"one_graph_stage_"}
    for what, g, e in zip(("weights", "biases"), got, expected):
        _assert_same(ns, g, e, what)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_rows_divide_directly_down_to_four_over_the_root_of_the_largest_float(dtype):
    """The direct division's bound is ``|rho| >= 4 / sqrt(max)``: a quotient by such a
    ``rho`` of a number whose square is finite stays below ``max / 4``. Rows at the bound
    divide directly; rows just below it take the guarded rules."""
    xp = array_api_compat.array_namespace(np.ones(1, dtype))
    exact = 4 / np.sqrt(float(np.finfo(dtype).max))
    at = dtype(exact)   # the least number of the dtype at or above the bound
    if at < exact:
        at = np.nextafter(at, dtype(np.inf))
    below = np.nextafter(at, dtype(0))
    assert fast._divides_finitely(xp, np.array([at, -at, 1.0], dtype))
    assert not fast._divides_finitely(xp, np.array([below, 1.0], dtype))
