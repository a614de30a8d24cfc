"""The contracts a user of ``torch.optim`` expects, for every optimizer of
:mod:`gsgd_adapters.torch` (GSGD, GAdam, GAdamW, PSISGD, PathSGD): arguments refused where
torch refuses them; ``state_dict``, ``deepcopy`` and ``pickle`` keeping the next step bit for
bit; frozen parameters and parameters without ``.grad`` never written; every hyperparameter
of every param group reaching exactly its group's parameters, in chains, PSI parts and
plain parameters alike; a non-finite gradient never written; the layouts discovery refuses
refused by every optimizer."""

import copy
import io
import math
import pickle
import warnings

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from _catalogue import CATALOGUE, UNSOUND
from _helpers import DEFAULT_INIT, triton_interpreting
from _strategies import examples
from gsgd_adapters.torch import (GAdam, GAdamW, GSGD, PSISGD, PathSGD, SkeletonWarning,
                                 skeleton_init_)

pytestmark = DEFAULT_INIT


def make_model(seed=0, init=True):
    """``0`` (Linear followed by batch norm: a PSI part in GSGD and PSISGD), ``3 -> 5 -> 7``
    (a chain), and plain parameters (``0.bias``, the batch norm's); float64; skeleton
    initialised unless not ``init`` (torch's default init then)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 5),
                          nn.ReLU(), nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    if init:
        skeleton_init_(model)
    return model


CHAIN = ("3.weight", "3.bias", "5.weight", "5.bias", "7.weight", "7.bias")
PSI = ("0.weight",)
PLAIN = ("0.bias", "1.weight", "1.bias")

#: name -> (class, keyword arguments that switch every buffer on)
OPTIMIZERS = {
    "GSGD": (GSGD, dict(lr=0.05, momentum=0.9, weight_decay=1e-2)),
    "GAdam": (GAdam, dict(lr=0.01, weight_decay=1e-2, amsgrad=True)),
    "GAdamW": (GAdamW, dict(lr=0.01)),
    "PSISGD": (PSISGD, dict(lr=0.05, momentum=0.9, weight_decay=1e-2)),
    "PathSGD": (PathSGD, dict(lr=0.05)),
}
NAMES = list(OPTIMIZERS)


def make(name, model=None, **kw):
    cls, defaults = OPTIMIZERS[name]
    model = make_model() if model is None else model
    return model, cls(model, **{**defaults, **kw})


def batch(k):
    g = torch.Generator().manual_seed(100 + k)
    return torch.randn(16, 3, generator=g, dtype=torch.float64), torch.randint(0, 2, (16,),
                                                                               generator=g)


def backward(model, k):
    model.zero_grad(set_to_none=True)
    x, y = batch(k)
    nn.functional.cross_entropy(model(x), y).backward()


def drawn_grads(model, k):
    """Gradients drawn for step ``k``, independent of the parameters (a hyperparameter's
    effect on one parameter cannot reach another through the loss), 100 times smaller at
    each step (Adam's second moment falls, so that ``amsgrad`` acts)."""
    g = torch.Generator().manual_seed(200 + k)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.01 ** k
                  if p.requires_grad else None)


def steps(model, opt, n, start=0, grads=backward):
    for k in range(start, start + n):
        grads(model, k)
        opt.step()


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def changed(model, before):
    return {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}


# ------------------------------------------------------------------ constructor arguments
#: ours -> (torch's optimizer, the arguments both take)
AGAINST = {"GSGD": (torch.optim.SGD, ("lr", "momentum", "dampening", "weight_decay")),
           "PSISGD": (torch.optim.SGD, ("lr", "momentum", "weight_decay")),
           "PathSGD": (torch.optim.SGD, ("lr",)),
           "GAdam": (torch.optim.Adam, ("lr", "eps", "weight_decay")),
           "GAdamW": (torch.optim.AdamW, ("lr", "eps", "weight_decay"))}

values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3), st.booleans(),
    st.none(), st.sampled_from(["0.1", "lr"]),
    st.floats(-2, 2).map(lambda v: torch.tensor(v, dtype=torch.float64)),
    st.integers(0, 3).map(lambda n: torch.full((n,), 0.1, dtype=torch.float64)))


def _refusal(build):
    """The exception ``build()`` raises, or None."""
    try:
        build()
    except (ValueError, TypeError, RuntimeError) as exc:
        return exc
    return None


def _stricter(name, arg, value) -> bool:
    """The values we refuse and torch takes, on purpose: non-finite numbers and booleans
    (a step from them is never meant), any dampening that is not a number in [0, 1] (torch
    checks none), and Adam's eps and weight decay as tensors (the core takes numbers)."""
    if isinstance(value, torch.Tensor):
        if (name.startswith("GAdam") and arg != "lr") or value.numel() != 1:
            return name.startswith("GAdam") or arg == "dampening"
        value = float(value)
    if isinstance(value, bool):
        return True
    if arg == "dampening":
        return not (isinstance(value, (int, float)) and 0 <= value <= 1)
    return isinstance(value, (int, float)) and not math.isfinite(value)


@settings(max_examples=examples(150))
@given(data=st.data(), value=values)
def test_arguments_are_refused_where_torch_refuses_them(data, value):
    """For each drawn value of each argument: refused (``ValueError`` naming the argument)
    exactly where torch's optimizer refuses it, and beyond that only where documented."""
    name = data.draw(st.sampled_from(NAMES))
    theirs, args = AGAINST[name]
    arg = data.draw(st.sampled_from(args))
    extra = dict(momentum=0.9) if arg == "dampening" else {}
    cls = OPTIMIZERS[name][0]
    torch_says = _refusal(lambda: theirs(make_model().parameters(), **{arg: value}, **extra))
    we_say = _refusal(lambda: cls(make_model(), **{arg: value}, **extra))
    if torch_says is not None or _stricter(name, arg, value):
        assert isinstance(we_say, ValueError), (name, arg, value, torch_says)
        assert arg in str(we_say), we_say
    else:
        assert we_say is None, (name, arg, value, we_say)


BETAS = [(0.9, 0.999), (0.0, 0.0), (-0.1, 0.9), (0.9, 1.0), (1.0, 0.9), (0.9, 1.5),
         (math.nan, 0.9), (torch.tensor(0.9), 0.99), (torch.tensor(0.9), torch.tensor(0.99))]


@pytest.mark.parametrize("name", ["GAdam", "GAdamW"])
@pytest.mark.parametrize("betas", BETAS, ids=str)
def test_betas_are_refused_where_torchs_adam_refuses_them(name, betas):
    theirs = AGAINST[name][0]
    torch_says = _refusal(lambda: theirs(make_model().parameters(), betas=betas))
    we_say = _refusal(lambda: OPTIMIZERS[name][0](make_model(), betas=betas))
    assert (we_say is None) == (torch_says is None), (betas, torch_says, we_say)
    if we_say is not None:
        assert isinstance(we_say, ValueError) and "betas" in str(we_say)


@pytest.mark.parametrize("kw", [dict(nesterov=True), dict(nesterov=True, momentum=0.9,
                                                          dampening=0.1),
                                dict(nesterov=True, momentum=0.9)], ids=str)
def test_nesterov_is_refused_where_torchs_sgd_refuses_it(kw):
    torch_says = _refusal(lambda: torch.optim.SGD(make_model().parameters(), **kw))
    we_say = _refusal(lambda: GSGD(make_model(), **kw))
    assert (we_say is None) == (torch_says is None)
    if we_say is not None:
        assert isinstance(we_say, ValueError) and "nesterov" in str(we_say)


# ------------------------------------------------------------------ round trips
def _through_state_dict(model, opt, name):
    twin = copy.deepcopy(model)
    other = make(name, twin)[1]
    buffer = io.BytesIO()  # through bytes, as a checkpoint does
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    other.load_state_dict(torch.load(buffer, weights_only=True))
    return twin, other


def _through_deepcopy(model, opt, name):
    both = copy.deepcopy({"model": model, "opt": opt})
    return both["model"], both["opt"]


def _through_pickle(model, opt, name):
    both = pickle.loads(pickle.dumps({"model": model, "opt": opt}))
    return both["model"], both["opt"]


ROUND_TRIPS = {"state_dict": _through_state_dict, "deepcopy": _through_deepcopy,
               "pickle": _through_pickle}


@pytest.mark.parametrize("trip", list(ROUND_TRIPS))
@pytest.mark.parametrize("name", NAMES)
def test_a_round_trip_keeps_the_next_steps_bit_for_bit(name, trip):
    """After two steps (every buffer filled), the optimizer and model through ``trip`` take
    the same two next steps as the originals, bit for bit, and the state is equal."""
    model, opt = make(name)
    steps(model, opt, 2)
    twin, other = ROUND_TRIPS[trip](model, opt, name)
    steps(model, opt, 2, start=2)
    steps(twin, other, 2, start=2)
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), n
    for p, q in zip(model.parameters(), twin.parameters()):
        a, b = opt.state[p], other.state[q]
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key])), key


# ------------------------------------------------------------------ frozen, grad None
@pytest.mark.filterwarnings("ignore:.*had no gradient:UserWarning")  # said once, tested
@settings(max_examples=examples(20))
@given(data=st.data())
def test_frozen_parameters_and_those_without_grad_are_never_written(data):
    """Any drawn set of parameters frozen (``requires_grad=False`` before the optimizer is
    built) and another set with ``.grad = None`` at the steps: neither is ever written, nor
    given state; every other parameter still moves."""
    name = data.draw(st.sampled_from(NAMES))
    names = [n for n, _ in make_model().named_parameters()]
    frozen = data.draw(st.sets(st.sampled_from(names), max_size=len(names) - 1))
    rest = [n for n in names if n not in frozen]
    no_grad = data.draw(st.sets(st.sampled_from(rest), max_size=len(rest) - 1))
    model = make_model()
    for n, p in model.named_parameters():
        p.requires_grad_(n not in frozen)
    model, opt = make(name, model)
    before = snapshot(model)
    for k in range(2):
        drawn_grads(model, k)  # a loss gives 0.bias (before batch norm) no gradient
        for n, p in model.named_parameters():
            if n in no_grad:
                p.grad = None
        opt.step()
    params = dict(model.named_parameters())
    assert not changed(model, before) & (frozen | no_grad)
    assert changed(model, before) == set(rest) - no_grad
    assert not any(opt.state[params[n]] for n in frozen | no_grad)


# ------------------------------------------------------------------ hyperparameters
def _grouped(name, model, hyper_of):
    """The optimizer with three groups: the chain, the PSI weight, the plain parameters."""
    params = dict(model.named_parameters())
    groups = [dict(params=[params[n] for n in part], **hyper_of(i))
              for i, part in enumerate((CHAIN, PSI, PLAIN))]
    cls, defaults = OPTIMIZERS[name]
    return cls(groups, model=model, **defaults)


#: name -> hyperparameter -> a second value (each acts on every part within 3 steps)
SECOND = {
    "GSGD": dict(lr=0.02, momentum=0.5, dampening=0.3, weight_decay=0.1, maximize=True),
    "GAdam": dict(lr=0.02, betas=(0.5, 0.9), eps=1e-2, weight_decay=0.1, amsgrad=False,
                  maximize=True),
    "GAdamW": dict(lr=0.02, betas=(0.5, 0.9), eps=1e-2, weight_decay=0.1, amsgrad=True,
                   maximize=True),
    "PathSGD": dict(lr=0.02, maximize=True),
}
CASES = [(n, h, g) for n, hs in SECOND.items() for h in hs for g in range(3)]


#: (optimizer, hyperparameter) -> what it does not act on: PSI-SGD(M) weights take no
#: weight decay (their scale does not change the loss) and no dampening (seed 004 has none).
INERT = {("GSGD", "weight_decay"): PSI, ("GSGD", "dampening"): PSI,
         ("PSISGD", "weight_decay"): PSI}


@pytest.mark.parametrize("name,hyper,group", CASES, ids=str)
def test_a_hyperparameter_of_one_group_changes_exactly_that_groups_step(name, hyper, group):
    """Three groups (chain, PSI weight, plain parameters) and gradients drawn independently
    of the parameters: with ``hyper`` changed in group ``group`` only, the parameters of that
    group end three steps elsewhere and every other parameter ends bit for bit where it
    did."""
    ends = []
    for changed_group in (None, group):
        model = make_model()
        opt = _grouped(name, model, lambda i, c=changed_group: (
            {hyper: SECOND[name][hyper]} if i == c else {}))
        steps(model, opt, 3, grads=drawn_grads)
        ends.append(snapshot(model))
    moved = {n for n in ends[0] if not torch.equal(ends[0][n], ends[1][n])}
    assert moved == set((CHAIN, PSI, PLAIN)[group]) - set(INERT.get((name, hyper), ()))


@pytest.mark.parametrize("hyper,value", [("lr", 0.02), ("momentum", 0.5),
                                         ("weight_decay", 0.1), ("maximize", True)])
def test_each_psisgd_hyperparameter_reaches_both_its_parts(hyper, value):
    """PSISGD has one group: a changed hyperparameter moves the PSI weight (weight decay
    excepted) and every other parameter, under gradients drawn independently of them."""
    ends = []
    for kw in ({}, {hyper: value}):
        model, opt = make("PSISGD", **kw)
        steps(model, opt, 3, grads=drawn_grads)
        ends.append(snapshot(model))
    moved = {n for n in ends[0] if not torch.equal(ends[0][n], ends[1][n])}
    assert moved == set(ends[0]) - set(INERT.get(("PSISGD", hyper), ()))


# ------------------------------------------------------------------ non-finite gradients
def parts(name):
    """The parts of ``name``'s step on :func:`make_model` (one param group): the chain, the
    PSI weight and the other parameters, as sets of names (empty where it has none)."""
    chain = set(CHAIN) if name != "PSISGD" else set()
    psi = set(PSI) if name in ("GSGD", "PSISGD") else set()
    return chain, psi, set(CHAIN + PSI + PLAIN) - chain - psi


@pytest.mark.filterwarnings("ignore::gsgd_adapters.torch.SkippedStepWarning")
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_gradient_is_never_written(name, bad):
    """A NaN or Inf at one entry of any parameter's gradient: the chain or the parameters
    outside chains it belongs to keep their values and state (the step of that part is
    skipped whole); a PSI weight keeps that row and finite values."""
    chain, psi, plain = parts(name)
    for target in CHAIN + PSI + PLAIN:
        model, opt = make(name)
        steps(model, opt, 1)
        backward(model, 1)
        params = dict(model.named_parameters())
        with torch.no_grad():
            params[target].grad.view(-1)[-1] = bad
        before = snapshot(model)
        state = copy.deepcopy(opt.state_dict()["state"])
        opt.step()
        if target in psi:
            assert torch.equal(params[target][-1], before[target][-1])
            assert torch.isfinite(params[target]).all()
            continue
        part = chain if target in chain else plain
        assert not changed(model, before) & part, (target, changed(model, before) & part)
        after = opt.state_dict()["state"]
        for i, n in enumerate(params):
            if n in part:
                for key, v in state.get(i, {}).items():
                    assert torch.equal(torch.as_tensor(after[i][key]), torch.as_tensor(v))
        # Path-SGD's core step keeps a chain with a non-finite gradient without a count
        assert opt.describe().skipped == (0 if name == "PathSGD" and part is chain else 1)


# ------------------------------------------------------------------ refused layouts
LAYOUTS = sorted(CATALOGUE)
FINDERS = {"GSGD": GSGD, "GAdam": GAdam, "GAdamW": GAdamW, "PathSGD": PathSGD}


def _layout(name):
    make_layout, shape, chains, psi = CATALOGUE[name]
    torch.manual_seed(0)
    model = make_layout().double()
    x = (torch.randint(0, 7, shape[1:]) if shape[0] == "tokens"
         else torch.randn(shape, dtype=torch.float64))
    return model, x, chains, psi


@pytest.mark.filterwarnings("ignore:.*cannot be traced:UserWarning")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_optimizer_claims_exactly_the_catalogues_chains(layout):
    """Each optimizer that finds chains claims the catalogue's verdict on every layout (the
    layouts discovery refuses are refused by all of them, not only by GSGD)."""
    model, _, chains, _ = _layout(layout)
    for name, cls in FINDERS.items():
        d = cls(model, lr=0.01).describe()
        assert [c[0] for c in d.chains] == chains, name


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", ["GSGD", "GAdam"])
def test_strict_refuses_exactly_the_layouts_with_a_layer_outside_chains(name, layout):
    """``strict=True`` raises, naming every such layer, exactly where a Linear/Conv layer
    would land in no chain and no PSI part (in ``describe()``: its reasons, less the PSI
    layers)."""
    model, _, _, _ = _layout(layout)
    d = FINDERS[name](model, lr=0.01).describe()
    outside = {w.rsplit(".", 1)[0] for w in d.reasons} - {
        w.rsplit(".", 1)[0] for w in d.normalised}
    refusal = _refusal(lambda: FINDERS[name](model, lr=0.01, strict=True))
    assert (refusal is not None) == bool(outside), (layout, outside, refusal)
    for layer in outside:
        assert f"{layer}: " in str(refusal)


@pytest.mark.parametrize("layout", sorted(UNSOUND))
@pytest.mark.parametrize("name", ["GSGD", "GAdam", "GAdamW"])
def test_an_unsound_chain_given_by_hand_is_refused_by_the_self_check(name, layout):
    model, x, _, _ = _layout(layout)
    modules = dict(model.named_modules())
    chain = [modules[n] for n in UNSOUND[layout]]
    with pytest.raises(ValueError, match="is not a chain of this model"):
        FINDERS[name](model, lr=0.01, chains=[chain], example_input=x)


@pytest.mark.parametrize("name", NAMES)
def test_a_step_without_closure_returns_none_and_one_with_it_the_loss(name):
    """torch.optim's convention: ``step()`` returns ``None``, ``step(closure)`` what the
    closure returns, evaluated with gradients on even where the caller turned them off."""
    model, opt = make(name)
    backward(model, 0)
    assert opt.step() is None

    def closure():
        assert torch.is_grad_enabled()
        backward(model, 1)
        return "the loss"
    with torch.no_grad():
        assert opt.step(closure) == "the loss"
    assert torch.is_grad_enabled()


@pytest.mark.parametrize("name", NAMES)
def test_a_tensor_lr_steps_as_its_number_bit_for_bit(name):
    """``lr`` given as a float64 0-d tensor (as schedulers and ``torch.optim`` take it) is
    read at its full precision by every part, plain parameters included: the same steps
    as the number, bit for bit."""
    model, opt = make(name)
    twin = copy.deepcopy(model)
    _, other = make(name, twin, lr=torch.tensor(opt.defaults["lr"], dtype=torch.float64))
    steps(model, opt, 2)
    steps(twin, other, 2)
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), n


# ------------------------------------------------------------------ chains given by hand
def test_chains_by_hand_join_the_first_group_with_their_trainable_parameters_only():
    """``GSGD(other_params, chains=...)``: the chains' parameters join the first group the
    user gave (or make the only one, given none), and no other group appears; a frozen bias
    is not taken into the optimizer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 5), nn.ReLU(),
                          nn.Linear(5, 2), nn.Linear(2, 2)).double()
    model[2].bias.requires_grad_(False)
    chain = [model[0], model[2], model[4]]
    trainable = [model[0].weight, model[0].bias, model[2].weight, model[4].weight,
                 model[4].bias]
    head = list(model[5].parameters())
    for groups, first in (([], []), ([dict(params=head, lr=0.02)], head)):
        opt = GSGD(groups, chains=[chain], lr=0.01)
        assert len(opt.param_groups) == 1
        assert [id(p) for p in opt.param_groups[0]["params"]] == [
            id(p) for p in first + trainable]


# ------------------------------------------------------------------ what describe() says
def _chain_state(opt):
    [chain] = [p for p in opt.describe().parts if p.kind == "chain"]
    return chain.skeleton_state


def test_path_sgd_describes_its_chains_skeleton_as_not_read():
    _, opt = make("PathSGD")  # skeleton-initialised: still not what Path-SGD reads
    assert _chain_state(opt) == "unused" and opt.describe().chains[0][2] is None
    assert "skeleton not read by this algorithm's step" in str(opt.describe())


def test_a_chain_stepped_from_its_skeleton_stays_trained_and_one_reinitialised_is_trained():
    """Once stepped from a skeleton-initialised chain, describe() says "initialised, then
    trained" even after another rule moved its free edges (the weights alone no longer tell:
    a new optimizer says so); stepped from torch's init and skeleton-initialised since, as
    the warning asks, it says what the weights show, not the default init it began from."""
    model, opt = make("GSGD")
    steps(model, opt, 1)
    plain = torch.optim.SGD(model.parameters(), lr=0.05)
    steps(model, plain, 1, start=1)
    assert _chain_state(make("GSGD", model)[1]) == "unknown"
    assert _chain_state(opt) == "trained"
    assert "skeleton initialised (he), then trained" in str(opt.describe())
    model, opt = make("GSGD", make_model(init=False))
    with pytest.warns(SkeletonWarning, match="is not initialised"):
        steps(model, opt, 1)
    skeleton_init_(model)
    steps(model, opt, 1, start=1)
    assert _chain_state(opt) == "trained"


# ------------------------------------------------------------------ the skeleton record
@pytest.mark.parametrize("record", [["initialised", None], ["initialised", None, "he"]],
                         ids=["one part short", "not a skeleton state"])
def test_a_state_dict_with_a_bad_skeleton_record_is_refused_before_anything_loads(record):
    model, opt = make("GSGD")
    steps(model, opt, 1)
    saved = {**opt.state_dict(), "gsgd_skeleton": record}
    _, other = make("GSGD")
    with pytest.raises(ValueError, match=r"gsgd_skeleton must hold one skeleton state or "
                                         r"None per part \(3\), got \["):
        other.load_state_dict(saved)
    assert not other.state and other.state_dict()["gsgd_skeleton"] == [None] * 3


def test_a_loaded_state_dict_says_what_the_skeleton_was_when_training_began():
    """Trained from torch's init: the resumed optimizer says so and is not warned again.
    Saved before any step: the first step after the load checks the skeleton (and warns)."""
    model, opt = make("GSGD", make_model(init=False))
    with pytest.warns(SkeletonWarning):
        steps(model, opt, 1)
    twin = copy.deepcopy(model)
    _, resumed = make("GSGD", twin)
    resumed.load_state_dict(opt.state_dict())
    assert _chain_state(resumed) == "began default"
    assert "when training began (a default init), trained since" in str(resumed.describe())
    with warnings.catch_warnings():
        warnings.simplefilter("error", SkeletonWarning)
        steps(twin, resumed, 1, start=1)
    _, fresh = make("GSGD", make_model(init=False))
    model, opt = make("GSGD", make_model(init=False))
    opt.load_state_dict(fresh.state_dict())
    with pytest.warns(SkeletonWarning, match="is not initialised"):
        steps(model, opt, 1)
    assert opt.state_dict()["gsgd_skeleton"] == ["default", None, None]


class _PickledBeforeTheSkeletonRecord:
    """Pickles as an optimizer pickled before the skeleton states, the check's flag and the
    fused switch were kept."""

    def __init__(self, opt):
        self.opt = opt

    def __reduce__(self):
        state = {k: v for k, v in self.opt.__getstate__().items()
                 if k not in ("_began", "_unchecked", "_fused")}
        return object.__new__, (type(self.opt),), state


def test_a_copied_or_pickled_optimizer_names_its_parameters_as_the_original_does():
    """``describe()`` names the parameters outside the chains, with the reason, on a deep
    copy and an unpickled copy of model and optimizer together, whose parameters are new
    tensors."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 5),
                          nn.ReLU(), nn.Linear(5, 2))
    opt = GSGD(model, lr=0.1)
    want = str(opt.describe())
    assert "0.bias: not in a chain: followed by BatchNorm1d" in want
    buf = io.BytesIO()
    torch.save({"m": model, "o": opt}, buf)
    buf.seek(0)
    for copied in (copy.deepcopy({"m": model, "o": opt}), torch.load(buf, weights_only=False)):
        assert str(copied["o"].describe()) == want


def _names(opt) -> str:
    """``describe()`` without its counts of column sums, which a copy starts anew."""
    return str(opt.describe()).split("\n  chain steps")[0]


def test_a_copy_of_an_optimizer_given_part_of_its_models_parameters_steps_and_names_alike():
    """``GSGD(params, model=model)`` whose params leave some of the model's parameters out
    (a layer the user does not train): a deep copy and an unpickled copy of model and
    optimizer describe themselves as the original does and step the copied model as the
    original steps its own, bit for bit (the copies' counts of column sums start anew)."""
    model = make_model()
    left_out = {id(p) for p in model[0].parameters()}
    opt = GSGD([p for p in model.parameters() if id(p) not in left_out], lr=0.1,
               momentum=0.9, model=model)
    steps(model, opt, 1)
    want = _names(opt)
    assert "0.weight" not in want and "chain 3 -> 5 -> 7" in want
    copies = [copy.deepcopy((model, opt)), pickle.loads(pickle.dumps((model, opt)))]
    steps(model, opt, 2, start=1)
    for twin, other in copies:
        assert _names(other) == want
        steps(twin, other, 2, start=1)
        for (n, p), q in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(p, q), n


def test_an_optimizer_pickled_before_the_skeleton_record_unpickles_and_steps_alike():
    model, opt = make("GSGD")
    steps(model, opt, 1)
    twin, old = pickle.loads(pickle.dumps((model, _PickledBeforeTheSkeletonRecord(opt))))
    steps(model, opt, 1, start=1)
    steps(twin, old, 1, start=1)
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), n
    assert old.state_dict()["gsgd_skeleton"] == [None] * 3


# ------------------------------------------------------------------ the fused step's plans
# Triton's interpreter runs the kernels on CPU tensors where it is on when triton is first
# imported (its own jit functions included), so at collection, before a test imports
# triton through torch: as tests/test_fused_optim.py does.
with triton_interpreting(torch.cuda.is_available()):
    try:
        import triton.language as tl

        import gsgd_backends.fused
        import gsgd_backends.fused_psi  # noqa: F401
    except ImportError:
        tl = None


def _fused_kernels():
    """Skips where the kernels cannot run interpreted on CPU tensors in this process."""
    if tl is None:
        pytest.skip("the fused step's kernels are Triton's, which does not import here")
    if type(tl.zeros).__name__ != "InterpretedFunction" or not gsgd_backends.fused.interpreted():
        pytest.skip("triton or the kernels were imported compiled in this process")


def _two_chains_two_psi_weights():
    """``0`` and ``3`` followed by batch norm (one PSI part of two weights) and two chains,
    ``6 -> 8`` and ``10 -> 12``, in one group; float64."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 5),
                          nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 6), nn.ReLU(),
                          nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 5), nn.ReLU(),
                          nn.Linear(5, 2)).double()
    return model, [[model[6], model[8]], [model[10], model[12]]]


def test_the_fused_step_follows_the_parts_with_gradients_and_a_new_dtype():
    """The fused step keeps its plans between steps: stepping each chain alone in turn, one
    PSI weight alone, then every part after ``model.float()``, it ends where the unfused
    step does (a plan kept for other chains, weights or dtype would be refused)."""
    _fused_kernels()
    without = [(), (10, 12), (0, 6, 8), ()]  # the layers without gradients at each step
    ends = []
    for fused in (False, True):
        model, chains = _two_chains_two_psi_weights()
        opt = GSGD(model, lr=0.1, chains=chains, fused=fused)
        with triton_interpreting():
            for k, none in enumerate(without + [()]):
                if k == len(without):
                    model.float()
                g = torch.Generator().manual_seed(k)
                for i, layer in enumerate(model):
                    for p in layer.parameters():
                        p.grad = None if i in none else torch.randn(
                            p.shape, generator=g, dtype=p.dtype)
                opt.step()
        ends.append(snapshot(model))
    for n, p in ends[1].items():
        torch.testing.assert_close(p, ends[0][n], rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ amp's protocol, by hand
def test_a_grad_scale_alone_unscales_the_gradients_as_torchs_fused_optimizers_read_it():
    """``opt.grad_scale`` without ``found_inf`` (what torch's fused optimizers read, each
    on its own): the step is the one on the unscaled gradients, bit for bit (a power of
    two scales exactly)."""
    models = []
    for scale in (None, 1024.0):
        model, opt = make("GSGD")
        model.zero_grad(set_to_none=True)
        x, y = batch(0)
        nn.functional.cross_entropy(model(x), y).mul(scale or 1.0).backward()
        if scale is not None:
            opt.grad_scale = torch.tensor(scale)
        opt.step()
        models.append(model)
    assert not changed(models[1], snapshot(models[0]))


# ------------------------------------------------------------------ the skeleton warning
SILENCE = ("Silence with warnings.filterwarnings('ignore', category="
           "gsgd_adapters.torch.SkeletonWarning)")


def test_a_step_at_lr_0_is_not_warned_and_leaves_the_skeleton_check_to_the_first_real_one():
    """DCP's ``get_state_dict`` steps at lr 0 before it loads: that step trains nothing, so
    it neither warns nor records the skeleton; the first step that trains does both."""
    model, opt = make("GSGD", make_model(init=False), lr=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SkeletonWarning)
        steps(model, opt, 1)
    assert opt.state_dict()["gsgd_skeleton"] == [None] * 3
    opt.param_groups[0]["lr"] = 0.05
    with pytest.warns(SkeletonWarning, match="is not initialised"):
        steps(model, opt, 1, start=1)
    assert opt.state_dict()["gsgd_skeleton"] == ["default", None, None]


def test_each_skeleton_warning_ends_with_how_to_silence_it():
    """From torch's init, and skeleton-initialised then trained by another rule (free edges
    off the recipe's scale)."""
    default = make_model(init=False)
    moved = make_model()
    steps(moved, torch.optim.SGD(moved.parameters(), lr=0.05), 1)
    for model, says in ((default, "from a default init"), (moved, "another rule")):
        _, opt = make("GSGD", model)
        with pytest.warns(SkeletonWarning) as caught:
            steps(model, opt, 1, start=1)
        [message] = [str(w.message) for w in caught]
        assert says in message and message.endswith(SILENCE), message


# ------------------------------------------------------------------ survivors of optim.py
def test_check_finite_on_finite_gradients_steps_as_without_the_check():
    """``check_finite=True`` refuses only a non-finite gradient: on finite ones the step is
    the unchecked one, bit for bit."""
    models = []
    for check in (False, True):
        model, opt = make("GSGD", check_finite=check)
        steps(model, opt, 2)
        models.append(model)
    assert not changed(models[1], snapshot(models[0]))


def test_a_ddp_model_is_followed_as_params_and_as_model_with_param_groups(one_process_group):
    """Under DDP the column sums of a backward pass run under ``no_sync`` (not averaged
    over the processes) are refused, whether the DDP model is the params or ``model=``
    beside param groups."""
    for as_model in (False, True):
        model = make_model()
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = (GSGD([dict(params=list(model.parameters()))], lr=0.05, model=ddp)
               if as_model else GSGD(ddp, lr=0.05))
        x, y = batch(0)
        with ddp.no_sync():
            nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        assert opt.describe().column_sums == {
            "the last backward pass ran under DDP's no_sync": 1}, as_model


@pytest.mark.parametrize("unscaled_before", [False, True])
def test_the_fused_step_says_who_unscaled_the_gradients_its_column_sums_were_refused_for(
        unscaled_before):
    """``fused=True`` with the sums from the backward pass, amp's protocol by hand: a
    ``grad_scale`` (``scaler.step``) is unscaled by the fused step on the device; none
    beside ``found_inf`` means ``scaler.unscale_(opt)`` unscaled the gradients before."""
    _fused_kernels()
    model = make_model()
    opt = GSGD(model, lr=0.05, fused=True, backward_sums=True)
    with triton_interpreting():
        backward(model, 0)
        opt.found_inf = torch.zeros(())
        if not unscaled_before:
            opt.grad_scale = torch.ones(())
        opt.step()
    why = ("GradScaler.unscale_ changed the gradients in place" if unscaled_before
           else "the fused step unscaled the gradients on the device")
    assert opt.describe().column_sums == {why: 1}
