"""In-place operations on a model's chains: skeleton initialisation and random rescaling."""

from __future__ import annotations

import numpy as np
import torch.nn as nn

from gsgd_backends import rescale_ as rescale_chain_
from gsgd_backends import skeleton_init_ as skeleton_init_chain_
from gsgd_core import random_rescaling

from .discovery import ChainLayers, discover, unwrap
from .groups import explicit_chains

__all__ = ["skeleton_init_", "random_rescale_"]


def _chains(model: nn.Module, chains) -> list[ChainLayers]:
    model = unwrap(model)
    return discover(model).chains if chains is None else explicit_chains(model, chains)


def skeleton_init_(model: nn.Module, chains=None) -> list[ChainLayers]:
    """Set every skeleton weight of the model's chains to ``+1`` (paper §11.2), in place.

    Call once after the usual initialisation, before training: it changes the network
    function. Returns the chains it initialised.
    """
    found = _chains(model, chains)
    for c in found:
        skeleton_init_chain_(c.chain, [m.weight for m in c.modules])
    return found


def random_rescale_(model: nn.Module, rng: np.random.Generator, spread: float = 1.0,
                          chains=None) -> list[ChainLayers]:
    """Rescale every hidden unit of every chain by ``exp(spread * N(0, 1))``, in place.

    The network function is unchanged (Theorem 3.3); the weights become unbalanced. Useful to
    see which optimizers notice.
    """
    found = _chains(model, chains)
    for c in found:
        rescale_chain_(c.chain, [m.weight for m in c.modules], [m.bias for m in c.modules],
                 random_rescaling(c.chain, rng, spread))
    return found
