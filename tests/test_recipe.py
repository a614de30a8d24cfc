"""The He skeleton recipe trains plain deep CNNs at SGD's learning rates (DESIGN §11).

VGG-11 and AlexNet layouts (written by hand in ``benchmarks.plain_cnn``, widths / 16) fit one
fixed batch of digits with momentum 0.9, side by side with SGD from the same He start; the
paper's skeleton (every skeleton edge 1) on the same nets is the control that explodes.
"""

import math
import pathlib

import pytest
import torch

import gsgd_core as gc
from _helpers import from_repository

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not (ROOT / "benchmarks").is_dir(),
                                reason="benchmarks/ not in checkout")


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("sklearn")
    plain_cnn = from_repository("benchmarks.plain_cnn")
    torch.set_num_threads(1)
    return plain_cnn, plain_cnn.run(list(plain_cnn.NETS), [0.01], steps=12, div=16,
                                    momentum=0.9)


@pytest.mark.parametrize("net", ["VGG-11", "AlexNet"])
def test_he_recipe_trains_where_sgd_trains(results, net):
    plain_cnn, res = results
    sgd, ours = res[net, 0.01, "SGD"], res[net, 0.01, "G-SGD, He skeleton"]
    assert plain_cnn.verdict(sgd) == "trains"
    assert plain_cnn.verdict(ours) == "trains"
    assert ours[-1] <= 1.25 * sgd[-1]  # as far as SGD gets in the same steps
    # the start is He-scaled: within a factor of SGD's own start loss, not 1e3 above it
    assert ours[0] < 2 * sgd[0]


@pytest.mark.parametrize("net", ["VGG-11", "AlexNet"])
def test_paper_skeleton_on_the_same_nets_explodes(results, net):
    """The control: the recipe is what makes the difference, not the nets or the data."""
    plain_cnn, res = results
    paper = res[net, 0.01, "G-SGD, paper skeleton"]
    assert paper[0] > 50 * res[net, 0.01, "SGD"][0]
    assert plain_cnn.verdict(paper) != "trains"


def test_he_skeleton_scale_puts_a_quarter_of_each_rows_variance_on_the_skeleton():
    chain = gc.Chain.from_shapes([(64, 3, 3, 3), (128, 64, 3, 3), (4096, 128 * 49),
                                  (10, 4096)])
    r = chain.he_skeleton_scale()
    # skeleton edges per row: tau edge (not in the last layer) + n_{l-1}/n_l free edges
    counts = [1, 1 + 64 / 128, 1 + 128 / 4096, 4096 / 10]
    for rl, c in zip(r, counts):
        assert math.isclose(rl * rl * c, 2 * gc.chain.HE_SKELETON_SHARE)
    with pytest.raises(ValueError, match="share"):
        chain.he_skeleton_scale(share=1.0)
