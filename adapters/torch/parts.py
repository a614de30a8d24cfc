"""The parts a chain-aware optimizer steps, each by its own rule, with the hyperparameters
of the user group it belongs to (:mod:`.groups` finds them):

- :class:`ChainPart`: the layers of one chain (G-SGD, G-Adam or Path-SGD: the optimizer's
  chain step, :mod:`.functional`);
- :class:`PSIPart`: weights of layers followed by a normalisation (PSI-SGD(M));
- :class:`SGDPart`: every other parameter of a user group (the optimizer's rest rule,
  ``torch.optim.SGD``'s or ``Adam``'s update).

Each part owns its step (``step(opt, group)``: the optimizer is stepped part by part, by
type), its entry in the saved state dict (``layout``) and in ``describe()`` (``info``).
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn as nn

from gsgd_core import Chain
from gsgd_core import skeleton_state as core_skeleton_state

from . import functional as F
from .description import PartInfo, initialised
from .fsdp import is_sharded, local, row_range
from .hyper import hyper_value
from .warn import warn_user

__all__ = ["ChainPart", "PSIPart", "Part", "Runs", "SGDPart", "chain_spec", "fingerprint",
           "skeleton_state", "sub_chain"]


def chain_spec(chain: Chain) -> dict:
    return dict(sizes=list(chain.sizes), slots=list(chain.slots), bias=list(chain.bias),
                tau=[list(t) for t in chain.tau], sigma=[list(s) for s in chain.sigma],
                skeleton_slots=list(chain.skeleton_slots),
                skeleton_scale=list(chain.skeleton_scale))


def fingerprint(spec: dict) -> str:
    return hashlib.sha1(repr(sorted(spec.items())).encode()).hexdigest()[:16]


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


class Part:
    """What the optimizer asks of every part: ``step(opt, group)`` (its update, with its
    user group's hyperparameters), ``info(opt, i, hyper)`` (its :class:`PartInfo`) and
    ``layout()`` (its entry in the saved state dict's ``gsgd_parts``: a change refuses
    state dicts saved before)."""

    kind: ClassVar[str]
    group: int

    def layout(self) -> list:
        return [self.kind, self.group]


@dataclass(eq=False)
class ChainPart(Part):
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
    runs: dict = field(default_factory=dict)   # liveness of the layers -> their Runs
    kind: ClassVar[str] = "chain"

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

    def layout(self) -> list:
        return [self.kind, self.group, self.names, self.fingerprint]

    def info(self, opt, i: int, hyper: dict) -> PartInfo:
        state = opt._skeleton_state(i, self)
        return PartInfo(self.kind, self.names, hyper, self.chain, initialised(state), state)

    def step(self, opt, group: dict) -> None:
        """Step the chain; layers without a weight gradient this step are never written
        (their biases take the rest's rule): the chain is stepped as the runs of consecutive
        layers that have one (a run of one layer takes the rest's rule), each with momentum
        restarted, and a warning says so once."""
        live = [w.grad is not None for w in self.weights]
        if not any(live) and all(x is None or x.grad is None for x in self.biases):
            return  # nothing of the chain has a gradient (a branch this step did not use)
        hyper = opt._hyper(group)
        if all(live):
            self._update(opt, self.chain, range(len(live)), group, hyper, opt.state)
            return
        runs = self.runs.get(tuple(live))
        if runs is None:
            runs = self.runs[tuple(live)] = Runs.of(self.chain, live)
            dead = [n for n, ok in zip(self.names, live) if not ok]
            warn_user(
                f"{opt.algorithm}: {', '.join(dead)} had no gradient, so the chain "
                f"{' -> '.join(self.names)} was stepped as the runs of layers that have one; "
                "those layers are never written, and the runs' momentum restarts")
        # Single-layer runs take the rest's rule; so do the biases of layers without a weight
        # gradient (their weights have no grad, and the rest leaves those alone).
        opt._rest([p for i in runs.outside for p in self.layer_params(i)], group, runs.state)
        for (start, stop), chain in runs.chains.items():
            self._update(opt, chain, range(start, stop), group, hyper, runs.state)

    def _update(self, opt, chain: Chain, layers, group: dict, hyper: dict, state) -> None:
        """One chain update (the optimizer's ``_chain_step``) of layers ``layers`` as
        ``chain``; counts and warns about skipped steps."""
        W = [self.weights[i] for i in layers]
        b = [self.biases[i] for i in layers]
        names = [self.names[i] for i in layers]
        G = [opt._grad(w, group) for w in W]
        Gb = [None if x is None else opt._grad(x, group) for x in b]
        # A frozen bias (or one without a gradient) is a basis path that does not move: the
        # update writes into a copy of it (and a scratch state, kept out of the optimizer's
        # state), so the parameter itself is never written.
        fixed = [x is not None and (self.frozen_bias[i] or x.grad is None)
                 for x, i in zip(b, layers)]
        b = [x.detach().clone() if f else x for x, f in zip(b, fixed)]
        G = [F.row_norm_scaled(g, w) if self.normalised[i] else g
             for g, w, i in zip(G, W, layers)]
        applied = opt._chain_step(
            chain, (W, b, G, Gb), fixed=fixed, state=state, hyper=hyper,
            plan=opt._stepper(chain, W, names),
            sums=opt._sums.take(self, len(layers) == len(self.weights),
                                bool(group.get("maximize"))))
        if not applied:
            opt._count_skip(f"the chain {' -> '.join(names)}")


@dataclass(eq=False)
class PSIPart(Part):
    """Weights of layers followed by a normalisation, stepped by PSI-SGD(M) (Yi et al.,
    Algorithm 1)."""

    names: list[str]           # layer names
    weights: list[torch.Tensor]
    group: int
    kind: ClassVar[str] = "psi"

    def info(self, opt, i: int, hyper: dict) -> PartInfo:
        return PartInfo(self.kind, self.names, hyper)

    def step(self, opt, group: dict) -> None:
        live = [(p, n) for p, n in zip(self.weights, self.names) if p.grad is not None]
        if not live:
            return
        # PSI acts on each row (output unit) alone: FSDP2's local rows are stepped as they are.
        W = [local(p) for p, _ in live]
        G = [local(opt._grad(p, group)) for p, _ in live]
        momentum = hyper_value(group["momentum"], "momentum")
        # PSI-SGD reads no buffer and keeps none (torch.optim.SGD's state)
        U = [local(F.momentum_buffer(opt.state[p], p)) for p, _ in live] if momentum else None
        F.psi(U, W, G, lr=opt._value(group, "lr"), momentum=momentum,
              max_norm=group["max_norm"], plan=opt._psi_plan(self, W),
              found_inf=opt._found_inf, grad_scale=opt._grad_scale)


@dataclass(eq=False)
class SGDPart(Part):
    """Every other parameter of a user group: the optimizer's rest rule."""

    params: list[torch.Tensor]
    group: int
    kind: ClassVar[str] = "sgd"

    def info(self, opt, i: int, hyper: dict) -> PartInfo:
        return PartInfo(self.kind, [opt._name(q) for q in self.params], hyper)

    def step(self, opt, group: dict) -> None:
        opt._rest(self.params, group, opt.state)


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
