"""In-place operations on a model's chains: skeleton initialisation and random rescaling."""

from __future__ import annotations

import copy
import functools
import math

import numpy as np
import torch
import torch.nn as nn

from gsgd_backends import rescale_ as rescale_chain_
from gsgd_backends import skeleton_init_ as skeleton_init_chain_
from gsgd_core import random_rescaling
from gsgd_core.chain import HE_SKELETON_SHARE

from .discovery import ChainLayers, discover, unwrap
from .fsdp import is_sharded, sharded_step
from .groups import explicit_chains, scaled

__all__ = ["check_invariance", "skeleton_init_", "random_rescale_"]


def _chains(model: nn.Module, chains) -> list[ChainLayers]:
    """The given chains, or the chains of the model's trainable layers: frozen layers
    (``requires_grad=False``) are never written, as the optimizers never write them."""
    model = unwrap(model)
    if chains is not None:
        return explicit_chains(model, chains)
    return discover(model, trainable={id(p) for p in model.parameters() if p.requires_grad}
                    ).chains


def skeleton_init_(model: nn.Module, chains=None, *, skeleton: str = "he") -> list[ChainLayers]:
    """Initialise the skeleton of every chain of the model's trainable layers, in place;
    returns the chains. Call once after the usual (He) initialisation, before training: it
    changes the network function. :class:`~gsgd_adapters.torch.GSGD` must use the same
    ``skeleton``.

    ``skeleton="he"`` (the default, skeleton guide): skeleton edges of layer ``l`` get magnitude
    ``r_l = sqrt(2 * share / c_l)`` (:meth:`gsgd_core.Chain.he_skeleton_scale`, ``c_l``
    skeleton edges per row, ``share = 1/4``) and keep their signs, and the other weights
    are scaled by ``sqrt(1 - share)``: every layer keeps He init's activation scale, G-SGD's
    first step moves the other weights by SGD's step, and tau paths start with gentle
    steps. It trains plain deep CNNs (VGG, AlexNet style) and wide MLPs at SGD's learning
    rates; on narrow MLPs (32 units) it is sensitive to the learning rate.
    ``skeleton="paper"`` sets every skeleton edge to ``+1`` (paper §11.2): the better choice
    for small, narrow MLPs, behind the He recipe on 128-wide ones and ruinous where widths
    shrink (VGG-11's 4096 -> 10 head puts ~410 ones in each output row: loss 2.2e3 at init).
    The measurement that chose the default is ``docs/skeleton_recipe.md``
    (``python -m benchmarks.skeleton_recipe``).
    """
    found = _chains(model, chains)
    rest = math.sqrt(1.0 - HE_SKELETON_SHARE) if skeleton == "he" else 1.0
    for c in found:
        # FSDP2-sharded layers are initialised on the gathered weights, rows written back.
        sharded_step([m.weight for m in c.modules], None,
                     functools.partial(skeleton_init_chain_, scaled(c.chain, skeleton),
                                       keep_signs=(skeleton == "he"), rest_scale=rest))
    return found


def random_rescale_(model: nn.Module, rng: np.random.Generator, spread: float = 1.0,
                          chains=None) -> list[ChainLayers]:
    """Rescale every hidden unit of every chain by ``exp(spread * N(0, 1))``, in place.

    The network function is unchanged (Theorem 3.3); the weights become unbalanced. Useful to
    see which optimizers notice.
    """
    found = _chains(model, chains)
    for c in found:
        for m in c.modules:
            if is_sharded(m.weight):
                raise ValueError("random_rescale_ draws its scales on each process: call it "
                                 "before fully_shard (the model's weights are DTensors)")
        rescale_chain_(c.chain, [m.weight for m in c.modules], [m.bias for m in c.modules],
                 random_rescaling(c.chain, rng, spread))
    return found


def check_invariance(model: nn.Module, example_input, chains=None, *, spread: float = 1.0,
                     seed: int = 0, rtol: float = 1e-9) -> dict[str, float]:
    """Check on ``example_input`` that every chain of ``model`` really is one.

    For each chain (found by :func:`discover`, or given as lists of layers), a float64 copy of
    the model in eval mode (no dropout) has the chain's hidden units rescaled by
    ``exp(spread * N(0, 1))`` (:func:`random_rescale_`), which must leave the output unchanged
    (Theorem 3.3). Returns each chain's relative output change (``max |out' - out| /
    max |out|``), and raises ``ValueError`` naming the first chain whose change exceeds
    ``rtol``.
    """
    model = unwrap(model)
    found = _chains(model, chains)
    base = copy.deepcopy(model).double().eval()
    inputs = example_input if isinstance(example_input, (tuple, list)) else (example_input,)
    inputs = [x.double() if torch.is_tensor(x) and x.is_floating_point() else x
              for x in inputs]
    index = {id(m): n for n, m in model.named_modules()}
    with torch.no_grad():
        ref = _flat_outputs(base(*inputs))
        out = {}
        for c in found:
            twin = copy.deepcopy(base)
            mods = dict(twin.named_modules())
            layers = [mods[index[id(m)]] for m in c.modules]
            random_rescale_(twin, np.random.default_rng(seed), spread, chains=[layers])
            got = _flat_outputs(twin(*inputs))
            change = max(float((a - b).abs().max()) for a, b in zip(got, ref)) / max(
                max(float(b.abs().max()) for b in ref), 1e-300)
            name = " -> ".join(c.names)
            out[name] = change
            if not change <= rtol:
                raise ValueError(
                    f"chain {name} is not a chain of this model: a random positive rescaling "
                    f"of its hidden units changes the output by {change:.3g} (relative, "
                    f"float64); pass chains=... without it, and please report the layout")
    return out


def _flat_outputs(out) -> list:
    if torch.is_tensor(out):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    return [t for o in out for t in _flat_outputs(o)]
