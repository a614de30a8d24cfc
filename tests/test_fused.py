"""The fused step (gsgd_backends.fused) against the core, in three launches and with no read
back to the host: compiled on a CUDA device where there is one, else run by Triton's
interpreter on CPU tensors.

Without CUDA, ``TRITON_INTERPRET=1`` is set while gsgd_backends.fused is first imported
(Triton decides at a kernel's definition whether it is interpreted) and while this module's
tests run (the interpreter checks it again at each launch), and restored between, so no
other test sees it. With CUDA the tests make their tensors on the GPU (the default device
while they run). Where the kernels were already imported the other way in this process,
these tests skip.
"""

import importlib
import sys

import numpy as np
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import gsgd_core as gc
from _conditioning import synced_gsgd_steps
from _helpers import Problem, from_repository, triton_interpreting
from _strategies import chains, examples, seeds

torch = pytest.importorskip("torch")
#: The kernels run compiled on this device where there is one, else interpreted on the CPU.
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


with triton_interpreting(CUDA):  # triton's own library functions are decided at its import
    triton = pytest.importorskip("triton", reason="the fused step's kernels are Triton's")
    fused = importlib.import_module("gsgd_backends.fused")
    fused_psi = importlib.import_module("gsgd_backends.fused_psi")


def _interpreted(fn) -> bool:
    return type(fn).__name__ == "InterpretedFunction"


@pytest.fixture(autouse=True, scope="module")
def _interpreter():
    with triton_interpreting(CUDA):
        yield

gbt = importlib.import_module("gsgd_backends.torch")
READS = from_repository("benchmarks.step_counts").READS
if CUDA and fused.interpreted():
    pytest.skip("gsgd_backends.fused was imported for Triton's interpreter in this process "
                "before these tests (run them in a process of their own)",
                allow_module_level=True)
if not CUDA and not (fused.interpreted() and _interpreted(triton.language.standard.sum)):
    pytest.skip("triton was imported for compiled kernels in this process before these tests "
                "(run them in a process of their own)", allow_module_level=True)

#: Small tiles, so that tiny layers still take several tiles, row chunks and node blocks.
BLOCKS = fused.Blocks(rows=4, cols=16, chunk=4, nodes=4)
HYPERS = [dict(), dict(momentum=0.9), dict(momentum=0.9, nesterov=True, weight_decay=0.01),
          dict(momentum=0.5, dampening=0.3), dict(weight_decay=0.1)]


def _ns(dtype):
    """The torch namespace of the tests' arrays: on the GPU where the kernels run there."""
    from _namespaces import _torch, _torch_cuda
    return (_torch_cuda if CUDA else _torch)(dtype)


def _plan(chains_, like):
    return fused.FusedPlan([gbt.ON_DEVICE.plan(c, like) for c in chains_], BLOCKS)


def _fused_step(chain, hyper, **kw):
    """A step for synced_gsgd_steps: the fused step of ``chain`` alone."""
    def step(A, Ab, G, Gb, lr, state):
        fused.fused_step_(_plan([chain], A[0]), [A], [Ab], [G], [Gb], lr,
                          None if state is None else [state], **hyper, **kw)
    return step


# No shrinking: an interpreted step takes a second, and the failing example is small anyway.
@settings(max_examples=examples(3), deadline=None,
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(chain=chains(max_depth=4, max_width=5, max_slots=4), seed=seeds,
       hyper=st.sampled_from(HYPERS), dtype=st.sampled_from(["float64", "float32"]))
def test_fused_step_equals_the_core(chain, seed, hyper, dtype):
    """Two fused steps against gsgd_update, each from the core's state (path values,
    momentum buffers, weights and biases where no tau ratio nears 0: _conditioning), on
    drawn chains (custom skeletons, skeleton scales, convolution slots, biases)."""
    synced_gsgd_steps(_ns(dtype), chain, Problem(chain, seed), hyper, 2, lr=0.1,
                      rtol=1e-12 if dtype == "float64" else 2e-4,
                      step=_fused_step(chain, hyper))


CNN = gc.Chain.from_shapes([(4, 3, 3, 3), (5, 4, 2, 2), (6, 5 * 4), (3, 6)],
                           bias=[True, False, True, True])


def test_fused_step_of_a_conv_flatten_chain_maximizes_on_the_negated_gradients():
    """Convolutions, a Linear after a flatten, Nesterov and weight decay: ``maximize``
    steps as the core does on ``-grad`` (the helper hands the core ``grad`` and the fused
    step ``-grad`` with ``maximize``)."""
    hyper = dict(momentum=0.9, nesterov=True, weight_decay=0.01)
    inner = _fused_step(CNN, hyper, maximize=True)

    def step(A, Ab, G, Gb, lr, state):
        inner(A, Ab, [-g for g in G], [None if g is None else -g for g in Gb], lr, state)
    synced_gsgd_steps(_ns("float64"), CNN, Problem(CNN, 3), hyper, 2, lr=0.1, rtol=1e-12,
                      step=step)


def _tensors(arrays, device=DEVICE):
    return [None if a is None else torch.tensor(a, device=device) for a in arrays]


def _setup(chains_, seed=0, device=DEVICE):
    """Per chain: weights, biases, gradients, bias gradients and a state (torch, float64,
    on ``device``), and the host problems."""
    out = []
    for i, c in enumerate(chains_):
        pb = Problem(c, seed + i)
        G, Gb = pb.grads()
        W, b = _tensors(pb.W, device), _tensors(pb.b, device)
        out.append((pb, W, b, _tensors(G, device), _tensors(Gb, device),
                    gc.gsgd_init(c, W, b)))
    return out


def _step_all(plan, parts, lr=0.1, **kw):
    fused.fused_step_(plan, *[[p[i] for p in parts] for i in range(1, 5)], lr,
                      [p[5] for p in parts], **kw)


def _snapshot(parts):
    return [[None if t is None else t.clone() for t in [*p[1], *p[2], *p[5].momentum,
                                                       *p[5].bias_momentum, p[5].step]]
            for p in parts]


def _assert_unchanged(before, after, which):
    for i in which:
        for x, y in zip(before[i], after[i]):
            if x is not None:
                assert torch.equal(x, y), f"chain {i} changed"


MANY = [gc.Chain.mlp([3, 4, 2]), gc.Chain((2, 3, 1, 2), (1, 2, 1), bias=False)]


def test_chains_in_one_fused_step_are_skipped_one_by_one_and_all_by_found_inf():
    """Two chains in one plan: a non-finite gradient in one skips that chain only (its
    weights, biases, buffers and step count unchanged) while the other takes the core's
    first step (with dampening: the first buffer is the path gradient itself); a set
    ``found_inf`` skips every chain; a clear one does not."""
    parts = _setup(MANY)
    plan = _plan(MANY, parts[0][1][0])
    parts[1][3][1][0, 0, 0] = float("nan")
    before = _snapshot(parts)
    _step_all(plan, parts, momentum=0.9, dampening=0.5)
    _assert_unchanged(before, _snapshot(parts), [1])
    for i in (0,):
        pb, W, b, _, _, state = parts[i]
        want_W, want_b, want_s = gc.gsgd_update(MANY[i], gc.gsgd_init(MANY[i], pb.W, pb.b),
                                                pb.W, pb.b, *pb.grads(), lr=0.1, momentum=0.9,
                                                dampening=0.5)
        for got, want in zip(W + list(state.momentum), list(want_W) + list(want_s.momentum)):
            np.testing.assert_allclose(got.cpu().numpy(), want, rtol=1e-12, atol=1e-12)
        assert int(state.step) == 1
    before = _snapshot(parts)
    _step_all(plan, parts, momentum=0.9, found_inf=torch.ones(1, device=DEVICE))
    _assert_unchanged(before, _snapshot(parts), range(2))
    _step_all(plan, parts, momentum=0.9, found_inf=torch.zeros(1, device=DEVICE))
    assert [int(p[5].step) for p in parts] == [2, 0]


class _Counting(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts ATen operations, except inside the Triton launches (the interpreter's own
    copies of the launch's arguments, which a GPU launch does not make) and the profiler's
    markers (``torch.optim``'s step records one; it launches nothing)."""

    def __init__(self):
        super().__init__()
        self.aten, self.launches, self.inside = [], [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside and func.namespace != "profiler":
            self.aten.append(str(func))
        return func(*args, **(kwargs or {}))


def _counted_launches(monkeypatch, *modules):
    """A _Counting mode that also records the launches of ``modules`` (the interpreter's
    own ATen work inside them not counted)."""
    counting = _Counting()
    for module in modules:
        real = module.launch

        def launch(kernel, grid, *args, real=real, **meta):
            counting.launches.append(kernel.fn.__name__)
            counting.inside = True
            try:
                real(kernel, grid, *args, **meta)
            finally:
                counting.inside = False
        monkeypatch.setattr(module, "launch", launch)
    return counting


def test_a_fused_step_is_three_launches_for_any_depth_and_number_of_chains(monkeypatch):
    """Chains of 2, 3 and 12 layers in one plan: a step (with
    momentum, Nesterov, weight decay and a device learning rate) launches the three kernels
    once each and no ATen operation, the first step after building the plan at most the
    pointer tables' copies: at most 8 in all."""
    group = [gc.Chain.mlp([1] * 3), gc.Chain.mlp([1] * 13, bias=False), MANY[1]]
    parts = _setup(group)
    plan = fused.FusedPlan([gbt.ON_DEVICE.plan(c, parts[0][1][0]) for c in group])
    counting = _counted_launches(monkeypatch, fused)
    lr = torch.tensor(0.1, dtype=torch.float64, device=DEVICE)
    hyper = dict(momentum=0.9, nesterov=True, weight_decay=0.01)
    totals = []
    for _ in range(2):
        counting.aten, counting.launches = [], []
        with counting:
            _step_all(plan, parts, lr=lr, **hyper)
        assert counting.launches == ["read_pass", "vector_stage", "write_pass"]
        totals.append(len(counting.aten) + len(counting.launches))
    assert totals[0] <= 8, counting.aten
    assert totals[1] == 3, counting.aten


class _NoHostReads(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in READS:
            raise AssertionError(f"{func.__name__} read a tensor back to the host")
        return func(*args, **(kwargs or {}))


def test_a_fused_step_reads_nothing_back_to_the_host():
    """``item``, ``bool``, ``tolist``, ``cpu``, ``numpy``, ``float``, ``int`` of any
    tensor raise during the step (a skipping one, of two chains, with momentum and
    ``found_inf``); the step still takes place."""
    parts = _setup(MANY[:2])
    plan = _plan(MANY[:2], parts[0][1][0])
    parts[1][3][0][0, 0, 0] = float("inf")
    with _NoHostReads():
        _step_all(plan, parts, momentum=0.9, found_inf=torch.zeros(1, device=DEVICE))
    assert [int(p[5].step) for p in parts] == [1, 0]


def _step_lists(parts, **kw):
    """The arguments of a step of ``parts`` with column sums and checks, ``kw`` replacing
    any."""
    args = dict(zip(["weights", "biases", "grads", "bias_grads"],
                    [[p[i] for p in parts] for i in range(1, 5)]), lr=0.1,
                states=[p[5] for p in parts],
                column_sums=[[(w * g).reshape(c.layer_shape(l)).sum(dim=(0, 2))
                              for l, w, g in zip(range(2, c.L + 1), p[1][1:], p[3][1:])]
                             for c, p in zip(MANY, parts)],
                gradient_check=[sum(g.sum() for g in p[3]) for p in parts])
    args.update(kw)
    return args


def _no_launch(monkeypatch, module) -> None:
    """Fail the test if ``module`` launches a kernel (a refusal comes before any)."""
    monkeypatch.setattr(module, "launch", lambda *a, **k: pytest.fail("a kernel ran"))


@pytest.mark.parametrize("change, message", [
    (lambda p: p[3].__setitem__(1, p[3][1][:, :1]), "layer 2"),
    (lambda p: p[1].__setitem__(0, p[1][0].transpose(0, 1).contiguous().transpose(0, 1)),
     "not contiguous"),
    (lambda p: p[5]._replace(step=p[5].step.double()), None),
])
def test_bad_input_is_refused_before_any_launch(monkeypatch, change, message):
    """The core's errors naming the layer, non-contiguous tensors, and a step counter of
    another dtype: ``ValueError`` before any kernel runs."""
    parts = [list(p) for p in _setup(MANY[:1])]
    plan = _plan(MANY[:1], parts[0][1][0])
    out = change(parts[0])
    if isinstance(out, gc.GSGDState):
        parts[0][5] = out
        message = "int32"
    _no_launch(monkeypatch, fused)
    with pytest.raises(ValueError, match=message):
        _step_all(plan, parts, momentum=0.9)


def test_a_grad_scale_of_two_elements_is_refused_before_any_launch(monkeypatch):
    """GradScaler's ``grad_scale``, read on the device, is one element: another is a
    ``ValueError`` before any kernel runs."""
    parts = _setup(MANY[:1])
    plan = _plan(MANY[:1], parts[0][1][0])
    _no_launch(monkeypatch, fused)
    with pytest.raises(ValueError, match="grad_scale must be a one-element tensor"):
        _step_all(plan, parts, momentum=0.9, grad_scale=torch.ones(2, device=DEVICE))


@pytest.mark.parametrize("lr, hyper, message", [
    (0.1, dict(momentum=0.9, dampening=1.5), r"dampening must be finite and in \[0, 1\]"),
    (0.1, dict(nesterov=True), "nesterov needs momentum > 0"),
    (0.1, dict(momentum=0.9, weight_decay=-0.1), "weight_decay must be finite and >= 0"),
    (-0.1, dict(momentum=0.9), r"lr must be finite and >= 0, got -0\.1"),
    (float("nan"), dict(), "lr must be finite and >= 0, got nan"),
])
def test_hyperparameters_the_core_refuses_are_refused_before_any_launch(monkeypatch, lr,
                                                                        hyper, message):
    """A dampening above 1, Nesterov without momentum, a negative weight decay, and a
    learning rate given as a number that is negative or NaN: the core's ``ValueError``
    before any kernel runs, nothing written."""
    parts = _setup(MANY)
    plan = _plan(MANY, parts[0][1][0])
    before = _snapshot(parts)
    _no_launch(monkeypatch, fused)
    with pytest.raises(ValueError, match=message):
        _step_all(plan, parts, lr=lr, **hyper)
    _assert_unchanged(before, _snapshot(parts), range(2))


@pytest.mark.parametrize("hyper", [dict(momentum=0.9), dict(weight_decay=0.1)], ids=str)
def test_momentum_or_weight_decay_without_states_is_refused_before_any_launch(
        monkeypatch, hyper):
    """Momentum or weight decay alone keeps a buffer or a step count: without ``states``
    the step is a ``ValueError`` saying so, before any kernel runs, nothing written."""
    parts = _setup(MANY[:1])
    plan = _plan(MANY[:1], parts[0][1][0])
    before = _snapshot(parts)
    _no_launch(monkeypatch, fused)
    with pytest.raises(ValueError, match="momentum and weight decay need states"):
        fused.fused_step_(plan, *[[p[i] for p in parts] for i in range(1, 5)], 0.1, **hyper)
    _assert_unchanged(before, _snapshot(parts), [0])


def test_a_fused_step_unscales_gradients_by_grad_scale_at_a_one_element_lr():
    """GradScaler's ``grad_scale`` (a one-element device tensor, 4): the step of gradients
    scaled by 4 is the core's step of the unscaled ones, at a learning rate given as a
    one-element device tensor, and the gradients hold the unscaled values after it."""
    parts = _setup(MANY[:1])
    pb, W, b, G, Gb, state = parts[0]
    want_W, want_b, want_s = gc.gsgd_update(MANY[0], gc.gsgd_init(MANY[0], pb.W, pb.b), pb.W,
                                            pb.b, *pb.grads(), lr=0.1, momentum=0.9)
    unscaled = [g.clone() for g in G + Gb]
    for g in G + Gb:
        g.mul_(4)
    _step_all(_plan(MANY[:1], W[0]), parts,
              lr=torch.tensor([0.1], dtype=torch.float64, device=DEVICE), momentum=0.9,
              grad_scale=torch.tensor([4.0], device=DEVICE))
    for got, want in zip(W + b + list(state.momentum),
                         list(want_W) + list(want_b) + list(want_s.momentum)):
        np.testing.assert_allclose(got.cpu().numpy(), want, rtol=1e-12, atol=1e-12)
    for got, want in zip(G + Gb, unscaled):
        torch.testing.assert_close(got, want, rtol=1e-15, atol=0)


def test_plain_g_sgd_of_two_chains_without_states_takes_column_sums_and_checks():
    """No momentum, no weight decay, no ``states``, two chains with column sums and
    gradient checks handed in: a finite check steps its chain as the core does, a NaN one
    skips its chain only."""
    parts = _setup(MANY)
    args = _step_lists(parts, states=None)
    args["gradient_check"][1] = args["gradient_check"][1] * float("nan")
    before = _snapshot(parts)
    fused.fused_step_(_plan(MANY, parts[0][1][0]), **args)
    _assert_unchanged(before, _snapshot(parts), [1])
    pb, W, b = parts[0][:3]
    want_W, want_b, _ = gc.gsgd_update(MANY[0], None, pb.W, pb.b, *pb.grads(), lr=0.1)
    for got, want in zip(W + b, list(want_W) + list(want_b)):
        if got is not None:
            np.testing.assert_allclose(got.cpu().numpy(), want, rtol=1e-12, atol=1e-12)


def test_weight_decay_alone_steps_with_buffer_less_states_as_the_optimizer_keeps_them():
    """Weight decay without momentum with the states the optimizer gathers for it
    (``GSGDState((), (), count)``: no buffer, a step count): the core's step, counted."""
    parts = _setup(MANY[:1])
    pb, W, b, G, Gb, _ = parts[0]
    state = gc.GSGDState((), (), torch.zeros((), dtype=torch.int32, device=DEVICE))
    want_W, want_b, _ = gc.gsgd_update(MANY[0], None, pb.W, pb.b, *pb.grads(), lr=0.1,
                                       weight_decay=0.1)
    fused.fused_step_(_plan(MANY[:1], W[0]), [W], [b], [G], [Gb], 0.1, [state],
                      weight_decay=0.1)
    for got, want in zip(W + b, list(want_W) + list(want_b)):
        np.testing.assert_allclose(got.cpu().numpy(), want, rtol=1e-12, atol=1e-12)
    assert int(state.step) == 1


def _meta_like(t):
    return torch.zeros_like(t, device="meta")


@pytest.mark.parametrize("chain, change, message", [
    (0, lambda s: s._replace(momentum=s.momentum[:1]), "chain 0: momentum has 1 arrays for 2"),
    (0, lambda s: s._replace(momentum=(s.momentum[0][:1], s.momentum[1])),
     r"chain 0, layer 1: the momentum buffer has shape \(1, 3, 1\) and dtype torch.float64; "
     r"expected \(4, 3, 1\) and torch.float64"),
    (0, lambda s: s._replace(bias_momentum=(None, s.bias_momentum[1])),
     r"chain 0, layer 1: the bias momentum buffer has shape None and dtype None; expected "
     r"\(4,\) and torch.float64"),
    (1, lambda s: s._replace(bias_momentum=(torch.zeros(3, dtype=torch.float64,
                                                        device=DEVICE), None, None)),
     r"chain 1, layer 1: the bias momentum buffer has shape \(3,\) and dtype torch.float64; "
     r"expected None and torch.float64"),
    (1, lambda s: s._replace(step=torch.zeros(2, dtype=torch.int32, device=DEVICE)),
     r"states\[1\].step must be a one-element tensor on .*, got shape \(2,\)"),
    (1, lambda s: s._replace(step=_meta_like(s.step)),
     r"states\[1\].step must be a one-element tensor on .*, got shape \(\) on meta"),
])
def test_states_whose_buffers_or_counter_do_not_fit_are_refused_before_any_launch(
        monkeypatch, chain, change, message):
    """A momentum buffer missing, of another shape, missing where the layer has a bias or
    given where it has none, and a step counter of two elements or on another device: a
    ``ValueError`` naming the chain, the layer and both shapes, before any kernel runs."""
    parts = [list(p) for p in _setup(MANY)]
    plan = _plan(MANY, parts[0][1][0])
    parts[chain][5] = change(parts[chain][5])
    _no_launch(monkeypatch, fused)
    with pytest.raises(ValueError, match=message):
        _step_all(plan, parts, momentum=0.9)


@pytest.mark.parametrize("given, message", [
    (dict(found_inf=torch.zeros(1, device="meta")),
     r"found_inf must be a one-element tensor on .*, got shape \(1,\) on meta"),
    ("check", r"gradient_check\[0\] must be a one-element tensor on .*, got shape \(\) on meta"),
])
def test_device_tensors_on_another_device_are_refused_before_any_launch(monkeypatch, given,
                                                                        message):
    """``found_inf`` and a gradient check that are not on the parameters' device: a
    ``ValueError`` saying where they are, before any kernel runs."""
    parts = _setup(MANY[:1])
    plan = _plan(MANY[:1], parts[0][1][0])
    if given == "check":
        _, W, _, G, _, _ = parts[0]
        given = dict(column_sums=[[(W[1] * G[1]).reshape(MANY[0].layer_shape(2)).sum(
            dim=(0, 2))]], gradient_check=[_meta_like(G[0].sum())])
    _no_launch(monkeypatch, fused)
    with pytest.raises(ValueError, match=message):
        _step_all(plan, parts, momentum=0.9, **given)


@pytest.mark.parametrize("change, message", [
    (lambda p, s: s.update(state=p[5]._replace(momentum=(
        _meta_like(p[5].momentum[0]), p[5].momentum[1]))),
     "chain 0, layer 1: the momentum buffer is on meta, the plan's tensors on"),
    (lambda p, s: s.update(state=p[5]._replace(momentum=(
        p[5].momentum[0], torch.zeros(2, 4, 2, dtype=torch.float64, device=DEVICE)[..., :1]))),
     r"chain 0, layer 2: .* the momentum buffer of shape \(2, 4, 1\) is not contiguous"),
    (lambda p, s: s.update(state=p[5]._replace(bias_momentum=(
        torch.zeros(8, dtype=torch.float64, device=DEVICE)[::2], p[5].bias_momentum[1]))),
     r"chain 0, layer 1: .* the bias momentum buffer of shape \(4,\) is not contiguous"),
    (lambda p, s: s.update(state=p[5]._replace(bias_momentum=(
        p[5].bias_momentum[0], _meta_like(p[5].bias_momentum[1])))),
     "chain 0, layer 2: the bias momentum buffer is on meta"),
    (lambda p, s: s.update(column_sums=[[_meta_like(p[1][0][:, 0, 0])]],
                           gradient_check=[p[3][0].sum()]),
     "chain 0, layer 2: the column sum is on meta"),
])
def test_a_tensor_on_another_device_or_not_contiguous_is_named_before_any_launch(
        monkeypatch, change, message):
    """A momentum buffer, a bias buffer, a column sum on another device or not
    contiguous: a ``ValueError`` naming the chain, the layer and which tensor it is,
    before any kernel runs."""
    parts = [list(p) for p in _setup(MANY[:1])]
    plan = _plan(MANY[:1], parts[0][1][0])
    kw = {}
    change(parts[0], kw)
    if "state" in kw:
        parts[0][5] = kw.pop("state")
    _no_launch(monkeypatch, fused)
    with pytest.raises(ValueError, match=message):
        _step_all(plan, parts, momentum=0.9, **kw)


def test_weights_of_another_dtype_than_the_plans_are_refused_before_any_launch(monkeypatch):
    """A float64 plan handed float32 weights and gradients (no states, so no buffer's dtype
    to tell): a ``ValueError`` saying the plan does not fit them, before any kernel runs."""
    parts = _setup(MANY[:1])
    plan = _plan(MANY[:1], parts[0][1][0])
    W, b, G, Gb = ([None if t is None else t.float() for t in x] for x in parts[0][1:5])
    _no_launch(monkeypatch, fused)
    with pytest.raises(ValueError, match="chain 0: .* does not fit weights of dtype "
                                         "torch.float32"):
        fused.fused_step_(plan, [W], [b], [G], [Gb], 0.1)


def test_without_weight_decay_path_values_beyond_float32_leave_the_cores_momentum():
    """float32 weights of 1e20 (path values of 1e40 overflow float32), momentum without
    weight decay: the momentum buffers are the core's (no ``0 * inf`` of a decay that is
    off turns the path gradients into NaN)."""
    chain = gc.Chain.mlp([2, 2, 2])
    W = [torch.full((2, 2), 1e20, dtype=torch.float32, device=DEVICE) for _ in range(2)]
    b = [torch.zeros(2, dtype=torch.float32, device=DEVICE) for _ in range(2)]
    G = [torch.full((2, 2), g, dtype=torch.float32, device=DEVICE) for g in (0.5, 0.25)]
    Gb = [torch.ones(2, dtype=torch.float32, device=DEVICE) for _ in range(2)]
    want = gc.gsgd_update(chain, gc.gsgd_init(chain, W, b), W, b, G, Gb, lr=0.1, momentum=0.9)
    state = gc.gsgd_init(chain, W, b)
    fused.fused_step_(_plan([chain], W[0]), [W], [b], [G], [Gb], 0.1, [state], momentum=0.9)
    assert float(want[2].momentum[0][0, 1]) > 0
    for got, expected in zip(W + b + list(state.momentum) + list(state.bias_momentum),
                             [*want[0], *want[1], *want[2].momentum, *want[2].bias_momentum]):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", ["weights", "biases", "grads", "bias_grads", "states",
                                  "column_sums", "gradient_check"])
def test_a_list_that_has_not_one_entry_per_chain_is_refused_before_any_launch(monkeypatch,
                                                                               name):
    """Two chains, one list of the step's with one entry: a ``ValueError`` naming it."""
    parts = _setup(MANY)
    args = _step_lists(parts)
    args[name] = args[name][:1]
    _no_launch(monkeypatch, fused)
    with pytest.raises(ValueError, match=f"^{name}: the plan steps 2 chains, got 1 lists"):
        fused.fused_step_(_plan(MANY, parts[0][1][0]), **args, momentum=0.9)


@pytest.mark.parametrize("drop, message", [
    ("column_sums", "gradient_check is the check of column_sums: pass both"),
    ("gradient_check", "gradient_check is the check of column_sums: pass both"),
    ("sums of the wrong shape", r"column_sums of layer 2: expected shape \(4,\)"),
])
def test_column_sums_without_their_check_or_of_the_wrong_shape_are_refused(monkeypatch, drop,
                                                                           message):
    """Column sums without a gradient check, a check without sums, sums of another
    length: a ``ValueError`` before any kernel runs."""
    parts = _setup(MANY)
    args = _step_lists(parts)
    if drop in args:
        args[drop] = None
    else:
        args["column_sums"][0][0] = args["column_sums"][0][0][:2]
    _no_launch(monkeypatch, fused)
    with pytest.raises(ValueError, match=message):
        fused.fused_step_(_plan(MANY, parts[0][1][0]), **args, momentum=0.9)


def test_chains_without_biases_step_with_biases_and_bias_grads_none():
    """Two bias-free chains stepped with ``biases`` and ``bias_grads`` ``None``: each
    takes the core's step."""
    chains_ = [MANY[1], MANY[1]]
    parts = _setup(chains_)
    fused.fused_step_(_plan(chains_, parts[0][1][0]), [p[1] for p in parts], None,
                      [p[3] for p in parts], None, 0.1)
    for pb, W, *_ in parts:
        want_W, _, _ = gc.gsgd_update(MANY[1], None, pb.W, None, *pb.grads(), lr=0.1)
        for got, want in zip(W, want_W):
            np.testing.assert_allclose(got.cpu().numpy(), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("likes, message", [
    ([], "a fused plan needs at least one chain"),
    ([(torch.float64, DEVICE), (torch.float32, DEVICE)],
     "a fused plan steps chains of one device and dtype"),
    ([(torch.float32, DEVICE), (torch.float32, "meta")],
     "a fused plan steps chains of one device and dtype"),
    ([(torch.int32, DEVICE)], "the fused step takes floating tensors, got torch.int32"),
])
def test_a_fused_plan_of_chains_it_cannot_step_at_once_is_refused(likes, message):
    """No chain, chains of two dtypes or two devices, integer weights: ``ValueError``
    when the plan is made."""
    plans = [gbt.ON_DEVICE.plan(MANY[0], torch.zeros(4, 3, 1, dtype=dtype, device=device))
             for dtype, device in likes]
    with pytest.raises(ValueError, match=message):
        fused.FusedPlan(plans, BLOCKS)


def test_a_non_finite_bias_gradient_skips_its_chain():
    """An infinite bias gradient in one chain: that chain is skipped whole (weights,
    biases, buffers, step count), with or without column sums handed in."""
    for sums in (False, True):
        parts = _setup(MANY)
        parts[0][4][1][0] = float("inf")
        args = _step_lists(parts) if sums else {}
        before = _snapshot(parts)
        if sums:
            fused.fused_step_(_plan(MANY, parts[0][1][0]), **args, momentum=0.9)
        else:
            _step_all(_plan(MANY, parts[0][1][0]), parts, momentum=0.9)
        _assert_unchanged(before, _snapshot(parts), [0])
        assert [int(p[5].step) for p in parts] == [0, 1]


def test_cpu_tensors_outside_the_interpreter_are_refused(monkeypatch):
    parts = _setup(MANY[:1], device=torch.device("cpu"))
    plan = _plan(MANY[:1], parts[0][1][0])
    monkeypatch.setattr(fused, "interpreted", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        _step_all(plan, parts)


def test_device_functions_compile_with_the_kernels_and_run_as_python_when_interpreted(
        monkeypatch):
    """A compiled kernel calls only Triton functions, so the kernels' helpers are jitted
    unless interpreted; whether they are is Triton's ``knobs`` or, in a Triton without
    them (3.2), the ``TRITON_INTERPRET`` variable it reads."""
    kernels = importlib.import_module("gsgd_backends.fused_kernels")

    def helper(x):
        return x

    for interpreting in (False, True):
        monkeypatch.setattr(kernels, "_interpreting", lambda v=interpreting: v)
        made = kernels.device_function(helper)
        assert (made is helper) == interpreting
        assert interpreting or type(made).__module__.startswith("triton.runtime")
    monkeypatch.undo()
    monkeypatch.delattr(triton, "knobs")
    monkeypatch.setitem(sys.modules, "triton.knobs", None)
    for value, expected in (("1", True), ("0", False)):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert kernels._interpreting() is expected
    monkeypatch.delenv("TRITON_INTERPRET")
    assert kernels._interpreting() is False


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_steps_as_the_core_in_float32(dtype):
    """float16 and bfloat16 weights, biases and buffers step as the core steps them
    (computed in float32, written back in their own dtype): within one unit of their last
    place."""
    chain = MANY[0]
    pb = Problem(chain, 5)
    G, Gb = pb.grads()

    def half(arrays):
        return [None if a is None else torch.tensor(a, dtype=dtype, device=DEVICE) for a in arrays]
    W, b, Gt, Gbt = half(pb.W), half(pb.b), half(G), half(Gb)
    state = gc.gsgd_init(chain, W, b)
    want = gc.gsgd_update(chain, gc.gsgd_init(chain, W, b), W, b, Gt, Gbt, lr=0.1,
                          momentum=0.9)
    fused.fused_step_(_plan([chain], W[0]), [W], [b], [Gt], [Gbt], 0.1, [state], momentum=0.9)
    for got, expected in zip(W + b + list(state.momentum),
                             list(want[0]) + list(want[1]) + list(want[2].momentum)):
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), expected.float(), atol=0,
                                   rtol=torch.finfo(dtype).eps)


def test_column_sums_from_the_backward_step_as_the_read_pass_and_a_bad_check_skips():
    """Column sums and a gradient check handed in (DESIGN §12: the backward pass takes
    them): the step equals the one that sums ``W * grad`` itself, with momentum and
    ``maximize``; a non-finite check skips the chain."""
    taken, given = _setup([CNN]), _setup([CNN])
    _, W, _, G, _, _ = given[0]
    sums = [(w * g).reshape(CNN.layer_shape(l)).sum(dim=(0, 2))
            for l, w, g in zip(range(2, CNN.L + 1), W[1:], G[1:])]
    check = sum(g.sum() for g in G)
    hyper = dict(momentum=0.9, dampening=0.5, maximize=True)
    _step_all(_plan([CNN], W[0]), taken, **hyper)
    plan = _plan([CNN], W[0])
    _step_all(plan, given, column_sums=[sums], gradient_check=[check], **hyper)
    for a, b in zip(_snapshot(taken)[0], _snapshot(given)[0]):
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-13)
    before = _snapshot(given)
    _step_all(plan, given, column_sums=[sums], gradient_check=[check * float("nan")], **hyper)
    _assert_unchanged(before, _snapshot(given), [0])


# PSI-SGD(M): normalised weights (a Conv, a Linear) in tiles of 2 rows, 4 columns at a time.
PSI_SHAPES = [(3, 2, 2, 2), (4, 5)]
PSI_BLOCKS = fused_psi.PSIBlocks(rows=2, cols=4)


def _psi_problem(dtype, seed=0):
    """Weights, gradients and buffers where the core's per-row rules act: row 0 of the
    Linear passes ``max_norm`` = 5 after the step, a NaN gradient in a Conv row, a Conv row
    whose squared norm overflows."""
    rng = np.random.default_rng(seed)

    def draw():
        return [torch.tensor(rng.uniform(-1, 1, s), dtype=torch.float64, device=DEVICE)
                for s in PSI_SHAPES]
    W, G, U = draw(), draw(), draw()
    W[1][0] *= 8
    G[0][1, 0, 0, 1] = float("nan")
    W[0][2] *= torch.finfo(dtype).max ** 0.5
    return [[t.to(dtype) for t in x] for x in (W, G, U)]


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_fused_psi_step_equals_psi_update(dtype, momentum):
    """Two fused PSI steps (the second from the first's result, at a device learning rate)
    against psi_update's: float64 to rounding, float32 within 1e-5 of the values' size;
    rows renormalised, a row with a NaN gradient and one that overflows kept, buffers
    untouched by PSI-SGD."""
    W, G, U = _psi_problem(dtype)
    want_W, want = list(W), gc.PSIState(tuple(U))
    state = gc.PSIState(tuple(u.clone() for u in U))
    W = [w.clone() for w in W]
    plan, norms = fused_psi.FusedPSIPlan(W, PSI_BLOCKS), []
    for lr in (0.1, torch.tensor(0.05, dtype=dtype, device=DEVICE)):
        want_W, want = gc.psi_update(want, want_W, G, lr=float(lr), momentum=momentum,
                                     max_norm=5.0)
        fused_psi.fused_psi_step_(plan, state, W, G, lr, momentum=momentum, max_norm=5.0)
        for got, expected in zip(W + list(state.momentum), want_W + list(want.momentum)):
            assert got.dtype == dtype
            torch.testing.assert_close(got, expected, atol=0,
                                       rtol=1e-12 if dtype == torch.float64 else 1e-5)
        norms.append(float(torch.linalg.vector_norm(W[1][0])))
    assert norms[0] == pytest.approx(1.0) and norms[1] != pytest.approx(1.0)  # renormalised
    assert torch.equal(W[0][1:3], _psi_problem(dtype)[0][0][1:3])  # both kept


def test_a_fused_psi_step_is_one_launch_reads_nothing_back_and_found_inf_skips(monkeypatch):
    """PSI-SGDM over every weight: one launch and no ATen operation once the plan's tables
    are made (at most 8 with them); no read back to the host (``item``, ``bool``, ...
    raise); a set ``found_inf`` writes nothing, a clear one steps."""
    W, G, U = _psi_problem(torch.float64)
    state = gc.PSIState(tuple(U))
    plan = fused_psi.FusedPSIPlan(W, PSI_BLOCKS)
    counting = _counted_launches(monkeypatch, fused_psi)
    totals = []
    for found in (1.0, 0.0):
        before = [t.clone() for t in W + U]
        found_inf = torch.tensor([found], dtype=torch.float64, device=DEVICE)
        counting.aten, counting.launches = [], []
        with counting, _NoHostReads():
            fused_psi.fused_psi_step_(plan, state, W, G, 0.1, momentum=0.9,
                                      found_inf=found_inf)
        assert counting.launches == ["psi_rows"]
        totals.append(len(counting.aten) + 1)
        same = [torch.equal(a, b) for a, b in zip(before, W + U)]
        assert all(same) if found else not any(same)
    assert totals[0] <= 8, counting.aten
    assert totals[1] == 1, counting.aten


@pytest.mark.parametrize("change, message", [
    (lambda W, G, U: G.__setitem__(1, G[1][:, :2]), "weight 1: grads has shape"),
    (lambda W, G, U: U.__setitem__(0, U[0].float()),
     "weight 0: .*momentum buffer.*float32 on [^,]*$"),
    (lambda W, G, U: W.__setitem__(0, W[0].to("meta")), "weight 0: .*weight.* on meta"),
    (lambda W, G, U: W.__setitem__(1, W[1].t().contiguous().t()), "not contiguous"),
    (lambda W, G, U: W.append(torch.zeros(2, 2, device=DEVICE)), "shapes"),
    (lambda W, G, U: dict(momentum=torch.tensor(0.9)), "momentum as a Python number"),
    (lambda W, G, U: dict(grad_scale=torch.ones(2, device=DEVICE)),
     "grad_scale must be a one-element tensor"),
    (lambda W, G, U: dict(found_inf=torch.zeros(1, device="meta")),
     "found_inf must be a one-element tensor on .*, got shape \\(1,\\) on meta"),
])
def test_bad_psi_input_is_refused_before_the_launch(monkeypatch, change, message):
    """The core's errors naming the weight and the shapes, and the plan's (dtype, layout,
    shapes, a momentum whose value would be read back): ``ValueError`` before any kernel
    runs."""
    W, G, U = _psi_problem(torch.float64)
    plan = fused_psi.FusedPSIPlan(W, PSI_BLOCKS)
    hyper = change(W, G, U) or dict(momentum=0.9)
    G += [torch.zeros(2, 2, device=DEVICE)] * (len(W) - len(G))
    U += [torch.zeros(2, 2, device=DEVICE)] * (len(W) - len(U))
    _no_launch(monkeypatch, fused_psi)
    with pytest.raises(ValueError, match=message):
        fused_psi.fused_psi_step_(plan, gc.PSIState(tuple(U)), W, G, 0.1, **hyper)


@pytest.mark.parametrize("lr", [-0.1, float("nan")])
def test_a_psi_learning_rate_the_core_refuses_as_a_number_is_refused_before_the_launch(
        monkeypatch, lr):
    """A learning rate given as a Python number is checked as the core checks it (only a
    device tensor's value is not read back): the core's ``ValueError``, before any kernel
    runs."""
    W, G, U = _psi_problem(torch.float64)
    plan = fused_psi.FusedPSIPlan(W, PSI_BLOCKS)
    _no_launch(monkeypatch, fused_psi)
    with pytest.raises(ValueError, match=r"lr must be finite and >= 0, got (-0\.1|nan)"):
        fused_psi.fused_psi_step_(plan, gc.PSIState(tuple(U)), W, G, lr, momentum=0.9)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_psi_steps_as_the_core_in_float32(dtype):
    """float16 and bfloat16 weights and buffers step as psi_update steps them (computed in
    float32, written in their own dtype): within one unit of their last place."""
    W, G, U = _psi_problem(dtype)
    want_W, want = gc.psi_update(gc.PSIState(tuple(U)), W, G, lr=0.1, momentum=0.9,
                                 max_norm=5.0)
    state = gc.PSIState(tuple(u.clone() for u in U))
    W = [w.clone() for w in W]
    fused_psi.fused_psi_step_(fused_psi.FusedPSIPlan(W, PSI_BLOCKS), state, W, G, 0.1,
                              momentum=0.9, max_norm=5.0)
    for got, expected in zip(W + list(state.momentum), want_W + list(want.momentum)):
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), expected.float(), atol=0,
                                   rtol=torch.finfo(dtype).eps)


@pytest.mark.parametrize("weights, message", [
    ([], "at least one weight"),
    ([torch.ones(2, 3, dtype=torch.int32)], "floating tensors, got torch.int32"),
    ([torch.ones(2, 3), torch.tensor(1.0)], r"weights with rows, got shapes \[\(2, 3\), \(\)\]"),
])
def test_a_fused_psi_plan_of_weights_it_cannot_step_is_refused(weights, message):
    """No weight, integer weights, a 0-d weight: ``ValueError`` when the plan is made."""
    with pytest.raises(ValueError, match=message):
        fused_psi.FusedPSIPlan([w.to(DEVICE) for w in weights])


def test_psi_sgd_steps_with_the_plans_idle_state_at_the_cores_defaults():
    """PSI-SGD (no momentum, the default ``max_norm``) with the plan's idle state, as the
    optimizer steps it: zeros in the weights' shapes and dtype that are neither read nor
    written, and the step psi_update takes at its defaults (row 0 of the Linear, of norm
    about 8, not renormalised)."""
    W, G, _ = _psi_problem(torch.float64)
    plan = fused_psi.FusedPSIPlan(W, PSI_BLOCKS)
    idle = plan.idle_state()
    assert [(u.shape, u.dtype, u.device) for u in idle.momentum] == [
        (w.shape, w.dtype, w.device) for w in W]
    assert not any(bool(u.any()) for u in idle.momentum)
    want_W, _ = gc.psi_update(gc.psi_init(W), W, G, lr=0.1)
    W = [w.clone() for w in W]
    fused_psi.fused_psi_step_(plan, idle, W, G, 0.1)
    for got, expected in zip(W, want_W):
        torch.testing.assert_close(got, expected, atol=0, rtol=1e-12)
    assert float(torch.linalg.vector_norm(W[1][0])) > 4


def test_a_fused_psi_step_unscales_gradients_by_grad_scale_at_a_one_element_lr():
    """GradScaler's ``grad_scale`` (a one-element device tensor, 4): the step of gradients
    scaled by 4 is the step of the unscaled ones, at a learning rate given as a
    one-element device tensor, and the Linear's rows (all written) hold the unscaled
    gradients after it."""
    W, G, U = _psi_problem(torch.float64)
    want_W, want = gc.psi_update(gc.PSIState(tuple(U)), W, G, lr=0.1, momentum=0.9,
                                 max_norm=5.0)
    state = gc.PSIState(tuple(u.clone() for u in U))
    W, scaled = [w.clone() for w in W], [g * 4 for g in G]
    fused_psi.fused_psi_step_(fused_psi.FusedPSIPlan(W, PSI_BLOCKS), state, W, scaled,
                              torch.tensor([0.1], dtype=torch.float64, device=DEVICE),
                              momentum=0.9, max_norm=5.0,
                              grad_scale=torch.tensor([4.0], device=DEVICE))
    for got, expected in zip(W + list(state.momentum), want_W + list(want.momentum)):
        torch.testing.assert_close(got, expected, atol=0, rtol=1e-12)
    assert torch.equal(scaled[1], G[1])


def test_fused_psi_on_cpu_tensors_without_the_interpreter_is_refused(monkeypatch):
    """CPU tensors with the kernels compiled (Triton's interpreter off): a ``ValueError``
    that says how to step them, before any launch."""
    W, G, U = _psi_problem(torch.float64)
    plan = fused_psi.FusedPSIPlan([w.cpu() for w in W], PSI_BLOCKS)
    monkeypatch.setattr(fused_psi, "interpreted", lambda: False)
    _no_launch(monkeypatch, fused_psi)
    with pytest.raises(ValueError, match="only under Triton's interpreter"):
        fused_psi.fused_psi_step_(plan, gc.PSIState(tuple(u.cpu() for u in U)),
                                  [w.cpu() for w in W], [g.cpu() for g in G], 0.1)


def _graph_captured(step):
    """``step`` warmed up once on a side stream (compiling the kernels, making the plan's
    tables) and captured in a CUDA graph, as torch's documentation captures a step."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def _eager_and_replayed(step, lrs, founds, schedule) -> None:
    """``step(0)`` taken eagerly and ``step(1)`` captured in a CUDA graph (after a first
    eager ``step(0)``, which compiles the kernels and makes the tables), then, for each
    ``(lr, found)`` of ``schedule`` written into the device tensors ``lrs`` and ``founds``,
    ``step(0)`` and a replay under torch's sync debug mode "error" (a host synchronisation
    raises)."""
    step(0)
    graph = _graph_captured(lambda: step(1))
    torch.cuda.set_sync_debug_mode("error")
    try:
        for lr, found in schedule:
            for t in lrs:
                t.fill_(lr)
            for t in founds:
                t.fill_(found)
            step(0)
            graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs and stream synchronisation need a GPU")
def test_a_fused_step_never_synchronises_and_replays_from_a_cuda_graph():
    """Two chains, momentum, Nesterov, weight decay, a device learning rate and GradScaler's
    ``found_inf``: eager steps under torch's sync debug mode "error" (any host
    synchronisation raises) and the same steps replayed from one captured CUDA graph agree
    bit for bit, including a learning rate changed on the device between replays and a
    replay skipped by a set ``found_inf``."""
    eager, captured = _setup(MANY), _setup(MANY)
    plans = _plan(MANY, eager[0][1][0]), _plan(MANY, captured[0][1][0])
    lrs = [torch.tensor(0.1, dtype=torch.float64, device=DEVICE) for _ in range(2)]
    founds = [torch.zeros(1, device=DEVICE) for _ in range(2)]
    hyper = dict(momentum=0.9, nesterov=True, weight_decay=0.01)

    def step(i):
        _step_all(plans[i], (eager, captured)[i], lr=lrs[i], found_inf=founds[i], **hyper)
    _eager_and_replayed(step, lrs, founds, ((0.1, 0.0), (0.05, 0.0), (0.05, 1.0), (0.2, 0.0)))
    for a, b in zip(_snapshot(eager), _snapshot(captured)):
        for x, y in zip(a, b):
            assert x is None or torch.equal(x, y)
    assert [int(p[5].step) for p in eager] == [4, 4]


@pytest.mark.skipif(not CUDA, reason="stream synchronisation needs a GPU")
def test_a_step_whose_gradients_moved_copies_its_pointer_table_without_synchronising():
    """Gradients at new addresses (as after ``zero_grad()`` where the allocator moved
    them): the step copies its new pointer table to the device from pinned memory, under
    torch's sync debug mode "error" (a copy from pageable memory would wait for the
    stream), and steps as the step on the old addresses does."""
    moved, kept = _setup(MANY), _setup(MANY)
    plans = _plan(MANY, moved[0][1][0]), _plan(MANY, kept[0][1][0])
    for plan, parts in zip(plans, (moved, kept)):
        _step_all(plan, parts, momentum=0.9)  # compiles the kernels, makes the tables
    for p in moved:
        p[3][:] = [g.clone() for g in p[3]]
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step_all(plans[0], moved, momentum=0.9)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    _step_all(plans[1], kept, momentum=0.9)
    for a, b in zip(_snapshot(moved), _snapshot(kept)):
        for x, y in zip(a, b):
            assert x is None or torch.equal(x, y)
