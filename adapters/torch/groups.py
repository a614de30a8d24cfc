"""How a chain-aware optimizer splits its parameters into parts, and its description.

``param_groups`` stay the user's groups (one by default), exactly as ``torch.optim.SGD`` keeps
them, so code that sets ``opt.param_groups[0]['lr']`` acts on every parameter. Beside them the
optimizer holds a partition into *parts*, each stepped by its own rule with the
hyperparameters of the user group it belongs to:

- :class:`ChainPart`: the layers of one chain (G-SGD or Path-SGD);
- :class:`PSIPart`: weights of layers followed by a normalisation (PSI-SGD(M));
- :class:`SGDPart`: every other parameter of a user group (``torch.optim.SGD``'s update).

A chain never spans two user groups (that is an error), and frozen parameters
(``requires_grad=False``, or not in any group) are never part of a chain: they split it.
"""

from __future__ import annotations

import hashlib
import sys
import warnings
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from gsgd_core import Chain
from gsgd_core import skeleton_state as core_skeleton_state

from .discovery import ChainLayers, Discovery, discover, unwrap
from .fsdp import is_sharded, local, row_range

SKELETONS = ("he", "paper")


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` pointed at the first frame outside ``gsgd_adapters`` and torch: the
    user's call, however deep the subclassing, and through torch's wrappers of
    ``Optimizer.step``.

    The frames are counted from this function's own, the frame that ``warnings.warn``
    counts its ``stacklevel`` from, so whatever stands between the user and here (a
    decorator, a wrapper) is counted as ``warnings.warn`` will count it."""
    frame, level = sys._getframe(0), 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in (
            "gsgd_adapters", "torch"):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def hyper_value(value, name: str) -> float:
    """A group's hyperparameter as the backends take it (a one-element tensor is read;
    ``ValueError`` naming it for a tensor of another size)."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.numel() != 1:
        raise ValueError(f"{name} as a tensor must have one element (as torch.optim.SGD "
                         f"requires), got shape {tuple(value.shape)}")
    return float(value)


def scaled(chain: Chain, skeleton: str) -> Chain:
    """``chain`` in the units of a skeleton recipe: ``"he"`` (skeleton edges of He init's
    standard deviation, skeleton guide) or ``"paper"`` (edges of 1, paper §11.2)."""
    if skeleton not in SKELETONS:
        raise ValueError(f"skeleton must be one of {SKELETONS}, got {skeleton!r}")
    return chain.with_skeleton_scale(chain.he_skeleton_scale() if skeleton == "he" else None)


def chain_spec(chain: Chain) -> dict:
    return dict(sizes=list(chain.sizes), slots=list(chain.slots), bias=list(chain.bias),
                tau=[list(t) for t in chain.tau], sigma=[list(s) for s in chain.sigma],
                skeleton_slots=list(chain.skeleton_slots),
                skeleton_scale=list(chain.skeleton_scale))


def fingerprint(spec: dict) -> str:
    return hashlib.sha1(repr(sorted(spec.items())).encode()).hexdigest()[:16]


@dataclass(eq=False)
class ChainPart:
    """One chain: its layers' names, weights and biases (``None`` where a layer has none),
    the core :class:`Chain`, the user group it belongs to, and which biases are frozen (a
    frozen bias is a basis path that never moves: it is never written)."""

    names: list[str]
    chain: Chain
    modules: list[nn.Module]
    weights: list[torch.Tensor]
    biases: list[torch.Tensor | None]
    group: int
    normalised: list[bool]
    frozen_bias: list[bool]
    kind: str = "chain"
    runs: dict = field(default_factory=dict)   # liveness of the layers -> their Runs

    def layer_params(self, i: int) -> list[torch.Tensor]:
        """Layer ``i``'s parameters that may move (its weight, and its bias unless frozen)."""
        bias = None if self.frozen_bias[i] else self.biases[i]
        return [p for p in (self.weights[i], bias) if p is not None]

    @property
    def params(self) -> list[torch.Tensor]:
        return [p for i in range(len(self.weights)) for p in self.layer_params(i)]

    @property
    def fingerprint(self) -> str:
        return fingerprint(chain_spec(self.chain))


@dataclass(eq=False)
class PSIPart:
    names: list[str]           # layer names
    weights: list[torch.Tensor]
    group: int
    kind: str = "psi"


@dataclass(eq=False)
class SGDPart:
    params: list[torch.Tensor]
    group: int
    kind: str = "sgd"


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
            if chains is None and find_chains:
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
        where = ", ".join(f"{n}: group {group_of[id(m.weight)]}"
                          for n, m in zip(c.names, c.modules))
        raise ValueError(f"the chain {' -> '.join(c.names)} is split across param groups "
                         f"({where}): G-SGD steps a chain as one, with one lr; put its layers "
                         "(weights and biases) in one group, or pass chains=... by hand")
    return ChainPart(list(c.names), scaled(c.chain, skeleton), list(c.modules),
                     [m.weight for m in c.modules], biases, groups.pop(), list(c.normalised),
                     frozen_bias)


# ---------------------------------------------------------------------- description
@dataclass
class PartInfo:
    """One part as :meth:`describe` reports it."""

    kind: str                      # "chain", "psi" or "sgd"
    names: list[str]               # layer names (chain, psi) or parameter names (sgd)
    hyper: dict                    # lr, momentum, weight_decay of its group
    chain: Chain | None = None
    skeleton_initialised: bool | None = None   # None: the weights cannot tell
    skeleton_state: str | None = None          # skeleton_text's key; None: from the above


#: A chain's skeleton as describe() says it: the states of :func:`gsgd_core.skeleton_state`,
#: and "began default" (a default init when training began: trained since).
SKELETON_TEXT = {
    "initialised": "skeleton initialised ({s})",
    "trained": "skeleton initialised ({s}), then trained",
    "default": "skeleton NOT initialised for skeleton={r} (call skeleton_init_(model))",
    "began default": "skeleton NOT initialised for skeleton={r} when training began (a "
                     "default init), trained since",
    "unknown": "skeleton not recognised for skeleton={r} (its free edges are off the "
               "recipe's scale): if this model was skeleton-initialised and trained, ignore "
               "this; otherwise call skeleton_init_(model) before training",
    "unused": "skeleton not read by this algorithm's step",
}


def skeleton_text(state: str, skeleton: str) -> str:
    """What describe() says of a chain whose skeleton is in ``state``."""
    return SKELETON_TEXT[state].format(s=skeleton, r=repr(skeleton))


def initialised(state: str) -> bool | None:
    """A state as :attr:`PartInfo.skeleton_initialised`: ``None`` where it cannot tell."""
    return {"initialised": True, "trained": True, "default": False,
            "began default": False}.get(state)


@dataclass
class Description:
    """What a chain-aware optimizer found and how it steps each part:
    ``print(opt.describe())``."""

    parts: list[PartInfo]
    algorithm: str
    reasons: dict = field(default_factory=dict)   # parameter name -> why it is not in a chain
    skipped: int = 0                              # chain steps skipped (non-finite gradients)
    skeleton: str = "paper"
    rest_rule: str = "plain SGD"                  # the rule of the "sgd" parts
    column_sums: dict = field(default_factory=dict)  # where chain steps got them -> count

    @property
    def chains(self) -> list[tuple[list[str], Chain, bool]]:
        return [(p.names, p.chain, p.skeleton_initialised) for p in self.parts
                if p.kind == "chain"]

    @property
    def normalised(self) -> list[str]:
        return [f"{n}.weight" for p in self.parts if p.kind == "psi" for n in p.names]

    @property
    def fallback(self) -> list[str]:
        return [n for p in self.parts if p.kind == "sgd" for n in p.names]

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
        for p in self.parts:
            hyper = ", ".join(f"{k}={v:g}" for k, v in p.hyper.items())
            if p.kind == "chain":
                state = p.skeleton_state or ("initialised" if p.skeleton_initialised
                                             else "default")
                init = skeleton_text(state, self.skeleton)
                lines.append(f"  chain {' -> '.join(p.names)}: {p.chain}; {init}; {hyper}")
            elif p.kind == "psi":
                weights = ", ".join(f"{n}.weight" for n in p.names)
                lines.append(f"  PSI-SGD (normalised rows) {weights}; {hyper}")
            else:
                lines.append(f"  {self.rest_rule} {', '.join(p.names)}; {hyper}")
        for name, why in self.reasons.items():
            if any(name in p.names for p in self.parts if p.kind == "sgd"):
                lines.append(f"    {name}: not in a chain: {why}")
        if self.skipped:
            lines.append(f"  steps skipped for non-finite gradients: {self.skipped}")
        if self.column_sums:
            sums = dict(self.column_sums)
            text = ("  chain steps with column sums from the backward pass: "
                    f"{sums.pop('backward', 0)}")
            if sums:
                text += "; read from W * grad instead: " + "; ".join(
                    f"{why} ({n})" for why, n in sums.items())
            lines.append(text)
        return "\n".join(lines)


def skeleton_state(part: ChainPart) -> str:
    """How the part's weights show its skeleton (:func:`gsgd_core.skeleton_state`; torch's
    default initialisation of Linear and Conv layers is ``U(-1/sqrt(fan_in),
    1/sqrt(fan_in))``)."""
    with torch.no_grad():
        # A sharded layer is judged by this process's rows: describe() may then run
        # on one process alone (no collective), as users print it.
        rows = [row_range(w, n) if is_sharded(w) else (0, w.shape[0])
                for w, n in zip(part.weights, part.names)]
        return core_skeleton_state(part.chain, [local(w).detach() for w in part.weights],
                                   rows=rows, default_bound=1.0)


def sub_chain(chain: Chain, start: int, stop: int) -> Chain:
    """Layers ``start..stop-1`` (0-based) of a chain with the default skeleton, as a chain."""
    return Chain(chain.sizes[start:stop + 1], chain.slots[start:stop],
                 bias=chain.bias[start:stop],
                 skeleton_scale=chain.skeleton_scale[start:stop])


@dataclass(eq=False)
class Runs:
    """How a chain is stepped while some of its layers have no weight gradient: each run of
    two or more consecutive layers that have one as its own chain (``chains``, by
    ``(start, stop)``), the other layers (``outside``) by SGD's rule, and the runs' own
    optimizer state (their momentum restarts; not in the optimizer's state dict)."""

    chains: dict[tuple[int, int], Chain]
    outside: list[int]
    state: dict = field(default_factory=lambda: defaultdict(dict))

    @classmethod
    def of(cls, chain: Chain, live: list[bool]) -> "Runs":
        """The runs of ``chain`` whose layers ``live[i]`` have a weight gradient."""
        runs, start = [], None
        for i, ok in enumerate(live + [False]):
            if ok and start is None:
                start = i
            elif not ok and start is not None:
                runs.append((start, i))
                start = None
        chains = {r: sub_chain(chain, *r) for r in runs if r[1] - r[0] > 1}
        return cls(chains, [i for i in range(len(live))
                            if not any(i in range(*r) for r in chains)])


__all__ = ["ChainPart", "Description", "PSIPart", "PartInfo", "Partition", "Runs", "SGDPart",
           "chain_spec", "explicit_chains", "fingerprint", "partition", "scaled",
           "skeleton_state", "skeleton_text", "sub_chain", "unwrap"]
