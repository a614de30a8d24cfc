"""The README's Python blocks run as written, top to bottom in one session, and do what they
say: the printed chain, a training step per library, free skeleton weights kept."""

import pathlib
import re

import numpy as np
import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if README.exists() else []


def _free_entries(chain, weights):
    return [np.asarray(w).reshape(chain.layer_shape(l))[chain.free_mask(l)]
            for l, w in enumerate(weights, start=1)]


@pytest.fixture(scope="module")
def session():
    """Every block executed in order in one namespace; after each block, a shallow copy of
    the namespace (later blocks rebind names such as ``weights``) and what it printed."""
    if len(BLOCKS) != 5:
        pytest.skip("README.md with its five Python blocks not found next to the tests")
    pytest.importorskip("torch")
    pytest.importorskip("optax")
    import contextlib
    import io

    import torch
    torch.manual_seed(0)
    scope, after = {"__name__": "__readme__"}, []
    for i, block in enumerate(BLOCKS, start=1):
        with contextlib.redirect_stdout(io.StringIO()) as out:
            exec(compile(block, f"README block {i}", "exec"), scope)
        after.append((dict(scope), out.getvalue()))
    return after


def test_numpy_quick_start_prints_the_chain_and_keeps_free_weights(session):
    scope, printed = session[0]
    assert printed.strip() == "Chain(4 -> 8 -> 8 -> 3; m=139, H=16, G-space dim=123, H/m=0.115)"
    chain, old, new = scope["chain"], scope["weights"], scope["new_w"]
    assert any(not np.array_equal(a, b) for a, b in zip(old, new))
    for a, b in zip(_free_entries(chain, old), _free_entries(chain, new)):
        np.testing.assert_array_equal(a, b)


def test_torch_block_finds_one_initialised_chain_and_trains(session):
    import torch
    scope, printed = session[1]
    assert "1 chain(s)" in printed and "skeleton initialised (he)" in printed
    assert scope["opt"].describe().fallback == []
    model, x, y = scope["model"], scope["x"], scope["y"]
    with torch.no_grad():
        loss = float(torch.nn.functional.cross_entropy(model(x), y))
    # three steps from a He-scaled start: below the loss of a uniform guess
    assert np.isfinite(loss) and loss < np.log(10)


def test_optax_block_steps_and_keeps_the_free_skeleton_weights(session):
    scope, _ = session[2]
    chain = scope["chains"][0].chain
    steps = [np.asarray(u) for u, _ in scope["updates"]]
    assert all(np.any(u != 0) for u in steps)
    for u in _free_entries(chain, steps):  # G-SGD never moves a free skeleton weight
        np.testing.assert_array_equal(u, np.zeros_like(u))
    for f in _free_entries(chain, [w for w, _ in scope["params"]]):  # initialised to 1
        np.testing.assert_array_equal(f, np.ones_like(f))


def test_path_space_block_trains_g_adamw_and_takes_an_optax_adam_step(session):
    import torch
    scope, _ = session[3]
    net, opt = scope["net"], scope["opt"]
    d = opt.describe()
    assert d.algorithm == "G-AdamW" and len(d.chains) == 1 and d.fallback == []
    chain = d.chains[0][1]
    weights = [m.weight.detach().numpy() for m in net if isinstance(m, torch.nn.Linear)]
    r = chain.skeleton_scale
    for l, f in enumerate(_free_entries(chain, weights)):  # He recipe: |free| = r_l, never moved
        np.testing.assert_array_equal(np.abs(f), np.full_like(f, r[l], dtype=f.dtype))
    assert int(opt.state[net[0].weight]["step"]) == 3
    jchain = scope["chains"][0].chain
    steps = [np.asarray(u) for u, _ in scope["updates"]]
    assert all(np.any(u != 0) for u in steps)
    for u in _free_entries(jchain, steps):
        np.testing.assert_array_equal(u, np.zeros_like(u))


def test_cupy_block_updates_numpy_arrays_in_place(session):
    scope, _ = session[4]
    chain, weights = scope["chain"], scope["weights"]
    for l, w in enumerate(weights, start=1):
        W = w.reshape(chain.layer_shape(l))
        free = W[chain.free_mask(l)]
        np.testing.assert_array_equal(free, np.ones_like(free))  # initialised, never moved
        rest = ~(chain.free_mask(l) | chain.tau_mask(l))
        assert np.all(W[rest] != 0)
    assert all(not np.array_equal(b, np.zeros_like(b)) for b in scope["biases"])
