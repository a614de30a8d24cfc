"""The multi-tensor PSI-SGD(M) step of torch tensors (gsgd_backends.psi) against the core's
psi_update: the same numbers on drawn layer shapes, renormalised rows, and the steps it hands
back (non-finite gradients, possible overflows, half precision)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gsgd_core as gc
from gsgd_backends import psi_update_
from gsgd_backends.psi import psi_step_
from _strategies import examples

torch = pytest.importorskip("torch")

SHAPES = st.lists(st.one_of(
    st.tuples(st.integers(0, 5), st.integers(1, 6)),                      # Linear
    st.tuples(st.integers(1, 5), st.integers(1, 3), st.integers(1, 3),    # Conv2d
              st.integers(1, 3))), min_size=1, max_size=4)


def _problem(shapes, seed, dtype, scale=1.0):
    rng = np.random.default_rng(seed)
    W = [torch.tensor(rng.standard_normal(s) * scale, dtype=dtype) for s in shapes]
    U = [torch.tensor(rng.standard_normal(s) * 0.1, dtype=dtype) for s in shapes]
    G = [torch.tensor(rng.standard_normal(s) * 0.1, dtype=dtype) for s in shapes]
    return W, G, U


def _both(W, G, U, **hyper):
    """(fast in place, whether it ran fast) and the core's result, from the same start."""
    Wf, Uf = [w.clone() for w in W], [u.clone() for u in U]
    ran = psi_step_(Wf, G, Uf, **hyper)
    We, state = gc.psi_update(gc.PSIState(tuple(U)), W, G, **hyper)
    return (Wf, Uf), ran, (We, list(state.momentum))


def _assert_close(got, want, rtol):
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.allclose(a, b, rtol=rtol, atol=rtol), float((a - b).abs().max())


@settings(max_examples=examples(25))
@given(shapes=SHAPES, seed=st.integers(0, 2**16), momentum=st.sampled_from([0.0, 0.9]),
       dtype=st.sampled_from([torch.float64, torch.float32]))
def test_fast_psi_equals_the_core(shapes, seed, momentum, dtype):
    W, G, U = _problem(shapes, seed, dtype)
    hyper = dict(lr=0.1, momentum=momentum, max_norm=1e4)
    (Wf, Uf), ran, (We, Ue) = _both(W, G, U, **hyper)
    assert ran
    rtol = 1e-12 if dtype == torch.float64 else 1e-5
    _assert_close(Wf, We, rtol)
    _assert_close(Uf, Ue, rtol)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_rows_past_max_norm_are_renormalised_as_the_core_does(momentum):
    W, G, U = _problem([(4, 3), (3, 2, 3, 3)], 0, torch.float64, scale=3.0)
    (Wf, Uf), ran, (We, Ue) = _both(W, G, U, lr=0.5, momentum=momentum, max_norm=2.0)
    assert ran
    assert any(bool((torch.linalg.vector_norm(w.reshape(len(w), -1), dim=1) > 2.0).any())
               for w in W)  # the case is exercised: rows did pass max_norm
    _assert_close(Wf, We, 1e-12)
    _assert_close(Uf, Ue, 1e-12)


@pytest.mark.parametrize("to", [2.1, 4.0])
@pytest.mark.parametrize("momentum, by", [(0.0, "gradient"), (0.9, "gradient"),
                                         (0.9, "buffer")])
def test_rows_the_step_pushes_past_max_norm_are_renormalised(momentum, by, to):
    """Rows below ``max_norm`` that the step itself carries past it (norm 1.9 -> 2.1, just
    past ``max_norm = 2``, or -> 4.0, a step larger than the row), through the gradient or
    the momentum buffer: the fast step's bound must see it coming and renormalise them."""
    w = torch.tensor([[1.9, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    delta = (to ** 2 - 1.9 ** 2) ** 0.5  # a step orthogonal to the row
    g, u = torch.zeros_like(w), torch.zeros_like(w)
    if by == "gradient":
        g[0, 1] = -delta / (0.5 * 1.9 ** 2)
    else:
        u[0, 1] = -delta / (0.5 * momentum)
    (Wf, Uf), ran, (We, Ue) = _both([w], [g], [u], lr=0.5, momentum=momentum, max_norm=2.0)
    assert ran
    assert abs(float(torch.linalg.vector_norm(We[0][0])) - 1.0) < 1e-12  # divided by its norm
    _assert_close(Wf, We, 1e-12)
    _assert_close(Uf, Ue, 1e-12)


def test_psi_sgd_keeps_no_buffer():
    W, G, U = _problem([(4, 3)], 1, torch.float64)
    (_, Uf), ran, (_, Ue) = _both(W, G, U, lr=0.1, momentum=0.0, max_norm=1e4)
    assert ran and torch.equal(Uf[0], U[0]) and torch.equal(Ue[0], U[0])


@pytest.mark.parametrize("spoil", ["nan", "inf", "overflow", "product"])
def test_steps_it_cannot_take_exactly_are_handed_back_and_the_core_takes_them(spoil):
    """A NaN/Inf gradient (its row keeps its values) or a gradient whose update would
    overflow float32, alone or (``product``: a finite ``||w||^2 g`` past float32's range
    from a large row and a large gradient): the fast path declines with nothing written,
    and psi_update_ gives the core's result."""
    W, G, U = _problem([(4, 3), (2, 3)], 2, torch.float32)
    if spoil == "product":
        W[0][1] *= 1e12
    G[0][1, 2] = {"nan": float("nan"), "inf": float("inf"), "overflow": 3e38,
                  "product": 1e15}[spoil]
    Wf, Uf = [w.clone() for w in W], [u.clone() for u in U]
    assert not psi_step_(Wf, G, Uf, lr=0.1, momentum=0.9, max_norm=1e4)
    assert all(torch.equal(a, b) for a, b in zip(Wf + Uf, W + U))
    psi_update_(gc.PSIState(tuple(Uf)), Wf, G, lr=0.1, momentum=0.9)
    We, state = gc.psi_update(gc.PSIState(tuple(U)), W, G, lr=0.1, momentum=0.9)
    _assert_close(Wf, We, 0)
    _assert_close(Uf, list(state.momentum), 0)
    assert all(bool(torch.isfinite(w).all()) for w in Wf + Uf)
    assert torch.equal(Wf[0][1], W[0][1])  # the spoilt row kept its values


def test_a_weight_or_buffer_not_contiguous_goes_to_the_core_a_gradient_does_not():
    """A transposed weight or buffer cannot be updated through a view: handed back with
    nothing written. A transposed gradient is only read: the fast step takes it."""
    W, G, U = _problem([(4, 3), (3, 3)], 4, torch.float64)
    for which in ("weight", "buffer"):
        Wf, Uf = [w.clone() for w in W], [u.clone() for u in U]
        (Wf if which == "weight" else Uf)[1] = (Wf if which == "weight" else Uf)[1].t()
        before = [a.clone() for a in Wf + Uf]
        assert not psi_step_(Wf, G, Uf, lr=0.1, momentum=0.9, max_norm=1e4), which
        assert all(torch.equal(a, b) for a, b in zip(Wf + Uf, before))
    G_t = [G[0], G[1].t().contiguous().t()]  # the same numbers, strided
    assert not G_t[1].is_contiguous()
    (Wf, Uf), ran, (We, Ue) = _both(W, G_t, U, lr=0.1, momentum=0.9, max_norm=1e4)
    assert ran
    _assert_close(Wf, We, 1e-12)
    _assert_close(Uf, Ue, 1e-12)


def test_psi_sgd_takes_buffers_that_hold_no_memory():
    """PSI-SGD reads and writes no buffer, so a zero expanded to the weight's shape (what
    the torch optimizers pass while the state has no buffer) is taken by the fast step,
    and, when the core takes the step (a NaN gradient), it is handed back untouched. With
    momentum such a buffer cannot be written: the core's step, same numbers."""
    W, G, U = _problem([(4, 3), (2, 3, 2, 2)], 7, torch.float64)
    Z = [torch.zeros((), dtype=torch.float64).expand_as(w) for w in W]
    Wf = [w.clone() for w in W]
    assert psi_step_(Wf, G, Z, lr=0.1, momentum=0.0, max_norm=1e4)
    _assert_close(Wf, gc.psi_update(gc.PSIState(tuple(U)), W, G, lr=0.1)[0], 1e-12)
    assert not psi_step_([w.clone() for w in W], G, Z, lr=0.1, momentum=0.9, max_norm=1e4)
    G[0][1, 2] = float("nan")
    Wf = [w.clone() for w in W]
    psi_update_(gc.PSIState(tuple(Z)), Wf, G, lr=0.1)
    _assert_close(Wf, gc.psi_update(gc.PSIState(tuple(U)), W, G, lr=0.1)[0], 0)
    assert all(z.stride() == (0,) * z.ndim and not z.any() for z in Z)


def test_no_weights_is_a_step_taken():
    assert psi_step_([], [], [], lr=0.1, momentum=0.9, max_norm=1e4)


def test_half_precision_goes_to_the_core():
    W, G, U = _problem([(4, 3)], 3, torch.bfloat16)
    assert not psi_step_([w.clone() for w in W], G, [u.clone() for u in U], lr=0.1,
                         momentum=0.9, max_norm=1e4)
    Wf, Uf = [w.clone() for w in W], [u.clone() for u in U]
    psi_update_(gc.PSIState(tuple(Uf)), Wf, G, lr=0.1, momentum=0.9)
    We, state = gc.psi_update(gc.PSIState(tuple(U)), W, G, lr=0.1, momentum=0.9)
    _assert_close(Wf, We, 0)


def test_bad_input_still_gets_the_cores_errors():
    W, G, U = _problem([(4, 3)], 4, torch.float64)
    with pytest.raises(ValueError, match="lr"):
        psi_update_(gc.PSIState(tuple(U)), W, G, lr=-0.1)
    with pytest.raises(ValueError):
        psi_update_(gc.PSIState(tuple(U)), W, [torch.zeros(3, 4, dtype=torch.float64)],
                    lr=0.1)


def _in_place(W, G, U, to, **hyper):
    """psi_update_ on copies (``to`` converts), and the core's result."""
    Wi, Ui = [to(w.clone()) for w in W], [to(u.clone()) for u in U]
    psi_update_(gc.PSIState(tuple(Ui)), Wi, [to(g) for g in G], **hyper)
    We, state = gc.psi_update(gc.PSIState(tuple(U)), W, G, **hyper)
    return [torch.as_tensor(w) for w in Wi + Ui], We + list(state.momentum)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("hyper", [dict(lr=0.1), dict(lr=0.1, momentum=0.9),
                                   dict(lr=0.1, momentum=0.5, max_norm=2.0)], ids=str)
def test_in_place_psi_equals_the_core_with_the_cores_defaults(lib, hyper):
    """psi_update_ on NumPy arrays (the core and a write-back) and torch tensors (the fast
    step), hyperparameters left to their defaults as the core's are."""
    W, G, U = _problem([(4, 3), (5, 2, 3, 3)], 5, torch.float64, scale=0.8)
    to = (lambda t: t.numpy()) if lib == "numpy" else (lambda t: t)
    got, want = _in_place(W, G, U, to, **hyper)
    _assert_close(got, want, 1e-12)


def test_in_place_psi_takes_the_fast_step_for_torch_only(monkeypatch):
    import gsgd_backends.psi

    calls = []
    monkeypatch.setattr(gsgd_backends.psi, "psi_step_",
                        lambda *a, **k: calls.append(1) or psi_step_(*a, **k))
    W, G, U = _problem([(4, 3), (5, 2, 3, 3)], 6, torch.float64)
    _in_place(W, G, U, lambda t: t, lr=0.1, momentum=0.9)
    assert calls == [1]
    _in_place(W, G, U, lambda t: t.numpy(), lr=0.1, momentum=0.9)
    _in_place(W, G, U, lambda t: t, lr=torch.tensor(0.1, dtype=torch.float64))  # not a number
    _in_place([W[0][0]], [G[0][0]], [U[0][0]], lambda t: t, lr=0.1)  # 1-D: the core
    assert calls == [1]


def _spoilt(dtype):
    """Weights, gradients and buffers where each kind of row the core treats specially
    occurs: rows past ``max_norm = 2`` (scale 3; the last weight's row 0 at norm 2.5,
    unmoved), and in the first weight a NaN gradient (row 0), an Inf one (row 1), a zero
    row with an Inf gradient (row 2, ``0 * inf``), and a finite ``||w||^2 g`` past float32's
    range (row 3)."""
    W, G, U = _problem([(5, 3), (3, 2, 3, 3), (4, 7)], 8, dtype, scale=3.0)
    W[2][0] *= 2.5 / torch.linalg.vector_norm(W[2][0])
    G[2][0], U[2][0] = 0.0, 0.0
    W[0][2] = 0.0
    W[0][3] *= 1e12
    G[0][0, 1], G[0][1, 2], G[0][2, 0], G[0][3, 0] = float("nan"), float("inf"), \
        float("inf"), 1e15
    return W, G, U


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_compiled_psi_sgd_takes_every_row_by_the_cores_rules(dtype):
    """The compiled PSI-SGD step (PSIPlan) equals the core on every row, with nothing
    handed back: rows renormalised, rows whose gradient or update is not finite kept as
    they were."""
    from gsgd_backends.psi import PSIPlan

    W, G, U = _spoilt(dtype)
    Wf = [w.clone() for w in W]
    assert PSIPlan().step_(Wf, G, U, lr=0.5, momentum=0.0, max_norm=2.0)
    We, _ = gc.psi_update(gc.PSIState(tuple(U)), W, G, lr=0.5, max_norm=2.0)
    rtol = 1e-12 if dtype == torch.float64 else 1e-5
    _assert_close(Wf, We, rtol)
    for i in range(4 if dtype == torch.float32 else 3):  # float64 takes row 3's product
        assert torch.equal(Wf[0][i], W[0][i]), i
    assert all(bool(torch.isfinite(w).all()) for w in Wf)
    moved = [i for i in range(1, 3)
             if not torch.equal(Wf[i], W[i])]  # rows past max_norm were divided by it
    assert moved and all(float(torch.linalg.vector_norm(
        Wf[i].reshape(len(Wf[i]), -1), dim=1).max()) <= 2.0 * (1 + rtol) for i in moved)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_compiled_psi_sgdm_equals_the_core_and_hands_back_what_it_cannot_take(dtype):
    """The compiled PSI-SGDM step equals the core where rows pass ``max_norm`` (the last
    weight's row 0 by a small margin); a step with a non-finite gradient or a possible
    overflow is handed back with nothing written, and psi_update_ with the plan then gives
    the core's result."""
    from gsgd_backends.psi import PSIPlan

    plan, rtol = PSIPlan(), 1e-12 if dtype == torch.float64 else 1e-5
    ran, loop = [], plan._momentum  # the compiled loop, not the eager passes, updates

    plan._momentum = lambda *args: ran.append(1) or loop(*args)
    W, G, U = _spoilt(dtype)
    clean = [w[4:] if i == 0 else w for i, w in enumerate(W)]  # rows 0-3 spoil weight 0
    Gc, Uc = [g[4:] if i == 0 else g for i, g in enumerate(G)], \
        [u[4:] if i == 0 else u for i, u in enumerate(U)]
    Wf, Uf = [w.clone() for w in clean], [u.clone() for u in Uc]
    assert plan.step_(Wf, Gc, Uf, lr=0.5, momentum=0.9, max_norm=2.0)
    We, state = gc.psi_update(gc.PSIState(tuple(Uc)), clean, Gc, lr=0.5, momentum=0.9,
                              max_norm=2.0)
    _assert_close(Wf + Uf, We + list(state.momentum), rtol)
    assert ran == [1]
    assert float(torch.linalg.vector_norm(W[2][0])) > 2.0 and not torch.equal(Wf[2][0], W[2][0])
    Wf, Uf = [w.clone() for w in W], [u.clone() for u in U]
    assert not plan.step_(Wf, G, Uf, lr=0.5, momentum=0.9, max_norm=2.0)
    assert all(torch.equal(a, b) for a, b in zip(Wf + Uf, W + U))
    psi_update_(gc.PSIState(tuple(Uf)), Wf, G, lr=0.5, momentum=0.9, max_norm=2.0, plan=plan)
    We, state = gc.psi_update(gc.PSIState(tuple(U)), W, G, lr=0.5, momentum=0.9, max_norm=2.0)
    _assert_close(Wf + Uf, We + list(state.momentum), 0)


def test_compiled_psi_hands_back_what_it_cannot_take():
    """Half precision or a weight that is not contiguous: ``False``, nothing written (the
    eager step or the core then takes it, as psi_update_ does)."""
    from gsgd_backends.psi import PSIPlan

    plan = PSIPlan()
    W, G, U = _problem([(4, 3)], 9, torch.bfloat16)
    Wf = [w.clone() for w in W]
    assert not plan.step_(Wf, G, U, lr=0.1, momentum=0.9, max_norm=1e4)
    assert torch.equal(Wf[0], W[0])
    W, G, U = _problem([(3, 3)], 9, torch.float64)
    Wt = [W[0].clone().t()]
    assert not plan.step_(Wt, G, U, lr=0.1, momentum=0.0, max_norm=1e4)
    assert torch.equal(Wt[0], W[0].t())
    assert plan.step_([], [], [], lr=0.1, momentum=0.0, max_norm=1e4)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_step_along_the_row_just_past_max_norm_is_renormalised(momentum):
    """A step parallel to the row (norm 1.9 -> 2.01, ``max_norm = 2``): the row's new norm
    is as large as the step's bound on it allows, and the row must still be divided."""
    w = torch.tensor([[1.9, 0.0], [0.0, 1.0]], dtype=torch.float64)
    g = torch.zeros_like(w)
    g[0, 0] = -(2.01 - 1.9) / (0.5 * 1.9 ** 2)
    (Wf, Uf), ran, (We, Ue) = _both([w], [g], [torch.zeros_like(w)], lr=0.5,
                                    momentum=momentum, max_norm=2.0)
    assert ran
    assert abs(float(We[0][0, 0]) - 1.0) < 1e-12  # divided by its norm
    _assert_close(Wf, We, 1e-12)
    _assert_close(Uf, Ue, 1e-12)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_row_exactly_at_max_norm_is_kept(momentum):
    """Only rows whose norm passes ``max_norm`` are divided (the core's rule): a row that
    ends exactly at it keeps its values, beside a row that passes it."""
    w = torch.tensor([[2.0, 0.0], [0.0, 3.0]], dtype=torch.float64)
    u = torch.tensor([[0.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    (Wf, Uf), ran, (We, Ue) = _both([w], [torch.zeros_like(w)], [u], lr=0.5,
                                    momentum=momentum, max_norm=2.0)
    assert ran and torch.equal(Wf[0][0], w[0])
    _assert_close(Wf, We, 1e-12)
    _assert_close(Uf, Ue, 1e-12)


_QUARTER = torch.finfo(torch.float64).max / 4


@pytest.mark.parametrize("lr, update", [
    (2.0 ** -4, _QUARTER),           # the update ||w||^2 g of a row reaches it
    (1.0, 4.4497354823324646e+307),  # the weight's bound, widened by 1%, reaches it
])
def test_steps_near_the_end_of_the_range_are_handed_back_with_a_margin(lr, update):
    """The fast step keeps a factor 4 from the largest float: a step whose update of a row
    (here ``||w||^2 g`` exactly: ``||w||^2 = 2^512``), or whose bound on the new row norms
    (``||w|| + lr |update|``, widened by 1% for the rounding of norms), reaches a quarter
    of it is handed back; one ulp of the update less, it is taken. Both give the core's
    numbers (the row's norm overflows: it is divided to zero)."""
    assert update <= _QUARTER and (lr == 2.0 ** -4 or update * 1.01 == _QUARTER)
    w = torch.tensor([[2.0 ** 256, 0.0, 0.0], [0.0, 0.5, 0.0]], dtype=torch.float64)
    for g01, taken in ((np.nextafter(update / 2 ** 512, 0), True),
                       (update / 2 ** 512, False)):
        g = torch.zeros_like(w)
        g[0, 1] = float(g01)
        (Wf, Uf), ran, (We, Ue) = _both([w], [g], [torch.zeros_like(w)], lr=lr,
                                        momentum=0.0, max_norm=1e4)
        assert ran is taken, g01
        if taken:
            _assert_close(Wf, We, 0)
            assert not We[0][0].any()


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_compiled_psi_of_one_weight_follows_its_device_not_the_default(momentum):
    """The compiled step of a single weight, run while torch's default device is one its
    tensors are not on (``meta``), equals the core's: its hyperparameters go to the
    weight's device, rows past ``max_norm`` are divided, a row ending exactly at it kept."""
    from gsgd_backends.psi import PSIPlan

    W, G, U = _problem([(4, 3)], 10, torch.float64, scale=3.0)
    W[0][0], G[0][0], U[0][0] = torch.tensor([2.0, 0.0, 0.0]), 0.0, 0.0
    Wf, Uf = [w.clone() for w in W], [u.clone() for u in U]
    with torch.device("meta"):
        assert PSIPlan().step_(Wf, G, Uf, lr=0.5, momentum=momentum, max_norm=2.0)
    We, state = gc.psi_update(gc.PSIState(tuple(U)), W, G, lr=0.5, momentum=momentum,
                              max_norm=2.0)
    assert torch.equal(Wf[0][0], W[0][0])
    assert not torch.equal(Wf[0][1:], W[0][1:])
    _assert_close(Wf + Uf, We + list(state.momentum), 1e-12)


@pytest.mark.parametrize("other", ["gradient", "buffer"])
def test_a_gradient_or_buffer_of_another_dtype_goes_to_the_core(other):
    """float64 weights with a float32 gradient or momentum buffer: the fast step hands the
    step back with nothing written; psi_update_ then gives the core's answer (its error for
    the gradient, its step for the buffer)."""
    W, G, U = _problem([(4, 3), (3, 2)], 11, torch.float64)
    G, U = ([g.float() for g in G], U) if other == "gradient" else (G, [u.float() for u in U])
    Wf, Uf = [w.clone() for w in W], [u.clone() for u in U]
    assert not psi_step_(Wf, G, Uf, lr=0.1, momentum=0.9, max_norm=1e4)
    assert all(torch.equal(a, b) for a, b in zip(Wf + Uf, W + U))
    if other == "gradient":
        with pytest.raises(ValueError, match="dtype"):
            psi_update_(gc.PSIState(tuple(Uf)), Wf, G, lr=0.1, momentum=0.9)
        return
    psi_update_(gc.PSIState(tuple(Uf)), Wf, G, lr=0.1, momentum=0.9)
    We, state = gc.psi_update(gc.PSIState(tuple(U)), W, G, lr=0.1, momentum=0.9)
    _assert_close(Wf + Uf, We + [u.float() for u in state.momentum], 0)


def test_in_place_psi_refuses_what_the_core_refuses_with_its_messages():
    """Arguments the multi-tensor step cannot read (no weights, a generator, a state not
    from psi_init, a hyperparameter the core does not take, momentum buffers too few or of
    another shape, though PSI-SGD would not read them): the core's errors, nothing
    written."""
    W, G, U = _problem([(4, 3), (3, 2)], 12, torch.float64)
    before = [a.clone() for a in W + U]
    state = gc.PSIState(tuple(U))
    for args, hyper, error, message in [
            ((gc.PSIState(()), [], []), {}, ValueError, "weights must be a non-empty list"),
            ((state, (w for w in W), G), {}, ValueError, "weights must be a non-empty list"),
            ((tuple(U), W, G), {}, ValueError, "state must come from psi_init"),
            ((state, W, G), dict(nesterov=True), TypeError,
             r"psi_update\(\) got an unexpected keyword argument 'nesterov'"),
            ((gc.PSIState(tuple(U[:1])), W, G), {}, ValueError,
             "momentum buffers has 1 entries for 2 weights"),
            ((gc.PSIState((U[0].t().contiguous(), U[1])), W, G), {}, ValueError,
             r"weight 0: momentum buffers has shape \(3, 4\), but the weight has shape "
             r"\(4, 3\)")]:
        with pytest.raises(error, match=message):
            psi_update_(*args, lr=0.1, **hyper)
    assert all(torch.equal(a, b) for a, b in zip(W + U, before))


def test_in_place_psi_sgd_of_numpy_arrays_never_writes_its_buffers():
    """PSI-SGD keeps no buffer: the core hands the state's arrays back as they were, and
    none is written, so read-only zeros that hold no memory will do."""
    W, G, U = _problem([(4, 3), (3, 2)], 13, torch.float64)
    Wn = [w.numpy().copy() for w in W]
    Z = [np.broadcast_to(np.zeros(()), w.shape) for w in Wn]
    psi_update_(gc.PSIState(tuple(Z)), Wn, [g.numpy() for g in G], lr=0.1)
    _assert_close([torch.as_tensor(w) for w in Wn],
                  gc.psi_update(gc.PSIState(tuple(U)), W, G, lr=0.1)[0], 1e-12)
    assert not any(z.flags.writeable or z.any() for z in Z)


@pytest.mark.parametrize("momentum", [0.5, 8.0])
def test_a_step_through_a_large_buffer_is_handed_back_by_momentum_times_its_norm(momentum):
    """The bound on the new row norms counts ``momentum`` times the buffer (the core takes
    any momentum >= 0, above 1 too): a step ``lr * momentum * u`` of ``2^1021`` is taken
    (the row's norm overflows: both divide it to zero), one of ``2^1024`` (past the largest
    float) is handed back with nothing written, and psi_update_ then gives the core's step,
    which keeps the row. Both are the core's numbers, finite."""
    w = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.5, 0.0]], dtype=torch.float64)
    g, u = torch.zeros_like(w), torch.zeros_like(w)
    u[0, 1] = 2.0 ** 500
    for e, taken in ((521, True), (524, False)):
        hyper = dict(lr=2.0 ** e / momentum, momentum=momentum, max_norm=1e4)
        (Wf, Uf), ran, (We, Ue) = _both([w], [g], [u], **hyper)
        assert ran is taken, e
        if not taken:
            assert torch.equal(Wf[0], w) and torch.equal(Uf[0], u)
            psi_update_(gc.PSIState(tuple(Uf)), Wf, [g], **hyper)
            assert torch.equal(Wf[0], w)
        _assert_close(Wf + Uf, We + Ue, 0)
        assert all(bool(torch.isfinite(a).all()) for a in Wf + Uf)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_weights_on_two_devices_are_handed_back_and_the_core_steps_them(momentum):
    """A weight on another device than the first (``meta`` here, which holds no numbers):
    both fast steps answer ``False``, the bool they promise, with nothing written, and
    psi_update_ gives the core's step of the CPU weight."""
    from gsgd_backends.psi import PSIPlan

    W, G, U = ([x[0], x[1].to("meta")]
               for x in _problem([(4, 3), (3, 2)], 14, torch.float64))
    hyper = dict(lr=0.1, momentum=momentum, max_norm=1e4)
    Wf, Uf = [w.clone() for w in W], [u.clone() for u in U]
    assert psi_step_(Wf, G, Uf, **hyper) is False
    assert PSIPlan().step_(Wf, G, Uf, **hyper) is False
    assert torch.equal(Wf[0], W[0]) and torch.equal(Uf[0], U[0])
    psi_update_(gc.PSIState(tuple(Uf)), Wf, G, **hyper)
    We, state = gc.psi_update(gc.PSIState(tuple(U)), W, G, **hyper)
    _assert_close([Wf[0], Uf[0]], [We[0], state.momentum[0]], 0)
    assert not torch.equal(Wf[0], W[0]) and Wf[1].device.type == "meta"


def test_psi_sgd_never_calls_the_momentum_steps_update():
    """``update`` takes the momentum step's update of buffers and weights; PSI-SGD has no
    such step: it takes its own single pass (the core's numbers) without calling it, so a
    caller may pass one hook whatever the momentum."""
    W, G, U = _problem([(4, 3), (2, 3, 2, 2)], 15, torch.float64)
    Z = [torch.zeros((), dtype=torch.float64).expand_as(w) for w in W]
    Wf, calls = [w.clone() for w in W], []
    assert psi_step_(Wf, G, Z, lr=0.1, momentum=0.0, max_norm=1e4,
                     update=lambda *args: calls.append(args))
    assert calls == []
    _assert_close(Wf, gc.psi_update(gc.PSIState(tuple(U)), W, G, lr=0.1)[0], 1e-12)
