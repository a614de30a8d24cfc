"""The model operations of the torch adapter (``skeleton_init_``, ``random_rescale_``,
``check_invariance``): each recipe's numbers, the defaults, the chains argument, and the
check's handling of inputs and outputs."""

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

import gsgd_adapters.torch.model_ops as model_ops
from gsgd_adapters.torch import check_invariance, discover, random_rescale_, skeleton_init_
from gsgd_core.chain import HE_SKELETON_SHARE


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 4), nn.ReLU(),
                         nn.Linear(4, 3))


def _skeleton(chain, l, w):
    """Layer ``l``'s skeleton mask (tau and free edges) shaped as its weight ``w``."""
    return torch.as_tensor(chain.tau_mask(l) | chain.free_mask(l)).reshape(w.shape)


@pytest.mark.parametrize("skeleton", ["he", "paper"])
def test_skeleton_init_sets_the_recipes_edges_and_scales_the_rest(skeleton):
    """He: skeleton edges of magnitude ``r_l`` with their signs, the rest times
    ``sqrt(1 - share)``; paper: skeleton edges ``+1``, the rest unchanged."""
    model = mlp()
    before = [m.weight.detach().clone() for m in model if isinstance(m, nn.Linear)]
    (c,) = skeleton_init_(model, skeleton=skeleton)
    chain = c.chain
    r = chain.he_skeleton_scale() if skeleton == "he" else (1.0,) * chain.L
    rest = math.sqrt(1.0 - HE_SKELETON_SHARE) if skeleton == "he" else 1.0
    for l, (m, w0) in enumerate(zip(c.modules, before), start=1):
        sk = _skeleton(chain, l, w0)
        want = torch.full_like(w0, r[l - 1])
        if skeleton == "he":
            want = torch.where(w0 < 0, -want, want)
        assert torch.equal(m.weight[sk], want[sk]), (skeleton, l)
        assert torch.equal(m.weight[~sk], w0[~sk] * rest)


def test_skeleton_init_of_the_given_chains_only():
    model = mlp()
    last = model[4].weight.detach().clone()
    (c,) = skeleton_init_(model, chains=[[model[0], model[2]]])
    assert list(c.modules) == [model[0], model[2]]
    assert torch.equal(model[4].weight, last), "a layer outside the given chain moved"


def test_random_rescale_draws_the_cores_scales_with_its_spread():
    """``exp(spread * N(0, 1))`` per hidden unit from ``rng`` (the default spread is 1):
    unit ``j`` of layer ``l`` has its weights and bias times ``s_j`` and the next layer's
    column ``j`` divided by it, and the function is unchanged."""
    x = torch.randn(7, 5)
    for spread, kwargs in ((1.0, {}), (0.3, {"spread": 0.3})):
        model = mlp()
        out = model(x)
        (c,) = discover(model).chains
        scales = model_ops.random_rescaling(c.chain, np.random.default_rng(4), spread)
        W = [m.weight.detach().double().clone() for m in c.modules]
        b = [m.bias.detach().double().clone() for m in c.modules]
        for l, s in enumerate(scales):
            s = torch.as_tensor(s)
            W[l], b[l] = W[l] * s[:, None], b[l] * s
            W[l + 1] = W[l + 1] / s[None, :]
        random_rescale_(model, np.random.default_rng(4), **kwargs)
        for m, w, bias in zip(c.modules, W, b):
            torch.testing.assert_close(m.weight.double(), w, rtol=1e-6, atol=0)
            torch.testing.assert_close(m.bias.double(), bias, rtol=1e-6, atol=0)
        torch.testing.assert_close(model(x), out, rtol=1e-5, atol=1e-6)


def test_random_rescale_refuses_sharded_weights_naming_the_remedy(monkeypatch):
    monkeypatch.setattr(model_ops, "is_sharded", lambda w: isinstance(w, torch.Tensor))
    with pytest.raises(ValueError) as refused:
        random_rescale_(mlp(), np.random.default_rng(0))
    assert str(refused.value) == (
        "random_rescale_ draws its scales on each process: call it before fully_shard "
        "(the model's weights are DTensors)")


def test_check_invariance_leaves_the_model_alone_and_its_defaults_are_spread_1_seed_0(
        monkeypatch):
    model = mlp()
    state = copy.deepcopy(model.state_dict())
    x = torch.randn(7, 5)
    got = check_invariance(model, x)
    assert all(v.dtype == torch.float32 for v in model.state_dict().values())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert got == check_invariance(model, x, spread=1.0, seed=0)
    drawn = []
    original = model_ops.random_rescale_

    def recorded(twin, rng, spread, chains):
        drawn.append((spread, rng.bit_generator.state["state"]["state"]))
        return original(twin, rng, spread, chains=chains)

    monkeypatch.setattr(model_ops, "random_rescale_", recorded)
    check_invariance(model, x)
    seed0 = np.random.default_rng(0).bit_generator.state["state"]["state"]
    assert drawn == [(1.0, seed0)], "the twin is rescaled by exp(N(0, 1)) from seed 0"
    (change,) = got.values()
    assert 0 < change < 1e-12
    # the bound is inclusive: a change equal to rtol passes
    assert check_invariance(model, x, rtol=change) == got
    with pytest.raises(ValueError, match="is not a chain of this model"):
        check_invariance(model, x, rtol=change / 2)


class TwoInputs(nn.Module):
    """Two float32 inputs in a tuple, a dict of outputs with a list inside."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x, y):
        h = self.b(torch.relu(self.a(x)))
        return {"out": h, "more": [h * y.sum(), torch.relu(h)]}


def test_check_invariance_takes_input_tuples_and_outputs_of_dicts_and_lists():
    torch.manual_seed(0)
    model = TwoInputs()
    x, y = torch.randn(5, 3), torch.randn(2)  # float32: the check works in float64
    got = check_invariance(model, (x, y))
    assert list(got) == ["a -> b"] and got["a -> b"] < 1e-12


class WithATemperature(nn.Module):
    """A tensor input and a Python number beside it, an option of the forward pass."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x, temperature):
        return self.b(torch.relu(self.a(x))) / temperature


def test_check_invariance_passes_inputs_that_are_not_tensors_as_they_are():
    torch.manual_seed(0)
    got = check_invariance(WithATemperature(), (torch.randn(5, 3), 2.0))
    assert list(got) == ["a -> b"] and got["a -> b"] < 1e-12


def test_check_invariance_rescales_each_chain_on_its_own_copy():
    """Each chain's twin is a fresh copy: two layer lists that are no chains (tanh is not
    positively homogeneous) report what each reports alone."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    x = torch.randn(3, 4)
    a, b = [m[0], m[2]], [m[2], m[4]]
    both = check_invariance(m, x, chains=[a, b], rtol=math.inf)
    alone = {**check_invariance(m, x, chains=[a], rtol=math.inf),
             **check_invariance(m, x, chains=[b], rtol=math.inf)}
    assert both == alone and len(both) == 2 and min(both.values()) > 1e-3
