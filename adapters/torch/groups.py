"""How a chain-aware optimizer splits its parameters into parts (:mod:`.parts`).

``param_groups`` stay the user's groups (one by default), exactly as ``torch.optim.SGD`` keeps
them, so code that sets ``opt.param_groups[0]['lr']`` acts on every parameter. Beside them the
optimizer holds a partition into *parts*, each stepped by its own rule with the
hyperparameters of the user group it belongs to: the layers of each chain, the weights of
layers followed by a normalisation, and every other parameter of a user group.

A chain never spans two user groups (that is an error), and frozen parameters
(``requires_grad=False``, or not in any group) are never part of a chain: they split it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from gsgd_core import Chain

from .discovery import ChainLayers, Discovery, discover, unwrap
from .parts import ChainPart, PSIPart, SGDPart
from .warn import warn_user

SKELETONS = ("he", "paper")


def scaled(chain: Chain, skeleton: str) -> Chain:
    """``chain`` in the units of a skeleton recipe: ``"he"`` (skeleton edges of He init's
    standard deviation, skeleton guide) or ``"paper"`` (edges of 1, paper §11.2)."""
    if skeleton not in SKELETONS:
        raise ValueError(f"skeleton must be one of {SKELETONS}, got {skeleton!r}")
    return chain.with_skeleton_scale(chain.he_skeleton_scale() if skeleton == "he" else None)


def explicit_chains(model, chains) -> list[ChainLayers]:
    names = {id(m): n for n, m in model.named_modules()} if model is not None else {}
    out = []
    for i, layers in enumerate(chains):
        if isinstance(layers, ChainLayers):
            out.append(layers)
            continue
        layers = list(layers)
        out.append(ChainLayers([names.get(id(m), f"chains[{i}][{j}]")
                                for j, m in enumerate(layers)], layers))
    return out


@dataclass
class Partition:
    parts: list
    names: dict                       # id(param) -> qualified name
    reasons: dict = field(default_factory=dict)   # param name -> why it is not in a chain


def partition(model: nn.Module | None, groups: list[dict], *, chains, find_chains: bool,
              find_normalised: bool, through_bn: bool, skeleton: str,
              strict: bool) -> Partition:
    """Split the parameters of ``groups`` (torch param groups) into chain, PSI and SGD parts.

    Chains come from ``chains`` (by hand) or, with ``find_chains``, from :func:`discover` on
    ``model``. Only trainable parameters (``requires_grad`` and in a group) join a chain.
    A model that cannot be traced gets no chains (a warning; ``strict`` raises), and with
    ``strict`` a Linear/Conv layer that lands in no chain and no PSI part is an error.
    """
    group_of = {id(p): i for i, g in enumerate(groups) for p in g["params"]}
    trainable = {id(p) for g in groups for p in g["params"] if p.requires_grad}
    names = {} if model is None else {id(p): n for n, p in model.named_parameters()}
    found = None
    if model is not None and (find_chains and chains is None or find_normalised):
        try:
            found = discover(model, through_bn, trainable=trainable)
        except ValueError as exc:
            if strict:
                raise
            if chains is None:  # nothing stands in for what was to be found
                warn_user(f"{exc}. Every parameter takes SGD's rule.")
                found = Discovery([], [])
    if strict and found is not None:
        psi = {n for n, _ in found.normalised} if find_normalised else set()
        bad = {n: why for n, why in found.reasons.items() if n not in psi}
        if bad:
            raise ValueError("strict=True: these layers are in no chain: " + "; ".join(
                f"{n}: {why}" for n, why in bad.items()))
    if chains is not None:
        layers = explicit_chains(model, chains)
        _check_explicit(layers, trainable)
    elif find_chains:
        if found is None:
            raise ValueError("pass a model (chains are found in it) or chains=[[layer, ...], "
                             "...] together with the other parameters")
        layers = found.chains
    else:
        layers = []
    parts: list = [_chain_part(c, group_of, trainable, skeleton) for c in layers]
    used = {id(p) for part in parts for p in part.weights + part.biases if p is not None}
    normalised = [] if not (find_normalised and found) else [
        (n, m) for n, m in found.normalised
        if id(m.weight) not in used and id(m.weight) in trainable]
    for gi in range(len(groups)):
        mine = [(n, m) for n, m in normalised if group_of[id(m.weight)] == gi]
        if mine:
            parts.append(PSIPart([n for n, _ in mine], [m.weight for _, m in mine], gi))
            used |= {id(m.weight) for _, m in mine}
    for gi, g in enumerate(groups):
        rest = [p for p in g["params"] if id(p) not in used]
        if rest:
            parts.append(SGDPart(rest, gi))
    reasons = {} if found is None else {
        f"{layer}.{what}": why for layer, why in found.reasons.items()
        for what in ("weight", "bias")}
    return Partition(parts, names, reasons)


def _check_explicit(layers: list[ChainLayers], trainable: set) -> None:
    for c in layers:
        for name, m in zip(c.names, c.modules):
            if id(m.weight) not in trainable:
                raise ValueError(
                    f"{name}.weight is frozen (requires_grad=False or in no param group), but "
                    f"the chain {' -> '.join(c.names)} was given by hand: G-SGD changes every "
                    "non-free weight of a chain; leave frozen layers out of chains=...")


def _chain_part(c: ChainLayers, group_of: dict, trainable: set, skeleton: str) -> ChainPart:
    biases = [m.bias for m in c.modules]
    frozen_bias = [b is not None and id(b) not in trainable for b in biases]
    groups = {group_of[id(m.weight)] for m in c.modules}
    groups |= {group_of[id(b)] for b, fb in zip(biases, frozen_bias) if b is not None and not fb}
    if len(groups) > 1:
        where = ", ".join(_group_of_layer(n, m, fb, group_of)
                          for n, m, fb in zip(c.names, c.modules, frozen_bias))
        raise ValueError(f"the chain {' -> '.join(c.names)} is split across param groups "
                         f"({where}): G-SGD steps a chain as one, with one lr; put its layers "
                         "(weights and biases) in one group, or pass chains=... by hand")
    return ChainPart(list(c.names), scaled(c.chain, skeleton), list(c.modules),
                     [m.weight for m in c.modules], biases, groups.pop(), list(c.normalised),
                     frozen_bias)


__all__ = ["Partition", "explicit_chains", "partition", "scaled", "unwrap"]


def _group_of_layer(name: str, m: nn.Module, frozen_bias: bool, group_of: dict) -> str:
    """Layer ``name``'s param group, or its weight's and its bias's where they differ."""
    w = group_of[id(m.weight)]
    b = w if m.bias is None or frozen_bias else group_of[id(m.bias)]
    return f"{name}: group {w}" if b == w else f"{name}.weight: group {w}, {name}.bias: group {b}"
