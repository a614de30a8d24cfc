"""The torch optimizers' fused step (``GSGD(..., fused=True)``, ``PSISGD``) against the
unfused step: compiled on a CUDA device where there is one, else run by Triton's interpreter
on CPU tensors (``TRITON_INTERPRET=1`` set as tests/test_fused.py sets it, for the same
reasons); where the kernels were already imported the other way in this process, these
tests skip.
"""

import copy
import importlib

import pytest

from _helpers import triton_interpreting

torch = pytest.importorskip("torch")
nn = torch.nn
#: The kernels run compiled on this device where there is one, else interpreted on the CPU.
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")

with triton_interpreting(CUDA):
    pytest.importorskip("triton", reason="the fused step's kernels are Triton's")
    fused = importlib.import_module("gsgd_backends.fused")
    fused_psi = importlib.import_module("gsgd_backends.fused_psi")

from gsgd_adapters.torch import GAdam, GAdamW, GSGD, PSISGD, skeleton_init_  # noqa: E402

if fused.interpreted() == CUDA:
    pytest.skip("gsgd_backends.fused was imported the other way (interpreted or compiled) in "
                "this process before these tests (run them in a process of their own)",
                allow_module_level=True)


@pytest.fixture(autouse=True, scope="module")
def _interpreter():
    with triton_interpreting(CUDA):
        yield


def _mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 6), nn.ReLU(),
                          nn.Linear(6, 3)).double().to(DEVICE)
    skeleton_init_(model)
    return model


def _cnn():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 4, 3),
                          nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3)).double().to(DEVICE)
    skeleton_init_(model)
    return model


def _bn():
    """A chain (conv -> conv), a PSI weight (followed by batch norm) and parameters outside
    both (the batch norm's and the last layer's)."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Conv2d(4, 3, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(3 * 6 * 6, 4)).double().to(DEVICE)
    skeleton_init_(model)
    return model


def _input(model):
    first = model[0]
    shape = (6, 2, 6, 6) if isinstance(first, nn.Conv2d) else (6, first.in_features)
    return torch.randn(*shape, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(3)).to(DEVICE)


def _backward(model, opt, x):
    opt.zero_grad()
    model(x).square().mean().backward()


def _launches(monkeypatch, modules):
    """The kernels launched by ``modules``, recorded as they run."""
    names = []
    for module in modules:
        real = module.launch

        def launch(kernel, *args, real=real, **kw):
            names.append(kernel.fn.__name__)
            return real(kernel, *args, **kw)
        monkeypatch.setattr(module, "launch", launch)
    return names


def _assert_twins_step_alike(make, opt_class, hyper, steps=3):
    """The model stepped by ``opt_class(fused=True)`` and its copy by ``fused=False``:
    parameters and optimizer states equal to 1e-12 after each of ``steps`` steps."""
    model = make()
    twin = copy.deepcopy(model)
    x = _input(model)
    a, b = opt_class(model, fused=True, **hyper), opt_class(twin, fused=False, **hyper)
    for _ in range(steps):
        for m, o in ((model, a), (twin, b)):
            _backward(m, o, x)
            o.step()
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)
        for p, q in zip(model.parameters(), twin.parameters()):
            for k, v in b.state[q].items():
                torch.testing.assert_close(a.state[p][k], v, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("make, hyper", [
    (_mlp, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (_mlp, dict(lr=0.05, momentum=0.5, dampening=0.3, maximize=True)),
    (_mlp, dict(lr=0.05, weight_decay=0.1)),
    (_cnn, dict(lr=0.05, momentum=0.9, weight_decay=0.01, maximize=True))],
    ids=["mlp-nesterov-wd", "mlp-dampening-maximize", "mlp-wd-alone", "cnn-maximize"])
def test_the_fused_gsgd_step_equals_the_unfused_one(make, hyper, monkeypatch):
    """Every chain of the model in the three launches of one fused step, whose weights,
    biases and momentum equal the unfused step's over three steps."""
    launched = _launches(monkeypatch, [fused])
    _assert_twins_step_alike(make, GSGD, hyper)
    assert launched == ["read_pass", "vector_stage", "write_pass"] * 3


def test_the_fused_psi_sgd_step_equals_the_unfused_one(monkeypatch):
    """PSISGD and GSGD on a model with batch norm: the normalised weight in one fused PSI
    launch, the chain in the fused G-SGD step, the rest by torch's fused SGD; all equal to
    the unfused steps."""
    launched = _launches(monkeypatch, [fused, fused_psi])
    _assert_twins_step_alike(_bn, PSISGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01))
    assert launched == ["psi_rows"] * 3
    launched.clear()
    _assert_twins_step_alike(_bn, GSGD, dict(lr=0.05, momentum=0.9), steps=2)
    assert sorted(launched) == sorted(["psi_rows", "read_pass", "vector_stage",
                                       "write_pass"] * 2)


def test_found_inf_skips_the_fused_step_and_a_grad_scale_unscales_it():
    """As ``GradScaler.step`` hands it: a set ``found_inf`` leaves every parameter and
    buffer as it was; a power-of-two ``grad_scale`` with ``found_inf`` clear steps as the
    unscaled gradients do."""
    model = _bn()
    twin = copy.deepcopy(model)
    x = _input(model)
    opt = GSGD(model, lr=0.05, momentum=0.9, fused=True)
    ref = GSGD(twin, lr=0.05, momentum=0.9, fused=False)
    for m, o in ((model, opt), (twin, ref)):  # momentum buffers to keep
        _backward(m, o, x)
        o.step()
    before = ([p.detach().clone() for p in model.parameters()],
              copy.deepcopy(opt.state_dict()))
    _backward(model, opt, x)
    opt.found_inf = torch.ones((), device=DEVICE)
    opt.grad_scale = torch.full((), 8.0, device=DEVICE)
    opt.step()
    after = list(model.parameters()), opt.state_dict()
    for p, q in zip(after[0], before[0]):
        assert torch.equal(p, q)
    for i, st in before[1]["state"].items():
        for k, v in st.items():
            assert torch.equal(after[1]["state"][i][k], v), (i, k)
    _backward(twin, ref, x)
    ref.step()
    _backward(model, opt, x)
    for p in model.parameters():
        p.grad.mul_(8.0)
    opt.found_inf = torch.zeros((), device=DEVICE)
    opt.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)


def test_a_fused_step_reads_nothing_back_to_the_host():
    """After the first step (its skeleton check reads the weights once), a fused step of a
    chain, a PSI weight and the rest, with momentum, a tensor ``lr`` and GradScaler's
    ``found_inf`` and ``grad_scale``, runs no ``aten::_local_scalar_dense`` (what
    ``.item()``, ``bool()`` and ``float()`` of a tensor run)."""
    model = _bn()
    x = _input(model)
    opt = GSGD(model, lr=torch.tensor(0.05, dtype=torch.float64, device=DEVICE), momentum=0.9,
               fused=True)
    _backward(model, opt, x)
    opt.step()
    ops = []

    class Recording(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    _backward(model, opt, x)
    opt.found_inf = torch.zeros((), device=DEVICE)
    opt.grad_scale = torch.full((), 4.0, device=DEVICE)
    with Recording():
        opt.step()
    assert ops and "aten._local_scalar_dense.default" not in ops


def test_fused_true_on_cpu_tensors_outside_the_interpreter_is_refused(monkeypatch):
    """``fused=True`` on CPU parameters is refused, as ``torch.optim`` refuses it, where the
    kernels are compiled (not interpreted); ``fused=None`` then steps unfused; G-Adam has no
    fused step yet."""
    monkeypatch.setattr(fused, "interpreted", lambda: False)
    with pytest.raises(ValueError, match="^fused=True requires all the params to be CUDA "
                                         "tensors"):
        GSGD(_mlp().cpu(), lr=0.1, fused=True)
    with pytest.raises(ValueError, match="^fused=True requires all the params to be CUDA "
                                         "tensors"):
        PSISGD(_bn().cpu(), lr=0.1, fused=True)
    assert not GSGD(_mlp().cpu(), lr=0.1)._fused
    for make in (GAdam, GAdamW):
        with pytest.raises(ValueError, match="fused G-Adam"):
            make(_mlp(), fused=True)
