"""torch.optim conventions of the chain-aware optimizers on the models people use.

``param_groups`` are the user's groups and act on every parameter of them; the partition into
chain, PSI and SGD parts lives outside them. No buffer holds the learning rate. The
optimizer survives ``copy.deepcopy``; a step skipped for a non-finite gradient warns once,
is counted, and costs no more than a normal step.
"""

import copy
import inspect
import io
import warnings

import pytest
import torch
import torch.nn as nn

import gsgd_core
from _helpers import DEFAULT_INIT
from gsgd_adapters.torch import (GAdam, GAdamW, GSGD, PSISGD, PathSGD, SkippedStepWarning,
                                 skeleton_init_)

pytestmark = DEFAULT_INIT


class ConvBNNet(nn.Module):
    """A PSI layer (c3 + BN), a chain (c1 -> c2) and plain parameters (BN, head); float64."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c3, self.bn = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6)
        self.c1, self.c2 = nn.Conv2d(6, 4, 3, padding=1), nn.Conv2d(4, 5, 3, padding=1)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        x = torch.relu(self.bn(self.c3(x)))
        x = self.c2(torch.relu(self.c1(x)))
        return self.head(x.mean((2, 3)))  # the mean ends the chain before the head


def _data():
    g = torch.Generator().manual_seed(3)
    return (torch.randn(8, 3, 6, 6, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (8,), generator=g))


def _steps(model, opt, n):
    x, y = _data()
    for _ in range(n):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _make(**kw):
    model = ConvBNNet().double()
    skeleton_init_(model)
    return model, GSGD(model, **{"lr": 0.1, "momentum": 0.9, **kw})


def test_one_param_group_holds_every_parameter_and_every_part_is_there():
    model, opt = _make()
    assert len(opt.param_groups) == 1
    assert {id(p) for p in opt.param_groups[0]["params"]} == {id(p) for p in model.parameters()}
    d = opt.describe()
    assert [c[0] for c in d.chains] == [["c1", "c2"]] and d.normalised == ["c3.weight"]
    assert set(d.fallback) == {"c3.bias", "bn.weight", "bn.bias", "head.weight", "head.bias"}


def test_setting_param_groups_0_lr_to_zero_stops_every_part_at_once():
    """With momentum buffers full, lr = 0 moves nothing: chain, PSI and SGD parts alike (PSI
    buffers used to carry the learning rate and kept moving)."""
    model, opt = _make(weight_decay=1e-3)
    _steps(model, opt, 3)
    opt.param_groups[0]["lr"] = 0.0
    before = _snapshot(model)
    _steps(model, opt, 2)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_the_learning_rate_acts_at_once_as_in_sgd():
    """Halving lr after steps with momentum halves the next step of a PSI weight and of an
    SGD parameter (nothing in a buffer remembers the old lr)."""
    moves = []
    for lr2 in (0.1, 0.05):
        model, opt = _make()
        _steps(model, opt, 2)
        opt.param_groups[0]["lr"] = lr2
        before = _snapshot(model)
        _steps(model, opt, 1)
        moves.append({n: p.detach() - before[n] for n, p in model.named_parameters()})
    for name in ("c3.weight", "head.weight"):
        torch.testing.assert_close(moves[1][name], 0.5 * moves[0][name], rtol=1e-9, atol=0)


def test_user_groups_are_kept_and_each_part_takes_its_groups_hyperparameters():
    model = ConvBNNet().double()
    skeleton_init_(model)
    chain_params = [*model.c1.parameters(), *model.c2.parameters()]
    rest = [p for p in model.parameters() if all(p is not q for q in chain_params)]
    opt = GSGD([{"params": chain_params, "lr": 0.0}, {"params": rest}], lr=0.1, model=model)
    assert len(opt.param_groups) == 2 and [c[0] for c in opt.describe().chains] == [["c1", "c2"]]
    before = _snapshot(model)
    _steps(model, opt, 2)
    assert torch.equal(model.c1.weight, before["c1.weight"])  # its group has lr 0
    assert not torch.equal(model.head.weight, before["head.weight"])
    assert "lr=0," in str(opt.describe()).split("\n")[1]


def test_a_chain_split_across_param_groups_is_an_error_naming_it():
    model = ConvBNNet()
    groups = [{"params": list(model.c1.parameters())},
              {"params": [p for n, p in model.named_parameters() if not n.startswith("c1.")]}]
    with pytest.raises(ValueError, match=(
            r"^the chain c1 -> c2 is split across param groups \(c1: group 0, c2: group 1\): "
            r"G-SGD steps a chain as one, with one lr; put its layers \(weights and biases\) "
            r"in one group, or pass chains=\.\.\. by hand$")):
        GSGD(groups, lr=0.1, model=model)
    weights = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    with pytest.raises(ValueError, match=(
            r"^the chain c1 -> c2 is split across param groups \(c1.weight: group 0, c1.bias: "
            r"group 1, c2.weight: group 0, c2.bias: group 1\)")):
        GSGD([{"params": weights}, {"params": biases}], lr=0.1, model=model)
    torch.manual_seed(0)  # a layer without bias, and a frozen bias, name their layer alone
    mlp = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5, bias=False), nn.ReLU(),
                        nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))
    mlp[0].bias.requires_grad_(False)
    first = [mlp[0].weight]
    with pytest.raises(ValueError, match=r"^the chain 0 -> 2 -> 4 -> 6 is split across param "
                                         r"groups \(0: group 0, 2: group 1, 4: group 1, 6: "
                                         r"group 1\)"):
        GSGD([{"params": first}, {"params": [p for p in mlp.parameters() if p is not first[0]]}],
             lr=0.1, model=mlp)


def test_deepcopy_gives_an_optimizer_that_steps_the_copy_identically():
    model, opt = _make(weight_decay=1e-3)
    _steps(model, opt, 2)
    twin = copy.deepcopy({"model": model, "opt": opt})
    _steps(model, opt, 2)
    _steps(twin["model"], twin["opt"], 2)
    for (n, p), q in zip(model.named_parameters(), twin["model"].parameters()):
        assert torch.equal(p, q), n


def test_state_dict_round_trip_and_a_different_structure_is_refused():
    model, opt = _make()
    _steps(model, opt, 2)
    other_model = copy.deepcopy(model)
    other = GSGD(other_model, lr=0.1, momentum=0.9)
    buffer = io.BytesIO()  # through bytes, as a checkpoint does (state_dict() holds references)
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    other.load_state_dict(torch.load(buffer, weights_only=True))
    _steps(model, opt, 1)
    _steps(other_model, other, 1)
    for p, q in zip(model.parameters(), other_model.parameters()):
        assert torch.equal(p, q)
    plain = GSGD(ConvBNNet().double(), lr=0.1, momentum=0.9, bn="sgd")
    with pytest.raises(ValueError, match="different structure"):
        plain.load_state_dict(opt.state_dict())


def test_skipped_steps_warn_once_are_counted_and_never_reach_the_core(monkeypatch):
    model, opt = _make()
    x, y = _data()

    def no_core(*args, **kwargs):
        raise AssertionError("a skipped step must not run the core's full update")

    monkeypatch.setattr(gsgd_core, "gsgd_update", no_core)
    before = _snapshot(model)
    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("always")
        for _ in range(3):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            model.c2.weight.grad[0, 0, 0, 0] = float("nan")
            opt.step()
    assert len([w for w in log if issubclass(w.category, SkippedStepWarning)]) == 1
    assert opt.describe().skipped == 3 and "skipped for non-finite gradients: 3" in str(opt)
    for name in ("c1.weight", "c1.bias", "c2.weight", "c2.bias"):
        assert torch.equal(getattr(model, name.split(".")[0]).get_parameter(
            name.split(".")[1]), before[name])


def test_describe_shows_each_parts_hyperparameters():
    _, opt = _make(weight_decay=0.01)
    lines = str(opt.describe()).splitlines()
    for kind in ("chain c1 -> c2", "PSI-SGD", "plain SGD"):
        line = next(s for s in lines if kind in s)
        assert "lr=0.1, momentum=0.9, weight_decay=0.01" in line


def test_a_one_element_tensor_lr_works_like_the_number():
    a, oa = _make()
    b, ob = _make(lr=torch.tensor(0.1, dtype=torch.float64))
    _steps(a, oa, 2)
    _steps(b, ob, 2)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


# --------------------------------------------------------------------- torch's own defaults
def _tiny():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    skeleton_init_(model)
    return model


@pytest.mark.parametrize("ours, theirs, keys", [
    (GSGD, torch.optim.SGD,
     ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "foreach")),
    (PSISGD, torch.optim.SGD,
     ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "foreach")),
    (PathSGD, torch.optim.SGD,
     ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "foreach")),
    (GAdam, torch.optim.Adam,
     ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach")),
    (GAdamW, torch.optim.AdamW,
     ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach")),
], ids=lambda x: getattr(x, "__name__", ""))
def test_hyperparameter_defaults_are_those_of_the_torch_optimizer_it_replaces(ours, theirs,
                                                                              keys):
    """Switching ``torch.optim.SGD(model.parameters())`` to ``GSGD(model)`` (Adam to GAdam)
    keeps every hyperparameter that is not given."""
    model = _tiny()
    mine, torchs = ours(model).param_groups[0], theirs(model.parameters()).param_groups[0]
    for key in keys:
        assert mine[key] == torchs[key], key
    assert mine["check_finite"] is False


@pytest.mark.parametrize("make", [GSGD, PSISGD], ids=["GSGD", "PSISGD"])
def test_psi_renormalisation_threshold_defaults_to_the_cores(make):
    core = inspect.signature(gsgd_core.psi_update).parameters["max_norm"].default
    assert make(_tiny()).param_groups[0]["max_norm"] == core


def test_dampening_of_one_is_accepted_and_above_one_refused():
    GSGD(_tiny(), lr=0.1, momentum=0.9, dampening=1.0)
    with pytest.raises(ValueError, match=r"dampening must be a finite number in \[0, 1\]"):
        GSGD(_tiny(), lr=0.1, momentum=0.9, dampening=1.0 + 1e-9)


def test_param_groups_without_parameters_are_refused():
    for params in ([], [dict(params=[])], [dict(params=[]), dict(params=[])]):
        with pytest.raises(ValueError, match="^the optimizer got no parameters$"):
            GSGD(params, lr=0.1)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_state_holds_what_torch_sgd_holds(momentum):
    """No momentum: no buffer at all in the state (chains, PSI and SGD parts alike), as
    ``torch.optim.SGD``; with momentum every stepped parameter has one."""
    model, opt = _make(momentum=momentum)
    twin = copy.deepcopy(model)
    sgd = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=momentum)
    _steps(model, opt, 2)
    _steps(twin, sgd, 2)
    mine = {n: sorted(k for k in opt.state.get(p, {}) if k != "step")
            for n, p in model.named_parameters()}
    torchs = {n: sorted(sgd.state.get(p, {})) for n, p in twin.named_parameters()}
    assert mine == torchs
    assert all(v == (["momentum_buffer"] if momentum else []) for v in mine.values())


def test_a_bad_group_is_named_only_when_there_are_several():
    model = _tiny()
    w, b = model[0].weight, model[0].bias
    with pytest.raises(ValueError, match=r"^lr must be"):
        GSGD([dict(params=[w, b], lr=-1.0)], model=model)
    with pytest.raises(ValueError, match=r"^param group 1: lr must be"):
        GSGD([dict(params=[w]), dict(params=[b], lr=-1.0)], model=model)
    opt = GSGD([dict(params=[w])], model=model, lr=0.1)
    with pytest.raises(ValueError, match=r"^param group 1: momentum must be"):
        opt.add_param_group(dict(params=[b], momentum=-1.0))
    opt.add_param_group(dict(params=[b], momentum=0.5))
    with pytest.raises(ValueError, match=r"^param group 2: momentum must be"):
        opt.add_param_group(dict(params=[model[2].weight], momentum=-1.0))
    opt.add_param_group(dict(params=[model[2].weight], momentum=0.25))
    assert [(p.kind, p.names, p.hyper["momentum"]) for p in opt.describe().parts[-2:]] == [
        ("sgd", ["0.bias"], 0.5), ("sgd", ["2.weight"], 0.25)]


def test_parameters_without_a_model_or_chains_are_refused():
    with pytest.raises(ValueError, match=(r"^pass a model \(chains are found in it\) or "
                                          r"chains=\[\[layer, \.\.\.\], \.\.\.\] together "
                                          r"with the other parameters$")):
        GSGD(list(_tiny().parameters()), lr=0.1)


def test_a_chains_fingerprint_tells_every_field_of_the_chain_apart():
    """A state dict is refused for a chain that differs in anything: its fingerprint (of
    the chain's widths, slots, biases, tau and sigma edges, skeleton slots and scales) is
    a 16-digit hex string, the same for equal chains and different for chains that differ
    in any one field. It is part of the saved format: a change of the fields' names or of
    how they are hashed would refuse every state dict saved before, so it is pinned."""
    import dataclasses

    from gsgd_adapters.torch.parts import chain_spec, fingerprint

    base = gsgd_core.Chain((3, 4, 5, 2), (4, 4, 1), bias=(True, False, True))
    tau, sigma = [list(t) for t in base.tau], [list(s) for s in base.sigma]
    tau[0][1], sigma[1][0] = 2, 1
    variants = [dataclasses.replace(base, sizes=(3, 4, 5, 3)),
                dataclasses.replace(base, slots=(4, 4, 2)),
                dataclasses.replace(base, bias=(True, True, True)),
                dataclasses.replace(base, tau=tuple(map(tuple, tau))),
                dataclasses.replace(base, sigma=tuple(map(tuple, sigma))),
                dataclasses.replace(base, skeleton_slots=(1, 2, 0)),
                base.with_skeleton_scale(base.he_skeleton_scale())]
    prints = [fingerprint(chain_spec(c)) for c in [base] + variants]
    assert len(set(prints)) == len(prints)
    assert all(len(f) == 16 and int(f, 16) >= 0 for f in prints)
    assert fingerprint(chain_spec(gsgd_core.Chain((3, 4, 5, 2), (4, 4, 1),
                                           bias=(True, False, True)))) == prints[0]
    assert prints[0] == "a43c16fd0d63bef8"
