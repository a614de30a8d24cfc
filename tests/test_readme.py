"""The README's Python blocks run as written, top to bottom in one namespace, and do what
they say: the torch block finds its one chain, initialises it and trains; the JAX block
takes a G-SGD step that leaves the free skeleton weights where they are."""

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
def readme_run():
    """Every block executed in order in one namespace: after each block, a shallow copy of
    the namespace and what the block printed, keyed by the framework it shows."""
    if not BLOCKS:
        pytest.skip("README.md not found next to the tests")
    pytest.importorskip("torch")
    pytest.importorskip("optax")
    import contextlib
    import io

    import torch
    torch.manual_seed(0)
    scope, after = {"__name__": "__readme__"}, {}
    for i, block in enumerate(BLOCKS, start=1):
        with contextlib.redirect_stdout(io.StringIO()) as out:
            exec(compile(block, f"README block {i}", "exec"), scope)
        key = "jax" if "import jax" in block else "torch" if "import torch" in block else i
        after[key] = (dict(scope), out.getvalue())
    return after


def test_readme_shows_torch_and_jax(readme_run):
    assert {"torch", "jax"} <= set(readme_run)


def test_torch_block_finds_one_initialised_chain_and_trains(readme_run):
    import torch
    scope, printed = readme_run["torch"]
    assert "1 chain(s)" in printed and "skeleton initialised (he)" in printed
    assert scope["opt"].describe().fallback == []
    model, x, y = scope["model"], scope["x"], scope["y"]
    with torch.no_grad():
        loss = float(torch.nn.functional.cross_entropy(model(x), y))
    # three steps from a He-scaled start: below the loss of a uniform guess
    assert np.isfinite(loss) and loss < np.log(10)


def test_jax_block_finds_the_cnn_whole_and_steps_without_moving_free_weights(readme_run):
    import jax
    scope, _ = readme_run["jax"]
    (found,) = scope["chains"]
    assert [p[-2] for p in found.weights] == ["Conv_0", "Conv_1", "Dense_0", "Dense_1"]
    start = scope["skeleton_init"](scope["model"].init(jax.random.PRNGKey(0), scope["x"]),
                                   scope["chains"])
    from gsgd_adapters.jax.leaves import key_paths
    views = []
    for params in (start, scope["params"]):
        paths, leaves, _ = key_paths(params)
        index = dict(zip(paths, range(len(paths))))
        views.append(found.arrays(index, [np.asarray(x) for x in leaves])[0])
    assert any(np.any(a != b) for a, b in zip(*views))  # the step moved the chain
    for a, b in zip(_free_entries(found.chain, views[0]), _free_entries(found.chain, views[1])):
        np.testing.assert_array_equal(a, b)  # G-SGD never moves a free skeleton weight

