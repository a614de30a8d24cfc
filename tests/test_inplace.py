"""The in-place layer (gsgd_backends) for path-space rules and its generic path: what the fast
path declines is computed by the core and written back whole (weights, biases, every array
of the state), and the helpers write what they promise."""

import numpy as np
import pytest

import gsgd_backends as gb
import gsgd_core as gc
from _helpers import Problem, assert_close

CHAIN = gc.Chain.mlp([3, 5, 4, 2])


def _data(ns, seed=0):
    pb = Problem(CHAIN, seed)
    G, Gb = pb.grads()
    return pb, ns.aslist(pb.W), ns.aslist(pb.b), ns.aslist(G), ns.aslist(Gb)


def test_path_update_in_place_equals_the_core(hxp):
    if hxp.name == "jax":
        pytest.skip("JAX arrays are immutable: the in-place layer refuses them")
    pb, A, Ab, G, Gb = _data(hxp)
    rule = gc.adamw_rule(0.01, amsgrad=True)
    state = gc.path_init(CHAIN, rule, A, Ab)
    E, Eb = hxp.aslist(pb.W), hxp.aslist(pb.b)  # the core's own copies
    es = gc.path_init(CHAIN, rule, E, Eb)
    ids = [id(a) for a in A]
    for _ in range(2):
        assert gb.path_update_(CHAIN, rule, state, A, Ab, G, Gb) is True
        E, Eb, es = gc.path_update(CHAIN, rule, es, E, Eb, G, Gb)
    assert [id(a) for a in A] == ids and int(hxp.to_numpy(state.count)) == 2
    tol = 1e-12 if hxp.is_f64 else 1e-5
    for a, e in zip(A + Ab + [x for bufs in state.buffers for x in bufs],
                    E + Eb + [x for bufs in es.buffers for x in bufs]):
        assert_close(hxp.to_numpy(a), hxp.to_numpy(e), tol)


def _fortran(ns, arrays):
    """The same values in arrays that are not C-contiguous: the fast paths decline them."""
    return [ns.asarray(np.asfortranarray(ns.to_numpy(a))) if ns.name == "numpy" else a
            for a in arrays]


def test_declined_steps_go_to_the_core_and_write_everything_back(xp):
    if xp.name != "numpy":
        pytest.skip("NumPy arrays in Fortran order are the declined case drawn here")
    pb, A, Ab, G, Gb = _data(xp, 1)
    A = _fortran(xp, A)
    assert not A[1].flags["C_CONTIGUOUS"]
    rule = gc.adam_rule(0.01)
    state = gc.path_init(CHAIN, rule, A, Ab)
    state = gc.RuleState(tuple(tuple(_fortran(xp, bufs)) for bufs in state.buffers),
                         np.asarray(0, dtype=np.int32))
    E, Eb, es = gc.path_update(CHAIN, rule, gc.path_init(CHAIN, rule, A, Ab), A, Ab, G, Gb)
    assert gb.path_update_(CHAIN, rule, state, A, Ab, G, Gb) is True
    for a, e in zip(A + Ab + [x for bufs in state.buffers for x in bufs],
                    E + Eb + [x for bufs in es.buffers for x in bufs]):
        np.testing.assert_array_equal(a, e)
    assert int(state.count) == 1
    W2 = _fortran(xp, xp.aslist(pb.W))
    EW, Eb2 = gc.gsgd_step(CHAIN, W2, xp.aslist(pb.b), G, Gb, 0.1)
    b2 = xp.aslist(pb.b)
    assert gb.gsgd_update_(CHAIN, None, W2, b2, G, Gb, lr=0.1) is True
    for a, e in zip(W2 + b2, EW + Eb2):
        np.testing.assert_array_equal(a, e)
    # a learning rate given as an array never reaches the fast path: the core, and True
    assert gb.gsgd_update_(CHAIN, None, W2, b2, G, Gb, lr=np.asarray(0.1)) is True


def test_in_place_helpers_write_weights_and_biases(xp):
    if xp.name == "jax":
        pytest.skip("JAX arrays are immutable: the in-place layer refuses them")
    pb, A, Ab, G, Gb = _data(xp, 2)
    EW, Eb = gc.path_sgd_step(CHAIN, A, Ab, G, Gb, 0.1)
    gb.path_sgd_step_(CHAIN, A, Ab, G, Gb, 0.1)
    for a, e in zip(A + Ab, EW + Eb):
        np.testing.assert_array_equal(xp.to_numpy(a), xp.to_numpy(e))
    gb.skeleton_init_(CHAIN, A)  # rest_scale defaults to 1: the other weights are kept
    for l, (a, e) in enumerate(zip(xp.tolist(A), xp.tolist(EW)), start=1):
        rest = ~(CHAIN.free_mask(l) | CHAIN.tau_mask(l)).reshape(a.shape)
        np.testing.assert_array_equal(a[rest], e[rest])


class Sign:
    """A rule of the user's, not elementwise-declared: Delta = lr * sign(D) (signSGD)."""

    def init(self, values):
        return ()

    def update(self, grads, state, values):
        import array_api_compat
        xp = array_api_compat.array_namespace(*grads)
        return tuple(0.01 * xp.sign(d) for d in grads), state


def test_any_rule_and_chains_without_biases_in_place(xp):
    if xp.name == "jax":
        pytest.skip("JAX arrays are immutable: the in-place layer refuses them")
    chain = gc.Chain.mlp([3, 5, 2], bias=False)
    pb = Problem(chain, 3)
    G, _ = pb.grads()
    for rule in (Sign(), gc.adam_rule(0.01)):
        A, E, AG = xp.aslist(pb.W), xp.aslist(pb.W), xp.aslist(G)
        E, _, _ = gc.path_update(chain, rule, gc.path_init(chain, rule, E), E, None, AG)
        state = gc.path_init(chain, rule, A)
        assert gb.path_update_(chain, rule, state, A, None, AG, None) is True
        for a, e in zip(A, E):
            assert_close(xp.to_numpy(a), xp.to_numpy(e), 1e-12 if xp.is_f64 else 1e-5)


def test_half_precision_in_place_takes_the_core():
    torch = pytest.importorskip("torch")
    pb = Problem(CHAIN, 0)
    G, Gb = pb.grads()
    half = lambda xs: [torch.tensor(x, dtype=torch.float16) for x in xs]  # noqa: E731
    A, Ab = half(pb.W), half(pb.b)
    rule = gc.adam_rule(0.01)
    state = gc.path_init(CHAIN, rule, A, Ab)
    E, Eb, _ = gc.path_update(CHAIN, rule, gc.path_init(CHAIN, rule, A, Ab), half(pb.W),
                              half(pb.b), half(G), half(Gb))
    assert gb.path_update_(CHAIN, rule, state, A, Ab, half(G), half(Gb)) is True
    for a, e in zip(A + Ab, E + Eb):
        assert a.dtype == torch.float16 and torch.equal(a, e)


class Wrapped:
    """Adam by composition: a PathRule whose state is a RuleState but which is no
    ElementwiseRule (so no fast path may apply it block by block)."""

    def __init__(self):
        self.inner = gc.adam_rule(0.01)

    def init(self, values):
        return self.inner.init(values)

    def update(self, grads, state, values):
        return self.inner.update(grads, state, values)


def test_a_rule_state_without_an_elementwise_rule_takes_the_core(xp):
    if xp.name == "jax":
        pytest.skip("JAX arrays are immutable: the in-place layer refuses them")
    pb, A, Ab, G, Gb = _data(xp, 4)
    rule = Wrapped()
    E, Eb, _ = gc.path_update(CHAIN, rule, gc.path_init(CHAIN, rule, A, Ab), xp.aslist(pb.W),
                              xp.aslist(pb.b), G, Gb)
    assert gb.path_update_(CHAIN, rule, gc.path_init(CHAIN, rule, A, Ab), A, Ab, G, Gb)
    for a, e in zip(A + Ab, E + Eb):
        np.testing.assert_array_equal(xp.to_numpy(a), xp.to_numpy(e))


class Counted:
    """signSGD whose state is a dict: the steps taken and the last step of every path."""

    def init(self, values):
        import array_api_compat
        xp = array_api_compat.array_namespace(*values)
        return {"steps": xp.zeros((), dtype=values[0].dtype),
                "last": [xp.zeros_like(v) for v in values]}

    def update(self, grads, state, values):
        import array_api_compat
        xp = array_api_compat.array_namespace(*grads)
        delta = tuple(0.01 * xp.sign(d) for d in grads)
        return delta, {"steps": state["steps"] + 1, "last": list(delta)}


def test_a_rule_state_of_dicts_and_lists_is_written_in_place(xp):
    """The core's new state goes into the same arrays of the rule's own state (a dict
    holding a 0-d array and a list), whatever its nesting."""
    if xp.name == "jax":
        pytest.skip("JAX arrays are immutable: the in-place layer refuses them")
    pb, A, Ab, G, Gb = _data(xp, 5)
    rule = Counted()
    state = gc.path_init(CHAIN, rule, A, Ab)
    held = [state["steps"]] + state["last"]
    _, _, want = gc.path_update(CHAIN, rule, gc.path_init(CHAIN, rule, A, Ab), A, Ab, G, Gb)
    assert gb.path_update_(CHAIN, rule, state, A, Ab, G, Gb) is True
    assert [state["steps"]] + state["last"] == held and float(xp.to_numpy(held[0])) == 1.0
    for a, e in zip(state["last"], want["last"]):
        np.testing.assert_array_equal(xp.to_numpy(a), xp.to_numpy(e))
    assert any(float(np.abs(xp.to_numpy(a)).max()) > 0 for a in state["last"])


def _core(*args, **kwargs):
    """Stands in for a core function where a fast path must take the step."""
    raise AssertionError("the core took the step")


def _updates():
    """gsgd_update_ and path_update_ (Adam), each as ``f(A, Ab, G, Gb, **kw)``."""
    rule = gc.adam_rule(0.01)
    return {"gsgd_update_": lambda A, Ab, G, Gb, **kw: gb.gsgd_update_(
                CHAIN, None, A, Ab, G, Gb, lr=0.1, **kw),
            "path_update_": lambda A, Ab, G, Gb, **kw: gb.path_update_(
                CHAIN, rule, gc.path_init(CHAIN, rule, A, Ab), A, Ab, G, Gb, **kw)}


@pytest.mark.parametrize("update", list(_updates()))
def test_column_sums_and_their_check_are_refused_before_any_write(fxp, update):
    """Column sums from the caller (DESIGN §12) are checked as a step plan hands them out:
    one vector per layer 2..L of its input width and the weights' dtype, a 0-d check of
    that dtype, and never a check without sums; a refusal writes nothing."""
    pb, A, Ab, G, Gb = _data(fxp, 6)
    before = [fxp.to_numpy(a).copy() for a in A + Ab]
    sums = [fxp.asarray(np.ones(n)) for n in CHAIN.sizes[1:-1]]
    check = fxp.asarray(np.zeros(()))
    step = _updates()[update]
    for kw, message in [
            (dict(gradient_check=check), "gradient_check is the check of column_sums: pass "
                                          "both"),
            (dict(column_sums=sums[:1]), "column_sums: a chain of 3 layers takes 2 vectors "
                                         r"\(layers 2..3\), got 1"),
            (dict(column_sums=[sums[0], sums[0]]), r"column_sums of layer 3: expected shape "
                                                  r"\(4,\)"),
            (dict(column_sums=sums, gradient_check=fxp.asarray(np.zeros(2))),
             r"gradient_check: expected a 0-d array of dtype .*, got shape \(2,\)")]:
        with pytest.raises(ValueError, match=message):
            step(A, Ab, G, Gb, **kw)
    for a, b in zip(A + Ab, before):
        np.testing.assert_array_equal(fxp.to_numpy(a), b)


def test_a_wrong_layer_count_is_refused_with_the_counts():
    pb = Problem(CHAIN, 11)
    rule = gc.adam_rule(0.01)
    state = gc.path_init(CHAIN, rule, pb.W, pb.b)
    for step in (lambda: gb.path_update_(CHAIN, rule, state, [], None, [], None),
                 lambda: gb.gsgd_update_(CHAIN, None, [], None, [], None, lr=0.1)):
        with pytest.raises(ValueError, match="weights has 0 entries, but the chain has 3 "
                                             "layers"):
            step()


@pytest.mark.parametrize("update", list(_updates()))
def test_a_step_takes_the_given_plan_and_column_sums(monkeypatch, update):
    """G-SGD's and an elementwise rule's steps on torch tensors take the plan and the
    column sums they are given (the core never runs): other sums give another step."""
    torch = pytest.importorskip("torch")
    pb = Problem(CHAIN, 7)
    G, Gb = pb.grads()
    T = lambda xs: [torch.tensor(x) for x in xs]  # noqa: E731

    step = _updates()[update]
    monkeypatch.setattr(gc, "path_update", _core)
    monkeypatch.setattr(gc, "gsgd_update", _core)
    plan = gb.step_plan(CHAIN, T(pb.W))
    steps = []
    for scale in (1.0, 2.0):
        A, Ab = T(pb.W), T(pb.b)
        sums = [scale * (w * g).sum(0).reshape(-1) for w, g in zip(A[1:], T(G)[1:])]
        assert step(A, Ab, T(G), T(Gb), plan=plan, column_sums=sums,
                    gradient_check=torch.zeros((), dtype=torch.float64)) is True
        steps.append(A)
    assert not all(torch.equal(a, b) for a, b in zip(*steps))


@pytest.mark.parametrize("where", ["weight", "bias"])
def test_a_non_finite_gradient_on_the_cores_path_is_a_skip(xp, where):
    """A step the core takes (a rule without a fast path; G-SGD on arrays without one) with
    a NaN in a weight's or a bias's gradient is skipped: ``False``, nothing written."""
    if xp.name == "jax":
        pytest.skip("JAX arrays are immutable: the in-place layer refuses them")
    pb = Problem(CHAIN, 8)
    G, Gb = pb.grads()
    (G if where == "weight" else Gb)[1][0] = np.nan
    rule = Sign()
    for step in (lambda *a: gb.path_update_(CHAIN, rule, rule.init(()), *a),
                 lambda *a: gb.gsgd_update_(CHAIN, None, *a, lr=0.1)):
        A, Ab = xp.aslist(pb.W), xp.aslist(pb.b)
        assert step(A, Ab, xp.aslist(G), xp.aslist(Gb)) is False
        for a, e in zip(A + Ab, pb.W + pb.b):
            np.testing.assert_array_equal(xp.to_numpy(a),
                                          np.asarray(e, dtype=xp.to_numpy(a).dtype))


def test_skeleton_init_in_place_keeps_signs_and_scales_the_rest_as_the_core(xp):
    if xp.name == "jax":
        pytest.skip("JAX arrays are immutable: the in-place layer refuses them")
    pb = Problem(CHAIN, 9)
    A = xp.aslist(pb.W)
    E, _ = gc.skeleton_init(CHAIN, xp.aslist(pb.W), keep_signs=True, rest_scale=0.5)
    gb.skeleton_init_(CHAIN, A, keep_signs=True, rest_scale=0.5)
    for a, e in zip(A, E):
        np.testing.assert_array_equal(xp.to_numpy(a), xp.to_numpy(e))
    assert any((xp.to_numpy(a) < 0).any() for a in A)  # signs kept: some skeleton edges < 0


def test_step_plan_takes_the_kernels_given_and_none_without_a_fast_path(xp):
    """step_plan builds the plan of the kernels given, else of the arrays' library; a
    library without a fast path (array-api-strict, JAX) has no plan."""
    W = xp.aslist(Problem(CHAIN, 10).W)
    plan = gb.step_plan(CHAIN, W)
    if xp.name not in ("numpy", "torch", "cupy"):
        assert plan is None
        return
    assert plan is not None and plan.fits(CHAIN, W[0])
    if xp.name == "torch":
        import gsgd_backends.torch as gbt
        assert set(gb.step_plan(CHAIN, W, kernels=gbt.COMPILED).layer_kernels) == {
            gbt.COMPILED}


def test_psi_update_of_torch_tensors_takes_its_fast_paths(monkeypatch):
    """Every hyperparameter given (lr, momentum, max_norm): the multi-tensor step, not the
    core; a PSIPlan given: its compiled step first."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    W = [torch.randn(4, 3, generator=g, dtype=torch.float64) for _ in range(2)]
    G = [torch.randn(4, 3, generator=g, dtype=torch.float64) for _ in range(2)]

    want, _ = gc.psi_update(gc.psi_init(W), W, G, lr=0.1, momentum=0.9, max_norm=2.0)
    monkeypatch.setattr(gc, "psi_update", _core)
    state = gc.psi_init(W)
    gb.psi_update_(state, W, G, lr=0.1, momentum=0.9, max_norm=2.0)
    for a, e in zip(W, want):
        assert torch.allclose(a, e, rtol=1e-12, atol=0)

    class Plan:
        def step_(self, *args, **hyper):
            calls.append(hyper)
            return True

    calls, before = [], [w.clone() for w in W]
    gb.psi_update_(state, W, G, plan=Plan(), lr=0.1)
    assert calls == [{"lr": 0.1, "momentum": 0.0, "max_norm": 1e4}]
    assert all(torch.equal(a, b) for a, b in zip(W, before))  # the plan's step, not another


def test_helpers_take_no_biases_for_a_chain_without_biases(xp):
    """``biases=None`` (a chain without biases) through every in-place helper, and through
    G-SGD on the core's path (a learning rate given as an array): the core's weights."""
    if xp.name == "jax":
        pytest.skip("JAX arrays are immutable: the in-place layer refuses them")
    chain = gc.Chain.mlp([3, 5, 4, 2], bias=False)
    pb = Problem(chain, 12)
    G, _ = pb.grads()
    scales = [np.linspace(0.5, 2.0, n) for n in chain.sizes[1:-1]]
    lr = xp.asarray(np.asarray(0.1))
    for step, core in [
            (lambda A: gb.canonicalize_(chain, A), lambda A: gc.canonicalize(chain, A)),
            (lambda A: gb.rescale_(chain, A, None, scales),
             lambda A: gc.rescale(chain, A, None, scales)),
            (lambda A: gb.path_sgd_step_(chain, A, None, xp.aslist(G), None, 0.1),
             lambda A: gc.path_sgd_step(chain, A, None, xp.aslist(G), None, 0.1)),
            (lambda A: gb.gsgd_update_(chain, None, A, None, xp.aslist(G), None, lr=lr),
             lambda A: gc.gsgd_update(chain, None, A, None, xp.aslist(G), None, lr=lr))]:
        A = xp.aslist(pb.W)
        step(A)
        for a, e in zip(A, core(xp.aslist(pb.W))[0]):
            np.testing.assert_array_equal(xp.to_numpy(a), xp.to_numpy(e))


def test_arguments_the_fast_path_cannot_read_get_the_cores_errors():
    """Weights as a generator (``model.parameters()``) and hyperparameters the core does not
    take, or lacks: the core's own errors, nothing written."""
    pb = Problem(CHAIN, 13)
    G, Gb = pb.grads()
    rule = gc.adam_rule(0.01)
    A, Ab = [np.array(w) for w in pb.W], [np.array(b) for b in pb.b]
    gen = "weights must be a list with one entry per layer \\(3\\), got generator"
    for step, error, message in [
            (lambda: gb.gsgd_update_(CHAIN, None, (a for a in A), Ab, G, Gb, lr=0.1),
             ValueError, gen),
            (lambda: gb.path_update_(CHAIN, rule, gc.path_init(CHAIN, rule, A, Ab),
                                     (a for a in A), Ab, G, Gb), ValueError, gen),
            (lambda: gb.gsgd_update_(CHAIN, None, A, Ab, G, Gb, lr=0.1, betas=(0.9, 0.99)),
             TypeError, r"gsgd_update\(\) got an unexpected keyword argument 'betas'"),
            (lambda: gb.gsgd_update_(CHAIN, None, A, Ab, G, Gb), TypeError,
             r"gsgd_update\(\) missing 1 required keyword-only argument: 'lr'")]:
        with pytest.raises(error, match=message):
            step()
    for a, e in zip(A + Ab, pb.W + pb.b):
        np.testing.assert_array_equal(a, e)


@pytest.mark.parametrize("field, message", [
    ("momentum", r"^layer 2: state.momentum\[1\] is None; a step with momentum needs"),
    ("bias_momentum", r"^layer 2: the layer has a bias but state.bias_momentum\[1\] is None")])
def test_a_momentum_state_lacking_a_buffer_is_refused_by_layer_before_any_write(fxp, field,
                                                                                message):
    _, W, b, G, Gb = _data(fxp)
    state = gc.gsgd_init(CHAIN, W, b)
    buffers = list(getattr(state, field))
    buffers[1] = None
    state = state._replace(**{field: tuple(buffers)})
    before = [np.array(fxp.to_numpy(a)) for a in W + b]
    with pytest.raises(ValueError, match=message):
        gb.gsgd_update_(CHAIN, state, W, b, G, Gb, lr=0.1, momentum=0.9)
    for a, e in zip(W + b, before):
        np.testing.assert_array_equal(fxp.to_numpy(a), e)


def test_a_step_skipped_for_a_non_finite_gradient_writes_nothing():
    """Where the fast path declines a step for a NaN gradient, the step is skipped without
    a write, not written back unchanged: read-only weights are left alone, no error."""
    pb = Problem(CHAIN, 14)
    G, Gb = pb.grads()
    G[1][0] = np.nan
    rule = gc.adam_rule(0.01)
    for step in (lambda A, Ab: gb.gsgd_update_(CHAIN, None, A, Ab, G, Gb, lr=0.1),
                 lambda A, Ab: gb.gsgd_update_(CHAIN, gc.gsgd_init(CHAIN, A, Ab), A, Ab, G,
                                               Gb, lr=0.1, momentum=0.9),
                 lambda A, Ab: gb.path_update_(CHAIN, rule, gc.path_init(CHAIN, rule, A, Ab),
                                               A, Ab, G, Gb)):
        A, Ab = [np.array(w) for w in pb.W], [np.array(b) for b in pb.b]
        for a in A + Ab:
            a.flags.writeable = False
        assert step(A, Ab) is False
        for a, e in zip(A + Ab, pb.W + pb.b):
            np.testing.assert_array_equal(a, e)


@pytest.mark.parametrize("update", list(_updates()))
def test_a_gradient_check_that_is_not_finite_leaves_the_step_to_the_core(monkeypatch, update):
    """A caller's check that overflowed (a bound on the gradients) over finite gradients:
    the step checks the gradients themselves, finds them finite, and the core takes it."""
    pb = Problem(CHAIN, 15)
    G, Gb = pb.grads()
    calls = []
    for name in ("gsgd_update", "path_update"):
        core = getattr(gc, name)
        monkeypatch.setattr(gc, name, lambda *a, core=core, **k: calls.append(1) or core(*a, **k))
    A, Ab = [np.array(w) for w in pb.W], [np.array(b) for b in pb.b]
    sums = [(w * g).sum(0).reshape(-1) for w, g in zip(A[1:], G[1:])]
    step = _updates()[update]
    assert step(A, Ab, G, Gb, column_sums=sums, gradient_check=np.asarray(np.inf)) is True
    assert calls == [1]
    E, Eb = [np.array(w) for w in pb.W], [np.array(b) for b in pb.b]
    monkeypatch.undo()
    step(E, Eb, G, Gb, column_sums=sums, gradient_check=np.asarray(0.0))
    for a, e in zip(A + Ab, E + Eb):
        assert_close(a, e, 1e-12)


class Stateless(Sign):
    """signSGD that keeps no state at all: ``None``."""

    def init(self, values):
        return None


def test_a_rule_without_state_steps_in_place(xp):
    if xp.name == "jax":
        pytest.skip("JAX arrays are immutable: the in-place layer refuses them")
    pb, A, Ab, G, Gb = _data(xp, 16)
    rule = Stateless()
    E, Eb, state = gc.path_update(CHAIN, rule, None, xp.aslist(pb.W), xp.aslist(pb.b), G, Gb)
    assert state is None
    assert gb.path_update_(CHAIN, rule, gc.path_init(CHAIN, rule, A, Ab), A, Ab, G, Gb)
    for a, e in zip(A + Ab, E + Eb):
        np.testing.assert_array_equal(xp.to_numpy(a), xp.to_numpy(e))
