"""What the optimizers say about a chain's skeleton: a fresh default-initialised model is
warned, a skeleton-initialised one is "initialised, then trained" after any number of steps,
and resuming, a second optimizer or a loaded checkpoint never tells the user to
re-initialise a trained network; torch (GSGD, GAdam, GAdamW, Path-SGD, DDP, FSDP2) and JAX."""

import copy
import io
import os
import pathlib
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

import gsgd_adapters
import gsgd_backends
import gsgd_core as gc
from _helpers import process_group
from gsgd_adapters.torch import (GAdam, GAdamW, GSGD, PathSGD, SkeletonWarning, random_rescale_,
                                 skeleton_init_)

ALGORITHMS = [GSGD, GAdam, GAdamW]
TRAINED = "skeleton initialised (he), then trained"


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 3))


def make(cls, model):
    return cls(model, lr=0.01, **(dict(momentum=0.9) if cls is GSGD else {}))


def train(model, opt, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


def quiet(fn, *args):
    """``fn(*args)``, failing on any SkeletonWarning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", SkeletonWarning)
        return fn(*args)


def trained_checkpoint(cls, steps: int = 3) -> dict:
    model = mlp()
    skeleton_init_(model)
    opt = make(cls, model)
    quiet(train, model, opt, steps)
    return dict(model=model.state_dict(), opt=opt.state_dict())


@pytest.mark.parametrize("cls", ALGORITHMS)
def test_a_default_initialised_model_is_warned_and_described_so(cls):
    """Never skeleton-initialised: the warning and describe() say to call skeleton_init_;
    once trained from there, describe() says so, with no call to make now."""
    model = mlp()
    opt = make(cls, model)
    assert "skeleton NOT initialised for skeleton='he' (call skeleton_init_(model))" in str(
        opt.describe())
    assert opt.describe().chains[0][2] is False
    with pytest.warns(SkeletonWarning, match="call gsgd_adapters.torch.skeleton_init_"):
        train(model, opt, 2)  # the first step warns: a resume loads its state before it
    text = str(opt.describe())
    assert "NOT initialised for skeleton='he' when training began" in text
    assert "skeleton_init_" not in text


@pytest.mark.parametrize("cls", ALGORITHMS)
def test_after_skeleton_init_and_steps_describe_says_initialised_then_trained(cls):
    model = mlp()
    skeleton_init_(model)
    opt = make(cls, model)
    assert "skeleton initialised (he);" in str(opt.describe())
    for steps in (1, 4):
        quiet(train, model, opt, steps)
        text = str(opt.describe())
        assert TRAINED in text and "skeleton_init_" not in text, text
        assert opt.describe().chains[0][2] is True


@pytest.mark.parametrize("cls", ALGORITHMS)
def test_resuming_a_second_optimizer_and_a_loaded_model_are_not_warned(cls):
    """Through torch.save(weights_only=True), with the optimizer built before the checkpoint
    is loaded (as DCP does) or after: the resumed optimizer steps bit-exactly as the other
    one, and neither they, a second optimizer on the trained model, nor one on a model that
    loaded the trained weights alone, are warned."""
    ck = trained_checkpoint(cls)
    buffer = io.BytesIO()
    torch.save(ck, buffer)
    buffer.seek(0)
    ck = torch.load(buffer, weights_only=True)
    model = mlp(seed=5)  # a default init: everything comes from the checkpoint
    opt = make(cls, model)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    straight = mlp()
    straight.load_state_dict(ck["model"])
    twin = make(cls, straight)
    twin.load_state_dict(copy.deepcopy(ck["opt"]))  # torch's load keeps the tensors given
    quiet(train, model, opt, 2)
    quiet(train, straight, twin, 2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), straight.parameters()))
    assert TRAINED in str(opt.describe())
    second = make(cls, model)
    quiet(train, model, second, 1)
    loaded = mlp(seed=7)
    loaded.load_state_dict(ck["model"])
    alone = make(cls, loaded)
    quiet(train, loaded, alone, 1)
    assert TRAINED in str(second.describe()) and TRAINED in str(alone.describe())


def test_the_state_dict_records_trained_chains_where_the_weights_cannot_tell():
    """A trained chain whose free edges moved since (rescaled units): the new optimizer's
    warning and describe() say both cases; the loaded state dict knows it was initialised."""
    ck = trained_checkpoint(GSGD)
    assert ck["opt"]["gsgd_skeleton"] == ["initialised"]
    model = mlp()
    model.load_state_dict(ck["model"])
    random_rescale_(model, np.random.default_rng(0))
    both = "if this model was skeleton-initialised and trained, ignore this; otherwise call"
    opt = make(GSGD, model)
    assert both in str(opt.describe()) and opt.describe().chains[0][2] is None
    with pytest.warns(SkeletonWarning, match=both):
        make(GSGD, model).step()
    opt.load_state_dict(ck["opt"])
    assert TRAINED in str(opt.describe())
    quiet(opt.step)


def test_a_state_dict_saved_without_skeleton_states_loads():
    """State dicts saved before the skeleton states were recorded load as before."""
    ck = trained_checkpoint(GSGD)
    del ck["opt"]["gsgd_skeleton"]
    model = mlp()
    model.load_state_dict(ck["model"])
    opt = make(GSGD, model)
    opt.load_state_dict(ck["opt"])
    quiet(train, model, opt, 1)
    assert TRAINED in str(opt.describe())
    bad = trained_checkpoint(GSGD)["opt"]
    bad["gsgd_skeleton"] = ["he"]
    with pytest.raises(ValueError, match=r"gsgd_skeleton must hold one skeleton state or "
                                         r"None per part \(1\), got \['he'\]"):
        opt.load_state_dict(bad)


def test_a_fresh_process_resumes_without_a_warning(tmp_path):
    ck = trained_checkpoint(GSGD)
    torch.save(ck, tmp_path / "ck.pt")
    code = (
        "import sys, torch, torch.nn as nn\n"
        "from gsgd_adapters.torch import GSGD\n"
        "ck = torch.load(sys.argv[1], weights_only=True)\n"
        "m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), "
        "nn.Linear(16, 3))\n"
        "opt = GSGD(m, lr=0.01, momentum=0.9)\n"
        "m.load_state_dict(ck['model'])\n"
        "opt.load_state_dict(ck['opt'])\n"
        "opt.step()\n"
        "print(opt.describe())\n")
    stage = tmp_path / "stage"  # the packages this process imported, under their names
    stage.mkdir()
    for module in (gc, gsgd_backends, gsgd_adapters):
        (stage / module.__name__).symlink_to(pathlib.Path(module.__file__).parent)
    proc = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", code,
                           str(tmp_path / "ck.pt")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(stage)})
    assert proc.returncode == 0, proc.stderr
    assert TRAINED in proc.stdout


def test_path_sgd_never_asks_for_a_skeleton():
    """Path-SGD's step reads no skeleton: no warning on a default init, and describe() never
    tells the user to call skeleton_init_, before or after steps or a resume."""
    model = mlp()
    opt = PathSGD(model, lr=0.01)
    for _ in range(2):
        text = str(opt.describe())
        assert "skeleton not read by this algorithm's step" in text
        assert "skeleton_init_" not in text and opt.describe().chains[0][2] is None
        quiet(train, model, opt, 2)
    again = PathSGD(model, lr=0.01)
    again.load_state_dict(opt.state_dict())
    quiet(again.step)
    assert "skeleton_init_" not in str(again.describe())


def test_a_ddp_model_is_described_and_resumed_as_a_plain_one():
    with process_group():
        with pytest.warns(SkeletonWarning, match="call gsgd_adapters.torch.skeleton_init_"):
            GSGD(nn.parallel.DistributedDataParallel(mlp()), lr=0.01).step()
        model = mlp()
        skeleton_init_(model)
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = make(GSGD, ddp)
        quiet(train, ddp, opt, 2)
        assert TRAINED in str(opt.describe())
        second = make(GSGD, ddp)
        second.load_state_dict(opt.state_dict())
        quiet(second.step)
        assert TRAINED in str(second.describe())


def test_core_states_of_a_chain():
    """gsgd_core.skeleton_state on NumPy: the four states, and a shard's rows."""
    chain = gc.Chain.mlp([4, 6, 3]).with_skeleton_scale(None)
    rng = np.random.default_rng(0)
    W = [rng.uniform(-0.5, 0.5, (6, 4)), rng.uniform(-0.4, 0.4, (3, 6))]
    assert gc.skeleton_state(chain, W) == "default"
    assert gc.skeleton_state(chain, [2 * w for w in W]) == "unknown"
    W, _ = gc.skeleton_init(chain, W)
    assert gc.skeleton_state(chain, W) == "initialised"
    assert gc.skeleton_state(chain, [W[0][3:], W[1][1:]], rows=[(3, 6), (1, 3)]) == (
        "initialised")
    W[0][chain.tau_mask(1)[..., 0]] = 0.5   # what training does to the first layer
    assert gc.skeleton_state(chain, W) == "trained"
    W[1][chain.free_mask(2)[..., 0]] = 1.5  # the free edges moved, but near their scale
    assert gc.skeleton_state(chain, W) == "unknown"
    small = chain.with_skeleton_scale((0.1, 0.1))  # skeleton edges within a default init's
    W, _ = gc.skeleton_init(small, [rng.uniform(-0.4, 0.4, (6, 4)),
                                    rng.uniform(-0.4, 0.4, (3, 6))], keep_signs=True)
    W[1][small.free_mask(2)[..., 0]] *= 1.2  # moved by another rule: near, not random
    assert gc.skeleton_state(small, W) == "unknown"


def test_core_states_read_every_layer_at_its_own_scale_and_fan_in():
    """gsgd_core.skeleton_state reads every layer, each against its own scale ``r_l`` and
    default bound ``1/sqrt(fan_in)`` (a conv's kernel counted, a float32 init's rounding
    allowed): a skeleton of unequal scales, the paper's recipe is ``+1`` (not ``-1``), one
    layer wrong among three, free edges below their scale but within a factor 2 of it, and
    arrays on array_api_strict's second device."""
    rng = np.random.default_rng(1)
    chain = gc.Chain.mlp([4, 6, 3])
    W = [rng.uniform(-0.5, 0.5, (6, 4)), rng.uniform(-0.4, 0.4, (3, 6))]
    unequal = chain.with_skeleton_scale((0.5, 2.0))
    assert gc.skeleton_state(unequal, gc.skeleton_init(unequal, W)[0]) == "initialised"
    assert gc.skeleton_state(chain, gc.skeleton_init(chain, W, keep_signs=True)[0]) == "unknown"
    xs = pytest.importorskip("array_api_strict")
    there = [xs.asarray(w, device=xs.Device("device1")) for w in gc.skeleton_init(chain, W)[0]]
    assert gc.skeleton_state(chain, there) == "initialised"
    at_bound = [w.copy() for w in W]
    at_bound[1][0, 0] = float(np.float32(1 / np.sqrt(6)))  # a float32 init, then .double()
    assert at_bound[1][0, 0] > 1 / np.sqrt(6) and gc.skeleton_state(chain, at_bound) == "default"

    deep = gc.Chain.mlp([4, 6, 5, 3])
    W = [rng.uniform(-0.5, 0.5, (6, 4)), rng.uniform(-0.4, 0.4, (5, 6)),
         rng.uniform(-0.4, 0.4, (3, 5))]
    assert gc.skeleton_state(deep, W) == "default"
    assert gc.skeleton_state(deep, [2 * W[0]] + W[1:]) == "unknown"  # layer 1 past its bound
    S, _ = gc.skeleton_init(deep, W)
    S[1][deep.free_mask(2)[..., 0]] = 1.5  # layer 2's free edges moved, layer 3's kept
    assert gc.skeleton_state(deep, S) == "unknown"
    small = deep.with_skeleton_scale((0.1, 0.1, 0.1))
    S, _ = gc.skeleton_init(small, W, keep_signs=True)
    for l in (2, 3):
        S[l - 1][small.free_mask(l)[..., 0]] *= 0.6  # below r, within a factor 2 of it
    assert gc.skeleton_state(small, S) == "unknown"
    S[1][small.free_mask(2)[..., 0]] = 0.3  # layer 2's now 3 r: a random init's
    assert gc.skeleton_state(small, S) == "default"

    conv = gc.Chain.from_shapes([(4, 2, 3), (3, 4, 3)], bias=False)  # fan_in 6, then 12
    K = [rng.uniform(-0.4, 0.4, (4, 2, 3)), rng.uniform(-0.28, 0.28, (3, 4, 3))]
    assert gc.skeleton_state(conv, K) == "default"
    K[0][0, 0, 0] = 0.5  # within 1/sqrt(2), past 1/sqrt(2 * 3)
    assert gc.skeleton_state(conv, K) == "unknown"


def test_jax_skeleton_state_of_a_default_init_skeleton_init_and_training():
    """gsgd_adapters.jax.skeleton_state: a default init (Equinox's uniform), skeleton_init,
    G-SGD's steps (free edges kept), and SGD's steps from the skeleton (cannot tell)."""
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    from gsgd_adapters.jax import skeleton_init, skeleton_state
    from gsgd_adapters.optax import chains_from_pairs, gsgd

    rng = np.random.default_rng(0)
    params = [(rng.uniform(-i ** -0.5, i ** -0.5, (o, i)).astype(np.float32),
               np.zeros(o, np.float32)) for i, o in ((8, 16), (16, 16), (16, 3))]
    chains = chains_from_pairs(params)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    assert skeleton_state(params, chains) == ["default"]
    params = skeleton_init(params, chains, skeleton="paper")  # the chains' own units
    assert skeleton_state(params, chains) == ["initialised"]

    def loss(p):
        h = x
        for w, b in p[:-1]:
            h = jax.nn.relu(h @ w.T + b)
        return ((h @ p[-1][0].T + p[-1][1]) ** 2).mean()

    def steps(opt, p):
        state = opt.init(p)
        update = jax.jit(lambda g, s, q: opt.update(g, s, q))
        for _ in range(2):
            updates, state = update(jax.grad(loss)(p), state, p)
            p = optax.apply_updates(p, updates)
        return p

    assert skeleton_state(steps(gsgd(0.05, chains, momentum=0.9), params), chains) == [
        "trained"]
    assert skeleton_state(steps(optax.sgd(0.05), params), chains) == ["unknown"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_dcp_resume_is_judged_on_the_loaded_weights(tmp_path):
    """DCP's get_state_dict steps the optimizer at lr 0 before the checkpoint is loaded:
    that step checks nothing, and the first real one sees the trained weights."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model = mlp()
    skeleton_init_(model)
    opt = make(GSGD, model)
    quiet(train, model, opt, 2)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path))
    fresh = mlp(seed=5)
    again = make(GSGD, fresh)
    msd, osd = quiet(get_state_dict, fresh, again)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=str(tmp_path))
    set_state_dict(fresh, again, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    quiet(train, fresh, again, 1)
    assert TRAINED in str(again.describe())
