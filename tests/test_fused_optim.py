"""The torch optimizers' fused step (``GSGD(..., fused=True)``, ``PSISGD``, ``GAdam``,
``GAdamW``) against the unfused step: compiled on a CUDA device where there is one, else run
by Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1`` set as tests/test_fused.py
sets it, for the same reasons); where the kernels were already imported the other way in
this process, these tests skip.
"""

import collections
import copy
import importlib
import sys

import pytest

from _helpers import DEFAULT_INIT, from_repository, triton_interpreting

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
from test_fused import _counted_launches, _NoHostReads  # noqa: E402

resnet = from_repository("benchmarks.resnet")

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


def _mlp_partly_without_bias():
    """A chain whose middle layer has no bias."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 6, bias=False), nn.ReLU(),
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


def _resnet(blocks):
    """A small ResNet with batch norm (ResNet-18's basic blocks, ``blocks`` of
    ``(channels, stride)``): every convolution a PSI weight, the batch norms' and the
    classifier's parameters outside chains."""
    torch.manual_seed(4)
    layers, cin = [nn.Conv2d(2, 4, 3, 1, 1, bias=False), nn.BatchNorm2d(4), nn.ReLU()], 4
    for cout, stride in blocks:
        layers.append(resnet.BasicBlock(cin, cout, stride))
        cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(cin, 3)).double().to(DEVICE)


#: The ResNets' depths: one basic block (three convolutions), and three with a
#: downsampling one (nine).
RESNETS = (((4, 1),), ((4, 1), (8, 2), (8, 1)))


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


#: How far G-Adam's twins may part: torch's own fused and foreach Adam round differently
#: (on a GPU, and on CPUs whose vector kernels differ), and Adam divides the gradients of
#: the convolution's bias before batch norm, which cancel to rounding noise (1e-18), by
#: ``sqrt(v) + eps`` (1e-8), so the noise moves those biases by up to ``lr * 1e-10``
#: (6e-11 seen on an AMD EPYC CPU); a wrong step moves them by ``lr``.
ADAM_ATOL = 1e-10


def _assert_twins_step_alike(make, opt_class, hyper, steps=3, atol=1e-12):
    """The model stepped by ``opt_class(fused=True)`` and its copy by ``fused=False``:
    parameters and optimizer states equal to ``atol`` (and 1e-12 relative) after each of
    ``steps`` steps; states compared by value (the fused step keeps G-Adam's step counts on
    the parameters' device, as torch's fused Adam does)."""
    model = make()
    twin = copy.deepcopy(model)
    x = _input(model)
    a, b = opt_class(model, fused=True, **hyper), opt_class(twin, fused=False, **hyper)
    for _ in range(steps):
        for m, o in ((model, a), (twin, b)):
            _backward(m, o, x)
            o.step()
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=atol)
        for p, q in zip(model.parameters(), twin.parameters()):
            for k, v in b.state[q].items():
                torch.testing.assert_close(a.state[p][k], v, rtol=1e-12, atol=atol,
                                           check_device=False)


@pytest.mark.parametrize("make, hyper", [
    (_mlp, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (_mlp, dict(lr=0.05, momentum=0.5, dampening=0.3, maximize=True)),
    (_mlp, dict(lr=0.05, weight_decay=0.1)),
    (_mlp_partly_without_bias, dict(lr=0.05, momentum=0.9)),
    (_cnn, dict(lr=0.05, momentum=0.9, weight_decay=0.01, maximize=True))],
    ids=["mlp-nesterov-wd", "mlp-dampening-maximize", "mlp-wd-alone", "mlp-a-layer-without-bias",
         "cnn-maximize"])
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


@pytest.mark.parametrize("opt_class, hyper", [
    (PSISGD, dict(lr=0.05, weight_decay=0.01)), (GSGD, dict(lr=0.05, nesterov=True,
                                                            momentum=0.9, weight_decay=0.01)),
    (PSISGD, dict(lr=0.05, momentum=0.9, max_norm=0.5))],
    ids=["psi-sgd", "psi-sgdm-nesterov-wd", "psi-sgdm-max-norm"])
def test_the_fused_psi_step_of_a_resnet_equals_the_unfused_one(opt_class, hyper):
    """PSI-SGD (no buffers: the kernel reads none) and PSI-SGDM on a ResNet with batch norm,
    the rest by torch's fused SGD: equal to the unfused steps over three steps."""
    _assert_twins_step_alike(lambda: _resnet(RESNETS[0]), opt_class, hyper)


def _counted_steps(counting, opt, model, x, steps=2, scale=None):
    """``steps`` steps of ``opt`` on ``model`` at input ``x``; the last one counted (the
    first makes the buffers, plans and tables). With a ``scale``, each step as
    ``GradScaler.step`` hands it to the optimizer: the gradients times ``scale``, which
    ``grad_scale`` holds, and a clear ``found_inf``."""
    for _ in range(steps):
        _backward(model, opt, x)
        if scale is not None:
            for p in model.parameters():
                p.grad.mul_(scale)
            opt.grad_scale = torch.full((1,), scale, device=DEVICE)
            opt.found_inf = torch.zeros(1, device=DEVICE)
        counting.aten, counting.launches = [], []
        with counting:
            opt.step()
    return collections.Counter(counting.aten + counting.launches)


def _within_budget(counts: list) -> None:
    """Every step at most 8 launches and ATen kernels, and the same ones at every depth but
    the pointer table's copy (``lift_fresh``: made again when the allocator moved a
    gradient)."""
    for c in counts:
        assert sum(c.values()) <= 8, c
    assert len({frozenset((k, v) for k, v in c.items() if "lift_fresh" not in k)
                for c in counts}) == 1, counts


#: A step with or without GradScaler (its ``grad_scale`` and ``found_inf``).
AMP = pytest.mark.parametrize("scale", [None, 1024.0], ids=["", "grad-scaler"])


@AMP
@pytest.mark.parametrize("opt_class, hyper", [
    (PSISGD, dict()), (PSISGD, dict(momentum=0.9, weight_decay=0.01)),
    (GSGD, dict(momentum=0.9, nesterov=True, weight_decay=0.01))],
    ids=["psi-sgd", "psi-sgdm-wd", "gsgd-nesterov-wd"])
def test_a_fused_psi_step_of_a_resnet_is_at_most_8_launches_whatever_its_depth(
        opt_class, hyper, scale, monkeypatch):
    """PSI-SGD(M) on ResNets with batch norm of three and nine convolutions, at a device
    learning rate: after the first step, one step launches the PSI kernel once and at
    most 7 ATen kernels (the rest's flag cleared and torch's check of its gradients into
    it, torch's fused SGD of the rest, the learning rate in its dtype, the pointer table
    where a gradient moved), the same at both depths; with GradScaler too (the kernels
    and torch's fused SGD unscale as they read, the rest skips on its ``found_inf``)."""
    counting = _counted_launches(monkeypatch, fused, fused_psi)
    counts = []
    for blocks in RESNETS:
        model = _resnet(blocks)
        lr = torch.tensor(0.05, dtype=torch.float64, device=DEVICE)
        counts.append(_counted_steps(counting, opt_class(model, lr=lr, fused=True, **hyper),
                                     model, _input(model), scale=scale))
        assert counting.launches == ["psi_rows"]
    _within_budget(counts)


@DEFAULT_INIT
@AMP
@pytest.mark.parametrize("opt_class, hyper", [
    (GSGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (GAdamW, dict(lr=0.01, amsgrad=True))], ids=["gsgd-nesterov-wd", "gadamw-amsgrad"])
def test_a_fused_chain_step_is_at_most_8_launches_for_any_depth_and_number_of_chains(
        opt_class, hyper, scale, monkeypatch):
    """One chain of 2 layers, then chains of 12 and 2 layers, in one optimizer: after the
    first step, one step is the three launches of the fused step and at most 5 ATen
    kernels, the same for both (no launch per chain or layer); with GradScaler too (the
    kernels unscale the gradients as they read them)."""
    counting = _counted_launches(monkeypatch, fused)
    counts = []
    for depths in ((2,), (12, 2)):
        torch.manual_seed(5)
        layers = [[nn.Linear(3, 3).double().to(DEVICE) for _ in range(d)] for d in depths]
        model = nn.Sequential(*[nn.Sequential(*chain) for chain in layers])
        opt = opt_class(list(model.parameters()), chains=layers, fused=True, **hyper)
        model.forward = lambda x, model=model: sum(torch.relu(m(x)) for m in model)
        counts.append(_counted_steps(counting, opt, model, _input(model[0]), scale=scale))
        assert counting.launches == ["read_pass", "vector_stage", "write_pass"]
    _within_budget(counts)


@pytest.mark.parametrize("lr", [0.01, torch.tensor(0.01)], ids=["float", "float32-tensor"])
def test_a_fused_gadamw_step_with_the_rest_under_grad_scaler_is_at_most_8_launches(
        lr, monkeypatch):
    """G-AdamW (AMSGrad) on a chain and parameters outside it, under GradScaler: after the
    first step, one step is the three launches of the fused step and torch's fused AdamW of
    the rest (its step counts incremented, the update, the skipped step's counts taken
    back, and a 0-d view of ``found_inf``), which reads the gradients unscaled and skips on
    GradScaler's ``found_inf`` itself: at most 8."""
    counting = _counted_launches(monkeypatch, fused)
    model = _bn()
    opt = GAdamW(model, lr=lr.to(DEVICE) if isinstance(lr, torch.Tensor) else lr,
                 amsgrad=True, fused=True)
    count = _counted_steps(counting, opt, model, _input(model), scale=1024.0)
    assert counting.launches == ["read_pass", "vector_stage", "write_pass"]
    assert sum(count.values()) <= 8, count


@pytest.mark.parametrize("opt_class, hyper", [
    (GAdam, dict(lr=0.01, weight_decay=0.1)),
    (GAdamW, dict(lr=0.01, amsgrad=True, maximize=True)),
    (GAdam, dict(lr=0.01, betas=(0.8, 0.9), eps=1e-3))],
    ids=["gadam-l2", "gadamw-amsgrad-maximize", "gadam-betas-eps"])
def test_the_fused_gadam_step_equals_the_unfused_one(opt_class, hyper, monkeypatch):
    """G-Adam and G-AdamW on a model with batch norm: the chain in the three launches of
    the fused G-Adam step, the rest (the convolution before the batch norm, the batch
    norm) by torch's fused Adam; parameters and moments equal to the unfused steps over
    three steps."""
    launched = _launches(monkeypatch, [fused])
    _assert_twins_step_alike(_bn, opt_class, hyper, atol=ADAM_ATOL)
    assert launched == ["read_pass", "vector_stage", "write_pass"] * 3


class _Spare(nn.Module):
    """``net`` and a layer its forward never reaches: a parameter outside chains that
    never gets a gradient."""

    def __init__(self, net):
        super().__init__()
        self.net, self.spare = net, nn.Linear(3, 2).double().to(DEVICE)

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize("opt_class, hyper", [(GSGD, dict(lr=0.05, momentum=0.9)),
                                              (GAdam, dict(lr=0.01))], ids=["gsgd", "gadam"])
@pytest.mark.parametrize("make", [_mlp, _bn], ids=["chain-alone", "with-rest"])
def test_parameters_without_a_gradient_are_left_alone_by_the_fused_step(make, opt_class,
                                                                         hyper):
    """A parameter that gets no gradient (the rest of a model whose other parameters are
    all in chains, or beside a rest that has gradients) is not stepped, as torch leaves
    it; everything else steps as unfused."""
    model, x = _Spare(make()), _input(make())
    twin = copy.deepcopy(model)
    spare = model.spare.weight.detach().clone()
    a, b = opt_class(model, fused=True, **hyper), opt_class(twin, fused=False, **hyper)
    for _ in range(2):
        for m, o in ((model, a), (twin, b)):
            _backward(m, o, x)
            o.step()
    assert model.spare.weight.grad is None and torch.equal(model.spare.weight, spare)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=ADAM_ATOL)


@pytest.mark.parametrize("opt_class", [GSGD, GAdam])
def test_check_finite_names_a_non_finite_gradient_outside_chains_under_fused(opt_class):
    """``check_finite`` reads every gradient under ``fused`` too: one outside chains that
    holds NaN is refused with its name, before anything is written."""
    model = _bn()
    opt = opt_class(model, fused=True, lr=0.01, check_finite=True)
    _backward(model, opt, _input(model))
    model[1].bias.grad[0] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"non-finite gradient in 1\.bias"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.parametrize("opt_class, hyper", [(GSGD, dict(lr=0.05, momentum=0.9)),
                                              (GAdam, dict(lr=0.01))], ids=["gsgd", "gadam"])
def test_found_inf_skips_the_fused_step_and_a_grad_scale_unscales_it(opt_class, hyper):
    """As ``GradScaler.step`` hands it: a set ``found_inf`` leaves every parameter and
    buffer (momentum; G-Adam's moments and step counts, the chain's and torch's fused
    Adam's) as it was; a power-of-two ``grad_scale`` with ``found_inf`` clear steps as the
    unscaled gradients do."""
    model = _bn()
    twin = copy.deepcopy(model)
    x = _input(model)
    opt = opt_class(model, fused=True, **hyper)
    ref = opt_class(twin, fused=False, **hyper)
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
        torch.testing.assert_close(p, q, rtol=1e-12,
                                   atol=ADAM_ATOL if opt_class is GAdam else 1e-12)


def _frozen_bias():
    """The MLP with its first bias frozen: its chain steps unfused."""
    model = _mlp()
    model[0].bias.requires_grad_(False)
    return model


def _scaled_steps(model, opt, scaler, x, inf_at):
    """Three steps of ``opt`` driven by ``scaler`` (``torch.amp.GradScaler``), a gradient
    made infinite before step ``inf_at``; the gradients after each step (of the parameters
    that have one)."""
    grads = []
    for i in range(3):
        opt.zero_grad()
        scaler.scale(model(x).square().mean()).backward()
        if i == inf_at:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    return grads


@pytest.mark.filterwarnings("ignore::gsgd_adapters.torch.SkippedStepWarning")  # unfused chain
@pytest.mark.parametrize("make, opt_class, hyper, scale", [
    (_bn, GSGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01), 2.0 ** 10),
    (_bn, GAdamW, dict(lr=0.01, amsgrad=True), 2.0 ** 10),
    (lambda: _resnet(RESNETS[0]), PSISGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01),
     2.0 ** 10),
    (_mlp, GSGD, dict(lr=0.05, momentum=0.5, dampening=0.3, maximize=True), 3.0),
    (_frozen_bias, GSGD, dict(lr=0.05, momentum=0.9), 3.0)],
    ids=["gsgd-nesterov-wd", "gadamw-amsgrad", "psi-sgdm-wd", "gsgd-maximize-scale-3",
         "frozen-bias-unfused"])
def test_the_fused_step_under_grad_scaler_equals_the_unfused_one(make, opt_class, hyper,
                                                                 scale):
    """Twins stepped by ``GradScaler`` (one skipped step: an infinite gradient, the scale
    backed off), ``fused=True`` and ``fused=False``: parameters, states and the gradients
    left after each step taken (unscaled, as ``scaler.unscale_`` and torch's fused
    optimizers leave them) equal to 1e-12. The chains of an MLP at a scale of 3 (no
    parameter outside them) read the gradients times ``1 / 3`` rounded to float32, as
    ``scaler.unscale_`` multiplies them; a chain that steps unfused (a frozen bias) reads them unscaled too."""
    model = make()
    twin = copy.deepcopy(model)
    x = _input(model)
    a, b = opt_class(model, fused=True, **hyper), opt_class(twin, fused=False, **hyper)
    got, want = (_scaled_steps(m, o, torch.amp.GradScaler(DEVICE.type, init_scale=scale), x,
                               inf_at=1) for m, o in ((model, a), (twin, b)))
    atol = ADAM_ATOL if opt_class is GAdamW else 1e-12
    for g, w in (got[0], want[0]), (got[2], want[2]):  # the steps taken
        for p, q in zip(g, w):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=atol)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=atol)
        for k, v in b.state[q].items():
            torch.testing.assert_close(a.state[p][k], v, rtol=1e-12, atol=atol,
                                       check_device=False)


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


def test_a_fused_psi_step_of_a_resnet_reads_nothing_back_to_the_host(monkeypatch):
    """PSI-SGDM on a ResNet with batch norm, with a device learning rate and GradScaler's
    ``found_inf`` and ``grad_scale``: ``item``, ``bool``, ``tolist``, ``cpu``, ``numpy``,
    ``float``, ``int`` of any tensor raise during a step, no
    ``aten._local_scalar_dense`` runs, and the step takes place."""
    model = _resnet(RESNETS[1])
    x = _input(model)
    opt = PSISGD(model, lr=torch.tensor(0.05, dtype=torch.float64, device=DEVICE),
                 momentum=0.9, fused=True)
    counting = _counted_launches(monkeypatch, fused, fused_psi)
    for _ in range(2):
        _backward(model, opt, x)
        before = [p.detach().clone() for p in model.parameters()]
        opt.found_inf = torch.zeros((), device=DEVICE)
        opt.grad_scale = torch.full((), 4.0, device=DEVICE)
        with counting, _NoHostReads():
            opt.step()
        assert "aten._local_scalar_dense.default" not in counting.aten
        assert not any(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_fused_true_on_cpu_tensors_outside_the_interpreter_is_refused(monkeypatch):
    """``fused=True`` on CPU parameters is refused, as ``torch.optim`` refuses it, where the
    kernels are compiled (not interpreted), G-Adam's too; ``fused=None`` then steps
    unfused."""
    monkeypatch.setattr(fused, "interpreted", lambda: False)
    with pytest.raises(ValueError, match="^fused=True requires all the params to be CUDA "
                                         "tensors"):
        GSGD(_mlp().cpu(), lr=0.1, fused=True)
    with pytest.raises(ValueError, match="^fused=True requires all the params to be CUDA "
                                         "tensors"):
        PSISGD(_bn().cpu(), lr=0.1, fused=True)
    assert not GSGD(_mlp().cpu(), lr=0.1)._fused
    for make in (GAdam, GAdamW):
        with pytest.raises(ValueError, match="^fused=True requires all the params to be "
                                             "CUDA tensors"):
            make(_mlp().cpu(), fused=True)


@pytest.mark.parametrize("fused, backward_sums, taken", [
    (True, None, {}), (True, True, {"backward": 1}), (False, None, {"backward": 1})])
def test_the_fused_step_reads_w_times_grad_unless_asked_for_the_backward_sums(
        fused, backward_sums, taken):
    """The fused step's default: no backward-pass hooks (on a GPU their launches cost the
    training step more than the read of ``W * grad`` they save); asked for, it takes them;
    the unfused step takes them by default."""
    model = _mlp()
    opt = GSGD(model, lr=0.05, fused=fused, backward_sums=backward_sums)
    _backward(model, opt, _input(model))
    opt.step()
    assert opt.describe().column_sums == taken


@pytest.mark.parametrize("opt_class", [GSGD, GAdam])
def test_the_backward_pass_sums_spare_a_fused_step_of_chains_without_biases_its_read_pass(
        opt_class, monkeypatch):
    """Asked for, the backward pass's column sums are what the fused step reads: chains
    without biases then have no gradient to read before the write pass (two launches, no
    read pass), and step as the unfused step, which takes those sums too."""
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 7, bias=False), nn.ReLU(),
                              nn.Linear(7, 3, bias=False)).double().to(DEVICE)
        skeleton_init_(model)
        return model

    launched = _launches(monkeypatch, [fused])
    _assert_twins_step_alike(make, lambda m, **kw: opt_class(m, backward_sums=True, **kw),
                             dict(lr=0.01), steps=2, atol=ADAM_ATOL)
    assert launched == ["vector_stage", "write_pass"] * 2


@pytest.mark.parametrize("hyper", [dict(lr=0.05), dict(lr=0.05, weight_decay=0.1)],
                         ids=["sgd", "weight-decay"])
def test_the_fused_gsgd_step_without_momentum_keeps_no_state_as_the_unfused_one(hyper):
    """Without momentum G-SGD keeps no buffer: the fused step adds nothing to the
    optimizer's state either (no momentum buffer, no step count in it)."""
    model = _mlp()
    twin = copy.deepcopy(model)
    a, b = GSGD(model, fused=True, **hyper), GSGD(twin, fused=False, **hyper)
    for m, o in ((model, a), (twin, b)):
        _backward(m, o, _input(m))
        o.step()
    assert a.state_dict()["state"] == b.state_dict()["state"] == {}


def test_the_nonfinite_flag_is_kept_per_device_and_set_from_found_inf():
    """:func:`~gsgd_adapters.torch.functional.nonfinite_flag`: without ``held``, a fresh
    float32 flag; with it, the same tensor at every call (no tensor made per step), cleared
    for finite gradients, set for a non-finite one or from a set ``found_inf``."""
    from gsgd_adapters.torch.functional import nonfinite_flag

    grads = [torch.ones(3, dtype=torch.float64, device=DEVICE)]
    flag = nonfinite_flag(grads)
    assert (flag.dtype, flag.shape, flag.device) == (torch.float32, (1,), grads[0].device)
    assert float(flag) == 0.0
    held = {}
    first = nonfinite_flag(grads, torch.ones(1, device=DEVICE), held)
    assert float(first) != 0.0 and list(held) == [grads[0].device]
    again = nonfinite_flag(grads, None, held)
    assert again is first and float(again) == 0.0
    nan = torch.full((2,), float("nan"), device=DEVICE)
    assert float(nonfinite_flag(grads + [nan], None, held)) != 0.0
    assert torch.equal(grads[0], torch.ones(3, dtype=torch.float64, device=DEVICE))


def test_a_fused_step_under_a_float64_default_dtype_equals_the_unfused_one():
    """``torch.set_default_dtype(torch.float64)`` (as scientific code sets it) changes
    nothing: the rest's skip flag is still the float32 torch's check takes."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        _assert_twins_step_alike(_bn, GSGD, dict(lr=0.05, momentum=0.9), steps=1)
    finally:
        torch.set_default_dtype(old)


def test_the_rest_reads_a_tensor_lr_in_float32_as_torchs_fused_sgd_on_a_gpu():
    """Under ``fused``, torch's fused SGD steps the parameters outside chains with the
    tensor ``lr`` in float32, the only dtype its CUDA kernels read, on the CPU too (the
    same step on both): a float64 ``lr`` steps them as its float32 rounding does."""
    model = _bn()
    twin = copy.deepcopy(model)
    x = _input(model)
    lr = torch.tensor(0.05, dtype=torch.float64, device=DEVICE)
    opt = GSGD(model, lr=lr, fused=True)
    rest = [twin[0].bias, twin[1].weight, twin[1].bias]
    ref = torch.optim.SGD(rest, lr=lr.float(), fused=True)
    for m, o in ((model, opt), (twin, ref)):
        _backward(m, o, x)
        o.step()
    for p, q in zip([model[0].bias, model[1].weight, model[1].bias], rest):
        assert torch.equal(p, q)


def test_fused_is_a_bool_and_true_is_refused_where_no_fused_step_can_run(monkeypatch):
    """``use_fused``: ``False`` for ``fused=False`` and by default on CPU tensors; ``True``
    refused with a message saying why: an algorithm without a fused step, and Triton not
    importing (``fused=None`` then steps unfused)."""
    from gsgd_adapters.torch.functional import use_fused

    params = list(_mlp().parameters())
    assert use_fused(False, params, "G-SGD", True) is False
    assert use_fused(None, [p.cpu() for p in params], "G-SGD", True) is False
    with pytest.raises(ValueError, match="^fused=True: the fused Path-SGD step is not "
                                         "available; use fused=False$"):
        use_fused(True, params, "Path-SGD", False)
    monkeypatch.setitem(sys.modules, "gsgd_backends.fused", None)  # Triton missing
    with pytest.raises(ValueError, match="^fused=True requires Triton"):
        GSGD(_mlp(), lr=0.1, fused=True)
    assert use_fused(None, params, "G-SGD", True) is False


@pytest.mark.filterwarnings("ignore:G-.*had no gradient:UserWarning")
@pytest.mark.parametrize("opt_class, hyper", [(GSGD, dict(lr=0.05, momentum=0.9)),
                                              (GAdam, dict(lr=0.01))], ids=["gsgd", "gadam"])
@pytest.mark.parametrize("what", ["weight", "bias"])
def test_a_layer_frozen_after_the_optimizer_was_built_is_never_written_by_the_fused_step(
        what, opt_class, hyper):
    """A weight or bias frozen mid-training (no gradient from then on, the optimizer built
    before) is left as it was, and the chain steps as unfused (the runs of layers with a
    gradient; a bias without one fixed), not by the fused step, which takes whole chains."""
    model = _mlp()
    twin, x = copy.deepcopy(model), _input(model)
    a, b = opt_class(model, fused=True, **hyper), opt_class(twin, fused=False, **hyper)
    for step in range(3):
        if step == 1:  # the middle layer's
            for m in model, twin:
                getattr(m[2], what).requires_grad_(False)
            frozen = getattr(model[2], what).detach().clone()
        for m, o in ((model, a), (twin, b)):
            _backward(m, o, x)
            o.step()
    assert torch.equal(getattr(model[2], what), frozen)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("opt_class, hyper", [
    (GSGD, dict(lr=0.05, momentum=0.9, weight_decay=0.1)),
    (GAdam, dict(lr=0.01, weight_decay=0.1))], ids=["gsgd", "gadam"])
def test_a_frozen_bias_with_a_zeroed_stale_gradient_is_never_written_by_the_fused_step(
        opt_class, hyper):
    """A bias frozen before the optimizer was built keeps the gradient of its last
    backward pass, zeroed (not dropped) by ``zero_grad(set_to_none=False)``: it is still a
    basis path that never moves, under weight decay too, as unfused."""
    model = _mlp()
    x = _input(model)
    model(x).square().mean().backward()  # trained before the bias was frozen
    model[0].bias.requires_grad_(False)
    twin = copy.deepcopy(model)
    frozen = model[0].bias.detach().clone()
    a, b = opt_class(model, fused=True, **hyper), opt_class(twin, fused=False, **hyper)
    for _ in range(2):
        for m, o in ((model, a), (twin, b)):
            o.zero_grad(set_to_none=False)
            m(x).square().mean().backward()
            o.step()
    assert model[0].bias.grad is not None and torch.equal(model[0].bias, frozen)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)


@pytest.mark.filterwarnings("ignore::gsgd_adapters.torch.SkeletonWarning")  # chain through bn
@pytest.mark.parametrize("opt_class, hyper", [(GSGD, dict(lr=0.05, momentum=0.9)),
                                              (GAdam, dict(lr=0.01))], ids=["gsgd", "gadam"])
def test_a_chain_through_batch_norm_under_bn_paper_steps_under_fused_as_unfused(opt_class,
                                                                                 hyper):
    """``bn="paper"`` scales the gradients of a chain through batch norm by row norms,
    which the fused step does not: that chain steps unfused under ``fused=True``, equal to
    ``fused=False``."""
    _assert_twins_step_alike(_bn, lambda m, **kw: opt_class(m, bn="paper", **kw), hyper,
                             steps=2)


def test_a_chain_fsdp2_shards_steps_under_fused_as_on_the_unsharded_model(one_process_group):
    """FSDP2's chains (DTensor rows) step by the sharded kernels under ``fused=True``, not
    the fused step: as the unsharded model steps, in a world of one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    plain = _mlp()
    model, mesh = copy.deepcopy(plain), init_device_mesh(DEVICE.type, (1,))
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = _input(plain)
    a = GSGD(model, lr=0.05, momentum=0.9, fused=True)
    b = GSGD(plain, lr=0.05, momentum=0.9, fused=False)
    for _ in range(2):
        for m, o in ((model, a), (plain, b)):
            _backward(m, o, x)
            o.step()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("key", ["momentum", "dampening", "weight_decay"])
def test_a_hyperparameter_set_to_a_tensor_of_two_elements_is_refused_beside_a_tensor_lr(key):
    """Under ``fused`` a tensor ``lr`` is left to the kernels, but nothing else: a group's
    other hyperparameter set (after construction) to a tensor of two elements is refused
    naming it, as without a tensor ``lr``, before any parameter is written."""
    model = _mlp()
    x = _input(model)
    opt = GSGD(model, lr=torch.tensor(0.05), momentum=0.9, fused=True)
    _backward(model, opt, x)
    opt.step()
    opt.param_groups[0][key] = torch.tensor([0.1, 0.1])
    _backward(model, opt, x)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=f"^{key} as a tensor must have one element"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
