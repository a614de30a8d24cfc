"""Find chains in a torch model with ``torch.fx``.

Linear and Conv1d/2d/3d layers joined by positively homogeneous, per-unit operations (ReLU,
LeakyReLU, max/avg/adaptive pooling, flatten, dropout, identity) with no branching form one
chain: a conv stack, its pooling, the flatten and the classifier head are one chain. Anything
else ends a chain: a residual add, a branch, batch/layer/group norm, any other operation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from gsgd_core import Chain

WEIGHT_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.GroupNorm, nn.LayerNorm,
         nn.SyncBatchNorm)
PASS_MODULES = (nn.ReLU, nn.LeakyReLU, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d,
                nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
                nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d,
                nn.AdaptiveMaxPool3d, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d,
                nn.Identity)
PASS_FUNCTIONS = {torch.relu, F.relu, F.leaky_relu, F.max_pool1d, F.max_pool2d, F.max_pool3d,
                  F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, F.adaptive_avg_pool1d,
                  F.adaptive_avg_pool2d, F.adaptive_avg_pool3d, F.adaptive_max_pool1d,
                  F.adaptive_max_pool2d, F.adaptive_max_pool3d, F.dropout, F.dropout1d,
                  F.dropout2d, F.dropout3d, torch.nn.functional.relu_}
PASS_METHODS = {"relu", "relu_"}
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
    normalised: list[tuple[str, nn.Module]]   # weight layers directly followed by a norm


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
    names = names or [type(m).__name__ for m in modules]
    for name, m in zip(names, modules):
        if not isinstance(m, WEIGHT_LAYERS):
            raise ValueError(f"{name}: a chain holds Linear and Conv1d/2d/3d layers, "
                             f"got {type(m).__name__}")
        if isinstance(m, nn.modules.conv._ConvNd) and m.groups != 1:
            raise ValueError(f"{name}: grouped or depthwise convolutions (groups={m.groups}) "
                             "cannot be in a chain yet")
    try:
        return Chain.from_shapes([tuple(m.weight.shape) for m in modules],
                                 bias=[m.bias is not None for m in modules])
    except ValueError as exc:
        raise ValueError(f"layers {names} do not form a chain: {exc}") from None


def _flatten_ok(node: fx.Node, mod) -> bool:
    if isinstance(mod, nn.Flatten):
        return mod.start_dim == 1 and mod.end_dim == -1
    if node.op == "call_function" and node.target is torch.flatten:
        start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
        end = node.args[2] if len(node.args) > 2 else node.kwargs.get("end_dim", -1)
        return start == 1 and end == -1
    if node.op == "call_method" and node.target == "flatten":
        start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
        return start == 1 and len(node.args) <= 2
    if node.op == "call_method" and node.target in ("view", "reshape"):
        shape = node.args[1:]
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return len(shape) == 2 and shape[1] == -1
    return False


def _step_kind(node: fx.Node, modules) -> str | None:
    """'pass' for a per-unit homogeneous op, 'flatten', or None (ends a chain)."""
    mod = modules.get(node.target) if node.op == "call_module" else None
    if _flatten_ok(node, mod):
        return "flatten"
    if mod is not None:
        return "pass" if isinstance(mod, PASS_MODULES) else None
    if node.op == "call_function" and node.target in PASS_FUNCTIONS:
        return "pass"
    if node.op == "call_method" and node.target in PASS_METHODS:
        return "pass"
    return None


BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def _next_layer(node: fx.Node, modules, through_bn: bool):
    """The weight layer that ``node``'s output reaches through pass-through ops alone, the
    norm directly after ``node`` (if any), and whether a batch norm was passed through."""
    spatial = isinstance(modules[node.target], nn.modules.conv._ConvNd)
    cur, norm = node, None
    while True:
        users = list(cur.users)
        if len(users) != 1 or (users[0].args[:1] != (cur,)):
            return None, norm, False
        user = users[0]
        mod = modules.get(user.target) if user.op == "call_module" else None
        if isinstance(mod, WEIGHT_LAYERS):
            conv = isinstance(mod, nn.modules.conv._ConvNd)
            return (user if conv == spatial else None), norm, norm is not None
        if isinstance(mod, NORMS) and cur is node:
            norm = mod
            if not (through_bn and isinstance(mod, BATCH_NORMS)):
                return None, norm, False
            cur = user
            continue
        kind = _step_kind(user, modules)
        if kind is None:
            return None, norm, False
        if kind == "flatten":
            spatial = False
        cur = user


def discover(model: nn.Module, through_bn: bool = False) -> Discovery:
    """Trace ``model`` and return its chains and its norm-followed weight layers.

    With ``through_bn``, batch norm directly after a layer does not end its chain (the
    paper's approximate BN variant, Appendix 10.2); such layers are marked ``normalised``.
    """
    model = unwrap(model)
    try:
        gm = fx.symbolic_trace(model)
    except Exception as exc:  # fx raises many types for untraceable code
        raise ValueError(f"torch.fx cannot trace {type(model).__name__} ({type(exc).__name__}: "
                         f"{exc}); {HOW_TO}") from None
    modules = dict(gm.named_modules())
    layer_nodes = [n for n in gm.graph.nodes if n.op == "call_module"
                   and isinstance(modules[n.target], WEIGHT_LAYERS)]
    seen: dict[str, int] = {}
    for n in layer_nodes:
        seen[n.target] = seen.get(n.target, 0) + 1
        if seen[n.target] > 1:
            raise ValueError(f"module {n.target!r} is used more than once in forward(); a "
                             f"shared layer cannot be placed in one chain automatically; {HOW_TO}")
    nxt, normalised, has_prev, via_bn = {}, [], set(), set()
    for n in layer_nodes:
        mod = modules[n.target]
        grouped = isinstance(mod, nn.modules.conv._ConvNd) and mod.groups != 1
        following, norm, passed = (None, None, False) if grouped else _next_layer(
            n, modules, through_bn)
        if following is not None and not (isinstance(modules[following.target],
                                                      nn.modules.conv._ConvNd)
                                          and modules[following.target].groups != 1):
            nxt[n] = following
            has_prev.add(following)
            if passed:
                via_bn.add(n)
        elif norm is not None:
            normalised.append((n.target, mod))
    chains = []
    for n in layer_nodes:
        if n in has_prev or n not in nxt:
            continue
        run = [n]
        while run[-1] in nxt:
            run.append(nxt[run[-1]])
        chains.append(ChainLayers([r.target for r in run], [modules[r.target] for r in run],
                                  [r in via_bn for r in run]))
    return Discovery(chains, normalised)


__all__ = ["ChainLayers", "Discovery", "chain_of", "discover", "unwrap"]
