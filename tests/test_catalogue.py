"""Chain discovery on a catalogue of real layouts: G-SGD on the models people use.

Each layout has an expected verdict. Wherever a chain is claimed, float64 checks show that a
random positive rescaling leaves the output unchanged and that rescaled twins train
identically under G-SGD; for the unsound claims that shapes alone cannot rule out, forcing
the chain by hand shows the output does change, so the verdict is what keeps G-SGD exact.
"""

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

from _catalogue import CATALOGUE, REASONS, UNSOUND, after, qat_conv
from _helpers import DEFAULT_INIT
from gsgd_adapters.torch import (GSGD, SkeletonWarning, chain_of, check_invariance, discover,
                                 random_rescale_, skeleton_init_)

NAMES = sorted(CATALOGUE)


def _build(name, dtype=torch.float64):
    make, shape, chains, psi = CATALOGUE[name]
    torch.manual_seed(0)
    model = make().to(dtype)
    x = (torch.randint(0, 7, shape[1:]) if shape[0] == "tokens"
         else torch.randn(shape, dtype=dtype))
    return model, x, chains, psi


def test_the_catalogue_is_large_enough():
    assert len(CATALOGUE) >= 20


@pytest.mark.parametrize("name", NAMES)
def test_discovery_verdict(name):
    model, x, chains, psi = _build(name)
    model(x)  # the layout runs as written
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    found = discover(model, trainable=trainable)
    assert [c.names for c in found.chains] == chains
    assert found.reasons == REASONS.get(name, {})
    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("always")
        opt = GSGD(model, lr=0.1)
        opt.step()  # its first step checks the skeleton (no gradient: nothing moves)
        d = opt.describe()
    # forgetting skeleton_init_ is never silent where there are chains
    assert any(issubclass(w.category, SkeletonWarning) for w in log) == bool(chains)
    assert [c[0] for c in d.chains] == chains
    assert d.normalised == [f"{n}.weight" for n in psi]
    in_chains = {f"{n}.weight" for c in chains for n in c}
    assert not in_chains & set(d.reasons)
    for w, why in d.reasons.items():  # every layer outside chains says why, in describe()
        assert why
        if w in d.fallback:
            assert f"{w}: not in a chain: {why}" in str(d)


@pytest.mark.parametrize("name", [n for n in NAMES if CATALOGUE[n][2]])
@DEFAULT_INIT  # the twin's, rescaled
def test_claimed_chains_are_invariant_and_rescaled_twins_train_identically(name):
    model, x, chains, _ = _build(name)
    changes = check_invariance(model, x)
    assert len(changes) == len(chains) and max(changes.values()) <= 1e-12
    model.eval()  # dropout off: both twins see the same function
    skeleton_init_(model)
    twin = copy.deepcopy(model)
    random_rescale_(twin, np.random.default_rng(1), 1.0)
    with torch.no_grad():
        moved = max(float((a - b).abs().max()) for a, b in zip(model.parameters(),
                                                                twin.parameters()))
    assert moved > 1e-3  # the twin really is rescaled
    torch.manual_seed(2)
    target = torch.randn_like(model(x))
    outs = []
    for m in (model, twin):
        opt = GSGD(m, lr=0.01, momentum=0.9, weight_decay=1e-3)
        for _ in range(4):
            opt.zero_grad()
            ((m(x) - target) ** 2).sum().backward()
            opt.step()
        outs.append(m(x).detach())
    scale = float(outs[0].abs().max())
    assert float((outs[0] - outs[1]).abs().max()) <= 1e-8 * scale


@pytest.mark.parametrize("name", sorted(UNSOUND))
def test_forcing_an_unsound_chain_changes_the_output(name):
    """The control: these are the claims discovery refuses; by hand, they are not chains."""
    model, x, chains, _ = _build(name)
    modules = dict(model.named_modules())
    with pytest.raises(ValueError, match="is not a chain of this model"):
        check_invariance(model, x, chains=[[modules[n] for n in UNSOUND[name]]])


def test_gsgd_with_example_input_runs_the_self_check():
    model, x, _, _ = _build("VGG-style with adaptive pool and dropout")
    skeleton_init_(model)
    GSGD(model, lr=0.1, example_input=x)
    bad, xb, _, _ = _build("per-token Linear then flatten")
    with pytest.raises(ValueError, match="fc1 -> head is not a chain"):
        GSGD(bad, lr=0.1, chains=[[bad.fc1, bad.head]], example_input=xb)


def test_strict_raises_and_names_each_layer_and_its_reason():
    model, _, _, _ = _build("per-token Linear then flatten")
    with pytest.raises(ValueError, match=r"head: after fc1: the flatten of a Linear output"):
        GSGD(model, lr=0.1, strict=True)
    model, _, _, _ = _build("head tied to an Embedding")
    with pytest.raises(ValueError, match=r"head: a parameter is shared with emb"):
        GSGD(model, lr=0.1, strict=True)


def test_chain_of_names_the_layers_by_class_without_names():
    with pytest.raises(ValueError, match=r"^ReLU: a chain holds Linear and Conv1d/2d/3d "
                       r"layers, got ReLU$"):
        chain_of([nn.Linear(3, 4), nn.ReLU()])
    with pytest.raises(ValueError, match=r"^conv: grouped or depthwise convolutions "
                       r"\(groups=2\) cannot be in a chain yet$"):
        chain_of([nn.Conv2d(4, 4, 3, groups=2)], names=["conv"])
    with pytest.raises(ValueError, match=r"^layers \['Linear', 'Linear'\] do not form a "
                       r"chain: "):
        chain_of([nn.Linear(3, 4), nn.Linear(5, 2)])


def test_chains_given_by_hand_are_refused_by_their_names_in_the_model():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"^1: a chain holds Linear and Conv1d/2d/3d layers, "
                       r"got ReLU$"):
        GSGD(model, lr=0.1, chains=[[model[0], model[1]]])
    with pytest.raises(ValueError, match=r"^layers \['2', '0'\] do not form a chain: "):
        GSGD(model, lr=0.1, chains=[[model[2], model[0]]])


def test_a_layer_that_cannot_take_the_units_of_the_last_is_refused_without_running():
    """torch.fx traces without shapes: a model that could not run has no chain, and
    discovery says why (the next layer takes 12 inputs, not the 6 units)."""
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(12, 3))
    assert discover(model).reasons == {
        "0": "the next layer 2 does not take its 6 units as inputs",
        "2": "after 0: the next layer 2 does not take its 6 units as inputs; its output is "
             "the model's output"}


def test_a_fake_quantised_conv_is_in_no_chain_and_forcing_it_changes_the_output():
    """QAT's Conv2d subclasses nn.Conv2d with a forward of its own (float32 only)."""
    torch.manual_seed(0)
    model = qat_conv()
    found = discover(model)
    assert found.chains == [] and found.reasons == {
        "2": "torch.ao.nn.qat.modules.conv.Conv2d is a subclass of nn.Conv2d with a forward "
             "of its own",
        "0": "the next layer 2 cannot be in a chain", "4": "its output is the model's output"}
    x = torch.randn(2, 2, 6, 6)
    model(x)  # the observers see the input once, then keep their quantisation grid
    model.apply(torch.ao.quantization.disable_observer)
    before = model(x)
    with torch.no_grad():  # unit j of layer 0 scaled by c_j, its outgoing weights by 1/c_j
        c = torch.tensor([0.5, 1.7, 3.1])
        model[0].weight.mul_(c[:, None, None, None])
        model[0].bias.mul_(c)
        model[2].weight.div_(c[None, :, None, None])
    assert model(x).sub(before).abs().max() > 1e-2 * before.abs().max()


@pytest.mark.parametrize("name", [n for n in NAMES if "norm (" in n])
def test_a_layer_with_a_computed_weight_steps_as_sgd(name):
    """A weight computed by a parametrisation or a hook is no parameter: G-SGD gives every
    parameter of the model SGD's step (no chain is left)."""
    (model, x, _, _), (twin, _, _, _) = _build(name), _build(name)  # a hook's weight: no deepcopy
    opt, sgd = GSGD(model, lr=0.1, momentum=0.9), torch.optim.SGD(twin.parameters(), lr=0.1,
                                                                    momentum=0.9)
    for _ in range(2):
        for m, o in ((model, opt), (twin, sgd)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_lazy_layers_are_refused_until_the_first_forward_pass():
    """As any model discovery cannot read: ``discover`` raises, G-SGD warns and gives every
    parameter SGD's rule (``strict=True`` raises)."""
    model = nn.Sequential(nn.LazyConv2d(3, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))
    why = (r"0.weight, 0.bias, 3.weight, 3.bias: lazy parameters have no shape before the "
           r"model's first forward pass; build the optimizer after one")
    with pytest.raises(ValueError, match=f"^{why}$"):
        discover(model)
    with pytest.warns(UserWarning, match=f"^{why}. Every parameter takes SGD's rule.$"):
        assert GSGD(model, lr=0.1).describe().chains == []
    model(torch.randn(2, 2, 5, 5))
    assert [c.names for c in discover(model).chains] == [["0", "3"]]


class _Stops(nn.Module):
    """A conv, batch norm, then what ``stop`` does with the normalised output."""

    def __init__(self, stop):
        super().__init__()
        self.c, self.bn, self.stop = nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), stop
        self.p = nn.Parameter(torch.ones(4, 4))
        self.frozen, self.wide, self.odd = nn.Conv2d(3, 2, 1), nn.Linear(4, 2), nn.Linear(7, 2)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        h = self.bn(self.c(x))
        return {"branch": lambda: h + h.relu(), "output": lambda: h,
                "second input": lambda: torch.matmul(self.p, h),
                "frozen next": lambda: self.frozen(h.relu()),
                "wrong axis": lambda: self.wide(h.relu()),
                "units do not fit": lambda: self.odd(h.relu().flatten(1)),
                "GELU": lambda: nn.functional.gelu(h)}[self.stop]()


@pytest.mark.parametrize("stop", ["branch", "output", "second input", "frozen next",
                                  "wrong axis", "units do not fit", "GELU"])
def test_a_layer_whose_walk_passes_batch_norm_and_stops_is_normalised(stop):
    """With batch norm passed through (the paper's BN variant), a layer followed by batch
    norm whose walk then stops, however it stops, still has its rows normalised: PSI's."""
    model = _Stops(stop)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    for through_bn in (False, True):
        found = discover(model, through_bn, trainable=trainable)
        assert [n for n, _ in found.normalised] == ["c"] and found.chains == [], through_bn


def test_with_batch_norm_passed_through_only_batch_norm_joins_a_chain():
    """The paper's BN variant passes batch norm only: a conv then batch norm then a conv is one
    chain (its first layer marked normalised there, so not left to PSI), while a conv then
    instance norm stops there and is PSI's."""
    def block(norm):
        return nn.Sequential(nn.Conv2d(2, 3, 3), norm, nn.ReLU(), nn.Conv2d(3, 2, 1))
    found = discover(block(nn.BatchNorm2d(3)), through_bn=True)
    assert [(c.names, c.normalised) for c in found.chains] == [(["0", "3"], [True, False])]
    assert found.normalised == [] and found.reasons == {}
    found = discover(block(nn.InstanceNorm2d(3, affine=True)), through_bn=True)
    assert found.chains == [] and [n for n, _ in found.normalised] == ["0"]
    assert found.reasons == {"0": "followed by InstanceNorm2d",
                             "3": after("0", "followed by InstanceNorm2d")}
