"""The JAX guide's Python blocks (docs/guide/jax.md) run as written, in one namespace, print
what the page shows without a warning (tests/test_docs.py leaves the page to this file), and
do what they say: the first (the README's JAX example) finds the CNN whole and trains it."""

import pathlib

import pytest
from _examples import examples, run_examples

PAGE = "guide/jax.md"
GUIDE = pathlib.Path(__file__).resolve().parents[1] / "docs" / PAGE


@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    if not GUIDE.exists():
        pytest.skip("docs/guide/jax.md not found next to the tests")
    for name in ("optax", "flax", "equinox", "haiku"):
        pytest.importorskip(name)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path_factory.mktemp("jax_guide"))  # examples that write files write here
        return run_examples(examples(GUIDE.read_text()), PAGE)


def test_the_readme_example_finds_the_cnn_whole_and_trains(blocks):
    import jax
    scope = blocks[0]
    (chain,) = scope["chains"]
    assert [p[-2] for p in chain.weights] == ["Conv_0", "Conv_1", "Dense_0", "Dense_1"]
    start = scope["skeleton_init"](scope["model"].init(jax.random.PRNGKey(0), scope["x"]),
                                   scope["chains"])
    moved = jax.tree_util.tree_map(lambda a, b: float(abs(a - b).max()), scope["params"], start)
    assert max(jax.tree_util.tree_leaves(moved)) > 0


def test_the_library_examples_find_what_their_comments_say(blocks):
    eqx_found, hk_found = blocks[1]["found"], blocks[2]["found"]
    assert [[str(k) for k in p] for p in eqx_found[0].weights] == [
        ["layers", "0", "weight"], ["layers", "1", "weight"], ["layers", "2", "weight"]]
    assert [p[0] for p in hk_found[0].weights] == ["linear_1", "linear"]
    bn = blocks[-1]["found"]
    assert [p[-2] for p in bn.normalised.weights] == ["Conv_0"]


def test_the_nnx_example_finds_the_mlp_and_trains_it_in_nnx_optimizer(blocks):
    import jax
    from flax import nnx
    scope = blocks[3]
    (chain,) = scope["found"]
    assert chain.weights == (("l1", "kernel"), ("l2", "kernel"), ("l3", "kernel"))
    start = scope["skeleton_init"](scope["NnxMLP"](nnx.Rngs(0)), scope["found"])
    moved = jax.tree_util.tree_map(lambda a, b: float(abs(a - b).max()),
                                   nnx.state(scope["net"], nnx.Param),
                                   nnx.state(start, nnx.Param))
    assert int(scope["opt"].step[...]) == 1 and max(jax.tree_util.tree_leaves(moved)) > 0
