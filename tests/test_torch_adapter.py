"""gsgd_adapters.torch: chain discovery, trajectories against the core, invariance of whole
training runs, and torch.optim behaviour (state_dict, schedulers, closure, GradScaler, ...)."""

import copy
import io
import math
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

import gsgd_core as gc
from _helpers import DEFAULT_INIT, assert_close, record_calls
from gsgd_adapters.torch import (GAdam, GAdamW, GSGD, PSISGD, PathSGD, SkeletonWarning,
                                 SkippedStepWarning, check_invariance, discover,
                                 random_rescale_, skeleton_init_)

pytestmark = DEFAULT_INIT


@pytest.fixture(autouse=True, scope="module")
def float64_default():
    """These tests compare trajectories in float64; restore the default afterwards."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5), nn.ReLU(), nn.Linear(5, 3))


def cnn():
    """conv -> pool -> conv -> pool -> flatten -> linear -> linear: ONE chain."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(4, 5, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
                         nn.Flatten(), nn.Linear(5 * 2 * 2, 6), nn.ReLU(), nn.Linear(6, 3))


def mlp_partly_without_bias():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5, bias=False), nn.ReLU(),
                         nn.Linear(5, 3))


def normed_mlp():
    """Layer 0 is normalised (a PSI part); layer 3 and the norm's parameters are the rest."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def data(model, n=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    shape = (n, 6) if isinstance(model[0], nn.Linear) else (n, 2, 8, 8)
    return torch.randn(shape, generator=g), torch.randn(n, 3, generator=g)


def loss_of(model, x, y):
    return ((model(x) - y) ** 2).mean()


def train(model, opt, x, y, steps):
    for _ in range(steps):
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
    return model


def _load(modules, W, b):
    """Copy the core's results into the layers."""
    with torch.no_grad():
        for m, w, v in zip(modules, W, b):
            m.weight.copy_(w)
            if v is not None:
                m.bias.copy_(v)


MODELS = [mlp, cnn]


@pytest.mark.parametrize("make", MODELS)
def test_discovery_finds_one_chain_through_pooling_and_flatten(make):
    model = make()
    found = discover(model)
    assert len(found.chains) == 1
    layers = [m for m in model if isinstance(m, (nn.Linear, nn.Conv2d))]
    assert found.chains[0].modules == layers
    opt = GSGD(model, lr=0.1)
    d = opt.describe()
    assert d.fallback == [] and d.H == sum(m.weight.shape[0] for m in layers[:-1])
    assert d.m == sum(p.numel() for p in model.parameters())
    assert ("; skeleton NOT initialised for skeleton='he' (call skeleton_init_(model)); "
            "lr=0.1, momentum=0, weight_decay=0") in str(opt)
    skeleton_init_(model)
    assert opt.describe().chains[0][2] and "skeleton initialised" in repr(opt)


@pytest.mark.parametrize("make", MODELS + [mlp_partly_without_bias])
@pytest.mark.parametrize("hyper", [dict(lr=0.05), dict(lr=0.05, momentum=0.9, nesterov=True,
                                                          weight_decay=1e-3),
                                   dict(lr=0.05, momentum=0.9, dampening=0.5)])
@pytest.mark.parametrize("by_hand", [False, True], ids=["found", "chains by hand"])
def test_trajectory_equals_the_core(make, hyper, by_hand):
    """Chains found in the model, or given by hand as lists of modules (no batch norm in
    them: their gradients are the plain ones), step as the core does."""
    model = make()
    twin = copy.deepcopy(model)
    x, y = data(model)
    chain = discover(twin).chains[0]
    opt = GSGD(model.parameters(), chains=[[model.get_submodule(n) for n in chain.names]],
               **hyper) if by_hand else GSGD(model, **hyper)
    core_chain = chain.chain.with_skeleton_scale(chain.chain.he_skeleton_scale())
    W = [m.weight.detach().clone() for m in chain.modules]
    b = [None if m.bias is None else m.bias.detach().clone() for m in chain.modules]
    state = gc.gsgd_init(core_chain, W, b)
    for _ in range(5):
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
        twin.zero_grad()
        loss_of(twin, x, y).backward()
        G = [m.weight.grad for m in chain.modules]
        Gb = [None if m.bias is None else m.bias.grad for m in chain.modules]
        W, b, state = gc.gsgd_update(core_chain, state, W, b, G, Gb, **hyper)
        _load(chain.modules, W, b)
    # The step takes the fused fast path: the core's trajectory to float64 rounding.
    for p, q in zip(model.parameters(), twin.parameters()):
        assert p.dtype == torch.float64
        assert_close(p.detach().numpy(), q.detach().numpy(), 1e-10)


def _rescaled_twin(model, spread=1.0, seed=0):
    twin = copy.deepcopy(model)
    random_rescale_(twin, np.random.default_rng(seed), spread)
    return twin


@pytest.mark.parametrize("make", MODELS)
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_rescaled_twins_train_identically_under_gsgd_but_not_sgd(make, momentum):
    model = make()
    skeleton_init_(model)
    twin = _rescaled_twin(model)
    x, y = data(model)
    assert torch.allclose(model(x), twin(x), rtol=1e-12)
    ma, mb = copy.deepcopy(model), copy.deepcopy(twin)
    train(ma, GSGD(ma, lr=0.02, momentum=momentum), x, y, 20)
    train(mb, GSGD(mb, lr=0.02, momentum=momentum), x, y, 20)
    with torch.no_grad():
        out_a, out_b = ma(x), mb(x)
    assert torch.allclose(out_b, out_a, rtol=1e-8, atol=1e-8 * float(out_a.abs().max()))
    assert not torch.allclose(out_a, model(x), atol=1e-3)  # it did train
    sa, sb = copy.deepcopy(model), copy.deepcopy(twin)
    train(sa, torch.optim.SGD(sa.parameters(), lr=0.02, momentum=momentum), x, y, 20)
    train(sb, torch.optim.SGD(sb.parameters(), lr=0.02, momentum=momentum), x, y, 20)
    assert (sa(x) - sb(x)).abs().max() > 1e-4


def test_state_dict_resume_is_bit_exact_and_weights_only_loadable():
    model = cnn()
    x, y = data(model)
    opt = GSGD(model, lr=0.05, momentum=0.9)
    train(model, opt, x, y, 3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed = cnn()
    resumed.load_state_dict(saved["model"])
    opt2 = GSGD(resumed, lr=0.05, momentum=0.9)
    opt2.load_state_dict(saved["opt"])
    train(model, opt, x, y, 3)
    train(resumed, opt2, x, y, 3)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def test_torch_distributed_checkpoint_state_dicts_resume_bit_exactly():
    """``torch.distributed.checkpoint.state_dict``'s ``get_state_dict`` keeps only torch's
    keys (``state``, ``param_groups``): ``set_state_dict`` loads them without the layout
    the optimizer's own state dict carries, and the next steps are the same."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = cnn()
    x, y = data(model)
    opt = GSGD(model, lr=0.05, momentum=0.9)
    train(model, opt, x, y, 3)
    msd, osd = get_state_dict(model, opt)
    assert set(osd) == {"state", "param_groups"}
    saved = copy.deepcopy({"model": msd, "optim": osd})
    resumed = cnn()
    opt2 = GSGD(resumed, lr=0.05, momentum=0.9)
    set_state_dict(resumed, opt2, model_state_dict=saved["model"],
                   optim_state_dict=saved["optim"])
    train(model, opt, x, y, 3)
    train(resumed, opt2, x, y, 3)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def test_a_chains_state_is_torchs_momentum_buffers_and_one_step_count():
    """The saved format of a chain's state: each parameter's ``momentum_buffer`` (as
    torch.optim.SGD keeps it) and, on the chain's first weight, the count of its steps (an
    int32 tensor): a state dict saved before must resume after a change of version."""
    model = mlp_partly_without_bias()
    x, y = data(model)
    opt = GSGD(model, lr=0.05, momentum=0.9)
    train(model, opt, x, y, 3)
    first = model[0].weight
    assert set(opt.state) == set(model.parameters())
    assert opt.state[first]["step"].dtype == torch.int32 and int(opt.state[first]["step"]) == 3
    for p in model.parameters():
        assert set(opt.state[p]) == {"momentum_buffer"} | ({"step"} if p is first else set())


@pytest.mark.parametrize("maximize, compile", [(False, False), (True, True)])
def test_every_chain_step_takes_its_kept_plan_and_the_backward_passs_column_sums(
        maximize, compile, monkeypatch):
    """The step hands each chain's update the step plan the optimizer keeps for it (built
    once, reused while it fits, of the compiled kernels under ``compile=True``) and the
    column sums taken during the backward pass (negated to maximise, as the gradients
    are)."""
    import gsgd_adapters.torch.functional as optim
    import gsgd_backends.torch as gbt
    from gsgd_backends import StepPlan

    calls, update_ = [], optim.gsgd_update_

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return update_(*args, **kwargs)

    monkeypatch.setattr(optim, "gsgd_update_", spy)
    model = mlp()
    x, y = data(model)
    opt = GSGD(model, lr=0.05, momentum=0.9, maximize=maximize, compile=compile)
    train(model, opt, x, y, 3)
    assert len(calls) == 3 and all(isinstance(c["plan"], StepPlan) for c in calls)
    assert calls[0]["plan"] is calls[1]["plan"] is calls[2]["plan"]
    assert (set(calls[0]["plan"].layer_kernels) == {gbt.COMPILED}) == compile
    assert all(c["column_sums"] is not None for c in calls)
    assert opt.describe().column_sums


def test_state_dict_of_another_structure_is_refused():
    opt = GSGD(mlp(), lr=0.1, momentum=0.9)
    other = GSGD(cnn(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="saved for a different structure"):
        other.load_state_dict(opt.state_dict())


def test_scheduler_closure_zero_grad_and_grads_left_untouched():
    model = mlp()
    x, y = data(model)
    opt = GSGD(model, lr=0.1, momentum=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    lrs = []
    for _ in range(3):
        def closure():
            opt.zero_grad()
            loss = loss_of(model, x, y)
            loss.backward()
            return loss
        loss = opt.step(closure)
        assert torch.is_tensor(loss)
        grads = [p.grad.clone() for p in model.parameters()]
        lrs.append(opt.param_groups[0]["lr"])
        for p, g in zip(model.parameters(), grads):
            assert torch.equal(p.grad, g)
        sched.step()
    assert lrs == [0.1, 0.05, 0.025]
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_lr_schedule_reaches_the_core():
    model = mlp()
    twin = copy.deepcopy(model)
    x, y = data(model)
    opt = GSGD(model, lr=0.1, skeleton="paper")
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    chain = discover(twin).chains[0]
    for lr in (0.1, 0.05, 0.025):
        train(model, opt, x, y, 1)
        sched.step()
        twin.zero_grad()
        loss_of(twin, x, y).backward()
        W, b = gc.gsgd_step(chain.chain, [m.weight.detach() for m in chain.modules],
                            [m.bias.detach() for m in chain.modules],
                            [m.weight.grad for m in chain.modules],
                            [m.bias.grad for m in chain.modules], lr)
        _load(chain.modules, W, b)
    for p, q in zip(model.parameters(), twin.parameters()):  # fast path: equal to rounding
        assert_close(p.detach().numpy(), q.detach().numpy(), 1e-10)


def test_maximize_equals_minimising_the_negative():
    a, b = mlp(), mlp()
    x, y = data(a)
    oa, ob = GSGD(a, lr=0.05, maximize=True), GSGD(b, lr=0.05)
    for _ in range(3):
        oa.zero_grad()
        (-loss_of(a, x, y)).backward()
        oa.step()
        ob.zero_grad()
        loss_of(b, x, y).backward()
        ob.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, rtol=1e-12, atol=1e-14)


def test_a_layer_without_grad_is_never_written_and_the_rest_steps_as_runs():
    """A layer frozen after construction (grad None) must not move. The chain
    0 -> 2 -> 4 without layer 2 falls into single-layer runs, which take SGD's rule."""
    model = mlp()
    x, y = data(model)
    opt = GSGD(model, lr=0.1, momentum=0.9)
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.simplefilter("ignore", SkeletonWarning)  # the first step's (a default init)
        opt.step()  # no gradients at all: nothing moves, and no run is announced
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)) and not caught
    loss_of(model, x, y).backward()
    model[2].weight.grad = None
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with pytest.warns(UserWarning) as caught:
        opt.step()
    assert [str(w.message) for w in caught] == [
        "G-SGD: 2 had no gradient, so the chain 0 -> 2 -> 4 was stepped as the runs of layers "
        "that have one; those layers are never written, and the runs' momentum restarts"]
    assert torch.equal(model[2].weight, before[2])
    for name, p in model.named_parameters():  # first momentum step of SGD: p - lr*g
        if name != "2.weight":
            q = dict(zip([n for n, _ in model.named_parameters()], before))[name]
            assert_close(p.detach().numpy(), (q - 0.1 * grads[name]).numpy(), 1e-12)


def test_biases_step_when_no_weight_of_their_chain_has_a_gradient():
    """Only the biases have gradients: every layer is out of the runs, and the biases take
    SGD's rule (the weights are never written)."""
    model = mlp()
    x, y = data(model)
    opt = GSGD(model, lr=0.1)
    loss_of(model, x, y).backward()
    for layer in (0, 2, 4):
        model[layer].weight.grad = None
    before = {n: (p.detach().clone(), p.grad) for n, p in model.named_parameters()}
    with pytest.warns(UserWarning, match="^G-SGD: 0, 2, 4 had no gradient, so the chain "):
        opt.step()
    for n, p in model.named_parameters():
        value, grad = before[n]
        if grad is None:
            assert torch.equal(p, value), n
        else:  # SGD's step, to rounding (torch may fuse its multiply-add)
            assert_close(p.detach().numpy(), (value - 0.1 * grad).numpy(), 1e-12)


def test_a_chain_without_any_gradient_is_left_alone_even_where_a_layer_has_no_bias():
    """A step where nothing of a chain has a gradient (a branch the step did not use, or
    no backward pass yet) leaves it alone, without a warning, whatever layers lack a
    bias."""
    model = mlp_partly_without_bias()
    skeleton_init_(model)
    opt = GSGD(model, lr=0.1, momentum=0.9)
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert not opt.state


def test_a_run_keeps_its_momentum_warns_once_and_reads_w_times_grad():
    """Two steps with layer 0 without a weight gradient: the run 2 -> 4 takes the core's
    G-SGD with momentum on that sub-chain, its buffers kept from one step to the next; the
    warning comes on the first step only; the backward pass's column sums (of the whole
    chain) are not used, and the count says why; layer 0's bias takes SGD's rule."""
    model = mlp()
    twin = copy.deepcopy(model)
    x, y = data(model)
    opt = GSGD(model, lr=0.1, momentum=0.9, skeleton="paper")
    sgd = torch.optim.SGD([twin[0].bias], lr=0.1, momentum=0.9)
    sub = gc.Chain.from_shapes([tuple(twin[2].weight.shape), tuple(twin[4].weight.shape)])
    layers = (twin[2], twin[4])
    state = gc.gsgd_init(sub, [m.weight.detach() for m in layers],
                         [m.bias.detach() for m in layers])
    for step in range(2):
        opt.zero_grad()
        loss_of(model, x, y).backward()
        model[0].weight.grad = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        assert len([w for w in caught if "had no gradient" in str(w.message)]) == (step == 0)
        twin.zero_grad()
        loss_of(twin, x, y).backward()
        sgd.step()
        W, b, state = gc.gsgd_update(sub, state, [m.weight.detach() for m in layers],
                                     [m.bias.detach() for m in layers],
                                     [m.weight.grad for m in layers],
                                     [m.bias.grad for m in layers], lr=0.1, momentum=0.9)
        _load(layers, W, b)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert_close(p.detach().numpy(), q.detach().numpy(), 1e-10)
    assert opt.describe().column_sums == {"a layer had no gradient": 2}


def test_two_of_three_layers_with_grads_step_as_a_chain():
    """Layers 2 and 4 keep their gradients: they are stepped as the chain 2 -> 4 (G-SGD of
    that sub-chain, equal to the core's step on it); layer 0 is never written."""
    model = mlp()
    twin = copy.deepcopy(model)
    x, y = data(model)
    opt = GSGD(model, lr=0.1, skeleton="paper")
    loss_of(model, x, y).backward()
    model[0].weight.grad = None
    before = model[0].weight.detach().clone()
    with pytest.warns(UserWarning, match="no gradient"):
        opt.step()
    assert torch.equal(model[0].weight, before)
    loss_of(twin, x, y).backward()
    sub = gc.Chain.from_shapes([tuple(twin[2].weight.shape), tuple(twin[4].weight.shape)])
    W, b = gc.gsgd_step(sub, [twin[2].weight.detach(), twin[4].weight.detach()],
                        [twin[2].bias.detach(), twin[4].bias.detach()],
                        [twin[2].weight.grad, twin[4].weight.grad],
                        [twin[2].bias.grad, twin[4].bias.grad], 0.1)
    for got, want in zip([model[2].weight, model[4].weight, model[2].bias, model[4].bias],
                         W + b):
        assert_close(got.detach().numpy(), want.numpy(), 1e-10)
    assert_close(model[0].bias.detach().numpy(),
                 (twin[0].bias - 0.1 * twin[0].bias.grad).detach().numpy(), 1e-12)


def test_grad_scaler_skips_non_finite_steps_and_unscales_others():
    model = mlp()
    x, y = data(model)
    opt = GSGD(model, lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(loss_of(model, x, y)).backward()
    model[0].weight.grad[0, 0] = float("inf")
    with warnings.catch_warnings():
        warnings.simplefilter("error", SkippedStepWarning)  # GradScaler's skip, not ours
        scaler.step(opt)
    scaler.update()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert opt.describe().skipped == 0
    twin = copy.deepcopy(model)
    opt.zero_grad()
    scaler.scale(loss_of(model, x, y)).backward()
    scaler.step(opt)
    train(twin, GSGD(twin, lr=0.05), x, y, 1)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(p, q, rtol=1e-10, atol=1e-12)


def test_check_finite_names_the_parameter_before_writing_anything():
    """Each part's parameter (a chain's weight or bias, a PSI weight, one outside both) is
    named, and nothing is written: not even the parts stepped before the one that holds
    it."""
    def refused(model, opt, name):
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(ValueError, match=rf"^non-finite gradient in {name}$"):
            opt.step()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)), name

    model = mlp()
    x, y = data(model)
    opt = GSGD(model, lr=0.1, check_finite=True)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()  # no gradient yet: nothing to check, nothing written, as torch's optimizers
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    loss_of(model, x, y).backward()
    model[2].bias.grad[1] = float("nan")
    refused(model, opt, r"2\.bias")
    model[2].bias.grad[1] = 0.0  # a chain's weight is named too
    model[4].weight.grad[0, 1] = float("-inf")
    refused(model, opt, r"4\.weight")
    normed = normed_mlp()  # a normalised layer's weight (a PSI part) is named too
    opt = GSGD(normed, lr=0.1, check_finite=True)
    loss_of(normed, x, y).backward()
    normed[0].weight.grad[1, 2] = float("inf")
    refused(normed, opt, r"0\.weight")
    normed[0].weight.grad[1, 2] = 0.0  # and a parameter outside chains and PSI parts
    normed[3].bias.grad[0] = float("nan")
    refused(normed, opt, r"3\.bias")
    opt.param_groups[0]["check_finite"] = False  # without the check: skipped, and named
    with pytest.warns(SkippedStepWarning, match="^G-SGD: a gradient of 0.bias, 1.weight, "
                                                "1.bias, 3.weight, 3.bias holds NaN or Inf"):
        opt.step()


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(2, 4, 3, padding=1)
        self.c1 = nn.Conv2d(4, 4, 3, padding=1)
        self.c2 = nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)
        self.out = nn.Linear(3, 3)

    def forward(self, x):
        h = torch.relu(self.stem(x))
        h = torch.relu(self.c2(torch.relu(self.c1(h))) + h)
        h = torch.nn.functional.adaptive_avg_pool2d(h, 1).flatten(1)
        return self.out(torch.relu(self.head(h)))


def test_residual_add_ends_chains_and_the_block_is_its_own_chain():
    found = discover(Residual())
    assert [c.names for c in found.chains] == [["c1", "c2"], ["head", "out"]]
    opt = GSGD(Residual(), lr=0.1)
    assert opt.describe().fallback == ["stem.weight", "stem.bias"]


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c1, self.bn1 = nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.c2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        h = torch.relu(self.bn1(self.c1(x)))
        h = torch.relu(self.bn2(self.c2(h)))
        return self.fc(h.mean(dim=(2, 3)))


def test_batch_norm_ends_chains_and_normalised_weights_get_psi_sgd():
    model = BNNet()
    opt = GSGD(model, lr=0.1, momentum=0.9)
    d = opt.describe()
    assert d.chains == [] and d.normalised == ["c1.weight", "c2.weight"]
    assert "fc.weight" in d.fallback and "bn1.weight" in d.fallback
    assert GSGD(BNNet(), lr=0.1, bn="sgd").describe().normalised == []


@pytest.mark.parametrize("make, compiles", [
    (lambda m, mu: PSISGD(m, lr=0.1, momentum=mu), False),
    (lambda m, mu: PSISGD(m, lr=0.1, momentum=mu, compile=True), True),
    (lambda m, mu: GSGD(m, lr=0.1, momentum=mu, compile=True), True)],
    ids=["PSISGD", "PSISGD compiled", "GSGD compiled"])
@pytest.mark.parametrize("momenta", [(0.0,) * 4, (0.9,) * 4, (0.9, 0.0, 0.9, 0.5)],
                         ids=["PSI-SGD", "PSI-SGDM", "momentum through 0"])
def test_psisgd_equals_the_core_on_normalised_weights_and_sgd_elsewhere(momenta, make,
                                                                       compiles, monkeypatch):
    """PSI weights by the multi-tensor fast path, or by the compiled one (``compile=True``,
    which then takes every step), equal the core's psi_update to float64 rounding (the
    buffers too), the rest torch's SGD (to rounding: its gradients see the PSI weights).
    A momentum scheduled through 0 keeps the buffers the core keeps."""
    from gsgd_backends.psi import PSIPlan

    compiled, step_ = [], PSIPlan.step_

    def counted(*args, **kwargs):
        compiled.append(step_(*args, **kwargs))
        return compiled[-1]

    monkeypatch.setattr(PSIPlan, "step_", counted)
    model, twin = BNNet().double(), BNNet().double()
    x = torch.randn(8, 2, 6, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    y = torch.randn(8, 3, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    opt = make(model, momenta[0])
    psi = [twin.c1.weight, twin.c2.weight]
    rest = [p for p in twin.parameters() if all(p is not q for q in psi)]
    sgd = torch.optim.SGD(rest, lr=0.1, momentum=momenta[0])
    state = gc.psi_init([p.detach() for p in psi])
    for momentum in momenta:
        opt.param_groups[0]["momentum"] = sgd.param_groups[0]["momentum"] = momentum
        train(model, opt, x, y, 1)
        twin.zero_grad()
        sgd.zero_grad()
        loss_of(twin, x, y).backward()
        sgd.step()
        W, state = gc.psi_update(state, [p.detach() for p in psi], [p.grad for p in psi],
                                 lr=0.1, momentum=momentum)
        with torch.no_grad():
            for p, w in zip(psi, W):
                p.copy_(w)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.allclose(p, q, rtol=1e-12, atol=1e-14), name
    assert compiled == ([True] * 4 if compiles else [])
    for w, u in zip([model.c1.weight, model.c2.weight], state.momentum):
        if any(momenta):
            assert torch.allclose(opt.state[w]["momentum_buffer"], u, rtol=1e-12, atol=1e-14)
        else:  # PSI-SGD keeps no buffer (the core's stay zero), as torch.optim.SGD
            assert "momentum_buffer" not in opt.state[w] and not u.any()


def test_path_sgd_equals_the_core():
    model, twin = mlp(), mlp()
    x, y = data(model)
    opt = PathSGD(model, lr=0.1)
    chain = discover(twin).chains[0]
    for _ in range(3):
        train(model, opt, x, y, 1)
        twin.zero_grad()
        loss_of(twin, x, y).backward()
        W, b = gc.path_sgd_step(chain.chain, [m.weight.detach() for m in chain.modules],
                                [m.bias.detach() for m in chain.modules],
                                [m.weight.grad for m in chain.modules],
                                [m.bias.grad for m in chain.modules], 0.1)
        _load(chain.modules, W, b)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_parameters_given_and_in_chains_by_hand_are_held_once():
    """A chain's parameters join the first group unless ``params`` has them already."""
    model = mlp()
    params = list(model.parameters())
    opt = GSGD(params, lr=0.1, chains=[[model[0], model[2]]])
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in params]
    opt = GSGD([model[4].weight], lr=0.1, chains=[[model[0], model[2]]])
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in (
        model[4].weight, model[0].weight, model[0].bias, model[2].weight, model[2].bias)]


@pytest.mark.parametrize("cls", [GSGD, PathSGD, GAdamW])
def test_chains_by_hand_replace_the_ones_found(cls):
    model = mlp()
    opt = cls(model, lr=0.1, chains=[[model[0], model[2]]])
    assert [names for names, _, _ in opt.describe().chains] == [["0", "2"]]


@pytest.mark.parametrize("cls", [GSGD, PSISGD, PathSGD])
@pytest.mark.parametrize("foreach", [False, True])
def test_foreach_picks_torchs_implementation_of_the_rest_update(cls, foreach, monkeypatch):
    """Parameters outside chains and PSI parts take ``torch.optim.SGD``'s update, by its
    multi-tensor implementation exactly when ``foreach=True`` (on the CPU torch's default
    is the single-tensor loop)."""
    import torch.optim.sgd as torch_sgd

    used = record_calls(monkeypatch, torch_sgd, ("_single_tensor_sgd", "_multi_tensor_sgd"))
    model = normed_mlp()  # its last layer and the normalisation's parameters are the rest
    opt = cls(model, lr=0.1, foreach=foreach)
    x, y = data(model)
    train(model, opt, x, y, 1)
    assert used and set(used) == {"_multi_tensor_sgd" if foreach else "_single_tensor_sgd"}


def test_the_self_check_runs_on_the_model_given_beside_its_parameters():
    """``GSGD(params, model=model, example_input=x)`` checks the chains on ``model``, and
    the skeleton warning says which recipe was asked for."""
    model = mlp()
    x, _ = data(model)
    opt = GSGD(list(model.parameters()), model=model, lr=0.1, example_input=x)
    with pytest.warns(SkeletonWarning, match="0 -> 2 -> 4 is not initialised"):
        opt.step()  # the first step warns (a resume loads its state before it)
    net = cnn()
    opt = GSGD(net, lr=0.1, skeleton="paper", chains=[[net[0], net[3]], [net[7], net[9]]])
    with pytest.warns(SkeletonWarning) as caught:
        opt.step()
    assert [str(w.message) for w in caught] == [
        "G-SGD: the skeleton of chain(s) 0 -> 3; 7 -> 9 is not initialised for "
        "skeleton='paper': call gsgd_adapters.torch.skeleton_init_(model) before building the "
        "optimizer (from a default init, path values are tiny and G-SGD diverges at the usual "
        "learning rates). Silence with warnings.filterwarnings('ignore', category="
        "gsgd_adapters.torch.SkeletonWarning)"]
    model[1] = nn.Tanh()  # not positively homogeneous: rescaling its inputs changes the output
    with pytest.raises(ValueError, match="0 -> 2 is not a chain of this model"):
        GSGD(list(model.parameters()), model=model, lr=0.1, chains=[[model[0], model[2]]],
             example_input=x)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_max_norm_renormalises_the_rows_of_normalised_weights(momentum):
    """A row of a normalised layer's weight whose norm passes ``max_norm`` after the step is
    divided by its norm (PSI-SGD's rule, Yi et al.): with a threshold below every row's
    norm, every row ends on the unit sphere."""
    model = normed_mlp()
    x, y = data(model)
    opt = PSISGD(model, lr=0.1, momentum=momentum, max_norm=0.01)
    train(model, opt, x, y, 1)
    norms = torch.linalg.vector_norm(model[0].weight, dim=1)
    assert torch.allclose(norms, torch.ones_like(norms), rtol=1e-12)


def test_psisgd_takes_a_model_and_every_optimizer_prints_its_name():
    with pytest.raises(ValueError, match="^PSISGD takes a model: it finds the normalised "
                                         "layers in it$"):
        PSISGD(list(mlp().parameters()), lr=0.1)
    for cls, algorithm in ((GSGD, "G-SGD"), (PSISGD, "PSI-SGD"), (PathSGD, "Path-SGD"),
                           (GAdam, "G-Adam"), (GAdamW, "G-AdamW")):
        assert repr(cls(mlp(), lr=0.1)).startswith(f"{cls.__name__}(\n{algorithm}: ")


def test_explicit_chains_with_other_parameters():
    model = mlp()
    opt = GSGD([], lr=0.1, chains=[[model[0], model[2], model[4]]])
    assert len(opt.describe().chains) == 1
    extra = nn.Parameter(torch.ones(3))
    opt = GSGD([extra], lr=0.1, chains=[[model[0], model[2]]])
    assert opt.describe().fallback == ["<(3,)>"]


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(torch.relu(self.a(x)))))


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        if x.sum() > 0:
            x = -x
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("model, kwargs, message", [
    (Twice(), dict(strict=True), r"^strict=True: these layers are in no chain: a: the module "
     r"is called 2 times in forward\(\); b: its output is the model's output$"),
    (Untraceable(), dict(strict=True), r"^torch.fx cannot trace Untraceable \(TraceError: "
     r"symbolically traced variables cannot be used as inputs to control flow\); pass the "
     r"chains by hand: GSGD\(model, chains=\[\[model.fc1, "),
    (mlp(), dict(lr=torch.tensor([0.1, 0.2])), "lr as a tensor must have one element"),
    (mlp(), dict(lr=-0.1), "^lr must be a finite number >= 0, got -0.1$"),
    (mlp(), dict(momentum=-1.0), "^momentum must be a finite number >= 0, got -1.0$"),
    (mlp(), dict(lr=float("nan")), "^lr must be a finite number >= 0, got nan$"),
    (mlp(), dict(weight_decay=math.inf), "^weight_decay must be a finite number >= 0, got inf$"),
    (mlp(), dict(lr=True), "^lr must be a finite number >= 0, got True$"),
    (mlp(), dict(lr="0.1"), "^lr must be a finite number >= 0, got '0.1'$"),
    (mlp(), dict(nesterov=True), "^nesterov needs momentum > 0 and dampening = 0$"),
    (mlp(), dict(nesterov=True, momentum=0.9, dampening=0.5),
     "^nesterov needs momentum > 0 and dampening = 0$"),
    (mlp(), dict(bn="exact"), "bn must be .psi., .sgd. or .paper."),
    (mlp(), dict(skeleton="xavier"), r"^skeleton must be one of \('he', 'paper'\), got 'xavier'$"),
])
def test_construction_errors(model, kwargs, message):
    kwargs.setdefault("lr", 0.1)
    with pytest.raises(ValueError, match=message):
        GSGD(model, **kwargs)


def test_params_are_a_model_or_tensors_or_groups_and_a_model_is_given_once():
    model = mlp()
    with pytest.raises(ValueError, match="^pass the model once: as params, or as model= with "
                                         "param groups$"):
        GSGD(model, model=model, lr=0.1)
    with pytest.raises(TypeError, match="^params must be a model, an iterable of tensors or of "
                                        "dicts, got a Tensor$"):
        GSGD(model[0].weight, lr=0.1)


def test_data_parallel_replicas_read_w_times_grad():
    """A DataParallel model's replicas run the forward pass on copies of the layers, whose
    backward pass the chains' hooks cannot follow: its steps read ``W * grad``."""
    here = "cuda" if torch.cuda.is_available() else "cpu"   # replicas only on a GPU
    model = mlp().to(here)
    x, y = (t.to(here) for t in data(model))
    opt = GSGD(nn.DataParallel(model), lr=0.1)
    train(model, opt, x, y, 1)
    assert opt.describe().column_sums == {}
    train(model, plain := GSGD(model, lr=0.1), x, y, 1)
    assert plain.describe().column_sums == {"backward": 1}


def test_reuse_and_untraceable_models_do_not_raise_by_default():
    opt = GSGD(Twice(), lr=0.1)
    reasons = opt.describe().reasons
    assert opt.describe().chains == [] and "called 2 times" in reasons["a.weight"]
    assert reasons["a.bias"] == reasons["a.weight"]
    with pytest.warns(UserWarning, match="cannot trace"):
        opt = GSGD(Untraceable(), lr=0.1)
    assert opt.describe().chains == [] and len(opt.describe().fallback) == 4
    m = Untraceable()
    opt = GSGD(m, lr=0.1, chains=[[m.a, m.b]])
    assert opt.describe().chains[0][0] == ["a", "b"]


def test_strict_checks_only_what_is_traced():
    """With the chains given by hand and no PSI parts (``bn="sgd"``) nothing is traced, so
    ``strict`` has nothing to refuse on a model torch.fx cannot trace; with ``bn="psi"`` the
    model is traced for its normalised layers, and ``strict`` refuses it."""
    m = Untraceable()
    opt = GSGD(m, lr=0.1, chains=[[m.a, m.b]], bn="sgd", strict=True)
    assert opt.describe().chains[0][0] == ["a", "b"]
    with pytest.raises(ValueError, match="torch.fx cannot trace Untraceable"):
        GSGD(m, lr=0.1, chains=[[m.a, m.b]], strict=True)


@pytest.mark.parametrize("cls, key, value", [
    (GSGD, "lr", torch.tensor([0.1, 0.2])),
    (GSGD, "momentum", torch.tensor([0.5, 0.2])),
    (GSGD, "dampening", torch.tensor([0.0, 0.1])),
    (GSGD, "weight_decay", torch.tensor([0.0, 0.1])),
    (PSISGD, "lr", torch.tensor([0.1, 0.2])),
    (PSISGD, "momentum", torch.tensor([0.5, 0.2])),
    (PathSGD, "lr", torch.tensor([0.1, 0.2])),
    (GAdamW, "lr", torch.tensor([0.1, 0.2])),
    (GAdamW, "betas", (torch.tensor([0.9, 0.8]), 0.999)),
])
def test_a_hyperparameter_set_to_a_tensor_of_two_elements_is_named_by_step(cls, key, value):
    """``param_groups`` may be changed after construction (as a scheduler does): a tensor of
    another size than one is refused when the step reads it, naming the hyperparameter."""
    if cls is PSISGD:  # its normalised layer's step comes first and reads lr and momentum
        model = normed_mlp()
    else:
        model = mlp()
        skeleton_init_(model)
    opt = cls(model, lr=0.1, **({"momentum": 0.5} if key in ("momentum", "dampening") else {}))
    x, y = data(model)
    loss_of(model, x, y).backward()
    opt.param_groups[0][key] = value
    with pytest.raises(ValueError, match=f"^{key} as a tensor must have one element"):
        opt.step()
    if key in cls.described:
        with pytest.raises(ValueError, match=f"^{key} as a tensor must have one element"):
            opt.describe()


def test_frozen_layers_split_chains_and_are_never_written():
    """A frozen backbone (requires_grad=False) with a trainable head trains."""
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                          nn.Linear(8, 7), nn.ReLU(), nn.Linear(7, 5), nn.ReLU(),
                          nn.Linear(5, 3)).double()
    for p in model[2].parameters():
        p.requires_grad_(False)
    skeleton_init_(model)
    opt = GSGD(model, lr=0.1, momentum=0.9)
    d = opt.describe()
    assert [c[0] for c in d.chains] == [["4", "6", "8"]]
    assert "frozen" in d.reasons["2.weight"]
    frozen = [p.detach().clone() for p in model[2].parameters()]
    x, y = data(model)
    train(model, opt, x, y, 3)
    assert all(torch.equal(p, q) for p, q in zip(model[2].parameters(), frozen))
    with pytest.raises(ValueError, match=(
            r"^2\.weight is frozen \(requires_grad=False or in no param group\), but the "
            r"chain 0 -> 2 was given by hand: G-SGD changes every non-free weight of a chain; "
            r"leave frozen layers out of chains=\.\.\.$")):
        GSGD(model, lr=0.1, chains=[[model[0], model[2]]])


def test_a_frozen_bias_in_a_chain_is_a_path_that_never_moves():
    model = mlp()
    model[2].bias.requires_grad_(False)
    skeleton_init_(model)
    opt = GSGD(model, lr=0.05, momentum=0.9, weight_decay=0.01)
    assert [c[0] for c in opt.describe().chains] == [["0", "2", "4"]]
    bias = model[2].bias.detach().clone()
    x, y = data(model)
    before = loss_of(model, x, y).item()
    train(model, opt, x, y, 2)
    entries = len(opt.state)
    train(model, opt, x, y, 3)
    assert torch.equal(model[2].bias, bias) and loss_of(model, x, y).item() < before
    assert len(opt.state) == entries  # the frozen bias's scratch buffers are not kept


def test_grouped_conv_ends_chains():
    model = nn.Sequential(nn.Conv2d(4, 4, 3, groups=2), nn.ReLU(), nn.Conv2d(4, 4, 1),
                          nn.ReLU(), nn.Conv2d(4, 2, 1))
    assert [c.names for c in discover(model).chains] == [["2", "4"]]


def test_ddp_dataparallel_and_compile_wrappers_are_unwrapped(one_process_group):
    """Discovery and the optimizer see through DDP (a one-process gloo group here; the
    two-process run is in test_torch_ddp.py), DataParallel, torch.compile and their nesting."""
    model = mlp()
    skeleton_init_(model, skeleton="paper")
    want = [[model[0], model[2], model[4]]]
    ddp = nn.parallel.DistributedDataParallel(model)
    wrappers = [ddp, nn.DataParallel(model), torch.compile(model), torch.compile(ddp)]
    for wrapped in wrappers:
        assert [c.modules for c in discover(wrapped).chains] == want, type(wrapped)
    model.to("cpu")  # DataParallel moves the module onto a GPU where there is one
    opt = GSGD(ddp, lr=0.05, skeleton="paper")
    x, y = data(model)
    ((ddp(x) - y) ** 2).mean().backward()
    W = [model[i].weight.detach().numpy().copy() for i in (0, 2, 4)]
    b = [model[i].bias.detach().numpy().copy() for i in (0, 2, 4)]
    G = [model[i].weight.grad.numpy().copy() for i in (0, 2, 4)]
    Gb = [model[i].bias.grad.numpy().copy() for i in (0, 2, 4)]
    opt.step()
    eW, eb = gc.gsgd_step(gc.Chain.mlp([6, 8, 5, 3]), W, b, G, Gb, 0.05)
    for i, e, eb_ in zip((0, 2, 4), eW, eb):
        assert_close(model[i].weight.detach().numpy(), e, 1e-12)
        assert_close(model[i].bias.detach().numpy(), eb_, 1e-12)


def test_a_model_keeping_something_else_as_orig_mod_is_not_unwrapped():
    """Only torch.compile's wrapper is seen through: ``_orig_mod`` that is no module (a
    model of the user's own keeping a name there) leaves the model as it is."""
    model = mlp()
    model._orig_mod = "mlp"
    assert [c.modules for c in discover(model).chains] == [[model[0], model[2], model[4]]]


def test_discovery_runs_on_a_torch_built_without_distributed_support(monkeypatch):
    """There ``FSDPModule`` cannot be imported, and discovery has no FSDP2 to see through."""
    import gsgd_adapters.torch.discovery as discovery
    monkeypatch.setattr(discovery, "_FSDPModule", None)
    model = mlp()
    assert [c.names for c in discover(model).chains] == [["0", "2", "4"]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_trajectory_equals_cpu():
    model = mlp()
    gpu = copy.deepcopy(model).cuda()
    x, y = data(model)
    train(model, GSGD(model, lr=0.05, momentum=0.9), x, y, 5)
    train(gpu, GSGD(gpu, lr=0.05, momentum=0.9), x.cuda(), y.cuda(), 5)
    for p, q in zip(model.parameters(), gpu.parameters()):
        assert q.device.type == "cuda"
        assert torch.allclose(p, q.cpu(), rtol=1e-9, atol=1e-12)


class BNChain(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.bn1 = nn.Linear(6, 8), nn.BatchNorm1d(8)
        self.l2, self.bn2 = nn.Linear(8, 5), nn.BatchNorm1d(5)
        self.l3 = nn.Linear(5, 3)

    def forward(self, x):
        return self.l3(torch.relu(self.bn2(self.l2(torch.relu(self.bn1(self.l1(x)))))))


def test_paper_bn_variant_follows_its_formula():
    """Appendix 10.2: BN stays inside the chain and ICR reads grad * ||W[j]|| there."""
    model, twin = BNChain(), BNChain()
    opt = GSGD(model, lr=0.05, momentum=0.9, bn="paper", skeleton="paper")
    d = opt.describe()
    assert [c[0] for c in d.chains] == [["l1", "l2", "l3"]] and d.normalised == []
    assert d.fallback == ["bn1.weight", "bn1.bias", "bn2.weight", "bn2.bias"]
    layers = [twin.l1, twin.l2, twin.l3]
    chain = gc.Chain.mlp([6, 8, 5, 3])
    sgd = torch.optim.SGD([p for n, p in twin.named_parameters() if "bn" in n], lr=0.05,
                          momentum=0.9)
    W, b = [m.weight.detach() for m in layers], [m.bias.detach() for m in layers]
    state = gc.gsgd_init(chain, W, b)
    x, y = torch.randn(16, 6), torch.randn(16, 3)
    for _ in range(3):
        train(model, opt, x, y, 1)
        sgd.zero_grad()
        for m in layers:
            m.zero_grad()
        loss_of(twin, x, y).backward()
        sgd.step()
        G = [m.weight.grad * m.weight.norm(dim=1, keepdim=True) for m in layers[:2]]
        G.append(layers[2].weight.grad)
        W, b, state = gc.gsgd_update(chain, state, [m.weight.detach() for m in layers],
                                     [m.bias.detach() for m in layers], G,
                                     [m.bias.grad for m in layers], lr=0.05, momentum=0.9)
        _load(layers, W, b)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(p, q, rtol=1e-12, atol=1e-14)


def test_add_param_group_and_per_group_hyperparameters():
    model = mlp()
    extra = nn.Parameter(torch.ones(3))
    opt = GSGD(model, lr=0.1, momentum=0.9)
    opt.add_param_group({"params": [extra], "lr": 0.5})
    assert opt.param_groups[-1]["momentum"] == 0.9 and len(opt.param_groups) == 2
    assert opt.describe().parts[-1].kind == "sgd"
    opt.param_groups[0]["lr"] = 0.0  # the model's group: lr 0 leaves it where it is
    x, y = data(model)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    (loss_of(model, x, y) + (extra ** 2).sum()).backward()
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert torch.allclose(extra, torch.full((3,), 1.0 - 0.5 * 2.0))


def test_parameters_outside_chains_take_sgds_update_with_its_weight_decay():
    """The SGD part of a G-SGD optimizer is torch.optim.SGD with the same hyperparameters
    (weight decay, momentum, dampening, Nesterov)."""
    for hyper in (dict(lr=0.1, weight_decay=0.5),
                  dict(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.5),
                  dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.5)):
        model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
        twin = copy.deepcopy(model)
        opt = GSGD(model, **hyper)
        assert opt.describe().chains == []  # Tanh: every parameter takes SGD's rule
        ref = torch.optim.SGD(twin.parameters(), **hyper)
        x, y = data(model)
        train(model, opt, x, y, 3)
        train(twin, ref, x, y, 3)
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p, q), hyper


# ------------------------------------------------------------------ the partition, described
def test_a_bias_left_out_of_the_param_groups_is_never_written():
    """A bias in no param group is frozen, as torch would leave it, although autograd gives
    it a gradient: the chain's step treats it as a basis path that does not move."""
    model = mlp()
    skeleton_init_(model)
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    opt = GSGD(weights, model=model, lr=0.1, momentum=0.9)
    assert [c[0] for c in opt.describe().chains] == [["0", "2", "4"]]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = data(model)
    train(model, opt, x, y, 2)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) == n.endswith("bias"), n
    opt.zero_grad()  # a step where layer 2 stays out of the runs: its bias does too
    loss_of(model, x, y).backward()
    model[2].weight.grad = None
    with pytest.warns(UserWarning, match="2 had no gradient"):
        opt.step()
    assert torch.equal(model[2].bias, before["2.bias"])


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.bn, self.c2 = nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.Conv2d(3, 4, 3)

    def forward(self, x):
        return self.c2(torch.relu(self.bn(self.c1(x)))).mean((2, 3))


def test_a_normalised_layer_in_a_chain_given_by_hand_or_frozen_takes_no_psi_step():
    """A weight followed by batch norm is a PSI weight unless a chain given by hand holds it
    (one rule per weight) or it is frozen."""
    model = ConvBN()
    assert GSGD(model, lr=0.1).describe().normalised == ["c1.weight"]
    opt = GSGD(model, lr=0.1, chains=[[model.c1, model.c2]])
    assert opt.describe().normalised == [] and opt.describe().chains[0][0] == ["c1", "c2"]
    assert PathSGD(model, lr=0.1).describe().normalised == []  # Path-SGD has no PSI rule
    model.c1.weight.requires_grad_(False)
    assert GSGD(model, lr=0.1).describe().normalised == []


def test_psi_sgd_on_an_untraceable_model_warns_that_every_parameter_takes_sgd():
    """PSISGD looks for nothing but normalised layers: where torch.fx cannot trace the
    model, none is found and the user is told, as GSGD tells of its chains."""
    with pytest.warns(UserWarning, match=r"^torch.fx cannot trace Untraceable .*\. Every "
                                         r"parameter takes SGD's rule\.$"):
        opt = PSISGD(Untraceable(), lr=0.1)
    assert opt.describe().normalised == [] and len(opt.describe().fallback) == 4


def test_a_frozen_normalised_layer_is_no_psi_part_and_a_model_all_in_chains_has_no_rest():
    """A frozen weight is never stepped, whatever the layer after it: a grouped convolution
    (no chain) followed by batch norm stays out of PSI-SGD's parts when frozen; and a model
    whose every parameter is in a chain has no part of plain SGD."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, groups=2), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Conv2d(4, 4, 3, groups=2), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Flatten(), nn.Linear(4 * 2 * 2, 3))
    model[0].weight.requires_grad_(False)
    d = PSISGD(model, lr=0.1).describe()
    assert d.normalised == ["3.weight"] and "0.weight" in d.fallback
    chained = mlp()
    skeleton_init_(chained)
    d = GSGD(chained, lr=0.1).describe()
    assert [p.kind for p in d.parts] == ["chain"] and "plain SGD" not in str(d)


def test_chains_given_by_hand_on_an_untraceable_model_warn_about_nothing_traced():
    m = Untraceable()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GSGD(m, lr=0.1, chains=[[m.a, m.b]])
        GAdam(m, lr=0.1, chains=[[m.a, m.b]])
    assert not [w for w in caught if "trace" in str(w.message)]


@pytest.mark.parametrize("cls", [GSGD, GAdamW], ids=["GSGD", "GAdamW"])
def test_the_untraceable_model_warning_points_at_the_users_line(cls):
    with pytest.warns(UserWarning, match="cannot trace") as caught:
        line = sys._getframe().f_lineno + 1
        cls(Untraceable(), lr=0.1)
    assert [(w.filename, w.lineno) for w in caught if "cannot trace" in str(w.message)] == [
        (__file__, line)]


def test_description_counts_are_the_chains():
    model = mlp()
    d = GSGD(model, lr=0.1).describe()
    (_, chain, _), = d.chains
    assert (d.m, d.H, d.g_space_dim, d.invariant_ratio) == (
        chain.m, chain.H, chain.g_space_dim, chain.invariant_ratio)
    assert chain.g_space_dim == chain.m - chain.H > 0
    bare = PSISGD(ConvBN(), lr=0.1).describe()
    assert (bare.m, bare.H, bare.g_space_dim, bare.invariant_ratio) == (0, 0, 0, 0.0)


def test_paper_skeleton_init_sets_skeleton_edges_to_one_and_leaves_the_rest():
    model = mlp()
    before = [m.weight.detach().clone() for m in (model[0], model[2], model[4])]
    (found,) = skeleton_init_(model, skeleton="paper")
    for l, (m, w0) in enumerate(zip(found.modules, before), start=1):
        mask = torch.as_tensor(found.chain.free_mask(l) | found.chain.tau_mask(l))
        w, w0 = (a.detach().reshape(found.chain.layer_shape(l)) for a in (m.weight, w0))
        assert torch.all(w[mask] == 1.0) and torch.equal(w[~mask], w0[~mask]), l


def test_a_paper_skeleton_edge_of_minus_one_is_not_initialised():
    """The paper's recipe sets skeleton edges to +1: a -1 edge (the He recipe keeps signs)
    is not its skeleton, and the optimizer says so."""
    model = mlp()
    (found,) = skeleton_init_(model, skeleton="paper")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GSGD(model, lr=0.1, skeleton="paper").step()
    with torch.no_grad():
        w = model[2].weight.view(found.chain.layer_shape(2))
        w[torch.as_tensor(found.chain.tau_mask(2))] *= -1.0
    with pytest.warns(SkeletonWarning, match="not initialised"):
        GSGD(model, lr=0.1, skeleton="paper").step()


def test_check_invariance_reports_a_change_relative_to_the_outputs_scale():
    """A tanh layer is no chain: its rescaled twin moves the output by O(1) of the output's
    size, at any output scale."""
    changes = []
    for scale in (1e-6, 1.0, 1e6):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
        with torch.no_grad():
            model[2].weight.mul_(scale)
            model[2].bias.mul_(scale)
        x = torch.randn(6, 4, dtype=torch.float64)
        (change,) = check_invariance(model, x, chains=[[model[0], model[2]]],
                                     rtol=math.inf).values()
        changes.append(change)
    assert 1e-3 < changes[1] < 10
    np.testing.assert_allclose(changes, changes[1], rtol=1e-9)


def test_path_sgd_steps_are_never_counted_as_skipped():
    model = mlp()
    opt = PathSGD(model, lr=0.01)
    x, y = data(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SkippedStepWarning)
        train(model, opt, x, y, 2)
    assert opt.describe().skipped == 0


def test_step_time_warnings_point_at_the_users_step_call():
    """Through torch's wrappers of ``step`` (no_grad, hooks): the user's line."""
    model = mlp()
    skeleton_init_(model)
    opt = GSGD(model, lr=0.1)
    x, y = data(model)
    loss_of(model, x, y).backward()
    model[2].weight.grad = None
    with pytest.warns(UserWarning, match="had no gradient") as caught:
        line = sys._getframe().f_lineno + 1
        opt.step()
    assert {(w.filename, w.lineno) for w in caught} == {(__file__, line)}
    opt.zero_grad()
    loss_of(model, x, y).backward()
    model[0].weight.grad[0, 0] = float("nan")
    with pytest.warns(SkippedStepWarning) as caught:
        line = sys._getframe().f_lineno + 1
        opt.step()
    assert {(w.filename, w.lineno) for w in caught} == {(__file__, line)}
    assert [str(w.message) for w in caught] == [
        "G-SGD: a gradient of the chain 0 -> 2 -> 4 holds NaN or Inf, so the step was skipped "
        "(weights and momentum unchanged); later skips are counted in describe() without a "
        "warning"]


def test_a_step_called_from_native_code_still_warns():
    """A step run by native code (a thread with no Python caller, as a C++ loop's callback
    runs it) has no frame of the user's to point at: it warns all the same, pointed past the
    stack, instead of failing."""
    import _thread
    import collections
    import operator

    model = mlp()
    skeleton_init_(model)
    opt = GSGD(model, lr=0.1)
    x, y = data(model)
    loss_of(model, x, y).backward()
    model[0].weight.grad[0, 0] = float("nan")
    done = _thread.allocate_lock()
    done.acquire()
    # the thread calls `opt.step()` then `done.release()` from C: no Python frame of its own
    calls = map(operator.call, [opt.step, done.release])
    with pytest.warns(SkippedStepWarning, match="the step was skipped"):
        _thread.start_new_thread(collections.deque, (calls, 0))
        assert done.acquire(timeout=10), "the step failed in its thread"
    assert opt.describe().skipped == 1


def test_a_run_of_a_chains_layers_is_the_chain_of_those_layers():
    """The chain a run of layers steps as (some layers without a weight gradient) has those
    layers' shapes, slots, biases and skeleton scales, here of a conv chain with a layer
    without bias and He scales."""
    from gsgd_adapters.torch.parts import sub_chain

    chain = gc.Chain.from_shapes([(4, 2, 3, 3), (5, 4, 2, 2), (6, 5 * 4), (3, 6)],
                                 bias=[True, False, True, False],
                                 skeleton_scale=[0.5, 0.25, 2.0, 4.0])
    for start, stop in ((0, 2), (1, 3), (1, 4), (0, 4)):
        sub = sub_chain(chain, start, stop)
        layers = range(start + 1, stop + 1)
        assert sub.L == stop - start
        assert [sub.layer_shape(i) for i in range(1, sub.L + 1)] == [chain.layer_shape(l)
                                                                     for l in layers]
        assert list(sub.bias) == [chain.bias[l - 1] for l in layers]
        assert list(sub.skeleton_scale) == [chain.skeleton_scale[l - 1] for l in layers]


def test_chains_given_as_found_are_each_stepped():
    """``chains=`` takes the :class:`ChainLayers` that :func:`discover` and
    :func:`skeleton_init_` return as they are, every one of them, as well as lists of
    modules (named by the model, or by position without one)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5), nn.Tanh(),
                          nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))
    found = discover(model).chains
    assert [c.names for c in found] == [["0", "2"], ["4", "6"]]
    opt = GSGD(model, lr=0.1, chains=found)
    assert [c[0] for c in opt.describe().chains] == [["0", "2"], ["4", "6"]]
    mixed = GSGD(model, lr=0.1, chains=[found[0], [model[4], model[6]]])
    assert [c[0] for c in mixed.describe().chains] == [["0", "2"], ["4", "6"]]
    inited = skeleton_init_(model)
    assert [c[0] for c in GSGD(model, lr=0.1, chains=inited).describe().chains] == [
        ["0", "2"], ["4", "6"]]
    by_hand = GSGD(list(model.parameters()), lr=0.1, chains=[[model[4], model[6]]])
    assert [c[0] for c in by_hand.describe().chains] == [["chains[0][0]", "chains[0][1]"]]


@pytest.mark.parametrize("layer", [1, 2, 3])
def test_describe_sees_any_skeleton_edge_off_its_scale(layer):
    """``describe()`` calls a chain's skeleton freshly initialised only if every skeleton
    edge (tau edges into hidden units, free edges out of them) has its layer's scale: one
    tau edge of layer 1 off it is what training does (initialised, then trained), one free
    edge that is no tau edge of layer 2 or 3 off it leaves the weights unable to tell."""
    model = mlp()
    skeleton_init_(model)
    opt = GSGD(model, lr=0.1)
    names, chain, initialised = opt.describe().chains[0][:3]
    assert initialised
    mask = chain.free_mask(layer) | chain.tau_mask(layer)
    only = mask & ~(chain.free_mask(layer) if layer == 1 else chain.tau_mask(layer))
    edge = tuple(int(i) for i in np.argwhere(only[..., 0])[0])
    with torch.no_grad():
        model[2 * (layer - 1)].weight[edge] *= 2.0
    info = opt.describe().parts[0]
    assert (info.skeleton_state, info.skeleton_initialised) == (
        ("trained", True) if layer == 1 else ("unknown", None))


def test_a_description_prints_every_part_reason_skip_and_source_of_column_sums():
    """``print(opt.describe())`` whole: the totals, chains with their skeleton states (as
    found by the step, or read from whether the weights look initialised) and
    hyperparameters, the PSI weights, the other parameters under the rest rule with why
    each is in no chain (a parameter of a chain or PSI part has no such line), the skipped
    steps and where the chain steps got their column sums."""
    from gsgd_adapters.torch import Description
    from gsgd_adapters.torch.description import PartInfo

    chain = gc.Chain.mlp([3, 4, 2])
    hyper = dict(lr=0.1, momentum=0.9, weight_decay=0.0)
    d = Description(
        [PartInfo("chain", ["a", "b"], hyper, chain, False),
         PartInfo("chain", ["c", "e"], dict(lr=0.5), chain, True),
         PartInfo("chain", ["i", "j"], dict(lr=0.5), chain, True, "trained"),
         PartInfo("psi", ["f", "g"], hyper), PartInfo("sgd", ["h.weight", "h.bias"], hyper)],
        "G-SGD", reasons={"h.weight": "followed by BatchNorm2d", "h.bias": "why not",
                          "f.weight": "normalised"},
        skipped=2, skeleton="he", rest_rule="SGD(M)",
        column_sums={"backward": 3, "clipped": 1, "hooks off": 2})
    assert str(d) == "\n".join([
        "G-SGD: 3 chain(s), m=78, H=12, G-space dim=66, invariant ratio H/m=0.1538",
        f"  chain a -> b: {chain}; skeleton NOT initialised for skeleton='he' (call "
        "skeleton_init_(model)); lr=0.1, momentum=0.9, weight_decay=0",
        f"  chain c -> e: {chain}; skeleton initialised (he); lr=0.5",
        f"  chain i -> j: {chain}; skeleton initialised (he), then trained; lr=0.5",
        "  PSI-SGD (normalised rows) f.weight, g.weight; lr=0.1, momentum=0.9, weight_decay=0",
        "  SGD(M) h.weight, h.bias; lr=0.1, momentum=0.9, weight_decay=0",
        "    h.weight: not in a chain: followed by BatchNorm2d",
        "    h.bias: not in a chain: why not",
        "  steps skipped for non-finite gradients: 2",
        "  chain steps with column sums from the backward pass: 3; read from W * grad instead: "
        "clipped (1); hooks off (2)"])
    only_backward = Description([], "G-Adam", column_sums={"backward": 4})
    assert str(only_backward).splitlines()[1:] == [
        "  chain steps with column sums from the backward pass: 4"]
    none_from_backward = Description([], "G-Adam", column_sums={"clipped": 1})
    assert str(none_from_backward).splitlines()[1] == (
        "  chain steps with column sums from the backward pass: 0; read from W * grad "
        "instead: clipped (1)")
    assert str(Description([], "G-SGD")) == (
        "G-SGD: 0 chain(s), m=0, H=0, G-space dim=0, invariant ratio H/m=0")


def test_describe_compares_skeleton_edges_in_the_weights_dtype():
    """A float64 model skeleton-initialised at He's scale (no power of two) is seen as
    initialised whatever torch's default dtype: the scale is compared in float64, not
    rounded to the default float32."""
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float32)
        model = mlp().double()
        skeleton_init_(model)
        assert GSGD(model, lr=0.1).describe().chains[0][2]
    finally:
        torch.set_default_dtype(old)
