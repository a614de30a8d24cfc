"""Param groups of the chain-aware torch optimizers, and their description.

Each chain is one param group (``kind='chain'``) holding its layers' weights and biases in
order, with plain-data metadata (so ``state_dict`` survives ``torch.load(weights_only=True)``):
the chain's structure and a fingerprint that ``load_state_dict`` checks. Weights of layers
followed by a normalisation form a ``'psi'`` group; everything else one ``'sgd'`` group.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from gsgd_core import Chain

from .discovery import ChainLayers, chain_of, discover, unwrap


def chain_spec(chain: Chain) -> dict:
    return dict(sizes=list(chain.sizes), slots=list(chain.slots), bias=list(chain.bias),
                tau=[list(t) for t in chain.tau], sigma=[list(s) for s in chain.sigma],
                skeleton_slots=list(chain.skeleton_slots))


def fingerprint(spec: dict) -> str:
    return hashlib.sha1(repr(sorted(spec.items())).encode()).hexdigest()[:16]


def chain_group(layers: ChainLayers) -> dict:
    params, layout = [], []
    for name, m in zip(layers.names, layers.modules):
        for p, what in ((m.weight, "weight"), (m.bias, "bias")):
            if p is not None and not p.requires_grad:
                raise ValueError(f"{name}.{what} has requires_grad=False, but G-SGD changes every "
                                 "non-free weight of a chain: freeze the whole chain's layers by "
                                 "leaving them out (pass chains=... without them) or unfreeze it")
        layout.append([len(params), None if m.bias is None else len(params) + 1])
        params += [m.weight] + ([] if m.bias is None else [m.bias])
    spec = chain_spec(layers.chain)
    return dict(params=params, kind="chain", layout=layout, layer_names=list(layers.names),
                chain_spec=spec, fingerprint=fingerprint(spec),
                normalised=list(layers.normalised))


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
class Plan:
    """How a model's parameters split into chain, PSI and SGD groups."""

    chains: list[ChainLayers]
    normalised: list[tuple[str, nn.Module]]
    others: list
    names: dict = field(default_factory=dict)


def plan(params, chains, *, find_chains: bool, find_normalised: bool,
         through_bn: bool = False) -> Plan:
    """Split a model (or explicit chains plus other parameters) into groups."""
    if isinstance(params, nn.Module):
        model = unwrap(params)
        names = {id(p): n for n, p in model.named_parameters()}
        found = None
        if find_chains and chains is None:
            found = discover(model, through_bn)
        elif find_normalised:
            try:  # chains given by hand: norms are found only if the model traces
                found = discover(model)
            except ValueError:
                find_normalised = False
        chain_list = (explicit_chains(model, chains) if chains is not None
                      else found.chains if find_chains else [])
        normalised = found.normalised if find_normalised else []
        used = {id(p) for c in chain_list for m in c.modules for p in m.parameters()}
        normalised = [(n, m) for n, m in normalised if id(m.weight) not in used]
        used |= {id(m.weight) for _, m in normalised}
        others = [p for p in model.parameters() if id(p) not in used and p.requires_grad]
        return Plan(chain_list, normalised, others, names)
    if chains is None and find_chains:
        raise ValueError("pass a model (chains are found in it) or chains=[[layer, ...], ...] "
                         "together with the other parameters")
    return Plan(explicit_chains(None, chains or []), [], list(params))


@dataclass
class Description:
    """What a chain-aware optimizer found: ``print(opt.describe())``."""

    chains: list[tuple[list[str], Chain, bool]]   # layer names, chain, skeleton initialised
    normalised: list[str]
    fallback: list[str]
    algorithm: str

    @property
    def m(self) -> int:
        return sum(c.m for _, c, _ in self.chains)

    @property
    def H(self) -> int:
        return sum(c.H for _, c, _ in self.chains)

    @property
    def g_space_dim(self) -> int:
        return self.m - self.H

    @property
    def invariant_ratio(self) -> float:
        return self.H / self.m if self.m else 0.0

    def __str__(self) -> str:
        lines = [f"{self.algorithm}: {len(self.chains)} chain(s), m={self.m}, H={self.H}, "
                 f"G-space dim={self.g_space_dim}, invariant ratio H/m={self.invariant_ratio:.4g}"]
        for names, chain, skel in self.chains:
            init = "skeleton initialised" if skel else (
                "skeleton NOT initialised (call skeleton_init_(model))")
            lines.append(f"  chain {' -> '.join(names)}: {chain}; {init}")
        if self.normalised:
            lines.append(f"  PSI-SGD (normalised rows): {', '.join(self.normalised)}")
        lines.append(f"  plain SGD: {', '.join(self.fallback) if self.fallback else '(none)'}")
        return "\n".join(lines)


def skeleton_is_initialised(group: dict, chain: Chain) -> bool:
    with torch.no_grad():
        for l, (w, _) in enumerate(group["layout"], start=1):
            W = group["params"][w].detach().reshape(chain.layer_shape(l))
            mask = torch.as_tensor(chain.free_mask(l) | chain.tau_mask(l), device=W.device)
            if not bool(torch.all(W[mask] == 1)):
                return False
    return True


__all__ = ["Description", "Plan", "chain_group", "chain_of", "chain_spec", "explicit_chains",
           "fingerprint", "plan", "skeleton_is_initialised"]
