"""On a CUDA device: every optimizer steps a model there as it steps the same model on the
CPU, and every tensor it makes (state, step counts, scratch, masks) is made on the model's
device. A CPU run cannot tell these apart: there the default device is the weights' own.
Skipped without CUDA (the CuPy and CUDA namespaces of the property tests are too)."""

import copy

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402

import gsgd_core as gc  # noqa: E402
from _helpers import DEFAULT_INIT  # noqa: E402
from gsgd_adapters.torch import GAdam, GSGD, PSISGD, skeleton_init_  # noqa: E402
from gsgd_backends import kernels_for  # noqa: E402
from gsgd_backends.fast import plan_for  # noqa: E402

pytestmark = [DEFAULT_INIT, pytest.mark.skipif(not torch.cuda.is_available(),
                                               reason="no CUDA device")]
CUDA = torch.device("cuda")
F64 = torch.float64


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8, dtype=F64), nn.ReLU(), nn.Linear(8, 5, dtype=F64),
                         nn.ReLU(), nn.Linear(5, 3, dtype=F64))


def paper_mlp():
    model = mlp()
    skeleton_init_(model, skeleton="paper")
    return model


def normed_mlp():
    """Layer 0 is normalised (PSI's); layer 3 and the norm's parameters are the rest."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8, dtype=F64), nn.BatchNorm1d(8, dtype=F64), nn.ReLU(),
                         nn.Linear(8, 3, dtype=F64))


OPTIMIZERS = {
    "G-SGD": (mlp, lambda m: GSGD(m, lr=0.05)),
    "G-SGD with momentum, Nesterov and weight decay": (
        mlp, lambda m: GSGD(m, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    "G-SGD, the paper's skeleton": (paper_mlp, lambda m: GSGD(m, lr=0.05, skeleton="paper")),
    "G-Adam": (mlp, lambda m: GAdam(m, lr=1e-3)),
    "PSI-SGD": (normed_mlp, lambda m: PSISGD(m, lr=0.05, momentum=0.9)),
}


def _batch():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(16, 6, generator=g, dtype=F64),
            torch.randn(16, 3, generator=g, dtype=F64))


def _train(model, opt, x, y, steps=4, scaler=None):
    for _ in range(steps):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def _tensors(state):
    return [v for per_param in state.values() for v in per_param.values()
            if isinstance(v, torch.Tensor)]


def _assert_same_run(cpu, gpu, gpu_opt):
    for (name, p), q in zip(cpu.named_parameters(), gpu.parameters()):
        assert q.device.type == "cuda", name
        torch.testing.assert_close(q.cpu(), p, rtol=1e-9, atol=1e-12, msg=name)
    assert {t.device.type for t in _tensors(gpu_opt.state)} <= {"cuda"}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_an_optimizer_steps_a_cuda_model_as_it_steps_a_cpu_one(name):
    make, optimizer = OPTIMIZERS[name]
    cpu = make()
    gpu = copy.deepcopy(cpu).to(CUDA)
    x, y = _batch()
    _train(cpu, optimizer(cpu), x, y)
    opt = optimizer(gpu)
    _train(gpu, opt, x.to(CUDA), y.to(CUDA))
    _assert_same_run(cpu, gpu, opt)


def test_a_cuda_model_under_a_grad_scaler_steps_as_an_unscaled_cpu_one():
    """``GradScaler.step`` unscales the gradients on their device (a power-of-two scale:
    exactly)."""
    cpu, x, y = mlp(), *_batch()
    gpu = copy.deepcopy(cpu).to(CUDA)
    _train(cpu, GSGD(cpu, lr=0.05, momentum=0.9), x, y)
    opt = GSGD(gpu, lr=0.05, momentum=0.9)
    _train(gpu, opt, x.to(CUDA), y.to(CUDA),
           scaler=torch.amp.GradScaler("cuda", init_scale=2.0**10))
    _assert_same_run(cpu, gpu, opt)


def test_the_paper_skeleton_is_seen_initialised_on_cuda():
    """The skeleton check reads CUDA weights: initialised as made; a free edge moved (which
    G-SGD never moves) leaves it unknown."""
    gpu = paper_mlp().to(CUDA)
    [(_, chain, initialised)] = GSGD(gpu, lr=0.05, skeleton="paper").describe().chains
    assert initialised
    free = chain.free_mask(2).reshape(gpu[2].weight.shape)
    edge = tuple(int(i[0]) for i in free.nonzero())
    with torch.no_grad():
        gpu[2].weight[edge] = 2.0
    assert GSGD(gpu, lr=0.05, skeleton="paper").describe().chains[0][2] is None


def test_a_plan_that_does_not_fit_names_the_first_weights_device():
    chain = gc.Chain.mlp([6, 8, 3])
    weights = [torch.ones(8, 6, dtype=F64, device=CUDA), torch.ones(3, 8, dtype=F64)]
    cpu_plan = kernels_for(weights[1]).plan(chain, weights[1])
    with pytest.raises(ValueError, match="on cuda:0"):
        plan_for(kernels_for(weights[0]), chain, weights, cpu_plan)
