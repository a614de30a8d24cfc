"""Find chains in a torch model with ``torch.fx``, claiming only what is proven.

A chain is a run of Linear/Conv layers through which a positive per-unit rescaling passes:
scaling unit ``j``'s incoming weights (and bias) by ``c > 0`` and its outgoing weights by
``1/c`` must leave the network function unchanged. Discovery follows each layer's output
through its single user, tracking where the *unit axis* is:

- after ``ConvNd`` the units are channels on axis 1, with ``N`` spatial axes after them;
- after ``Linear`` the units are on the last axis (the input may be ``(batch, tokens, ...)``).

It passes an operation only if it commutes with per-unit positive scaling in that layout:

- elementwise positively homogeneous maps, by their property: ReLU (module, function,
  method, ``clamp(min=0)``), LeakyReLU, PReLU (any slopes: ``PReLU(cx) = c PReLU(x)`` for
  ``c > 0`` elementwise), dropout of every kind, identity;
- max/avg/adaptive pooling only over spatial axes: an ``N``-d pool of a ``ConvNd`` output;
- a flatten from axis 1 only of a channel-first (conv) output, into a Linear (whose input is
  then channel-major, ``(out, C*S)``);
- the next layer only if it reads the units where they are: a ``ConvNd`` after a ``ConvNd``,
  a Linear after a Linear or after a flattened conv.

Everything else ends a chain, with a reason recorded per layer: residual adds and other
branches (a unit's output used twice), norms, other activations, pooling or flatten over the
unit axis, a frozen or shared parameter, a weight also read outside its module (tied
weights, ``F.linear(x, self.fc.weight)``), a module called twice, grouped convolutions, and
layers that do not compute ``x @ weight.T + bias`` (or the convolution) from parameters of
their own: a weight computed by ``weight_norm``, ``spectral_norm`` or another
parametrisation, and subclasses with a forward of their own (QAT's fake-quantised layers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parameter import is_lazy

from gsgd_core import Chain

try:
    from torch.distributed.fsdp import FSDPModule as _FSDPModule
except ImportError:  # pragma: no cover - a torch built without distributed support
    _FSDPModule = None

CONVS = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}
WEIGHT_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
# Normalisations that make each output unit's incoming weights scale-invariant (per row):
# statistics taken per channel. LayerNorm and GroupNorm with fewer groups than channels mix
# units, so they are invariant only to a common scale of several rows (not PSI's premise).
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
PER_UNIT_NORMS = BATCH_NORMS + (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
NORMS = PER_UNIT_NORMS + (nn.GroupNorm, nn.LayerNorm, getattr(nn, "RMSNorm", nn.LayerNorm))
ELEMENTWISE_MODULES = (nn.ReLU, nn.LeakyReLU, nn.PReLU, nn.Dropout, nn.Dropout1d, nn.Dropout2d,
                       nn.Dropout3d, nn.Identity)
ELEMENTWISE_FUNCTIONS = {torch.relu, torch.relu_, F.relu, F.relu_, F.leaky_relu, F.leaky_relu_,
                         F.prelu, F.dropout, F.dropout1d, F.dropout2d, F.dropout3d}
ELEMENTWISE_METHODS = {"relu", "relu_"}
POOL_MODULES = {nn.MaxPool1d: 1, nn.MaxPool2d: 2, nn.MaxPool3d: 3, nn.AvgPool1d: 1,
                nn.AvgPool2d: 2, nn.AvgPool3d: 3, nn.AdaptiveAvgPool1d: 1,
                nn.AdaptiveAvgPool2d: 2, nn.AdaptiveAvgPool3d: 3, nn.AdaptiveMaxPool1d: 1,
                nn.AdaptiveMaxPool2d: 2, nn.AdaptiveMaxPool3d: 3}
POOL_FUNCTIONS = {F.max_pool1d: 1, F.max_pool2d: 2, F.max_pool3d: 3, F.avg_pool1d: 1,
                  F.avg_pool2d: 2, F.avg_pool3d: 3, F.adaptive_avg_pool1d: 1,
                  F.adaptive_avg_pool2d: 2, F.adaptive_avg_pool3d: 3,
                  F.adaptive_max_pool1d: 1, F.adaptive_max_pool2d: 2, F.adaptive_max_pool3d: 3}
HOW_TO = ("pass the chains by hand: GSGD(model, chains=[[model.fc1, model.fc2, ...], ...]) "
          "with the layers of each chain in order")


@dataclass
class ChainLayers:
    """A chain found in a model: its layers (modules), their names and the core Chain.

    ``normalised[i]`` marks a layer followed by batch norm inside the chain (only when BN is
    treated as pass-through, the paper's approximate variant, Appendix 10.2).
    """

    names: list[str]
    modules: list[nn.Module]
    normalised: list[bool] = None  # type: ignore[assignment]
    chain: Chain = field(init=False)

    def __post_init__(self) -> None:
        self.chain = chain_of(self.modules, self.names)
        if self.normalised is None:
            self.normalised = [False] * len(self.modules)


@dataclass
class Discovery:
    chains: list[ChainLayers]
    normalised: list[tuple[str, nn.Module]]   # weight layers directly followed by a per-unit norm
    reasons: dict = field(default_factory=dict)   # layer name -> why it is in no chain


def unwrap(model: nn.Module) -> nn.Module:
    """Strip DDP/DataParallel (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


def chain_of(modules, names=None) -> Chain:
    """The core :class:`Chain` of a list of Linear/Conv layers, validated."""
    names = names or [_cls(m).__name__ for m in modules]
    for name, m in zip(names, modules):
        if not isinstance(m, WEIGHT_LAYERS):
            raise ValueError(f"{name}: a chain holds Linear and Conv1d/2d/3d layers, "
                             f"got {_cls(m).__name__}")
        if isinstance(m, nn.modules.conv._ConvNd) and m.groups != 1:
            raise ValueError(f"{name}: grouped or depthwise convolutions (groups={m.groups}) "
                             "cannot be in a chain yet")
    try:
        return Chain.from_shapes([tuple(m.weight.shape) for m in modules],
                                 bias=[m.bias is not None for m in modules])
    except ValueError as exc:
        raise ValueError(f"layers {names} do not form a chain: {exc}") from None


# ---------------------------------------------------------------------- layouts
# A layout says where the units of a tensor are: ("conv", N) channel axis 1 and N spatial
# axes after it; ("linear",) the last axis (leading axes unknown); ("flat",) a conv output
# flattened from axis 1, channel-major.

def _layout_of_layer(mod: nn.Module) -> tuple:
    return ("conv", CONVS[_cls(mod)]) if _cls(mod) in CONVS else ("linear",)


def _arg(node: fx.Node, i: int, name: str, default):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _is_flatten(node: fx.Node, mod, layout: tuple) -> bool:
    """A flatten of every axis from 1 on (``nn.Flatten()``, ``torch.flatten(x, 1)``,
    ``x.flatten(1)``, ``x.view(x.size(0), -1)``, ``x.reshape(n, -1)``) of a tensor of
    ``layout``; the last axis may be named (``torch.flatten(x, 1, 3)`` of a Conv2d
    output: its number of axes is the layout's)."""
    last = (-1, layout[1] + 1) if layout[0] == "conv" else (-1,)
    if isinstance(mod, nn.Flatten):
        return mod.start_dim == 1 and mod.end_dim in last
    if (node.op == "call_function" and node.target is torch.flatten) or (
            node.op == "call_method" and node.target == "flatten"):
        return _arg(node, 1, "start_dim", 0) == 1 and _arg(node, 2, "end_dim", -1) in last
    if node.op == "call_method" and node.target in ("view", "reshape"):
        shape = node.args[1:]
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return len(shape) == 2 and shape[1] == -1
    return False


def _is_relu_clamp(node: fx.Node) -> bool:
    """``x.clamp(min=0)`` / ``torch.clamp(x, min=0)`` / ``clamp_min(x, 0)``: ReLU."""
    if node.target in (torch.clamp, "clamp", torch.clamp_min, "clamp_min"):
        low = _arg(node, 1, "min", None)
        high = _arg(node, 2, "max", None) if node.target in (torch.clamp, "clamp") else None
        return low == 0 and high is None
    return False


def _name(node: fx.Node, mod) -> str:
    """What ``node`` calls, as a reason names it: the module's class or the function's or
    method's name."""
    return _cls(mod).__name__ if mod is not None else getattr(node.target, "__name__",
                                                              str(node.target))


def _through(node: fx.Node, mod, layout: tuple) -> tuple | str:
    """The layout after a non-weight op ``node`` on a tensor of ``layout``, or why the op
    does not commute with per-unit positive scaling there."""
    if isinstance(mod, ELEMENTWISE_MODULES) or (node.op == "call_function" and node.target in
                                                ELEMENTWISE_FUNCTIONS) or (
            node.op == "call_method" and node.target in ELEMENTWISE_METHODS) or (
            node.op in ("call_function", "call_method") and _is_relu_clamp(node)):
        return layout
    dims = POOL_MODULES.get(_cls(mod)) if mod is not None else (
        POOL_FUNCTIONS.get(node.target) if node.op == "call_function" else None)
    if dims is not None:
        if layout == ("conv", dims):
            return layout
        return (f"{_name(node, mod)} pools over the unit axis of a {_describe(layout)} output "
                "(it mixes units)")
    if _is_flatten(node, mod, layout):
        if layout[0] == "conv":
            return ("flat",)
        return (f"the flatten of a {_describe(layout)} output may not be channel-major "
                "(a Linear applied per token, then flattened, is token-major)")
    return f"its output goes to {_name(node, mod)}, which is not positively homogeneous per unit"


def _describe(layout: tuple) -> str:
    return {"conv": f"Conv{layout[-1]}d", "linear": "Linear", "flat": "flattened"}[layout[0]]


def _reads(layout: tuple, mod: nn.Module) -> bool:
    """Whether weight layer ``mod`` takes the units of ``layout`` as its input units."""
    if _cls(mod) in CONVS:
        return layout == ("conv", CONVS[_cls(mod)])
    return layout[0] in ("linear", "flat")


def _fits(prev: nn.Module, mod: nn.Module, layout: tuple) -> bool:
    """Whether ``mod``'s input units are ``prev``'s output units (channel-major ``C*S``
    inputs after a flatten)."""
    units, fan_in = prev.weight.shape[0], mod.weight.shape[1]
    return fan_in % units == 0 if layout == ("flat",) else fan_in == units


# ---------------------------------------------------------------------- the graph walk
def _per_unit(norm: nn.Module) -> bool:
    """Whether ``norm`` normalises each unit (channel) on its own statistics."""
    return isinstance(norm, PER_UNIT_NORMS) or (
        isinstance(norm, nn.GroupNorm) and norm.num_groups == norm.num_channels)


def _metadata_only(node: fx.Node) -> bool:
    """``x.size(0)``, ``x.shape``, ``x.dim()``: reads no values of ``x``."""
    return (node.op == "call_method" and node.target in ("size", "dim")) or (
        node.op == "call_function" and node.target is getattr)


def _not_plain(mod: nn.Module) -> str:
    """Why weight layer ``mod`` may not compute its class's map of parameters of its own
    (``""`` when it does): its weight computed from other tensors (``weight_norm``,
    ``spectral_norm``, any parametrisation), or a subclass's own ``forward`` (QAT's fake
    quantisation), neither of them positively homogeneous per unit in the weight. A
    computed weight is never read: reading it may move the model (spectral_norm's power
    iteration)."""
    if mod._parameters.get("weight") is None:
        return ("its weight is computed from other tensors (weight_norm, spectral_norm or "
                "another parametrisation), not a parameter of its own")
    base = next(cls for cls in WEIGHT_LAYERS if isinstance(mod, cls))
    cls = _cls(mod)
    if cls.forward is not base.forward:
        return (f"{cls.__module__}.{cls.__qualname__} is a subclass of nn.{base.__name__} "
                "with a forward of its own")
    return ""


def _eligible(gm: fx.GraphModule, model: nn.Module, modules: dict,
              trainable: set | None) -> tuple[set, set, dict]:
    """Weight-layer nodes that may be in a chain, the grouped convolutions (in no chain, but
    PSI may take them), and why each other layer may not be in a chain."""
    calls: dict[str, list] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module" and isinstance(modules[n.target], WEIGHT_LAYERS):
            calls.setdefault(n.target, []).append(n)
    owners: dict[int, list[str]] = {}
    # The traced graph module keeps only the submodules forward() calls: ownership (tied
    # weights, e.g. an Embedding never called) is read from the model itself. Each module
    # once: one module under two names (``self.head = self.fc``) ties nothing.
    for name, m in model.named_modules():
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), []).append(name)
    read_outside = {n.target.rsplit(".", 1)[0] for n in gm.graph.nodes if n.op == "get_attr"}
    ok, grouped, why = set(), set(), {}
    for name, nodes in calls.items():
        mod = modules[name]
        if not_plain := _not_plain(mod):
            why[name] = not_plain
        elif len(nodes) > 1:
            why[name] = f"the module is called {len(nodes)} times in forward()"
        elif isinstance(mod, nn.modules.conv._ConvNd) and mod.groups != 1:
            why[name] = f"grouped or depthwise convolution (groups={mod.groups})"
            grouped.add(nodes[0])
        elif shared := sorted({o for p in (mod.weight, mod.bias) if p is not None
                               for o in owners[id(p)]} - {name}):
            why[name] = f"a parameter is shared with {', '.join(shared)} (tied weights)"
        elif name in read_outside:
            why[name] = "its parameters are also read outside the module (e.g. F.linear)"
        elif trainable is not None and id(mod.weight) not in trainable:
            why[name] = "frozen (requires_grad=False, or in no param group)"
        else:
            ok.add(nodes[0])
    return ok, grouped, why


def _reached(node: fx.Node, modules: dict) -> str | None:
    """The weight layer that ``node``'s value reaches through single-user ops of any kind,
    if any: the layer a stopped walk would have led to."""
    cur = node
    while True:  # a DAG: the walk ends at the output, which has no users
        users = [u for u in cur.users if not _metadata_only(u)]
        if len(users) != 1:
            return None
        cur = users[0]
        if cur.op == "call_module" and isinstance(modules[cur.target], WEIGHT_LAYERS):
            return cur.target


class _Walk(NamedTuple):
    """Where the walk from a weight layer ended: the norm directly after the layer (if any),
    and the next chain layer, or why there is none and the node where the walk stopped."""

    norm: nn.Module | None
    next: fx.Node | None = None
    why: str = ""
    at: fx.Node | None = None


def _follow(node: fx.Node, modules: dict, eligible: set, through_bn: bool) -> _Walk:
    """Walk from weight layer ``node`` through its single-user ops to the next chain layer,
    or to where the walk must stop. A norm directly after ``node`` ends the walk unless
    ``through_bn`` and it is a batch norm: a walk that finds a next layer with a norm has
    passed through batch norm."""
    layout = _layout_of_layer(modules[node.target])
    cur, norm = node, None
    while True:
        users = [u for u in cur.users if not _metadata_only(u)]
        if len(users) != 1:
            return _Walk(norm, why="its output is used by several operations (a branch or a "
                         "residual add)" if users else "its output is unused")
        user = users[0]
        if user.op == "output":
            return _Walk(norm, why="its output is the model's output")
        mod = modules.get(user.target) if user.op == "call_module" else None
        if user.args[:1] != (cur,):  # a module by its name, a function by its own
            return _Walk(norm, why=f"its output is not the first input of {_name(user, None)}")
        if isinstance(mod, WEIGHT_LAYERS):
            if user not in eligible:
                return _Walk(norm, why=f"the next layer {user.target} cannot be in a chain")
            if not _reads(layout, mod):
                return _Walk(norm, why=f"the next layer {user.target} does not read the units "
                             f"of a {_describe(layout)} output", at=cur)
            if not _fits(modules[node.target], mod, layout):
                return _Walk(norm, why=f"the next layer {user.target} does not take its "
                             f"{modules[node.target].weight.shape[0]} units as inputs", at=cur)
            return _Walk(norm, next=user)
        if isinstance(mod, NORMS) and cur is node:
            norm = mod
            if not (through_bn and isinstance(mod, BATCH_NORMS)):
                return _Walk(norm, why=f"followed by {_cls(mod).__name__}", at=user)
            cur = user
            continue
        layout = _through(user, mod, layout)
        if isinstance(layout, str):
            return _Walk(norm, why=layout, at=user)
        cur = user


def _cls(mod: nn.Module) -> type:
    """The module's class, seeing through FSDP2, which swaps a module's class for a
    subclass (``FSDPConv2d``) of :class:`FSDPModule` and the original class."""
    cls = type(mod)
    if _FSDPModule is not None and issubclass(cls, _FSDPModule):
        return cls.__mro__[cls.__mro__.index(_FSDPModule) + 1]
    return cls


class _Tracer(fx.Tracer):
    """``torch.fx``'s tracer, which sees through FSDP2 (``fully_shard``): a module it wraps
    is traced as its own class (a wrapped Linear stays a leaf) and never through FSDP's
    hooks, which would gather parameters and leave FSDP's state initialised by a trace."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        base = _cls(m)  # fx's own rule, on the class FSDP2 wrapped
        return ((base.__module__.startswith("torch.nn")
                 or base.__module__.startswith("torch.ao.nn"))
                and not issubclass(base, nn.Sequential))

    def call_module(self, m: nn.Module, forward, args, kwargs):
        if (_FSDPModule is not None and isinstance(m, _FSDPModule)
                and not self.is_leaf_module(m, self.path_of_module(m))):
            return m.forward(*args, **kwargs)  # the module's code, without FSDP's hooks
        return super().call_module(m, forward, args, kwargs)


def discover(model: nn.Module, through_bn: bool = False, *,
             trainable: set | None = None) -> Discovery:
    """Trace ``model`` and return its chains, its per-unit-normalised weight layers, and why
    each other Linear/Conv layer is in no chain.

    ``trainable`` (ids of parameters) marks what may move: a layer whose weight is not in it
    ends chains. With ``through_bn``, batch norm directly after a conv does not end its chain
    (the paper's approximate BN variant, Appendix 10.2); such layers are marked
    ``normalised``. A model ``torch.fx`` cannot trace raises ``ValueError``.
    """
    model = unwrap(model)
    lazy = [n for n, p in model.named_parameters() if is_lazy(p)]
    if lazy:
        raise ValueError(f"{', '.join(lazy)}: lazy parameters have no shape before the "
                         "model's first forward pass; build the optimizer after one")
    try:
        gm = fx.GraphModule(model, _Tracer().trace(model))
    except Exception as exc:  # fx raises many types for untraceable code
        raise ValueError(f"torch.fx cannot trace {type(model).__name__} ({type(exc).__name__}: "
                         f"{exc}); {HOW_TO}") from None
    modules = dict(gm.named_modules())
    eligible, grouped, reasons = _eligible(gm, model, modules, trainable)
    layer_nodes = [n for n in gm.graph.nodes if n in eligible]
    nxt, normalised, has_prev, via_bn, stop, incoming = {}, [], set(), set(), {}, {}
    for n in gm.graph.nodes:
        if n not in eligible and n not in grouped:  # its reason is known; the walk tells nothing
            continue
        walk = _follow(n, modules, eligible, through_bn)
        if walk.next is not None and n in eligible:
            nxt[n] = walk.next
            has_prev.add(walk.next)
            if walk.norm is not None:
                via_bn.add(n)
        else:
            stop[n.target] = walk.why
            target = None if walk.at is None else _reached(walk.at, modules)
            if target is not None and n.target not in reasons:
                incoming.setdefault(target, f"after {n.target}: {walk.why}")
        norm = walk.norm
        if walk.next is None and norm is not None:
            if _per_unit(norm):
                normalised.append((n.target, modules[n.target]))
            else:
                stop[n.target] = reasons[n.target] = (
                    f"followed by {_cls(norm).__name__}, which normalises several units "
                    "together: a row is not scale-invariant on its own (no PSI either)")
    chains = []
    for n in layer_nodes:
        if n in has_prev or n not in nxt:
            continue
        run = [n]
        while run[-1] in nxt:
            run.append(nxt[run[-1]])
        chains.append(ChainLayers([r.target for r in run], [modules[r.target] for r in run],
                                  [r in via_bn for r in run]))
    in_chain = {name for c in chains for name in c.names}
    for n in layer_nodes:
        if n.target not in in_chain and n.target not in reasons:
            reasons[n.target] = "; ".join(r for r in (incoming.get(n.target),
                                                      stop.get(n.target)) if r)
    return Discovery(chains, normalised, reasons)


__all__ = ["ChainLayers", "Discovery", "chain_of", "discover", "unwrap"]
