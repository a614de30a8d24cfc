"""Operations on a Keras model's chains: skeleton initialisation."""

from __future__ import annotations

import math

import gsgd_core as gc
from gsgd_core.chain import HE_SKELETON_SHARE

from .discovery import as_numpy, find_chains


def skeleton_init(model, *, skeleton: str = "he") -> None:
    """Initialise the skeleton of every chain of ``model`` in place (paper §11.2, skeleton
    guide): with ``"he"``, skeleton edges get He init's scale (signs kept) and the other
    weights are scaled by ``sqrt(1 - share)``; with ``"paper"`` every skeleton edge is
    ``+1``. Call once after the usual initialisation (it changes the function), with the
    optimizer's ``skeleton``."""
    he = skeleton == "he"
    rest = math.sqrt(1.0 - HE_SKELETON_SHARE) if he else 1.0
    for c in find_chains(model, skeleton=skeleton):
        W = [lay.view(as_numpy(k.value)) for lay, k in zip(c.layouts, c.kernels)]
        W, _ = gc.skeleton_init(c.chain, W, keep_signs=he, rest_scale=rest)
        for lay, k, w in zip(c.layouts, c.kernels, W):
            k.assign(lay.kernel(w, tuple(k.shape)))
