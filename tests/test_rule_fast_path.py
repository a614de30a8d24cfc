"""The fast step of elementwise path-space rules (gsgd_backends.rule_step) against the core's
path_update: the same numbers on every drawn chain and block size, the degenerate skeletons
that take the per-entry rules, and the steps it hands back (non-finite gradients, half
precision)."""

import contextlib

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import gsgd_backends as gb
import gsgd_core as gc
from gsgd_backends.rule_step import rule_step_
from _helpers import Problem, assert_close, from_repository, reverse_axes
from _namespaces import available_namespaces
from _conditioning import (assert_buffers_close, assert_step_close, flat_paths,
                          gradient_rounding, step_tolerance)
from _strategies import chains, examples, seeds
from test_fast_paths import CHAIN, _chunk, _tol

RULES = {"adam": lambda: gc.adam_rule(0.01),
         "adamw-amsgrad": lambda: gc.adamw_rule(0.01, betas=(0.8, 0.99), weight_decay=0.1,
                                                amsgrad=True),
         "sgd-nesterov": lambda: gc.sgd_rule(0.05, momentum=0.9, nesterov=True,
                                             weight_decay=1e-3)}


def _runs(ns, chain, pb, rule, steps, W=None, chunk=None, grad_scale=1.0):
    """``steps`` steps by the fast path (in place) and by the core (gradients times
    ``grad_scale``); host copies of both, and whether every fast step ran fast."""
    W = pb.W if W is None else W
    A, Ab = ns.aslist(W), ns.aslist(pb.b)
    E, Eb = ns.aslist(W), ns.aslist(pb.b)
    fs, es = gc.path_init(chain, rule, A, Ab), gc.path_init(chain, rule, E, Eb)
    kernels, ran = gb.kernels_for(A[0]), []
    for _ in range(steps):
        G, Gb = pb.grads(ns.tolist(E), ns.tolist(Eb))
        G = [g * grad_scale for g in G]
        with _chunk(kernels, chunk):
            ran.append(rule_step_(kernels, chain, rule, fs, A, Ab, ns.aslist(G), ns.aslist(Gb)))
        fs = fs._replace(count=fs.count + 1)
        E, Eb, es = gc.path_update(chain, rule, es, E, Eb, ns.aslist(G), ns.aslist(Gb))
    return all(ran), (ns.tolist(A), ns.tolist(Ab), fs), (ns.tolist(E), ns.tolist(Eb), es)


def _assert_same(ns, fast, core):
    for what, a, e in (("weights", fast[0], core[0]), ("biases", fast[1], core[1])):
        for i, (x, y) in enumerate(zip(a, e)):
            assert_close(x, y, _tol(ns), f"{what}[{i}]")
    for j, (fb, eb) in enumerate(zip(fast[2].buffers, core[2].buffers)):
        for i, (x, y) in enumerate(zip(fb, eb)):
            assert_close(ns.to_numpy(x), ns.to_numpy(y), _tol(ns), f"buffer {j}[{i}]")


def _state(ns, chain, rule, W, b, buffers, count):
    """Weights, biases and a rule state in ``ns`` from host copies (``buffers`` None: the
    rule's initial state)."""
    A, Ab = ns.aslist(W), ns.aslist(b)
    state = gc.path_init(chain, rule, A, Ab)
    if buffers is not None:
        state = state._replace(buffers=tuple(tuple(ns.aslist(list(bufs))) for bufs in buffers),
                               count=state.count + count)
    return A, Ab, state


def _synced_steps(ns, chain, pb, rule, steps, chunk=None, step=None) -> bool:
    """``steps`` steps along the core's trajectory, each taken by the fast path and by the
    core from the same state and compared with the tolerance the rule's conditioning gives
    (:mod:`_conditioning`). Whether every fast step ran fast. ``step(state, A, Ab, G,
    Gb)`` takes the step in place instead of the fast path (another in-place
    implementation, e.g. the fused kernels; it returns whether it ran)."""
    W, b, buffers, ran = ns.tolist(ns.aslist(pb.W)), ns.tolist(ns.aslist(pb.b)), None, []
    for count in range(steps):
        G, Gb = (ns.tolist(ns.aslist(g)) for g in pb.grads(W, b))  # in the step's dtype
        D, dD, V = gradient_rounding(chain, W, b, G, Gb)
        zeros = tuple(tuple(np.zeros_like(v) for v in V) for _ in rule.buffers)
        tol_delta, tol_bufs = step_tolerance(rule, count, D, dD, V, buffers or zeros)
        A, Ab, fs = _state(ns, chain, rule, W, b, buffers, count)
        if step is not None:
            ran.append(step(fs, A, Ab, ns.aslist(G), ns.aslist(Gb)))
        else:
            kernels = gb.kernels_for(A[0])
            with _chunk(kernels, chunk):
                ran.append(rule_step_(kernels, chain, rule, fs, A, Ab, ns.aslist(G),
                                      ns.aslist(Gb)))
        E, Eb, es = _state(ns, chain, rule, W, b, buffers, count)
        E, Eb, es = gc.path_update(chain, rule, es, E, Eb, ns.aslist(G), ns.aslist(Gb))
        old, (W, b) = (W, b), (ns.tolist(E), ns.tolist(Eb))
        buffers = tuple(tuple(ns.tolist(list(x))) for x in es.buffers)
        assert_step_close(chain, old, (ns.tolist(A), ns.tolist(Ab)), (W, b), _tol(ns),
                          tol_delta, f"step {count}")
        for j, (fb, eb) in enumerate(zip(fs.buffers, buffers)):
            assert_buffers_close(ns.tolist(list(fb)), list(eb), _tol(ns), tol_bufs[j],
                                 f"step {count} buffer {j}")
    return all(ran)


#: Drawn by the property below (hypothesis 6.170): node 3 of layer 2 carries gradient only
#: along its tau edge, so its ``D_tau`` cancels to rounding, which G-Adam's ``lr / eps``
#: slope turns into differences of 1e-11 to 1e-6 in the weights (torch's blocked column
#: sums round otherwise than NumPy's pairwise sums).
CANCELLING = gc.Chain(sizes=(4, 6, 4, 4), slots=(4, 1, 4), bias=(False, False, False),
                      tau=((0,) * 6, (0, 0, 0, 1)), sigma=((0,) * 6, (0, 0, 0, 0)),
                      skeleton_slots=(0, 0, 2))


@pytest.mark.parametrize("name", list(RULES))
@settings(max_examples=examples(10))
@given(chain=st.one_of(st.just(CHAIN), chains(max_depth=4)), seed=seeds,
       chunk=st.sampled_from([None, 1, 7]))
@example(chain=CANCELLING, seed=16117, chunk=1)
def test_rule_fast_step_equals_the_core(fxp, name, chain, seed, chunk):
    """Three steps along the core's trajectory, each from the core's state: path values
    and buffers within the rule's conditioning of the core's (:mod:`_conditioning`)."""
    assert _synced_steps(fxp, chain, Problem(chain, seed), RULES[name](), 3, chunk=chunk)


class SignRule(gc.ElementwiseRule):
    """A user's rule that squashes ``D`` (sign descent, no buffers): an overflowing ``D``
    gives a finite step, so only the check of ``D`` itself sends its block to the per-entry
    rules (which freeze the path: ``D = 0``)."""

    def coefficients(self, xp, count, dtype):
        return 0.01

    def apply(self, xp, D, V, bufs, coef):
        return coef * xp.sign(D), ()


@pytest.mark.parametrize("name", ["adam", "adamw-amsgrad", "sign"])
@pytest.mark.parametrize("case", ["zero tau", "zero free", "huge gradient", "overflowing D"])
def test_degenerate_skeletons_take_the_per_entry_rules(fxp, case, name):
    """A zero skeleton weight (``F B = 0``: frozen paths) or a ``D`` that overflows makes a
    block's sums non-finite: the block is recomputed by the core's per-entry rules."""
    pb = Problem(CHAIN, 4)
    W = [w.copy() for w in pb.W]
    if case == "zero tau":
        W[0][CHAIN.tau_mask(1)] = 0.0
    elif case == "zero free":
        W[1][CHAIN.free_mask(2)] = 0.0
    elif case == "huge gradient":
        tiny = 1e-150 if fxp.is_f64 else 1e-18
        W[0] = W[0] * tiny  # B_1 ~ tiny: D = G / (F B) of layer 2 overflows
    else:  # D = G / (F B) overflows, a step of size lr / (F B) would not
        W[0] = W[0] * (1e-160 if fxp.is_f64 else 1e-8)
    scale = (1e160 if fxp.is_f64 else 1e32) if case == "overflowing D" else 1.0
    rule = SignRule() if name == "sign" else RULES[name]()
    steps = 1 if case == "overflowing D" else 2  # its step moves weights far
    ran, fast, core = _runs(fxp, CHAIN, pb, rule, steps, W=W, chunk=5, grad_scale=scale)
    assert ran
    assert all(np.all(np.isfinite(x)) for x in fast[0] + fast[1] if x is not None)
    _assert_same(fxp, fast, core)


@pytest.mark.parametrize("which, layer", [("weight", 0), ("weight", 1), ("bias", 2)])
def test_non_finite_gradients_are_handed_back(fxp, which, layer):
    """A NaN in a weight's or a bias's gradient: nothing written, the step handed back."""
    pb = Problem(CHAIN, 2)
    rule = RULES["adam"]()
    A, Ab = fxp.aslist(pb.W), fxp.aslist(pb.b)
    G, Gb = pb.grads()
    bad = G if which == "weight" else Gb
    bad[layer] = bad[layer].copy()
    bad[layer].reshape(-1)[1] = np.nan
    state = gc.path_init(CHAIN, rule, A, Ab)
    before = fxp.tolist(A)
    assert not rule_step_(gb.kernels_for(A[0]), CHAIN, rule, state, A, Ab, fxp.aslist(G),
                          fxp.aslist(Gb))
    assert all(np.array_equal(a, b) for a, b in zip(fxp.tolist(A), before))
    # through the dispatch: skipped, nothing written, count kept
    assert not gb.path_update_(CHAIN, rule, state, A, Ab, fxp.aslist(G), fxp.aslist(Gb))
    assert all(np.array_equal(a, b) for a, b in zip(fxp.tolist(A), before))
    assert int(fxp.to_numpy(state.count)) == 0


def test_the_dispatch_takes_the_fast_path_and_counts_the_step(fxp, monkeypatch):
    import gsgd_backends.inplace as inplace
    calls = []
    monkeypatch.setattr(inplace, "rule_step_",
                        lambda *a, **k: calls.append(1) or rule_step_(*a, **k))
    monkeypatch.setattr(gc, "path_update", None)  # the core is never reached
    pb = Problem(CHAIN, 5)
    rule = RULES["adam"]()
    A, Ab = fxp.aslist(pb.W), fxp.aslist(pb.b)
    state = gc.path_init(CHAIN, rule, A, Ab)
    G, Gb = pb.grads()
    assert gb.path_update_(CHAIN, rule, state, A, Ab, fxp.aslist(G), fxp.aslist(Gb))
    assert calls == [1] and int(fxp.to_numpy(state.count)) == 1


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_takes_the_core(dtype):
    """The rule's fast step declines half precision (it would round every intermediate
    to 16 bits); the in-place step then writes the core's result, computed in float32 (DESIGN
    §6), into the half-precision tensors and their state, bit for bit."""
    torch = pytest.importorskip("torch")
    half = getattr(torch, dtype)
    chain, rule = gc.Chain.mlp([4, 5, 3]), RULES["adamw-amsgrad"]()
    pb = Problem(chain, 9)
    G, Gb = pb.grads()
    T = lambda xs: [torch.tensor(x.reshape(x.shape[0], -1) if x.ndim == 3 else x).to(half)
                    for x in xs]  # noqa: E731
    A, Ab, Gh, Gbh = T(pb.W), T(pb.b), T(G), T(Gb)
    state = gc.path_init(chain, rule, A, Ab)
    eW, eb, estate = gc.path_update(chain, rule, state, A, Ab, Gh, Gbh)
    assert not rule_step_(gb.kernels_for(A[0]), chain, rule, gc.path_init(chain, rule, A, Ab),
                          [a.clone() for a in A], [a.clone() for a in Ab], Gh, Gbh)
    assert gb.path_update_(chain, rule, state, A, Ab, Gh, Gbh)
    for got, want, old in zip(A + Ab, list(eW) + list(eb), T(pb.W) + T(pb.b)):
        assert got.dtype == half and torch.equal(got, want) and not torch.equal(got, old)
    for got, want in zip(state.buffers, estate.buffers):
        assert all(torch.equal(g, w) for g, w in zip(got, want))


class ToZero(gc.ElementwiseRule):
    """Delta = V: every path lands exactly on 0, each tau path ratio is 0 (the epsilon rule)."""

    def coefficients(self, xp, count, dtype):
        return None

    def apply(self, xp, D, V, bufs, coef):
        return V, ()


def test_a_tau_ratio_of_zero_becomes_epsilon_as_in_the_core(fxp):
    pb = Problem(CHAIN, 6)
    ran, fast, core = _runs(fxp, CHAIN, pb, ToZero(), 1)
    assert ran
    eps = np.finfo(fxp.dtype_name).eps
    tau = CHAIN.tau_mask(1).reshape(pb.W[0].shape)
    assert_close(fast[0][0][tau], pb.W[0][tau] * eps, _tol(fxp), "tau edges of layer 1")
    # Every path lands within rounding of 0 (a tau path on eps V); above a tau ratio of eps
    # the weights hold that rounding divided by eps, which differs with the order of the
    # arithmetic (a GPU's fused kernels), so fast and core meet in path space.
    V0 = flat_paths(*gc.path_values(CHAIN, pb.W, pb.b))
    bound = 8 * eps * max(float(np.max(np.abs(v))) for v in V0)
    for W, b in (fast[:2], core[:2]):
        V1 = flat_paths(*gc.path_values(CHAIN, W, b))
        assert max(float(np.max(np.abs(v))) for v in V1) <= bound
    for l, (a, e) in enumerate(zip(fast[0], core[0]), start=1):
        free = CHAIN.free_mask(l)
        np.testing.assert_array_equal(a.reshape(free.shape)[free], e.reshape(free.shape)[free])


def test_non_finite_steps_and_non_contiguous_gradients_as_in_the_core(fxp):
    """Adam with ``eps = 0`` divides 0 by 0 wherever ``D = 0`` (a zero gradient row; free
    edges): those paths keep their values on the fast path as in the core; gradients that are
    not contiguous are read as they are."""
    pb = Problem(CHAIN, 9)
    rule = gc.adam_rule(0.01, eps=0.0)
    G, Gb = pb.grads()
    G = [g.copy() for g in G]
    G[3][0] = 0.0
    Gb = [None if g is None else g.copy() for g in Gb]
    Gb[3][0] = 0.0
    A, Ab = fxp.aslist(pb.W), fxp.aslist(pb.b)
    E, Eb = fxp.aslist(pb.W), fxp.aslist(pb.b)
    # not contiguous: the transpose (all axes reversed) of a contiguous transposed copy
    AG = [reverse_axes(fxp.asarray(np.ascontiguousarray(np.transpose(g)))) for g in G]
    state, es = gc.path_init(CHAIN, rule, A, Ab), gc.path_init(CHAIN, rule, E, Eb)
    assert rule_step_(gb.kernels_for(A[0]), CHAIN, rule, state, A, Ab, AG, fxp.aslist(Gb))
    E, Eb, es = gc.path_update(CHAIN, rule, es, E, Eb, fxp.aslist(G), fxp.aslist(Gb))
    fs = state._replace(count=state.count + 1)
    _assert_same(fxp, (fxp.tolist(A), fxp.tolist(Ab), fs), (fxp.tolist(E), fxp.tolist(Eb), es))
    assert all(np.all(np.isfinite(x)) for x in fxp.tolist(A) + fxp.tolist(Ab) if x is not None)


@pytest.mark.parametrize("sizes", [[5_000, 20, 2], [500, 20, 2]])
def test_rows_wider_than_a_block(fxp, sizes, monkeypatch):
    """A row of more elements than a block (one row per block) and blocks that hold a
    fraction of the layer's rows (blocks of 2^12 elements here); a finite step checks every
    block rather than applying the per-entry rules to it (``path_gradient`` then sees only
    the node vectors). The plan of CUDA tensors reads nothing on the host: every block
    takes the per-entry rules there."""
    import gsgd_backends.rule_step as rule_step

    monkeypatch.setattr(rule_step, "BLOCK", 1 << 12)
    seen = []
    real = rule_step.path_gradient
    monkeypatch.setattr(rule_step, "path_gradient",
                        lambda xp, a, *r: seen.append(a.ndim) or real(xp, a, *r))
    chain = gc.Chain.mlp(sizes)
    ran, fast, core = _runs(fxp, chain, Problem(chain, 1), RULES["adamw-amsgrad"](), 1)
    assert ran
    _assert_same(fxp, fast, core)
    if fxp.place == "cuda":   # the device plan reads nothing on the host: no block checked
        assert seen and max(seen) == 2, "the device plan skipped the per-entry rules"
    else:
        assert seen and max(seen) == 1, "a finite block took the per-entry rules"


def _fresh(ns, pb, rule, chain=CHAIN):
    """Weights, biases, their gradients and the rule's initial state, in ``ns``."""
    G, Gb = pb.grads()
    A, Ab, state = _state(ns, chain, rule, pb.W, pb.b, None, 0)
    return A, Ab, ns.aslist(G), ns.aslist(Gb), state


def _unchanged(ns, arrays, before) -> bool:
    return all(np.array_equal(a, b) for a, b in zip(ns.tolist(arrays), before))


class NotElementwise:
    """A path rule (:class:`gsgd_core.PathRule`) that is not an ElementwiseRule: its update
    may mix paths, so no block of one layer can be updated alone."""

    def init(self, values):
        return ()

    def update(self, grads, state, values):
        return tuple(-g for g in grads), state


def test_what_the_fast_path_cannot_take_is_handed_back_untouched(fxp):
    """``False``, and nothing written, for: a rule that is not elementwise, a state that is
    not a RuleState, buffers of another count or dtype than the weights' or that cannot be
    written in place, and weights that cannot be written in place. The core takes these."""
    pb = Problem(CHAIN, 3)
    rule = RULES["adam"]()
    A, Ab, G, Gb, state = _fresh(fxp, pb, rule)
    kernels, before = gb.kernels_for(A[0]), fxp.tolist(A)
    short = state._replace(buffers=tuple(bufs[:-1] for bufs in state.buffers))
    other = fxp.xp.float32 if fxp.is_f64 else fxp.xp.float64
    cast = state._replace(buffers=tuple(tuple(fxp.xp.astype(m, other) for m in bufs)
                                        for bufs in state.buffers))
    L = CHAIN.L
    strided = state._replace(buffers=tuple(tuple(
        reverse_axes(fxp.asarray(np.ascontiguousarray(np.transpose(fxp.to_numpy(m)))))
        for m in bufs[:L]) + tuple(bufs[L:]) for bufs in state.buffers))
    cases = [(NotElementwise(), state), (rule, tuple(state)), (rule, short), (rule, cast),
             (rule, strided)]
    for r, s in cases:
        assert rule_step_(kernels, CHAIN, r, s, A, Ab, G, Gb) is False, type(r).__name__
        assert _unchanged(fxp, A, before)
    frozen = [reverse_axes(fxp.asarray(np.ascontiguousarray(np.transpose(w)))) for w in pb.W]
    held = fxp.tolist(frozen)
    assert rule_step_(kernels, CHAIN, rule, state, frozen, Ab, G, Gb) is False
    assert _unchanged(fxp, frozen, held) and _unchanged(fxp, A, before)


def test_a_chain_without_biases_takes_none_for_its_bias_lists(fxp):
    chain = gc.Chain.from_shapes([(6, 5), (7, 6), (3, 7)], bias=False)
    pb = Problem(chain, 4)
    rule = RULES["adamw-amsgrad"]()
    A, _, G, _, state = _fresh(fxp, pb, rule, chain)
    E, _, _, _, es = _fresh(fxp, pb, rule, chain)
    assert rule_step_(gb.kernels_for(A[0]), chain, rule, state, A, None, G, None)
    E, _, es = gc.path_update(chain, rule, es, E, None, G, None)
    for i, (x, y) in enumerate(zip(fxp.tolist(A), fxp.tolist(E))):
        assert_close(x, y, _tol(fxp), f"weights[{i}]")


def test_a_given_plan_is_the_one_used(fxp, monkeypatch):
    pb = Problem(CHAIN, 5)
    rule = RULES["adam"]()
    A, Ab, G, Gb, state = _fresh(fxp, pb, rule)
    kernels = gb.kernels_for(A[0])
    plan, used = kernels.plan(CHAIN, A[0]), []
    real = type(plan).prepared
    monkeypatch.setattr(plan, "prepared", lambda *a: used.append(1) or real(plan, *a))
    assert rule_step_(kernels, CHAIN, rule, state, A, Ab, G, Gb, plan=plan)
    assert used == [1]


def test_given_column_sums_and_gradient_check_are_the_ones_used():
    """Sums equal to ``W * grad``'s give the core's step; sums off by one give another; a
    gradient check that is not finite hands the step back although the gradients are."""
    chain = gc.Chain.from_shapes([(6, 5), (7, 6), (3, 7)], bias=True)
    pb = Problem(chain, 6)
    rule = RULES["sgd-nesterov"]()  # linear in D (Adam's first step is about sign(D))
    G, Gb = pb.grads()
    sums = [(pb.W[l] * G[l]).sum(axis=(0, 2)) for l in (1, 2)]
    total = np.asarray(sum(g.sum() for g in G))

    def run(**given):
        W, b = [w.copy() for w in pb.W], [v.copy() for v in pb.b]
        state = gc.path_init(chain, rule, W, b)
        ran = rule_step_(gb.kernels_for(W[0]), chain, rule, state, W, b, G, Gb, **given)
        return ran, W + b

    E, Eb, _ = gc.path_update(chain, rule, gc.path_init(chain, rule, pb.W, pb.b), pb.W, pb.b,
                              G, Gb)
    ran, got = run(column_sums=sums, gradient_check=total)
    assert ran
    for x, y in zip(got, E + Eb):
        assert_close(x, y, 1e-12)
    ran, wrong = run(column_sums=[s + 1.0 for s in sums], gradient_check=total)
    assert ran and not all(np.allclose(x, y) for x, y in zip(wrong, E + Eb))
    ran, kept = run(column_sums=sums, gradient_check=np.asarray(np.nan))
    assert ran is False and all(np.array_equal(x, y) for x, y in zip(kept, pb.W + pb.b))


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_an_unchecked_bulk_equals_the_checked_one(lib):
    """``rule_bulk_(checked=False)`` (compiled kernels' path: every block by the per-entry
    rules, no host read) gives the checked path's numbers on finite blocks, bit for bit, on
    NumPy's kernels and torch's: so the size of a block, which decides only which entries
    share a check, changes none."""
    from array_api_compat import array_namespace

    from gsgd_backends.rule_step import rule_bulk_

    wrap = pytest.importorskip("torch").from_numpy if lib == "torch" else np.asarray
    # torch's reads into the host are counted (on a GPU each is a synchronisation)
    reading = from_repository("benchmarks.step_counts").HostReads if lib == "torch" else None
    rng = np.random.default_rng(7)
    n, p, k = 5, 4, 3
    rule = RULES["adamw-amsgrad"]()
    W, G = rng.standard_normal((n, p * k)), rng.standard_normal((n, p * k))
    coef = rule.coefficients(array_namespace(wrap(W)), wrap(np.asarray(2)), wrap(W).dtype)
    M = [np.abs(rng.standard_normal((n, p * k))) for _ in rule.buffers]
    F, B, rho = (np.exp(rng.standard_normal(m)) for m in (n, p, p))
    out, reads = [], []
    for checked in (True, False):
        w, m = wrap(W.copy()), [wrap(x.copy()) for x in M]
        with reading() if reading else contextlib.nullcontext() as counted:
            rule_bulk_(gb.kernels_for(w), rule, coef, w, wrap(G), m, F=wrap(F),
                       B_prev=wrap(B), rho=wrap(rho), checked=checked)
        out.append([np.asarray(w)] + [np.asarray(x) for x in m])
        reads.append(counted and counted.count.total())
    assert not np.array_equal(out[0][0], W)
    if reading:
        assert reads[0] > 0 and reads[1] == 0, reads
    for a, b in zip(*out):
        np.testing.assert_array_equal(a, b)


def test_weights_in_their_frameworks_layout_step_as_the_chains_views(fxp):
    """Conv weights as a framework holds them, ``(n, p, kh, kw)``, and their gradients so
    too: the step writes what the core writes on the chain's ``(n, p, k)`` views."""
    pb = Problem(CHAIN, 3)
    rule = RULES["adamw-amsgrad"]()
    layouts = [(4, 3, 3, 3), (5, 4, 2, 2), (6, 5, 4), (3, 6, 1)]
    G, Gb = pb.grads()
    A = [fxp.asarray(w.reshape(s)) for w, s in zip(pb.W, layouts)]
    Ab = fxp.aslist(pb.b)
    state = gc.path_init(CHAIN, rule, A, Ab)
    assert rule_step_(gb.kernels_for(A[0]), CHAIN, rule, state, A, Ab,
                      [fxp.asarray(g.reshape(s)) for g, s in zip(G, layouts)], fxp.aslist(Gb))
    E, Eb, _ = gc.path_update(CHAIN, rule, gc.path_init(CHAIN, rule, fxp.aslist(pb.W), Ab),
                              fxp.aslist(pb.W), fxp.aslist(pb.b), fxp.aslist(G), fxp.aslist(Gb))
    for i, (a, e, s) in enumerate(zip(fxp.tolist(A), fxp.tolist(E), layouts)):
        assert a.shape == s
        assert_close(a.reshape(e.shape), e, _tol(fxp), f"weights[{i}]")


def test_a_gradient_of_the_wrong_shape_is_refused_before_anything_is_written():
    pb = Problem(CHAIN, 3)
    rule = RULES["adam"]()
    G, Gb = pb.grads()
    G[2] = np.ascontiguousarray(G[2][:, :, :2])
    A, Ab = [w.copy() for w in pb.W], [None if b is None else b.copy() for b in pb.b]
    state = gc.path_init(CHAIN, rule, A, Ab)
    with pytest.raises(ValueError, match=r"^layer 3: grads\[2\] has shape \(6, 5, 2\), but the "
                                         r"weight has shape \(6, 5, 4\)$"):
        rule_step_(gb.kernels_for(A[0]), CHAIN, rule, state, A, Ab, G, Gb)
    assert all(np.array_equal(a, w) for a, w in zip(A, pb.W))


class Blowup(gc.ElementwiseRule):
    """Delta = V * 1e308: finite where |V| < 1.8, and its quotient by F overflows wherever
    F is small (a bias's new value ``b - Delta / F`` is then not finite)."""

    def coefficients(self, xp, count, dtype):
        return None

    def apply(self, xp, D, V, bufs, coef):
        return V * 1e308, ()


def test_a_bias_whose_new_value_overflows_keeps_its_value_as_in_the_core():
    pb = Problem(CHAIN, 8)
    W = [0.1 * w for w in pb.W]
    pb.b = [None if b is None else np.full_like(b, 4.0) for b in pb.b]
    numpy64 = next(ns for ns in available_namespaces() if ns.id == "numpy-float64")
    ran, fast, core = _runs(numpy64, CHAIN, pb, Blowup(), 1, W=W)
    assert ran
    for i, (got, want) in enumerate(zip(fast[1], core[1])):
        if want is not None:
            np.testing.assert_array_equal(got, want, f"biases[{i}]")
    assert any(np.all(b == 4.0) for b in fast[1][:-1] if b is not None), "no bias was kept"
