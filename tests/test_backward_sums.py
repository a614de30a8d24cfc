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
        self.detach, self.checkpoint = False, None

    def forward(self, x):
        h = torch.relu(self.l1(x))
        if self.detach:
            h = h.detach()
        if self.checkpoint is None:
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


def _checkpointed(reentrant):
    def play(model, opt, seed):
        model.checkpoint = reentrant
        try:
            _plain(model, opt, seed)
        finally:
            model.checkpoint = None
    return play


# scenario -> how many of its 3 steps take their sums from the backward pass (the others
# read W * grad); None: either, only agreement is asserted
SCENARIOS = {
    "optimizer zero_grad": (_plain, 3),
    "model.zero_grad()": (_model_zero_grad, 3),
    "optimizer zero_grad(set_to_none=False)": (_zero_in_place, 3),
    "accumulated micro-batches": (_micro_batches, 3),
    "retain_graph, two backward passes": (_retain_graph, 3),
    "two uses in one backward pass": (_two_uses, 3),
    # zeroing gradients that are still None (the first step) changes nothing
    "model.zero_grad(set_to_none=False)": (_model_zero_grad_in_place, 1),
    "clip_grad_norm_": (_clip, 0),
    "gradient scaled in place": (_scale_in_place, 0),
    "gradient replaced": (_replace, 0),
    "layer 1's gradient scaled": (_unscale_first_layer, 0),
    "zero_grad between forward and backward": (_zero_between_forward_and_backward, 0),
    "gradient assigned between forward and backward": (_assign_between_forward_and_backward,
                                                       0),
    "a use with a detached input, then one without": (_detached(True), 0),
    "a use without, then one with a detached input": (_detached(False), 0),
    "torch.autograd.grad": (_autograd_grad, 0),
    "gradients not cleared": (_no_zero_grad, 1),
    "weights written after the backward pass": (_weights_written, 0),
    "weights written before the forward pass": (_weights_written_first, 3),
    "torch.func.functional_call with other parameters": (_functional_call, 3),
    "checkpoint (non-reentrant)": (_checkpointed(False), 3),
    "checkpoint (reentrant)": (_checkpointed(True), 3),
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
    play, from_backward = SCENARIOS[name]
    (model, opt), (twin, ref) = _pair(make_opt, **kw)
    for seed in range(3):
        for m, o in ((model, opt), (twin, ref)):
            play(m, o, seed)
            o.step()
    assert_same_parameters(model, twin)
    counts = opt.describe().column_sums
    assert sum(counts.values()) == 3 and ref.describe().column_sums == {}
    if from_backward is not None:
        assert counts.get("backward", 0) == from_backward, counts


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


@pytest.mark.parametrize("init_scale, unscale_first, from_backward", [
    (2.0**10, False, 3), (1000.0, False, 0), (2.0**10, True, 0)],
    ids=["power-of-two", "other-scale", "unscale_-first"])
def test_grad_scaler_unscales_the_sums_exactly_or_refuses_them(init_scale, unscale_first,
                                                               from_backward):
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
    assert opt.describe().column_sums.get("backward", 0) == from_backward
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
