"""Any rule in path space (gsgd_core.path_update): the SGD rule is G-SGD, G-Adam(W) is
torch's Adam(W) run on the basis-path values, allocation moves path values by exactly -Delta,
rescaled twins coincide (and plain Adam's do not), and the numerics rules hold."""

import array_api_compat
import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import gsgd_core as gc
from gsgd_core import reference as ref
from _conditioning import (assert_paths_close, flat_paths, gradient_rounding, ill_conditioned,
                          step_tolerance)
from _helpers import Problem, assert_all_close, assert_close
from _nets import output
from _strategies import chains, examples, seeds

SGD_HYPERS = [dict(lr=0.05), dict(lr=0.05, weight_decay=1e-2), dict(lr=0.02, momentum=0.9),
              dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=1e-3),
              dict(lr=0.02, momentum=0.5, dampening=0.3)]
ADAM_RULES = {"adam": lambda eps=1e-8: gc.adam_rule(0.01, eps=eps),
              "adam-l2-amsgrad": lambda eps=1e-8: gc.adam_rule(
                  0.01, betas=(0.8, 0.99), eps=eps, weight_decay=0.1, amsgrad=True),
              "adamw": lambda eps=1e-8: gc.adamw_rule(0.01, eps=eps, weight_decay=0.1)}

#: Rules built from a learning rate alone, for the tests of how ``lr`` reaches the step.
LR_RULES = {"sgd": gc.sgd_rule, "sgd-momentum": lambda lr: gc.sgd_rule(lr, momentum=0.9),
            "adam": gc.adam_rule}


def _ids(h):
    return ",".join(f"{k}={v}" for k, v in h.items())


@pytest.mark.parametrize("hyper", SGD_HYPERS, ids=_ids)
@settings(max_examples=examples(5))
@given(chain=chains(max_depth=4), seed=seeds)
def test_sgd_rule_is_gsgd_update(hxp, hyper, chain, seed):
    """``path_update`` with ``sgd_rule`` gives ``gsgd_update``'s numbers over 5 steps
    (to rounding: ``lr*D/(FB)`` against ``lr*(D/(FB))``)."""
    pb = Problem(chain, seed)
    rule = gc.sgd_rule(**hyper)
    W, b = hxp.aslist(pb.W), hxp.aslist(pb.b)
    W2, b2 = W, b
    state = gc.gsgd_init(chain, W, b)
    rstate = gc.path_init(chain, rule, W, b)
    for _ in range(5):
        G, Gb = pb.grads(hxp.tolist(W), hxp.tolist(b))
        W, b, state = gc.gsgd_update(chain, state, W, b, hxp.aslist(G), hxp.aslist(Gb), **hyper)
        W2, b2, rstate = gc.path_update(chain, rule, rstate, W2, b2, hxp.aslist(G),
                                        hxp.aslist(Gb))
        assert_all_close(hxp.tolist(W2), hxp.tolist(W), hxp.rtol, "weights")
        assert_all_close(hxp.tolist(b2), hxp.tolist(b), hxp.rtol, "biases")
    assert int(hxp.to_numpy(rstate.count)) == 5
    for a in W2 + [x for x in b2 if x is not None]:
        assert a.dtype == hxp.dtype


class Recording:
    """A rule of the test's own: a fixed random step, remembered (the protocol, duck-typed)."""

    def __init__(self, rng, xp, scale):
        self.rng, self.xp, self.scale, self.deltas = rng, xp, scale, None

    def init(self, values):
        return ()

    def update(self, grads, state, values):
        self.deltas = tuple(self.xp(self.scale * self.rng.standard_normal(v.shape))
                            for v in values)
        return self.deltas, state


@given(chain=chains(), seed=seeds, scale=st.sampled_from([1e-3, 0.1, 1.0]))
def test_allocation_moves_path_values_by_exactly_minus_delta(hxp, chain, seed, scale):
    """Whatever the rule returns, the new basis-path values are ``V - Delta`` and the free
    weights are unchanged bit for bit; :func:`gsgd_core.allocate` alone does the same."""
    pb = Problem(chain, seed)
    G, Gb = pb.grads()
    W, b = hxp.aslist(pb.W), hxp.aslist(pb.b)
    rule = Recording(pb.rng, hxp.asarray, scale)
    W2, b2, _ = gc.path_update(chain, rule, (), W, b, hxp.aslist(G), hxp.aslist(Gb))
    delta = [hxp.to_numpy(d) for d in rule.deltas]
    bias_delta = iter(delta[chain.L:])
    bias_delta = [None if x is None else next(bias_delta) for x in pb.b]
    V, Vb = gc.path_values(chain, W, b)
    expected = ref.to_basis(chain, [v - d for v, d in zip(hxp.tolist(V), delta)],
                            [None if v is None else v - d
                             for v, d in zip(hxp.tolist(Vb), bias_delta)])
    if np.any(expected[ref.to_basis(chain, hxp.tolist(V), hxp.tolist(Vb)) != 0] == 0):
        return  # a tau path landing exactly on 0: the documented epsilon case
    W3, b3 = gc.allocate(chain, W, b, [hxp.asarray(d) for d in delta[:chain.L]],
                         [hxp.asarray(d) for d in bias_delta])
    for Wn, bn in ((W2, b2), (W3, b3)):
        V2, Vb2 = gc.path_values(chain, Wn, bn)
        assert_close(ref.to_basis(chain, hxp.tolist(V2), hxp.tolist(Vb2)), expected,
                     hxp.rtol, "V' = V - Delta")
        for l, (w, w2) in enumerate(zip(hxp.tolist(W), hxp.tolist(Wn)), start=1):
            free = chain.free_mask(l)
            assert np.array_equal(w.reshape(free.shape)[free], w2.reshape(free.shape)[free])


def _torch_reference(name):
    """torch's own optimizer for each rule of ADAM_RULES."""
    if name == "adam":
        return lambda p: torch.optim.Adam(p, lr=0.01)
    if name == "adam-l2-amsgrad":
        return lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.99), weight_decay=0.1,
                                          amsgrad=True)
    return lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1)


@pytest.mark.parametrize("name", list(ADAM_RULES))
@settings(max_examples=examples(10))
@given(chain=chains(max_depth=4), seed=seeds)
def test_adam_rule_equals_adam_run_on_the_path_values(name, chain, seed):
    """G-Adam(W) is ``torch.optim.Adam(W)`` run on the basis-path values with the path
    gradients as gradients: after each of 6 steps the path values of our weights equal
    torch's parameters (float64; torch's Adam is the independent reference)."""
    pb = Problem(chain, seed)
    rule = ADAM_RULES[name]()
    W, b = pb.W, pb.b
    state = gc.path_init(chain, rule, W, b)
    V, Vb = gc.path_values(chain, W, b)
    params = [torch.tensor(v, requires_grad=True) for v in V + [x for x in Vb if x is not None]]
    opt = _torch_reference(name)(params)
    for _ in range(6):
        G, Gb = pb.grads(W, b)
        D, Db = gc.icr(chain, W, b, G, Gb)
        for p, d in zip(params, D + [x for x in Db if x is not None]):
            p.grad = torch.tensor(d)
        opt.step()
        W, b, state = gc.path_update(chain, rule, state, W, b, G, Gb)
        V, Vb = gc.path_values(chain, W, b)
        ours = V + [x for x in Vb if x is not None]
        for l, (p, v) in enumerate(zip(params, ours)):
            expected = p.detach().numpy()
            if l < chain.L:  # free edges own no path: 0 in V, 0 (never moved) in torch's
                expected = np.where(chain.free_mask(l + 1).reshape(v.shape), 0.0, expected)
            assert_close(v, expected, 1e-9, f"path values, array {l}")


def _twins(ns, chain, pb, make_rule, steps):
    """G-Adam from ``w`` and from a random rescaling of it: per run, host copies of the
    weights, biases and rule state before the first step and after each."""
    scales = gc.random_rescaling(chain, pb.rng, 1.0)
    Wt, bt = gc.rescale(chain, pb.W, pb.b, scales)
    runs = []
    for W, b in ((pb.W, pb.b), (Wt, bt)):
        W, b = ns.aslist(W), ns.aslist(b)
        rule = make_rule()
        state = gc.path_init(chain, rule, W, b)
        run = []
        for _ in range(steps + 1):
            run.append((ns.tolist(W), ns.tolist(b),
                        tuple(tuple(ns.tolist(list(x))) for x in state.buffers)))
            if len(run) <= steps:
                G, Gb = pb.grads(ns.tolist(W), ns.tolist(b))
                W, b, state = gc.path_update(chain, rule, state, W, b, ns.aslist(G),
                                             ns.aslist(Gb))
        runs.append(run)
    return runs, scales


def _step_bound(chain, pb, rule, before, count):
    """:func:`_conditioning.step_tolerance` of the rule's step from ``before`` (``(weights,
    biases, buffers)``): per path array (layers first), how far rounding may move ``Delta``.
    Adam's ``lr / eps`` slope turns the rounding of a ``D_tau`` that cancels (a degenerate
    skeleton's, e.g. every tau edge from one unit) into steps that part the twins."""
    W, b, buffers = before
    dtype = W[0].dtype
    G, Gb = pb.grads(W, b)
    G = [np.asarray(g, dtype=dtype) for g in G]
    Gb = [None if g is None else np.asarray(g, dtype=dtype) for g in Gb]
    D, dD, V = gradient_rounding(chain, W, b, G, Gb)
    return step_tolerance(rule, count, D, dD, V, buffers)[0]


@pytest.mark.parametrize("name", list(ADAM_RULES))
@settings(max_examples=examples(8))
@given(chain=chains(max_depth=4), seed=seeds)
def test_adam_trajectories_of_rescaled_twins_coincide(hxp, name, chain, seed):
    """G-Adam / G-AdamW from ``w`` and from a random rescaling ``g(w)`` (scales
    ``exp(N(0, 1))``): after each step the twins have the same path values, their weights
    are still ``g``-related and the network outputs agree (float64 over 10 steps to 1e-7,
    float32 over 3 to 1e-3).

    Adam divides by ``sqrt(v)``, so it turns a path gradient that is pure rounding noise (a
    ``D`` that vanishes analytically, e.g. on the chains of width 1 drawn here) into a step
    of size up to ``lr`` whose sign is the noise's. In float32 that noise (~1e-7 of the
    summed terms) is above ``eps = 1e-8``, so float32 runs use ``eps = 1e-4``; in float64
    it is far below the default, yet it can still be the whole gradient of a tau path.
    The twins' rounding differs, so path values are compared to the rule's response to it
    (:func:`_step_bound`) summed over the steps, times ``1 + 2 / (1 - beta1)``: a change of
    ``D`` at one step enters ``m`` (and ``v``) and reaches the later steps' ``Delta`` with
    total weight at most ``1 / (1 - beta1^(k+1))`` each. Weights and outputs are compared
    while that sum is below rounding; every comparison stops where a step is ill
    conditioned (:func:`_conditioning.ill_conditioned`)."""
    pb = Problem(chain, seed)
    steps, tol, eps = (10, 1e-7, 1e-8) if hxp.is_f64 else (3, 1e-3, 1e-4)
    rule = ADAM_RULES[name](eps)
    (ours, twin), scales = _twins(hxp, chain, pb, lambda: ADAM_RULES[name](eps), steps)
    carry = 1 + 2 / (1 - rule.betas[0])
    bound, compared = None, 0
    for count in range(steps):
        step = _step_bound(chain, pb, rule, ours[count], count)
        V_old, V_new = (gc.path_values(chain, *ours[k][:2]) for k in (count, count + 1))
        if ill_conditioned(chain, step, V_old[0], V_new[0]):
            break
        bound = step if bound is None else [a + t for a, t in zip(bound, step)]
        compared = count + 1
        (W, b, _), (W2, b2, _) = ours[compared], twin[compared]
        for i, (a, e, t) in enumerate(zip(flat_paths(*gc.path_values(chain, W2, b2)),
                                          flat_paths(*V_new), bound)):
            assert_paths_close(a, e, tol, carry * np.reshape(t, np.shape(e)),
                               f"twin path values [{i}], step {compared}")
        if any(float(np.max(t, initial=0.0)) > 1e-2 * tol for t in bound):
            continue
        We, be = gc.rescale(chain, [w.astype(np.float64) for w in W],
                            [None if v is None else v.astype(np.float64) for v in b], scales)
        assert_all_close(W2, We, tol, f"twin weights, step {compared}")
        assert_all_close(b2, be, tol, f"twin biases, step {compared}")
        assert_close(output(chain, W2, b2, pb.x), output(chain, W, b, pb.x), tol,
                     f"outputs, step {compared}")
    assume(compared > 0)  # nothing to compare


def test_plain_adam_trajectories_of_rescaled_twins_differ():
    """The control: Adam on the weights does not commute with rescaling, so the test above
    can fail."""
    chain = gc.Chain.mlp([4, 5, 5, 3])
    pb = Problem(chain, 7)
    Wt, bt = gc.rescale(chain, pb.W, pb.b, gc.random_rescaling(chain, pb.rng, 1.0))
    outs = []
    for W, b in ((pb.W, pb.b), (Wt, bt)):
        params = [torch.tensor(a, requires_grad=True) for a in W + b]
        opt = torch.optim.Adam(params, lr=0.01)
        for _ in range(10):
            G, Gb = pb.grads([p.detach().numpy() for p in params[:3]],
                             [p.detach().numpy() for p in params[3:]])
            for p, g in zip(params, G + Gb):
                p.grad = torch.tensor(g)
            opt.step()
        outs.append(output(chain, [p.detach().numpy() for p in params[:3]],
                           [p.detach().numpy() for p in params[3:]], pb.x))
    assert np.max(np.abs(outs[0] - outs[1])) > 1e-3


# ------------------------------------------------------------------ numerics (DESIGN §6)
def _problem(xp_ns, chain=None, seed=3):
    chain = chain or gc.Chain.mlp([3, 4, 4, 2])
    pb = Problem(chain, seed)
    G, Gb = pb.grads()
    return chain, pb, hxp_lists(xp_ns, pb, G, Gb)


def hxp_lists(ns, pb, G, Gb):
    return ns.aslist(pb.W), ns.aslist(pb.b), ns.aslist(G), ns.aslist(Gb)


@pytest.mark.parametrize("layer", [0, 2])
@pytest.mark.parametrize("what", ["weight", "bias"])
def test_non_finite_gradient_skips_the_step_and_keeps_the_state(xp, layer, what):
    chain, pb, (W, b, G, Gb) = _problem(xp)
    rule = gc.adam_rule(0.01)
    state = gc.path_init(chain, rule, W, b)
    W, b, state = gc.path_update(chain, rule, state, W, b, G, Gb)  # a state with history
    bad = [xp.to_numpy(g).copy() for g in (G if what == "weight" else Gb)]
    bad[layer].reshape(-1)[0] = np.nan
    G2, Gb2 = (xp.aslist(bad), Gb) if what == "weight" else (G, xp.aslist(bad))
    W2, b2, state2 = gc.path_update(chain, rule, state, W, b, G2, Gb2)
    for new, old in zip(W2 + b2, W + b):
        assert np.array_equal(xp.to_numpy(new), xp.to_numpy(old))
    assert int(xp.to_numpy(state2.count)) == 1
    for new, old in zip(state2.buffers, state.buffers):
        for n, o in zip(new, old):
            assert np.array_equal(xp.to_numpy(n), xp.to_numpy(o))


def test_a_path_whose_step_is_not_finite_keeps_its_value(xp):
    """Adam with ``eps = 0`` divides 0 by 0 on paths with ``D = 0`` (here: every path of
    the top layer's first row, whose gradient is 0): those paths keep their values, the
    others move as ``V - Delta``."""
    chain, pb, (W, b, G, Gb) = _problem(xp)
    G_host = [xp.to_numpy(g).copy() for g in G]
    G_host[2][0] = 0.0
    Gb_host = [xp.to_numpy(g).copy() for g in Gb]
    Gb_host[2][0] = 0.0
    rule = gc.adam_rule(0.01, eps=0.0)
    state = gc.path_init(chain, rule, W, b)
    W2, b2, state = gc.path_update(chain, rule, state, W, b, xp.aslist(G_host),
                                   xp.aslist(Gb_host))
    V, Vb = (xp.tolist(a) for a in gc.path_values(chain, W, b))
    V2, Vb2 = (xp.tolist(a) for a in gc.path_values(chain, W2, b2))
    assert all(np.all(np.isfinite(a)) for a in xp.tolist(W2) + xp.tolist(b2))
    assert_close(V2[2][0], V[2][0], xp.rtol, "top row kept")
    assert_close(Vb2[2][0], Vb[2][0], xp.rtol, "top bias kept")
    moved = np.abs(V2[2][1] - V[2][1])
    free = chain.free_mask(3)[1, :, 0]
    assert np.all(moved[~free] > 1e-3)  # |Delta| = lr on the first step where D != 0


class StepToZero:
    """Delta = V on every path: each tau path ratio is exactly 0."""

    def init(self, values):
        return ()

    def update(self, grads, state, values):
        return tuple(values), state


def test_tau_ratio_of_zero_becomes_epsilon(xp):
    chain, pb, (W, b, G, Gb) = _problem(xp)
    W2, b2, _ = gc.path_update(chain, StepToZero(), (), W, b, G, Gb)
    eps = np.finfo(xp.dtype_name).eps
    W1, W1n = xp.to_numpy(W[0]), xp.to_numpy(W2[0])
    tau = chain.tau_mask(1).reshape(W1.shape)
    assert_close(W1n[tau], W1[tau] * eps, xp.rtol, "tau edges of layer 1: W * eps")
    assert all(np.all(np.isfinite(a)) for a in xp.tolist(W2) + xp.tolist(b2))


# ------------------------------------------------------------------ clear errors
@pytest.mark.parametrize("make, message", [
    (lambda: gc.adam_rule(-1.0), "lr must be finite and >= 0, got -1.0"),
    (lambda: gc.adamw_rule(eps=-1.0), "eps must be finite and >= 0, got -1.0"),
    (lambda: gc.adam_rule(weight_decay=-1.0), "weight_decay must be finite and >= 0, got -1.0"),
    (lambda: gc.adam_rule(betas=(np.asarray(0.9), 0.9)),
     "betas[0] must be a Python number (only lr may be an array), got array(0.9)"),
    (lambda: gc.adam_rule(eps=np.asarray(1e-8)),
     "eps must be a Python number (only lr may be an array), got array(1.e-08)"),
    (lambda: gc.adam_rule(betas=(0.9, 1.5)), "betas[1] must be finite and in [0, 1], got 1.5"),
])
def test_adam_rules_refuse_bad_hyperparameters_naming_them(make, message):
    with pytest.raises(ValueError) as err:
        make()
    assert str(err.value) == message


def test_rules_refuse_bad_hyperparameters():
    with pytest.raises(ValueError, match=r"betas\[1\]"):
        gc.adam_rule(betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="betas must be a pair"):
        gc.adam_rule(betas=(0.9,))
    with pytest.raises(ValueError, match="eps"):
        gc.adamw_rule(eps=-1e-8)
    with pytest.raises(ValueError, match="momentum"):
        gc.sgd_rule(0.1, momentum=-0.5)
    with pytest.raises(ValueError, match=r"^momentum must be a Python number \(only lr may be "
                                         r"an array\), got array\(0\.9\)$"):
        gc.sgd_rule(0.1, momentum=np.asarray(0.9))
    with pytest.raises(ValueError, match="^nesterov needs momentum > 0 and dampening = 0"):
        gc.sgd_rule(0.1, nesterov=True)
    with pytest.raises(ValueError, match="^weight_decay must be finite and >= 0"):
        gc.sgd_rule(0.1, weight_decay=-1e-3)
    with pytest.raises(ValueError, match="^dampening must be finite and in"):
        gc.sgd_rule(0.1, momentum=0.9, dampening=1.5)


def test_rule_factories_build_the_rule_they_name():
    """Every argument of the factories reaches the rule: AdamW is Adam with decoupled decay."""
    assert gc.sgd_rule(0.1, 0.9, 0.0, True, 1e-3) == gc.SGDRule(0.1, 0.9, 0.0, True, 1e-3)
    assert gc.adam_rule(0.1, (0.8, 0.9), 1e-6, 1e-3, amsgrad=True) == gc.AdamRule(
        0.1, (0.8, 0.9), 1e-6, 1e-3, decoupled=False, amsgrad=True)
    assert gc.adamw_rule(0.1, [0.8, 0.9], 1e-6, 1e-3, amsgrad=True) == gc.AdamRule(
        0.1, (0.8, 0.9), 1e-6, 1e-3, decoupled=True, amsgrad=True)
    assert gc.adamw_rule().weight_decay == 1e-2 and not gc.adamw_rule().amsgrad


@pytest.mark.parametrize("make", list(LR_RULES.values()), ids=list(LR_RULES))
def test_an_array_learning_rate_steps_as_the_same_python_number(xp, make):
    """``lr`` as a float64 0-d array (a schedule's, traced under ``jit``) is cast to the
    paths' dtype: the step is that of the same ``lr`` given as a Python number, to the last
    bit for SGD. Adam divides ``lr`` by ``1 - beta1**t``, which torch computes in double
    precision for a Python number: there the two may differ by an ulp."""
    chain = gc.Chain.mlp([4, 5, 3])
    pb = Problem(chain, 2)
    G, Gb = pb.grads()
    W, b = xp.aslist(pb.W), xp.aslist(pb.b)
    got = []
    for lr in (0.1, xp.xp.asarray(0.1, dtype=xp.xp.float64, device=xp.device)):
        rule = make(lr)
        state = gc.path_init(chain, rule, W, b)
        W2, b2, _ = gc.path_update(chain, rule, state, W, b, xp.aslist(G), xp.aslist(Gb))
        got.append(xp.tolist(W2 + b2))
    ulps = 4 if isinstance(make(0.1), gc.AdamRule) else 0
    for a, e in zip(*got):
        assert a.dtype == e.dtype == np.dtype(xp.dtype_name)
        np.testing.assert_allclose(a, e, rtol=ulps * np.finfo(a.dtype).eps, atol=0)


def test_path_update_refuses_what_is_not_a_rule_or_its_state():
    chain = gc.Chain.mlp([3, 4, 2])
    pb = Problem(chain, 0)
    G, Gb = pb.grads()
    with pytest.raises(ValueError, match=r"\(gsgd_core.PathRule\), got object$"):
        gc.path_update(chain, object(), None, pb.W, pb.b, G, Gb)
    with pytest.raises(ValueError, match=r"PathRule\), got function$"):
        gc.path_init(chain, gc.adam_rule, pb.W, pb.b)  # the factory, not a rule
    with pytest.raises(ValueError, match=r"^AdamRule needs the state of its own init\(\), with "
                                         r"buffers \('exp_avg', 'exp_avg_sq'\)$"):
        gc.path_update(chain, gc.adam_rule(), gc.gsgd_init(chain, pb.W, pb.b), pb.W, pb.b, G, Gb)
    sgd_state = gc.path_init(chain, gc.sgd_rule(0.1, momentum=0.9), pb.W, pb.b)
    with pytest.raises(ValueError, match=r"^AdamRule needs the state of its own init\(\)"):
        gc.path_update(chain, gc.adam_rule(), sgd_state, pb.W, pb.b, G, Gb)  # 1 buffer, not 2
    with pytest.raises(ValueError, match="layer 2"):
        gc.path_update(chain, gc.adam_rule(), None, pb.W, pb.b, [G[0], G[1][:, :2]], Gb)

    class Short(StepToZero):
        def update(self, grads, state, values):
            return tuple(values[:1]), state

    with pytest.raises(ValueError, match="returned 1 arrays for 4"):
        gc.path_update(chain, Short(), (), pb.W, pb.b, G, Gb)
    with pytest.raises(ValueError, match=r"layer 2: the layer has a bias but "
                                         r"bias_delta\[1\] is None"):
        gc.allocate(chain, pb.W, pb.b, G, [Gb[0], None])
    with pytest.raises(ValueError, match=r"^layer 1: the layer has a bias but "
                                         r"bias_delta\[0\] is None$"):
        gc.allocate(chain, pb.W, pb.b, G, [None, Gb[1]])
    with pytest.raises(ValueError, match=r"^layer 1: delta\[0\] is None; every layer needs one$"):
        gc.allocate(chain, pb.W, pb.b, [None, G[1]], Gb)


def test_half_precision_is_computed_in_float32_and_written_back():
    chain = gc.Chain.mlp([3, 4, 2])
    pb = Problem(chain, 0)
    G, Gb = pb.grads()
    half = [torch.tensor(a, dtype=torch.float16) for a in pb.W + pb.b + G + Gb]
    W, b, Gh, Gbh = half[:2], half[2:4], half[4:6], half[6:]
    rule = gc.adam_rule(0.01)
    state = gc.path_init(chain, rule, W, b)
    assert state.buffers[0][0].dtype == torch.float32
    W2, b2, state = gc.path_update(chain, rule, state, W, b, Gh, Gbh)
    assert all(a.dtype == torch.float16 for a in W2 + b2)
    W64, b64, _ = gc.path_update(chain, rule, gc.path_init(chain, rule, pb.W, pb.b), pb.W,
                                 pb.b, G, Gb)
    assert_all_close([a.float().numpy() for a in W2], W64, 5e-3, "weights")


@pytest.mark.parametrize("change, message", [
    (lambda d, db: ([d[0], d[1][:, :2]], db),
     r"layer 2: delta\[1\] has shape \(2, 2, 1\), but the weight has shape \(2, 4, 1\)"),
    (lambda d, db: (d[:1], db), "delta has 1 entries, but the chain has 2 layers"),
    (lambda d, db: (d, [db[0], db[1][:1]]),
     r"layer 2: bias_delta\[1\] has shape \(1,\), but the bias has shape \(2,\)"),
    (lambda d, db: (d, db[:1]), "bias_delta has 1 entries, but the chain has 2 layers")])
def test_allocate_refuses_deltas_of_the_wrong_shape_or_count(change, message):
    """``delta`` and ``bias_delta`` are checked as the weights and biases are, with
    messages that name them, before any array is touched."""
    chain = gc.Chain.mlp([3, 4, 2])
    pb = Problem(chain, 0)
    with pytest.raises(ValueError, match=f"^{message}$"):
        gc.allocate(chain, pb.W, pb.b, *change(pb.W, pb.b))


def test_allocate_keeps_a_path_whose_delta_is_not_finite(xp):
    chain, pb, (W, b, _, _) = _problem(xp)
    delta = [np.full(w.shape, 1e-3) for w in pb.W]
    bias_delta = [np.full(x.shape, 1e-3) for x in pb.b]
    delta[2][1, 2] = np.inf
    bias_delta[1][0] = np.nan
    W2, b2 = gc.allocate(chain, W, b, xp.aslist(delta), xp.aslist(bias_delta))
    V, Vb = (xp.tolist(a) for a in gc.path_values(chain, W, b))
    V2, Vb2 = (xp.tolist(a) for a in gc.path_values(chain, W2, b2))
    assert all(np.all(np.isfinite(a)) for a in xp.tolist(W2) + xp.tolist(b2))
    assert_close(V2[2][1, 2], V[2][1, 2], xp.rtol, "path with an infinite delta kept")
    assert_close(Vb2[1][0], Vb[1][0], xp.rtol, "bias path with a NaN delta kept")
    assert_close(Vb2[1][1], Vb[1][1] - 1e-3, xp.rtol, "the others move by -delta")


def test_allocate_without_biases_needs_no_bias_delta(xp):
    chain = gc.Chain.mlp([3, 4, 2], bias=False)
    pb = Problem(chain, 0)
    W = xp.aslist(pb.W)
    delta = [np.full(w.shape, 1e-3) for w in pb.W]
    W2, b2 = gc.allocate(chain, W, None, xp.aslist(delta))
    assert b2 == [None, None]
    V = [xp.to_numpy(v) for v in gc.path_values(chain, W)[0]]
    V2 = [xp.to_numpy(v) for v in gc.path_values(chain, W2)[0]]
    for l, (v, v2) in enumerate(zip(V, V2), start=1):
        moved = ~chain.free_mask(l).reshape(v.shape)
        assert_close(v2[moved], v[moved] - 1e-3, xp.rtol, f"layer {l}")


@pytest.mark.parametrize("rule", [gc.sgd_rule(0.1, momentum=0.9), gc.adam_rule(amsgrad=True)],
                         ids=["sgd-momentum", "adam-amsgrad"])
def test_a_rules_state_is_made_in_the_paths_dtype_and_device(xp, rule):
    """``init``: one zero buffer per name and path array, shaped, typed and placed like it,
    and an int32 count of 0 on the same device; one array of paths is enough."""
    for count in (1, 2):
        values = tuple(xp.asarray(np.ones((3, 2 + i))) for i in range(count))
        state = rule.init(values)
        assert len(state.buffers) == len(rule.buffers)
        for buffer in state.buffers:
            assert len(buffer) == count
            for b, v in zip(buffer, values):
                assert b.dtype == xp.dtype and tuple(b.shape) == tuple(v.shape)
                assert array_api_compat.device(b) == array_api_compat.device(v)
                assert not np.any(xp.to_numpy(b))
        assert state.count.dtype == xp.xp.int32 and int(xp.to_numpy(state.count)) == 0
        assert array_api_compat.device(state.count) == array_api_compat.device(values[0])
        deltas, state = rule.update(values, state, values)
        assert [d.dtype for d in deltas] == [xp.dtype] * count
        assert int(xp.to_numpy(state.count)) == 1


@pytest.mark.parametrize("rule", [gc.sgd_rule(0.1), gc.sgd_rule(0.1, momentum=0.9),
                                  gc.adam_rule(0.1), gc.adamw_rule(0.1, weight_decay=0.0)],
                         ids=["sgd", "sgd-momentum", "adam", "adamw-no-decay"])
def test_without_weight_decay_a_rules_step_does_not_read_the_path_values(xp, rule):
    """torch's optimizers add nothing for ``weight_decay = 0``: two paths of one gradient,
    one of value 1 and one whose value overflowed to ``inf``, take the same finite step and
    keep the same buffers, over two steps. ``apply`` (what a fast path calls on a subset of
    the paths) returns one new buffer per name in ``rule.buffers``."""
    values = (xp.asarray(np.array([1.0, np.inf])),)
    grads = (xp.asarray(np.array([0.5, 0.5])),)
    state = rule.init(values)
    for _ in range(2):
        (delta,), state = rule.update(grads, state, values)
        delta = xp.to_numpy(delta)
        assert np.isfinite(delta).all() and delta[0] == delta[1]
        for (buffer,) in state.buffers:
            assert xp.to_numpy(buffer)[0] == xp.to_numpy(buffer)[1]
    coef = rule.coefficients(xp.xp, state.count, values[0].dtype)
    bufs = tuple(b[0] for b in state.buffers)
    assert len(rule.apply(xp.xp, grads[0], values[0], bufs, coef)[1]) == len(rule.buffers)


def test_a_rule_refuses_gradients_and_values_of_two_namespaces():
    values = (torch.ones(3, 2),)
    for rule in (gc.sgd_rule(0.1, momentum=0.9), gc.adam_rule()):
        for grads, vals in (((np.ones((3, 2)),), values), (values, (np.ones((3, 2)),))):
            with pytest.raises(TypeError, match="Multiple namespaces"):
                rule.update(grads, rule.init(vals), vals)


@pytest.mark.parametrize("make", list(LR_RULES.values()), ids=list(LR_RULES))
def test_a_learning_rate_traced_under_jax_jit_steps_as_the_number(make):
    """A schedule's ``lr`` under ``jax.jit`` is a tracer: the rule takes it as an array."""
    jax = pytest.importorskip("jax")
    chain = gc.Chain.mlp([4, 5, 3])
    W, b, G, Gb = Problem(chain, 2).in_jax()

    def step(lr):
        rule = make(lr)
        return gc.path_update(chain, rule, gc.path_init(chain, rule, W, b), W, b, G, Gb)[:2]

    got, want = jax.jit(step)(0.1), step(0.1)
    for a, e in zip(got[0] + got[1], want[0] + want[1]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-12, atol=0)
