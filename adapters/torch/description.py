"""What a chain-aware optimizer found and how it steps each part: ``print(opt.describe())``.

Each part (:mod:`.parts`) reports itself as a :class:`PartInfo`; a :class:`Description`
holds them with the totals, the reasons parameters are in no chain, the skipped steps and
where the chain steps got their column sums.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gsgd_core import Chain

__all__ = ["Description", "PartInfo", "SKELETON_TEXT", "initialised", "skeleton_text"]


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
