"""gsgd_adapters.torch.GAdam / GAdamW: the core's G-Adam on chains and torch's Adam(W)
elsewhere, invariant training runs, and torch.optim behaviour (state_dict, lr, skips)."""

import copy
import io

import numpy as np
import pytest
import torch
import torch._dynamo.utils as dynamo_utils
import torch.nn as nn

import gsgd_core as gc
from _helpers import assert_close, record_calls
from _twins import assert_same_parameters, step_twins
from test_torch_adapter import float64_default, loss_of, train  # noqa: F401 (autouse)
from gsgd_adapters.torch import (GAdam, GAdamW, SkeletonWarning, SkippedStepWarning, discover,
                                 random_rescale_, skeleton_init_)


class Net(nn.Module):
    """A batch-normalised first layer (Adam's part) before a 3-layer chain fc1 -> fc2 -> fc3."""

    def __init__(self, bn=True):
        super().__init__()
        torch.manual_seed(0)
        # no bias before batch norm: its gradient would be rounding noise, which Adam (torch's
        # too) turns into lr-sized steps of the noise's sign
        self.fc0 = nn.Linear(6, 8, bias=not bn)
        self.bn = nn.BatchNorm1d(8) if bn else nn.Identity()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 7), nn.Linear(7, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = torch.relu(self.bn(self.fc0(x)))
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(h)))))


def data(n=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


@pytest.mark.parametrize("cls,kw,rule", [
    (GAdam, dict(lr=0.01), dict(lr=0.01)),
    (GAdam, dict(lr=0.01, betas=(0.8, 0.99), weight_decay=0.1, amsgrad=True),
     dict(lr=0.01, betas=(0.8, 0.99), weight_decay=0.1, amsgrad=True)),
    (GAdamW, dict(lr=0.01), dict(lr=0.01, weight_decay=1e-2))])
def test_chains_take_the_cores_rule_and_the_rest_torchs_adam(cls, kw, rule):
    """The chain is the core's ``path_update`` with the Adam rule in the He skeleton's units,
    every other parameter ``torch.optim.Adam``/``AdamW`` (to float64 rounding: the chain's
    step takes the fast path, and its rounding reaches the other layers' gradients)."""
    model = Net()
    skeleton_init_(model)
    twin = copy.deepcopy(model)
    x, y = data()
    opt = cls(model, **kw)
    found = discover(twin).chains[0]
    assert [n for n in found.names] == ["fc1", "fc2", "fc3"]
    chain = found.chain.with_skeleton_scale(found.chain.he_skeleton_scale())
    make = gc.adamw_rule if cls is GAdamW else gc.adam_rule
    core_rule = make(**rule)
    chain_params = [p for m in found.modules for p in (m.weight, m.bias)]
    rest = [p for p in twin.parameters() if all(p is not q for q in chain_params)]
    ref = (torch.optim.AdamW if cls is GAdamW else torch.optim.Adam)(rest, **kw)
    W = [m.weight for m in found.modules]
    b = [m.bias for m in found.modules]
    state = gc.path_init(chain, core_rule, [w.detach() for w in W], [v.detach() for v in b])
    for _ in range(4):
        train(model, opt, x, y, 1)
        twin.zero_grad()
        loss_of(twin, x, y).backward()
        ref.step()
        W2, b2, state = gc.path_update(chain, core_rule, state, [w.detach() for w in W],
                                       [v.detach() for v in b], [w.grad for w in W],
                                       [v.grad for v in b])
        with torch.no_grad():
            for p, new in zip(W + b, W2 + b2):
                p.copy_(new)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert_close(p.detach().numpy(), q.detach().numpy(), 1e-12, name)
    assert int(opt.state[model.fc1.weight]["step"]) == 4


@pytest.mark.filterwarnings("ignore::gsgd_adapters.torch.SkeletonWarning")  # the twin's
@pytest.mark.parametrize("cls", [GAdam, GAdamW])
def test_rescaled_twins_train_identically_under_gadam_but_not_adam(cls):
    model = Net(bn=False)
    skeleton_init_(model)
    twin = copy.deepcopy(model)
    random_rescale_(twin, np.random.default_rng(0), 1.0)
    x, y = data()
    assert torch.allclose(model(x), twin(x), rtol=1e-12)
    outs = []
    for m in (copy.deepcopy(model), copy.deepcopy(twin)):
        opt = cls(m, lr=0.01, weight_decay=1e-2)
        assert len(opt.describe().chains) == 1  # fc0 -> ... -> fc3, one chain
        train(m, opt, x, y, 20)
        with torch.no_grad():
            outs.append(m(x))
    assert torch.allclose(outs[1], outs[0], rtol=1e-8, atol=1e-8 * float(outs[0].abs().max()))
    with torch.no_grad():
        assert not torch.allclose(outs[0], model(x), atol=1e-3)  # it did train
    plain = []
    for m in (copy.deepcopy(model), copy.deepcopy(twin)):
        train(m, torch.optim.Adam(m.parameters(), lr=0.01), x, y, 20)
        with torch.no_grad():
            plain.append(m(x))
    assert (plain[0] - plain[1]).abs().max() > 1e-4


@pytest.mark.filterwarnings("ignore::gsgd_adapters.torch.SkeletonWarning")  # the resumed
def test_state_dict_resume_is_bit_exact():
    model = Net()
    skeleton_init_(model)
    x, y = data()
    opt = GAdamW(model, lr=0.01, amsgrad=True)
    train(model, opt, x, y, 3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed = Net()
    resumed.load_state_dict(saved["model"])
    opt2 = GAdamW(resumed, lr=0.01, amsgrad=True)
    opt2.load_state_dict(saved["opt"])
    train(model, opt, x, y, 3)
    train(resumed, opt2, x, y, 3)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    assert set(opt2.state[resumed.fc1.weight]) == {"exp_avg", "exp_avg_sq", "max_exp_avg_sq",
                                                   "step"}


def test_param_groups_lr_reaches_every_part_at_once():
    model = Net()
    skeleton_init_(model)
    x, y = data()
    opt = GAdam(model, lr=0.01)
    train(model, opt, x, y, 2)
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0]["lr"] = 0.0
    train(model, opt, x, y, 1)
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)
    opt.param_groups[0]["lr"] = 0.01
    train(model, opt, x, y, 1)
    assert not torch.equal(model.fc1.weight, before[2])


def test_a_non_finite_gradient_skips_the_chain_step_with_a_warning():
    model = Net()
    skeleton_init_(model)
    x, y = data()
    opt = GAdam(model, lr=0.01)
    train(model, opt, x, y, 1)
    chain = [model.fc1, model.fc2, model.fc3]
    before = [p.detach().clone() for m in chain for p in (m.weight, m.bias)]
    moments = [opt.state[m.weight]["exp_avg"].clone() for m in chain]
    opt.zero_grad()
    loss_of(model, x, y).backward()
    model.fc2.bias.grad[0] = float("nan")
    with pytest.warns(SkippedStepWarning):
        opt.step()
    for p, q in zip([p for m in chain for p in (m.weight, m.bias)], before):
        assert torch.equal(p, q)
    for m, e in zip(chain, moments):
        assert torch.equal(opt.state[m.weight]["exp_avg"], e)
    assert int(opt.state[model.fc1.weight]["step"]) == 1
    assert opt.describe().skipped == 1


def test_maximize_equals_minimising_the_negative():
    a, b = Net(), Net()
    skeleton_init_(a)
    skeleton_init_(b)
    x, y = data()
    oa, ob = GAdam(a, lr=0.01, maximize=True), GAdam(b, lr=0.01)
    for _ in range(3):
        oa.zero_grad()
        (-loss_of(a, x, y)).backward()
        oa.step()
        train(b, ob, x, y, 1)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, rtol=1e-12, atol=1e-14)


def test_a_frozen_bias_never_moves_and_gets_no_state():
    model = Net(bn=False)
    skeleton_init_(model)
    model.fc2.bias.requires_grad_(False)
    frozen = model.fc2.bias.detach().clone()
    x, y = data()
    opt = GAdamW(model, lr=0.01)
    train(model, opt, x, y, 3)
    assert torch.equal(model.fc2.bias, frozen)
    assert model.fc2.bias not in opt.state
    # its scratch moments stay out of the state: one entry per trainable parameter, no growth
    assert len(opt.state) == sum(p.requires_grad for p in model.parameters())


def test_the_skeleton_warning_points_at_the_users_line():
    opt = GAdamW(Net(), lr=0.01)  # a resume loads its state before the first step
    with pytest.warns(SkeletonWarning) as caught:
        opt.step()
    assert caught[0].filename == __file__  # through torch's wrappers of step


def test_describe_and_errors():
    model = Net()
    opt = GAdamW(model, lr=0.01)
    skeleton_init_(model)
    text = str(opt.describe())
    assert text.startswith("G-AdamW: 1 chain(s)")
    assert "AdamW fc0.weight" in text and "weight_decay=0.01" in text
    with pytest.raises(ValueError, match=r"betas\[0\]"):
        GAdam(Net(), betas=(1.0, 0.999))
    with pytest.raises(ValueError, match="lr"):
        GAdam(Net(), lr=-1.0)
    with pytest.raises(ValueError, match="bn must be"):
        GAdam(Net(), bn="psi")
    with pytest.raises(ValueError, match=r"param group 1: .*eps"):
        GAdam([dict(params=[Net().fc0.weight]), dict(params=[Net().fc1.weight], eps=-1.0)])


def test_paper_bn_variant_chains_through_batch_norm_and_trains():
    model = Net()
    skeleton_init_(model, chains=[[model.fc0, model.fc1, model.fc2, model.fc3]])
    x, y = data()
    opt = GAdam(model, lr=0.01, bn="paper")
    names = opt.describe().chains[0][0]
    assert names == ["fc0", "fc1", "fc2", "fc3"]  # batch norm does not end the chain
    before = float(loss_of(model, x, y).detach())
    train(model, opt, x, y, 10)
    assert float(loss_of(model, x, y).detach()) < before


@pytest.mark.parametrize("cls, torch_cls", [(GAdam, torch.optim.Adam),
                                            (GAdamW, torch.optim.AdamW)])
def test_defaults_are_torchs(cls, torch_cls):
    """Every hyperparameter torch's Adam(W) has, with torch's default, plus ``check_finite``."""
    theirs = torch_cls([nn.Parameter(torch.zeros(1))]).defaults
    ours = cls(Net(), lr=theirs["lr"])
    default_lr = cls(Net())
    for key in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach"):
        assert ours.defaults[key] == theirs[key], key
        assert default_lr.defaults[key] == theirs[key], key
    assert ours.defaults["check_finite"] is False
    given = cls(Net(), foreach=False, check_finite=True).defaults
    assert given["foreach"] is False and given["check_finite"] is True


@pytest.mark.parametrize("amsgrad", [False, True])
def test_the_plain_parameters_state_is_torchs(amsgrad):
    """Batch norm's parameters (no chain) carry torch's Adam state, key for key."""
    model = Net()
    twin = copy.deepcopy(model)
    skeleton_init_(model)
    opt = GAdam(model, lr=0.01, amsgrad=amsgrad)
    ref = torch.optim.Adam(twin.bn.parameters(), lr=0.01, amsgrad=amsgrad)
    x, y = data()
    train(model, opt, x, y, 1)
    loss_of(twin, x, y).backward()
    ref.step()
    for p, q in zip(model.bn.parameters(), twin.bn.parameters()):
        assert set(opt.state[p]) == set(ref.state[q])


@pytest.mark.parametrize("name", ["lr", "betas"])
def test_a_tensor_hyperparameter_of_several_elements_is_refused_by_name(name):
    value = torch.tensor([0.1, 0.2])
    kwargs = {"lr": value} if name == "lr" else {"betas": (value, value)}
    with pytest.raises(ValueError, match=f"^{name} as a tensor must have one element"):
        GAdam(Net(), **kwargs)  # refused before the skeleton is looked at


@pytest.mark.parametrize("cls, kw", [(GAdam, dict(lr=1e-2)),
                                     (GAdamW, dict(lr=1e-2, weight_decay=0.1, amsgrad=True))])
def test_compiled_g_adam_steps_like_the_eager_one(cls, kw):
    """``compile=True`` runs the update of every edge as one compiled loop per layer (a
    conv chain with a flatten, float64): the same steps to rounding, sums from the
    backward pass in both."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(4, 5, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(5 * 16, 7), nn.ReLU(), nn.Linear(7, 3)).double()
    skeleton_init_(model)
    twin = copy.deepcopy(model)
    fast, eager = cls(model, compile=True, **kw), cls(twin, **kw)
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    step_twins([(model, fast), (twin, eager)],
               [torch.randn(6, 3, 8, 8, dtype=torch.float64,
                            generator=torch.Generator().manual_seed(seed)) for seed in range(3)])
    assert_same_parameters(model, twin)
    assert fast.describe().column_sums == {"backward": 3}
    # each optimizer compiles its own copy of the stages: its steps ran compiled graphs
    assert dynamo_utils.counters["stats"]["unique_graphs"] > graphs


def test_g_adam_compiles_nothing_unless_asked():
    """``compile`` is off by default: G-Adam's steps run eagerly and compile no graph."""
    model = _mlp()
    opt = GAdam(model, lr=1e-2)
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    step_twins([(model, opt)], [torch.randn(4, 6, dtype=torch.float64)] * 2)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs
    assert opt.describe().column_sums == {"backward": 2}


def _mlp(dtype=torch.float64):
    """A seeded 6 -> 8 -> 7 -> 3 ReLU MLP (one chain) in ``dtype``, skeleton-initialised."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 7), nn.ReLU(),
                          nn.Linear(7, 3)).to(dtype)
    skeleton_init_(model)
    return model


def test_a_half_precision_chain_keeps_its_moments_in_float32_as_the_core_does():
    """bfloat16 weights: the chain's moments are the core's float32 moments (not rounded to
    half precision), and its weights the core's, step after step."""
    model = _mlp(torch.bfloat16)
    found = discover(model).chains[0]
    chain = found.chain.with_skeleton_scale(found.chain.he_skeleton_scale())
    rule = gc.adam_rule(lr=1e-2)
    W, b = [m.weight for m in found.modules], [m.bias for m in found.modules]
    state = gc.path_init(chain, rule, [w.detach() for w in W], [v.detach() for v in b])
    opt = GAdam(model, lr=1e-2)
    x, y = (t.to(torch.bfloat16) for t in data(12))
    for _ in range(3):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        W2, b2, state = gc.path_update(chain, rule, state, [w.detach().clone() for w in W],
                                       [v.detach().clone() for v in b], [w.grad for w in W],
                                       [v.grad for v in b])
        opt.step()
        for p, q in zip(W + b, W2 + b2):
            assert torch.equal(p, q)
    for name, buffers in zip(rule.buffers, state.buffers):
        for p, want in zip(W + b, buffers):
            assert opt.state[p][name].dtype == want.dtype == torch.float32, name
            assert torch.equal(opt.state[p][name], want), name


def test_the_chains_step_count_stays_exact_past_two_to_the_24():
    """A long run's step count (Adam's bias correction reads it) keeps counting where a
    count in torch's default float32 would stop: 2**24 + 1 is not a float32."""
    model = _mlp()
    x, y = data()
    opt = GAdam(model, lr=1e-2)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)  # the user's default, where the count is made
    try:
        train(model, opt, x, y, 1)
    finally:
        torch.set_default_dtype(default)
    count = opt.state[model[0].weight]["step"]
    count.fill_(2 ** 24)  # where a long run gets to
    train(model, opt, x, y, 1)
    assert int(count) == 2 ** 24 + 1


def test_the_skeleton_warning_names_the_skeleton_asked_for():
    """The warning for a chain whose skeleton is not initialised says which skeleton."""
    for skeleton in ("he", "paper"):
        opt = GAdam(Net(), skeleton=skeleton)
        with pytest.warns(SkeletonWarning, match=f"skeleton={skeleton!r}"):
            opt.step()


def test_the_self_check_runs_on_the_model_given_beside_its_parameters():
    """``GAdam(params, model=model, example_input=x)`` checks the chains on ``model``: the
    chain it finds passes, and layers around a tanh given as a chain are refused."""
    model = _mlp()
    x, _ = data()
    GAdam(list(model.parameters()), model=model, example_input=x)
    model[1] = nn.Tanh()  # not positively homogeneous: rescaling its inputs changes the output
    with pytest.raises(ValueError, match="0 -> 2 is not a chain of this model"):
        GAdam(list(model.parameters()), model=model, chains=[[model[0], model[2]]],
              example_input=x)


def test_betas_of_a_number_and_a_tensor_are_refused_as_torch_refuses_them():
    """One beta a tensor and the other a number: refused, with torch's reason."""
    with pytest.raises(ValueError, match=r"^betas must be both numbers or both tensors \(as "
                                         r"torch.optim.Adam requires\), got \("):
        GAdam(Net(), betas=(torch.tensor(0.9), 0.999))


@pytest.fixture
def one_process_mesh(one_process_group):
    """The 1-D device mesh of a one-process group, for FSDP2 in this process."""
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (1,))


def _sharded_twins(mesh, dtype):
    """An MLP sharded by FSDP2 (``fully_shard`` per layer and at the root) and its plain
    twin, each with its G-Adam (AMSGrad: every buffer)."""
    from torch.distributed.fsdp import fully_shard
    twin = _mlp(dtype)
    model = copy.deepcopy(twin)
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return [(m, GAdam(m, lr=1e-2, amsgrad=True)) for m in (model, twin)]


def _assert_same_run(pairs, rtol):
    """The sharded run's parameters and optimizer state equal the plain run's."""
    (model, opt), (twin, ref) = pairs
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, rtol=rtol, atol=rtol, msg=name)
        for key, want in ref.state[q].items():
            got = opt.state[p][key]
            got = got.full_tensor() if hasattr(got, "full_tensor") else got
            assert got.dtype == want.dtype, (name, key)
            torch.testing.assert_close(got, want, rtol=rtol, atol=rtol, msg=f"{name} {key}")


def test_a_sharded_chain_steps_its_local_rows_as_one_process_does(one_process_mesh,
                                                                   monkeypatch):
    """FSDP2: the chain steps the rows each process holds, with no parameter, gradient or
    moment gathered whole, and takes the plain model's steps (moments and count too)."""
    from torch.distributed.tensor import DTensor
    pairs = _sharded_twins(one_process_mesh, torch.float64)
    (model, opt), _ = pairs
    assert isinstance(model[0].weight, DTensor)
    gathered = []
    full_tensor = DTensor.full_tensor
    monkeypatch.setattr(DTensor, "full_tensor",
                        lambda t, *a, **k: gathered.append(t) or full_tensor(t, *a, **k))
    step_twins(pairs, [data(12, seed)[0] for seed in range(3)])
    assert not gathered
    monkeypatch.undo()
    _assert_same_run(pairs, 1e-12)
    assert int(opt.state[model[0].weight]["step"]) == 3


def test_a_sharded_half_precision_chain_steps_on_gathered_arrays(one_process_mesh):
    """FSDP2 with bfloat16 weights: the core computes half precision in float32, on the
    arrays gathered whole, and each process keeps its rows of the result: the plain
    model's steps, float32 moments included."""
    pairs = _sharded_twins(one_process_mesh, torch.bfloat16)
    step_twins(pairs, [data(12, seed)[0].to(torch.bfloat16) for seed in range(3)])
    _assert_same_run(pairs, 0.0)
    model = pairs[0][0]
    assert not torch.equal(model[0].weight.full_tensor(), _mlp(torch.bfloat16)[0].weight)


@pytest.mark.parametrize("cls", [GAdam, GAdamW])
@pytest.mark.parametrize("foreach", [False, True])
def test_foreach_picks_torchs_implementation_of_the_rest_adam_update(cls, foreach,
                                                                     monkeypatch):
    """Parameters outside chains take ``torch.optim.Adam``'s (``AdamW``'s) update, by its
    multi-tensor implementation exactly when ``foreach=True`` (on the CPU torch's default
    is the single-tensor loop)."""
    import torch.optim.adam as torch_adam

    used = record_calls(monkeypatch, torch_adam, ("_single_tensor_adam", "_multi_tensor_adam"))
    model = Net()  # the batch-normalised first layer and the batch norm are the rest
    skeleton_init_(model)
    x, y = data()
    train(model, cls(model, lr=0.01, foreach=foreach), x, y, 1)
    assert used and set(used) == {"_multi_tensor_adam" if foreach else "_single_tensor_adam"}


def test_paper_bn_variant_chains_convolutions_through_batch_norm_and_trains():
    """The paper's BN variant takes convolutions too: a 4-d filter followed by batch norm
    joins the chain (its gradient scaled by each output channel's filter norm, eq. 30)
    and the model trains."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Conv2d(4, 3, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(3 * 5 * 5, 2))
    skeleton_init_(model, chains=[[model[0], model[3], model[6]]])
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 2, 5, 5, generator=g), torch.randn(8, 2, generator=g)
    opt = GAdam(model, lr=0.01, bn="paper")
    assert opt.describe().chains[0][0] == ["0", "3", "6"]
    before = float(loss_of(model, x, y).detach())
    train(model, opt, x, y, 5)
    assert float(loss_of(model, x, y).detach()) < before
