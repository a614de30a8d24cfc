"""Column sums from the backward pass (DESIGN §12): the identity, and every way the gradients
can stop being the accumulation of the backward passes the sums saw.

The identity ``colsum_l[a] = sum_{b,k} W_l[b,a,k] grad_l[b,a,k] = sum over batch and
positions of x_l * dL/dx_l`` is drawn on random chains with convolution, pooling, flatten,
dropout and biases, over accumulated micro-batches, in float64. Then each way of touching
the gradients (or the weights) is played on two copies of one model, one stepped by
``GSGD(model)`` (sums from the backward pass where they are valid) and one by
``GSGD(model, backward_sums=False)`` (sums from ``W * grad``): the weights must agree to
float64 rounding, and ``describe()`` must say which source each step used.
"""

import copy
import math
import pickle

import pytest
import torch
import torch.nn as nn
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.checkpoint import checkpoint

from _helpers import DEFAULT_INIT
from _twins import assert_same_parameters, step_twins
from gsgd_adapters.torch import GAdam, GSGD, skeleton_init_
from gsgd_adapters.torch.backward_sums import BackwardSums
from gsgd_adapters.torch.discovery import chain_of
from gsgd_backends import gsgd_update_, path_update_
from gsgd_core import Chain

pytestmark = DEFAULT_INIT
F64 = torch.float64


def _colsums(modules, sizes):
    """``colsum(W_l * grad_l)`` for layers 2..L, from the weights and gradients."""
    return [(m.weight * m.weight.grad).reshape(m.weight.shape[0], sizes[l], -1).sum((0, 2))
            for l, m in enumerate(modules) if l >= 1]


def _net(draw_conv: bool, widths, pool: bool, dropout: bool, bias: bool) -> nn.Sequential:
    if not draw_conv:
        layers = []
        for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
            layers.append(nn.Linear(a, b, bias=bias, dtype=F64))
            if i < len(widths) - 2:
                layers += [nn.ReLU()] + ([nn.Dropout(0.3)] if dropout else [])
        return nn.Sequential(*layers)
    c0, c1, c2, out = widths[:4]
    side = 4 if pool else 8
    return nn.Sequential(
        nn.Conv2d(c0, c1, 3, padding=1, bias=bias, dtype=F64), nn.ReLU(),
        *([nn.MaxPool2d(2)] if pool else []),
        nn.Conv2d(c1, c2, 3, padding=1, bias=bias, dtype=F64), nn.ReLU(),
        *([nn.Dropout(0.3)] if dropout else []), nn.Flatten(),
        nn.Linear(c2 * side * side, out, bias=bias, dtype=F64))


def _inputs(net, n, conv):
    first = net[0]
    return torch.randn((n, first.in_channels, 8, 8) if conv else (n, first.in_features),
                       dtype=F64)


@given(conv=st.booleans(), widths=st.lists(st.integers(1, 5), min_size=4, max_size=5),
       pool=st.booleans(), dropout=st.booleans(), bias=st.booleans(),
       micro=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_backward_sums_equal_the_column_sums_of_w_times_grad(conv, widths, pool, dropout,
                                                             bias, micro, seed):
    torch.manual_seed(seed)
    net = _net(conv, widths, pool, dropout, bias)
    modules = [m for m in net if isinstance(m, (nn.Linear, nn.Conv2d))]
    chain = chain_of(modules)
    sums = BackwardSums(modules, chain.sizes)
    for _ in range(micro):
        net(_inputs(net, 3, conv)).square().sum().backward()
    got, check = sums.take()
    with torch.no_grad():
        want = _colsums(modules, chain.sizes)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12 * float(w.abs().max()) + 1e-300)
    assert float(check) == 0.0  # the bound proves every gradient entry finite
    for layer, m in zip(sums.layers, modules):  # Cauchy-Schwarz, summed over micro-batches
        assert float(m.weight.grad.abs().max()) <= float(layer.bound) * (1 + 1e-12)
    assert dict(sums.counts) == {"backward": 1}


class Net(nn.Module):
    """An MLP whose forward can detach its second layer's input or checkpoint its middle."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = (nn.Linear(5, 6, dtype=F64), nn.Linear(6, 7, dtype=F64),
                                     nn.Linear(7, 3, dtype=F64))
        self.detach, self.checkpoint, self.keyword = False, None, False

    def forward(self, x):
        h = torch.relu(self.l1(x))
        if self.detach:
            h = h.detach()
        if self.keyword:  # forward hooks see no positional input
            h = torch.relu(self.l2(input=h))
        elif self.checkpoint is None:
            h = torch.relu(self.l2(h))
        else:
            h = checkpoint(lambda t: torch.relu(self.l2(t)), h,
                           use_reentrant=self.checkpoint)
        return self.l3(h)


def _loss(model, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 5, generator=g, dtype=F64)
    return model(x).square().mean()


def _plain(model, opt, seed):
    opt.zero_grad()
    _loss(model, seed).backward()


def _model_zero_grad(model, opt, seed):
    model.zero_grad()
    _loss(model, seed).backward()


def _model_zero_grad_in_place(model, opt, seed):
    model.zero_grad(set_to_none=False)
    _loss(model, seed).backward()


def _micro_batches(model, opt, seed):
    opt.zero_grad()
    for k in range(3):
        _loss(model, 10 * seed + k).backward()


def _retain_graph(model, opt, seed):
    opt.zero_grad()
    loss = _loss(model, seed)
    loss.backward(retain_graph=True)
    loss.backward()


def _clip(model, opt, seed):
    _plain(model, opt, seed)
    nn.utils.clip_grad_norm_(model.parameters(), 1e-3)


def _scale_in_place(model, opt, seed):
    _plain(model, opt, seed)
    model.l2.weight.grad.mul_(0.5)


def _replace(model, opt, seed):
    _plain(model, opt, seed)
    model.l3.weight.grad = model.l3.weight.grad * 0.5


def _unscale_first_layer(model, opt, seed):
    _plain(model, opt, seed)
    model.l1.weight.grad.mul_(2.0)  # layer 1's gradient enters only through the check


def _first_layer_without_gradient(model, opt, seed):
    """Layer 1's weight gradient dropped after the backward pass: the chain steps in runs
    of the layers that have one."""
    _plain(model, opt, seed)
    model.l1.weight.grad = None


def _zero_between_forward_and_backward(model, opt, seed):
    _plain(model, opt, seed)  # a gradient there, then cleared after the next forward pass
    loss = _loss(model, seed + 100)
    model.zero_grad()
    loss.backward()


def _assign_between_forward_and_backward(model, opt, seed):
    opt.zero_grad()
    loss = _loss(model, seed)
    model.l2.weight.grad = torch.ones_like(model.l2.weight)
    loss.backward()


def _detached(first):
    """One backward pass through two uses of the layers, one of them (the ``first`` or the
    second forward pass) with a detached input: the tap sees the same graph task as the
    weight's accumulation, and misses that use."""
    def play(model, opt, seed):
        opt.zero_grad()
        losses = []
        for detach in (first, not first):
            model.detach = detach
            try:
                losses.append(_loss(model, seed + len(losses)))
            finally:
                model.detach = False
        (losses[0] + losses[1]).backward()
    return play


def _two_uses(model, opt, seed):
    """The layers used twice in one loss (one backward pass, two uses of each layer)."""
    opt.zero_grad()
    (_loss(model, seed) + _loss(model, seed + 1)).backward()


def _zero_in_place(model, opt, seed):
    opt.zero_grad(set_to_none=False)
    _loss(model, seed).backward()


def _autograd_grad(model, opt, seed):
    _plain(model, opt, seed)
    torch.autograd.grad(_loss(model, seed + 1), list(model.parameters()))


def _no_zero_grad(model, opt, seed):
    _loss(model, seed).backward()  # accumulates onto the last step's gradients


def _weights_written(model, opt, seed):
    _plain(model, opt, seed)
    with torch.no_grad():
        model.l2.weight.mul_(1.0)


def _functional_call(model, opt, seed):
    """A loss of the same layers with other parameters, backward to those: no tap."""
    _plain(model, opt, seed)
    other = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    x = torch.randn(4, 5, dtype=F64)
    torch.func.functional_call(model, other, (x,)).square().sum().backward()


def _weights_written_first(model, opt, seed):
    """Weights written after the gradients were cleared and before the forward pass (a
    skeleton re-initialisation, a projection): the sums are those of the new weights."""
    opt.zero_grad()
    with torch.no_grad():
        model.l2.weight.mul_(1.0)
    _loss(model, seed).backward()


def _input_requires_grad(model, opt, seed):
    """A loss whose input requires grad (an input gradient taken with the weights')."""
    opt.zero_grad()
    x = torch.randn(4, 5, dtype=F64, generator=torch.Generator().manual_seed(seed))
    model(x.requires_grad_()).square().mean().backward()


def _discarded_batch(model, opt, seed):
    """A batch backpropagated, then its gradients dropped by the model's ``zero_grad``."""
    _plain(model, opt, seed + 100)
    model.zero_grad()
    _loss(model, seed).backward()


def _autograd_grad_first(model, opt, seed):
    """``torch.autograd.grad`` through the layers while the gradients are cleared, then the
    batch whose gradients the step takes."""
    opt.zero_grad()
    torch.autograd.grad(_loss(model, seed + 100), list(model.parameters()))
    _loss(model, seed).backward()


def _weights_alone(model, opt, seed):
    """A loss of the weights alone (a penalty, no forward pass through the layers): the
    backward pass reaches every gradient without passing its layer. The first batch is
    taken on the fresh model without ``zero_grad`` (its gradients are None)."""
    if seed:
        opt.zero_grad()
    ((seed + 1.0) * sum(m.weight.square().sum() for m in (model.l1, model.l2, model.l3))
     ).backward()


def _forward_with(option, value):
    """A plain step whose forward pass runs with ``Net``'s ``option`` set to ``value``."""
    def play(model, opt, seed):
        before = getattr(model, option)
        setattr(model, option, value)
        try:
            _plain(model, opt, seed)
        finally:
            setattr(model, option, before)
    return play


# the reasons ``describe()`` gives for a step that read W * grad
CHANGED = "the gradient was changed after a backward pass"
NOT_CLEARED = "the gradients were not cleared after a step"
WRITTEN = "the weights were written after a backward pass"
NOT_INTO_GRAD = "a backward pass went through the layer and not into its gradient, or back"
NOT_INPUT = "a backward pass went through the layer but not through its input"
BACKWARD = {"backward": 3}

# scenario -> where each of its 3 steps took its column sums from ("backward", or the
# reason it read W * grad instead)
SCENARIOS = {
    "optimizer zero_grad": (_plain, BACKWARD),
    "model.zero_grad()": (_model_zero_grad, BACKWARD),
    "optimizer zero_grad(set_to_none=False)": (_zero_in_place, BACKWARD),
    "accumulated micro-batches": (_micro_batches, BACKWARD),
    "retain_graph, two backward passes": (_retain_graph, BACKWARD),
    "two uses in one backward pass": (_two_uses, BACKWARD),
    "an input that requires grad": (_input_requires_grad, BACKWARD),
    "a batch discarded by model.zero_grad()": (_discarded_batch, BACKWARD),
    "torch.autograd.grad before the backward pass": (_autograd_grad_first, BACKWARD),
    # zeroing gradients that are still None (the first step) changes nothing
    "model.zero_grad(set_to_none=False)": (_model_zero_grad_in_place,
                                           {"backward": 1, NOT_CLEARED: 2}),
    "clip_grad_norm_": (_clip, {CHANGED: 3}),
    "gradient scaled in place": (_scale_in_place, {CHANGED: 3}),
    "gradient replaced": (_replace, {CHANGED: 3}),
    "layer 1's gradient scaled": (_unscale_first_layer, {CHANGED: 3}),
    "layer 1's gradient dropped": (_first_layer_without_gradient,
                                   {"a layer had no gradient": 3}),
    "zero_grad between forward and backward": (_zero_between_forward_and_backward,
                                               {CHANGED: 3}),
    "gradient assigned between forward and backward": (_assign_between_forward_and_backward,
                                                       {CHANGED: 3}),
    "a use with a detached input, then one without": (_detached(True), {NOT_INPUT: 3}),
    "a use without, then one with a detached input": (_detached(False), {NOT_INPUT: 3}),
    "torch.autograd.grad": (_autograd_grad, {NOT_INTO_GRAD: 3}),
    "a loss of the weights alone": (_weights_alone, {NOT_INTO_GRAD: 3}),
    "gradients not cleared": (_no_zero_grad, {"backward": 1, NOT_CLEARED: 2}),
    "weights written after the backward pass": (_weights_written, {WRITTEN: 3}),
    "weights written before the forward pass": (_weights_written_first, BACKWARD),
    "torch.func.functional_call with other parameters": (_functional_call, BACKWARD),
    "checkpoint (non-reentrant)": (_forward_with("checkpoint", False), BACKWARD),
    "checkpoint (reentrant)": (_forward_with("checkpoint", True), BACKWARD),
    "a layer called with its input by keyword": (_forward_with("keyword", True),
                                                 {NOT_INTO_GRAD: 3}),
}


def _pair(make_opt, **kw):
    torch.manual_seed(0)
    model = Net()
    skeleton_init_(model)
    twin = copy.deepcopy(model)
    return (model, make_opt(model, **kw)), (twin, make_opt(twin, backward_sums=False, **kw))


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("make_opt, kw", [
    (GSGD, dict(lr=0.05)), (GSGD, dict(lr=0.05, momentum=0.9, weight_decay=1e-3)),
    (GSGD, dict(lr=0.05, maximize=True)), (GAdam, dict(lr=1e-2))],
    ids=["gsgd", "gsgd-momentum", "gsgd-maximize", "gadam"])
def test_every_way_of_touching_the_gradients_steps_like_w_times_grad(name, make_opt, kw):
    play, sources = SCENARIOS[name]
    (model, opt), (twin, ref) = _pair(make_opt, **kw)
    for seed in range(3):
        for m, o in ((model, opt), (twin, ref)):
            play(m, o, seed)
            o.step()
    assert_same_parameters(model, twin)
    assert opt.describe().column_sums == sources and ref.describe().column_sums == {}


@pytest.mark.parametrize("how", ["backward", "assigned"])
def test_gradients_made_before_the_optimizer_are_read_from_w_times_grad(how):
    """An optimizer built after a backward pass, or on gradients assigned by hand: its first
    step reads ``W * grad`` (the sums began at zero and never saw those gradients) and steps
    as the optimizer without sums; the next batch takes the sums from its backward pass."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(Net())
        skeleton_init_(models[-1])
        if how == "backward":
            _loss(models[-1], 0).backward()
        else:
            for p in models[-1].parameters():
                p.grad = torch.randn_like(p)
    (model, twin) = models
    opt, ref = GSGD(model, lr=0.05), GSGD(twin, lr=0.05, backward_sums=False)
    for seed in (None, 1):
        for m, o in ((model, opt), (twin, ref)):
            if seed is not None:
                _plain(m, o, seed)
            o.step()
    assert_same_parameters(model, twin)
    assert opt.describe().column_sums == {"the gradient was there before the optimizer": 1,
                                          "backward": 1}


def test_fallbacks_are_counted_with_their_reason_and_described():
    (model, opt), _ = _pair(GSGD, lr=0.05)
    _plain(model, opt, 0)
    opt.step()
    _clip(model, opt, 1)
    opt.step()
    counts = opt.describe().column_sums
    assert counts == {"backward": 1, "the gradient was changed after a backward pass": 1}
    assert ("column sums from the backward pass: 1; read from W * grad instead: the gradient "
            "was changed after a backward pass (1)") in str(opt.describe())


def test_a_non_finite_gradient_skips_the_step_with_sums_from_the_backward_pass():
    (model, opt), _ = _pair(GSGD, lr=0.05)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    x = torch.randn(4, 5, dtype=F64)
    x[0, 0] = float("inf")
    model(x).square().mean().backward()
    with pytest.warns(UserWarning, match="NaN or Inf"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert opt.describe().skipped == 1 and opt.describe().column_sums == {"backward": 1}


@pytest.mark.parametrize("huge", [0, 1, 2])
def test_a_gradient_that_overflows_skips_the_step_though_the_sums_are_finite(huge):
    """One entry of ``grad_2``, ``gz[:, huge]^T x[:, 0]``, overflows where
    ``sum(x * W_2^T gz)`` does not (tiny ``W_2``): for two of the three outputs ``huge``
    that entry is an edge of the bulk (not the free edge of column 0), which no backward sum
    sees. The sum of the gradient, taken in the backward pass, says the step must be
    skipped."""
    model = nn.Sequential(nn.Linear(2, 3, dtype=F64), nn.ReLU(), nn.Linear(3, 3, dtype=F64))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[0].weight[0] = 1e100
        model[0].bias.zero_()
        model[2].weight.fill_(1e-200)
    opt = GSGD(model, lr=0.05)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    out = model(torch.full((4, 2), 1e100, dtype=F64))
    (out[:, huge].sum() * 1e200 + out.sum()).backward()
    assert torch.isfinite(model[2].weight.grad).sum() == 8
    sums = opt._sums[id(opt._parts[0])]
    assert all(torch.isfinite(layer.sums).all() for layer in sums.layers)
    with pytest.warns(UserWarning, match="NaN or Inf"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert opt.describe().skipped == 1 and opt.describe().column_sums == {"backward": 1}


def test_a_copy_of_the_model_neither_feeds_the_sums_nor_breaks_pickling():
    (model, opt), (twin, ref) = _pair(GSGD, lr=0.05)
    clone = copy.deepcopy(model)
    assert isinstance(pickle.loads(pickle.dumps(model)), Net)
    for m, o in ((model, opt), (twin, ref)):
        _plain(m, o, 0)
    _loss(clone, 5).backward()  # its forward hooks are the original's, disarmed
    opt.step()
    ref.step()
    assert_same_parameters(model, twin)
    assert opt.describe().column_sums == {"backward": 1}


def test_a_compiled_model_steps_like_w_times_grad():
    (model, opt), (twin, ref) = _pair(GSGD, lr=0.05)
    fast = torch.compile(model)
    for seed in range(2):
        opt.zero_grad()
        fast(torch.randn(4, 5, dtype=F64, generator=torch.Generator().manual_seed(seed))
             ).square().mean().backward()
        opt.step()
        _plain(twin, ref, seed)
        ref.step()
    assert_same_parameters(model, twin)


@pytest.mark.parametrize("update", ["gsgd", "adam"])
@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_the_fast_step_with_given_sums_equals_the_step_that_forms_them(update, lib):
    """The backends take column sums and a gradient sum from the caller: the step then
    equals the one that reads ``W * grad`` (float64 rounding), and with sums planted wrong
    it does not (the sums are used)."""
    import numpy as np

    from gsgd_core import adam_rule

    chain = Chain.from_shapes([(6, 5), (7, 6), (3, 7)], bias=True)
    rng = np.random.default_rng(0)
    arr = (lambda a: a) if lib == "numpy" else torch.from_numpy
    W = [arr(rng.standard_normal(chain.layer_shape(l)[:2]) * 0.5) for l in (1, 2, 3)]
    b = [arr(rng.standard_normal(n) * 0.1) for n in (6, 7, 3)]
    G = [arr(rng.standard_normal(w.shape) * 0.1) for w in W]
    Gb = [arr(rng.standard_normal(x.shape) * 0.1) for x in b]
    sums = [(W[l] * G[l]).sum(0) for l in (1, 2)]
    total = sum(g.sum() for g in G)

    def run(**given):
        w, x = [copy.deepcopy(a) for a in W], [copy.deepcopy(a) for a in b]
        if update == "gsgd":
            gsgd_update_(chain, None, w, x, G, Gb, lr=0.1, **given)
        else:
            rule = adam_rule(1e-2)
            state = rule.init(tuple(w) + tuple(x))
            state = state._replace(buffers=tuple(tuple(m.copy() if lib == "numpy" else m.clone()
                                                       for m in bufs) for bufs in state.buffers))
            path_update_(chain, rule, state, w, x, G, Gb, **given)
        return w + x

    want = run()
    for got_w, want_w in zip(run(column_sums=sums, gradient_check=total), want):
        np.testing.assert_allclose(np.asarray(got_w), np.asarray(want_w), rtol=1e-13)
    for got_w, want_w in zip(run(column_sums=sums), want):
        np.testing.assert_allclose(np.asarray(got_w), np.asarray(want_w), rtol=1e-13)
    wrong = run(column_sums=[s + 1.0 for s in sums], gradient_check=total)
    assert not all(np.allclose(np.asarray(p), np.asarray(q)) for p, q in zip(wrong, want))


@pytest.mark.parametrize("bad, match", [
    (lambda s, t: dict(column_sums=s[:1]), "takes 2 vectors"),
    (lambda s, t: dict(column_sums=[s[0], s[1][:-1]]), "column_sums of layer 3: expected "
                                                        r"shape \(7,\)"),
    (lambda s, t: dict(column_sums=[s[0].float(), s[1]]), "column_sums of layer 2"),
    (lambda s, t: dict(column_sums=s, gradient_check=t.reshape(1)), "gradient_check"),
    (lambda s, t: dict(gradient_check=t), "pass both"),
])
def test_bad_column_sums_are_refused_before_anything_is_written(bad, match):
    chain = Chain.from_shapes([(6, 5), (7, 6), (3, 7)], bias=False)
    W = [torch.randn(chain.layer_shape(l)[:2], dtype=F64) for l in (1, 2, 3)]
    G = [torch.randn_like(w) for w in W]
    before = [w.clone() for w in W]
    sums = [(W[l] * G[l]).sum(0) for l in (1, 2)]
    with pytest.raises(ValueError, match=match):
        gsgd_update_(chain, None, W, None, G, None, lr=0.1, **bad(sums, sum(g.sum() for g in G)))
    assert all(torch.equal(w, v) for w, v in zip(W, before))


@pytest.mark.parametrize("init_scale, unscale_first, sources", [
    (2.0**10, False, BACKWARD),
    (1000.0, False, {"the gradients were unscaled by a factor that is not a power of two": 3}),
    (2.0**10, True, {"GradScaler.unscale_ changed the gradients in place": 3})],
    ids=["power-of-two", "other-scale", "unscale_-first"])
def test_grad_scaler_unscales_the_sums_exactly_or_refuses_them(init_scale, unscale_first,
                                                               sources):
    """``GradScaler.step`` hands GSGD its scale: the gradients are unscaled and the sums by
    the same factor (exact for a power of two; any other scale, or gradients that
    ``scaler.unscale_`` changed out of sight of version counters, refuse the sums)."""
    (model, opt), (twin, ref) = _pair(GSGD, lr=0.05, momentum=0.9)
    scalers = [torch.amp.GradScaler("cpu", init_scale=init_scale) for _ in range(2)]
    for seed in range(3):
        for m, o, scaler in ((model, opt, scalers[0]), (twin, ref, scalers[1])):
            o.zero_grad()
            scaler.scale(_loss(m, seed)).backward()
            if unscale_first:
                scaler.unscale_(o)
            scaler.step(o)
            scaler.update()
    assert_same_parameters(model, twin)
    assert opt.describe().column_sums == sources
    if init_scale != 2.0**10:
        return  # GradScaler unscales by a float32 reciprocal: exact for powers of two only
    (plain, plain_opt), _ = _pair(GSGD, lr=0.05, momentum=0.9)
    for seed in range(3):
        _plain(plain, plain_opt, seed)
        plain_opt.step()
    assert_same_parameters(model, plain)


def test_an_in_place_relu_after_a_layer_keeps_the_sums_exact():
    """``nn.ReLU(inplace=True)`` rewrites a layer's output: the bound's hook on that output
    still gets the gradient of the output as the layer wrote it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, dtype=F64), nn.ReLU(inplace=True),
                          nn.Conv2d(4, 5, 3, padding=1, dtype=F64), nn.ReLU(inplace=True),
                          nn.Flatten(), nn.Linear(5 * 36, 3, dtype=F64))
    skeleton_init_(model)
    twin = copy.deepcopy(model)
    opt, ref = GSGD(model, lr=0.05), GSGD(twin, lr=0.05, backward_sums=False)
    step_twins([(model, opt), (twin, ref)],
               [torch.randn(4, 3, 6, 6, dtype=F64, generator=torch.Generator().manual_seed(seed))
                for seed in range(2)])
    assert_same_parameters(model, twin)
    assert opt.describe().column_sums == {"backward": 2}


def _chain_modules(net):
    return [m for m in net if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d))]


@pytest.mark.parametrize("make_opt, backend", [
    (GSGD, "gsgd_adapters.torch.functional.gsgd_update_"),
    (GAdam, "gsgd_adapters.torch.functional.path_update_")], ids=["gsgd", "gadam"])
def test_the_step_hands_the_backend_the_sums_from_the_backward_pass(make_opt, backend,
                                                                    monkeypatch):
    """A step whose record stands hands the backend the column sums of ``W * grad`` and a
    gradient check of zero (the bound proves every gradient entry finite), so that the
    step need not form them; a step that reads ``W * grad`` instead hands it neither."""
    real = {"gsgd": gsgd_update_, "gadam": path_update_}[make_opt.__name__.lower()]
    calls = []

    def spy(*args, **kw):  # a copy: the record's buffers restart at the next zero_grad
        calls.append({k: [t.clone() for t in v] if k == "column_sums" else
                      v if v is None else v.clone()
                      for k, v in kw.items() if k in ("column_sums", "gradient_check")})
        return real(*args, **kw)

    monkeypatch.setattr(backend, spy)
    (model, opt), _ = _pair(make_opt, lr=1e-2)
    _plain(model, opt, 0)
    with torch.no_grad():
        want = _colsums([model.l1, model.l2, model.l3], (5, 6, 7, 3))
    opt.step()
    _clip(model, opt, 1)
    opt.step()
    given, read = calls
    for g, w in zip(given["column_sums"], want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)
    check = given["gradient_check"]
    assert isinstance(check, torch.Tensor) and check.shape == () and check.dtype == F64
    assert float(check) == 0.0
    assert "column_sums" not in read and "gradient_check" not in read


@pytest.mark.parametrize("above", [False, True], ids=["at-the-limit", "above-it"])
def test_the_gradient_check_is_zero_up_to_its_limit_and_inf_above(above):
    """``take``'s check proves the gradients finite (0) while the bound, the sum over layers
    of ``||dL/dz|| * ||x||``, is at most the dtype's largest number times ``2**-16``, and is
    ``inf`` above that (the step then checks the gradients themselves). A one-unit chain
    whose second layer has a zero weight puts the whole bound on that layer, exactly."""
    limit = torch.finfo(F64).max * 2.0**-16
    model = nn.Sequential(nn.Linear(1, 1, bias=False, dtype=F64), nn.ReLU(),
                          nn.Linear(1, 1, bias=False, dtype=F64))
    with torch.no_grad():
        model[0].weight.fill_(2.0**504)  # x_2 = 2**504
        model[2].weight.zero_()  # dL/dz_1 = 0: layer 1 adds nothing to the bound
    sums = BackwardSums(_chain_modules(model), (1, 1, 1))
    gz = limit / 2.0**504
    if above:
        gz = math.nextafter(gz, math.inf)
    (model(torch.ones(1, 1, dtype=F64)) * gz).sum().backward()
    bound = sum(float(layer.bound) for layer in sums.layers)
    assert bound == gz * 2.0**504 and (bound > limit) == above
    _, check = sums.take()
    assert float(check) == (math.inf if above else 0.0)


@pytest.mark.parametrize("conv", [False, True], ids=["linear", "conv"])
def test_an_unbatched_input_gives_the_column_sums_of_w_times_grad(conv):
    """One sample without its batch axis (``(features,)`` for a Linear, ``(C, H, W)`` for a
    convolution): the sums are still those of ``W * grad``."""
    torch.manual_seed(0)
    if conv:
        net = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, dtype=F64), nn.ReLU(),
                            nn.Conv2d(3, 4, 3, padding=1, dtype=F64), nn.ReLU(),
                            nn.Flatten(0), nn.Linear(4 * 36, 2, dtype=F64))
        x = torch.randn(2, 6, 6, dtype=F64)
    else:
        net = _net(False, [3, 4, 5, 2], pool=False, dropout=False, bias=True)
        x = torch.randn(3, dtype=F64)
    modules = _chain_modules(net)
    sizes = chain_of(modules).sizes
    sums = BackwardSums(modules, sizes)
    net(x).square().sum().backward()
    got, _ = sums.take()
    with torch.no_grad():
        want = _colsums(modules, sizes)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


class _UpcastLinear(nn.Linear):
    """A Linear that casts its input to its weights' dtype."""

    def forward(self, x):
        return super().forward(x.to(self.weight.dtype))


class _UpcastConv1d(nn.Conv1d):
    """A Conv1d that casts its input to its weights' dtype."""

    def forward(self, x):
        return super().forward(x.to(self.weight.dtype))


@pytest.mark.parametrize("conv", [False, True], ids=["linear", "conv"])
def test_the_sums_are_summed_in_the_weights_dtype(conv):
    """A float64 layer fed a float32 input that it casts up: the products ``x * dL/dx``
    are float32 but their sum is taken in float64, as ``W * grad`` is. The two products,
    ``2**24`` and ``1``, sum to ``2**24 + 1``, exact in float64 and not in float32; they are
    a batch's two rows for a Linear, a position's two positions for a convolution."""
    big = 4096.0  # 2**12: its square is 2**24
    if conv:
        first = nn.Conv1d(1, 1, 1, bias=False)
        second = _UpcastConv1d(1, 1, 1, bias=False, dtype=F64)
        x, scale = torch.tensor([[[big, 1.0]]]), torch.tensor([[[big, 1.0]]], dtype=F64)
    else:
        first = nn.Linear(1, 1, bias=False)
        second = _UpcastLinear(1, 1, bias=False, dtype=F64)
        x, scale = torch.tensor([[big], [1.0]]), torch.tensor([[big], [1.0]], dtype=F64)
    with torch.no_grad():
        first.weight.fill_(1.0)
        second.weight.fill_(1.0)
    sums = BackwardSums([first, second], (1, 1, 1))
    (second(torch.relu(first(x))) * scale).sum().backward()
    got, _ = sums.take()
    with torch.no_grad():
        want = _colsums([first, second], (1, 1, 1))
    assert float(want[0]) == 2.0**24 + 1
    assert got[0].dtype == F64 and torch.equal(got[0], want[0])


class _Scaled(nn.Linear):
    """A Linear whose output is multiplied by a second argument of its forward."""

    def forward(self, x, scale):
        return super().forward(x) * scale


def test_a_layer_called_with_more_arguments_gets_them_all():
    """The input's tap takes the place of the first argument only: a layer whose forward
    takes more arguments gets them, and the sums are still those of ``W * grad``."""
    torch.manual_seed(0)
    first, second = nn.Linear(3, 4, dtype=F64), _Scaled(4, 2, dtype=F64)
    sums = BackwardSums([first, second], (3, 4, 2))
    second(torch.relu(first(torch.randn(5, 3, dtype=F64))), 3.0).square().sum().backward()
    got, _ = sums.take()
    with torch.no_grad():
        want = _colsums([first, second], (3, 4, 2))
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)


def test_remove_takes_every_layers_hooks_off():
    """After ``remove`` (twice: it holds nothing more to remove) no layer feeds the record:
    a backward pass leaves every layer's sums and bound at zero."""
    torch.manual_seed(0)
    net = _net(False, [3, 4, 5, 2], pool=False, dropout=False, bias=True)
    modules = _chain_modules(net)
    sums = BackwardSums(modules, chain_of(modules).sizes)
    sums.remove()
    sums.remove()
    net(torch.randn(4, 3, dtype=F64)).square().sum().backward()
    for layer in sums.layers:
        assert float(layer.bound) == 0.0 and not layer.sums.any()
        assert not layer.uses and not layer.taps and not layer.accumulations


def test_the_record_is_on_the_weights_device():
    """Weights on another device (``meta`` here: shapes without values) get their sums and
    their gradient check on that device."""
    net = nn.Sequential(nn.Linear(5, 6, device="meta"), nn.ReLU(),
                        nn.Linear(6, 7, device="meta"), nn.ReLU(),
                        nn.Linear(7, 3, device="meta"))
    modules = _chain_modules(net)
    sums = BackwardSums(modules, chain_of(modules).sizes)
    net(torch.empty(4, 5, device="meta")).square().sum().backward()
    got, check = sums.take()
    assert [s.device.type for s in got] == ["meta", "meta"] and check.device.type == "meta"
    assert [tuple(s.shape) for s in got] == [(6,), (7,)]


def test_a_layer_called_with_no_tensor_raises_torchs_own_error():
    model = Net()
    GSGD(model, lr=0.05)
    with pytest.raises(TypeError, match=r"^linear\(\): argument 'input' \(position 1\) must be "
                       r"Tensor, not list$"):
        model.l2([0.0] * 6)


def test_no_sums_are_taken_before_a_backward_pass():
    """Gradients that are still None: there is no step to take sums for."""
    net = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 7), nn.ReLU(), nn.Linear(7, 3))
    modules = _chain_modules(net)
    sums = BackwardSums(modules, chain_of(modules).sizes)
    net(torch.ones(4, 5)).sum()  # a forward pass, not backpropagated
    assert sums.take() is None
    assert dict(sums.counts) == {CHANGED: 1}


def test_clear_keeps_the_buffers_until_the_weights_change_dtype():
    """``clear`` zeroes the record's buffers in place while the weights keep their dtype and
    device (a step allocates nothing for its sums), and makes them anew in the weights'
    dtype after ``model.float()``; the sums are those of ``W * grad`` throughout."""
    torch.manual_seed(0)
    net = _net(False, [3, 4, 5, 2], pool=False, dropout=False, bias=True)
    modules = _chain_modules(net)
    sizes = chain_of(modules).sizes
    sums = BackwardSums(modules, sizes)

    def step(dtype):
        net.zero_grad()
        net.to(dtype)
        sums.clear()
        net(torch.randn(4, 3, dtype=dtype)).square().sum().backward()
        got, _ = sums.take()
        with torch.no_grad():
            want = _colsums(modules, sizes)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == dtype
            torch.testing.assert_close(g, w)
        return [t for layer in sums.layers for t in (layer.sums, layer.bound)]

    first, again, cast = step(F64), step(F64), step(torch.float32)
    assert all(a is b for a, b in zip(first, again))
    assert not any(a is c for a, c in zip(first, cast))


@pytest.mark.parametrize("name", ["gsgd", "gadam"])
@pytest.mark.parametrize("first_step", [False, True])
def test_a_dtype_change_after_zero_grad_steps_like_w_times_grad(name, first_step):
    """``zero_grad``, then ``model.float()`` (which leaves the weights' version counters
    as they were), then forward, backward and step: the sums restart in the new dtype and
    the steps equal those from ``W * grad``, on a new optimizer or after a step."""
    torch.manual_seed(0)
    net = _net(False, [3, 4, 5, 2], pool=False, dropout=False, bias=True)
    twin = copy.deepcopy(net)
    make = GSGD if name == "gsgd" else GAdam
    pairs = [(net, make(net, lr=0.01)), (twin, make(twin, lr=0.01, backward_sums=False))]
    x = torch.randn(6, 3, dtype=torch.float64)
    if first_step:
        step_twins(pairs, [x])
    for model, opt in pairs:
        opt.zero_grad()
        model.float()
    for _ in range(2):
        for model, opt in pairs:
            model(x.float()).square().sum().backward()
            opt.step()
            opt.zero_grad()
    assert_same_parameters(net, twin, rtol=1e-5, atol=1e-6)  # float32 sums, summed otherwise
    assert pairs[0][1].describe().column_sums["backward"] == 2 + first_step


def test_a_chain_through_batch_norm_steps_on_its_row_scaled_gradients():
    """``bn="paper"``: the gradient of a layer followed by batch norm is scaled by its rows'
    norms before the step, which the sums of the backward pass do not see: that chain takes
    none, and steps as without them."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 6, dtype=F64), nn.ReLU(), nn.Linear(6, 7, dtype=F64),
                        nn.BatchNorm1d(7, dtype=F64), nn.ReLU(), nn.Linear(7, 3, dtype=F64))
    twin = copy.deepcopy(net)
    pairs = [(net, GSGD(net, lr=0.05, bn="paper")),
             (twin, GSGD(twin, lr=0.05, bn="paper", backward_sums=False))]
    g = torch.Generator().manual_seed(0)
    step_twins(pairs, [torch.randn(8, 5, dtype=F64, generator=g) for _ in range(2)])
    assert_same_parameters(net, twin)
    assert pairs[0][1].describe().column_sums == {}


def test_a_layer_frozen_with_its_gradient_zeroed_keeps_the_sums_from_the_backward_pass():
    """Fine-tuning: ``l2.weight`` frozen after the first step, its gradient zeroed in place
    (``zero_grad(set_to_none=False)``) and never accumulated into again: ``W * grad`` is
    zero there, as its sums stay, so every step takes the sums from the backward pass."""
    (model, opt), (twin, ref) = _pair(GSGD, lr=0.05)
    for seed in range(3):
        for m, o in ((model, opt), (twin, ref)):
            o.zero_grad(set_to_none=False)
            _loss(m, seed).backward()
            o.step()
            m.l2.weight.requires_grad_(False)
    assert_same_parameters(model, twin)
    assert opt.describe().column_sums == BACKWARD


def test_ddp_says_a_gradient_changed_though_every_layers_record_had_stopped(one_process_group):
    """A micro-batch under DDP's ``no_sync``, every gradient clipped in place, a reduced
    micro-batch, a step: the step reads ``W * grad`` because the gradients were changed;
    the last backward pass was reduced, though no chain layer's record still counted it."""
    import _ddp_worker as dw

    model, x, y = dw.model_and_data()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = GSGD(ddp, lr=0.05)
    with ddp.no_sync():
        ((ddp(x) - y) ** 2).mean().backward()
    torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.1)
    ((ddp(x) - y) ** 2).mean().backward()
    opt.step()
    assert opt.describe().column_sums == {CHANGED: 1}
