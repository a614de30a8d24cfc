"""The README's Python examples run as written."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S) if README.exists() else []


@pytest.mark.skipif(not BLOCKS, reason="README.md not found next to the tests")
def test_numpy_quick_start_runs_and_prints_the_chain(capsys):
    exec(compile(BLOCKS[0], "README quick start", "exec"), {})
    assert capsys.readouterr().out.strip() == (
        "Chain(4 -> 8 -> 8 -> 3; m=139, H=16, G-space dim=123, H/m=0.115)")


@pytest.mark.skipif(len(BLOCKS) < 2, reason="README.md not found next to the tests")
def test_torch_example_runs_on_a_model():
    import torch.nn as nn
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    exec(compile(BLOCKS[1], "README torch example", "exec"), {"model": model})


@pytest.mark.skipif(len(BLOCKS) < 3, reason="README.md not found next to the tests")
def test_optax_example_runs():
    jnp = pytest.importorskip("jax.numpy")
    optax = pytest.importorskip("optax")
    params = [(jnp.ones((5, 4)), jnp.zeros(5)), (jnp.ones((3, 5)), jnp.zeros(3))]
    grads = [(0.1 * w, 0.1 * b) for w, b in params]
    scope = {"params": params, "grads": grads, "optax": optax}
    exec(compile("state = None\n" + BLOCKS[2].replace(
        "updates, state", "state = opt.init(params)\nupdates, state"), "README optax", "exec"),
        scope)
    assert len(scope["updates"]) == 2
