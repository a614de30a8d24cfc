"""The fused G-SGD step: every chain of a model in three Triton launches, no host read.

DESIGN §14: a step needs only a read pass over the weights (the column sums of ``W * grad``
and a finiteness flag), a vector stage over the ``n_l``-sized node vectors (sequential in
``l`` but tiny: one program per chain) and a write pass over every weight, whatever the
depth and the number of chains. Here they are :mod:`.fused_kernels`' ``read_pass``,
``vector_stage`` and ``write_pass``, each one launch over a table of every layer of every
chain (``data_ptr()``s and sizes, as ``_foreach`` and fused Adam take them):

- a chain with a non-finite gradient, or a set ``found_inf`` (GradScaler's), is skipped on
  the device (weights, biases, buffers and step counter unchanged), as fused Adam skips;
- GradScaler's ``grad_scale`` is read on the device too: the kernels read the gradients
  unscaled and write them back so, as torch's fused optimizers do, with no launch of its
  own;
- the learning rate may be a 0-d device tensor and the step counters are the states' own
  device tensors, so nothing is read back to the host and the step can be captured in a
  CUDA graph (the tables are rebuilt only when a tensor's address changes, and copied
  to the device from pinned memory, so that the host does not wait);
- every entry follows :mod:`gsgd_core.rules` (the kernels write each rule once more);
  float16 and bfloat16 are computed in float32.

:class:`FusedPlan` holds the tables and the device workspace of a list of chains (built
from their :class:`~gsgd_backends.plan.StepPlan`s, kept by whoever steps) and
:func:`fused_step_` takes one step. The kernels take the step rule as flags: G-Adam's step
(:mod:`.fused_adam`) shares the plan, the checks (:func:`checked_tensors`) and the
launches (:func:`launch_step`). CPU tensors run only under Triton's interpreter
(``TRITON_INTERPRET=1`` set before this module is imported), which is how a machine without
a GPU tests the kernels.

This module imports triton: import it only where triton is installed.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import array_api_compat.numpy as np_compat
import numpy as np
import torch
import triton.language as tl

from gsgd_core.arrays import layer_meta
from gsgd_core.gsgd import check_update_hypers

from . import fused_kernels as fk
from .plan import StepPlan, check_column_sums

__all__ = ["Blocks", "Buffers", "DeviceValues", "FusedPlan", "check_lengths", "checked_tensors",
           "fused_step_", "interpreted", "launch_step"]

#: The Triton element type of each torch dtype the fused steps take.
TRITON_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
                 torch.float32: tl.float32, torch.float64: tl.float64}


class Blocks(NamedTuple):
    """Tile sizes: ``rows`` x ``cols`` entries per write-pass program, the read pass's
    programs each sum ``chunk`` rows (in blocks of ``rows``), and the vector stage works on
    ``nodes`` node entries at a time."""

    rows: int = 32
    cols: int = 128
    chunk: int = 512
    nodes: int = 256


def interpreted() -> bool:
    """Whether the kernels run under Triton's interpreter (CPU tensors)."""
    return type(fk.write_pass).__name__ == "InterpretedFunction"


def launch(kernel, grid: int, *args, **meta) -> None:
    """Every launch of the step goes through here (tests count them). The interpreter
    computes in NumPy, which warns where a GPU computes quietly (``inf - inf`` of the
    finiteness test)."""
    with np.errstate(all="ignore"):
        kernel[(grid,)](*args, **meta)


def _csr(targets: np.ndarray, count: int, keep: np.ndarray):
    """Per target ``0..count-1``, the indices ``i`` with ``keep[i]`` and ``targets[i]`` equal
    to it, as ``(starts, members)`` (``starts`` has ``count + 1`` entries)."""
    members = np.nonzero(keep)[0]
    order = np.argsort(targets[members], kind="stable")
    members = members[order]
    starts = np.searchsorted(targets[members], np.arange(count + 1))
    return starts, members


class _Tables:
    """The host side of a plan's tables, appended layer by layer."""

    def __init__(self) -> None:
        self.layers: list = []
        self.scale: list = []
        self.idx: list = [np.zeros(1, np.int64)]  # offset 0: arrays a layer does not have
        self.size = 1
        self.part = 0

    def put(self, a) -> int:
        a = np.asarray(a, np.int64).reshape(-1)
        at = self.size
        self.idx.append(a)
        self.size += a.size
        return at if a.size else 0


class DeviceValues:
    """Device tensors of a plan's host values, made when a value changes (so a step
    copies nothing to the device while they stay the same). Needs ``device`` and
    ``compute`` (the kernels' dtype)."""

    device: torch.device
    compute: torch.dtype

    def cached(self, slot: str, key, make) -> torch.Tensor:
        """The tensor ``make()`` kept in attribute ``slot`` while ``key`` is unchanged."""
        held = getattr(self, slot, (None, None))
        if held[0] != key:
            held = (key, make())
            setattr(self, slot, held)
        return held[1]

    def on_device(self, values, dtype: torch.dtype) -> torch.Tensor:
        """``values`` (numbers) as a tensor on the plan's device, copied without a host
        synchronisation: a CUDA copy from pageable memory makes the host wait for the
        stream, one from pinned memory does not (torch's caching host allocator keeps the
        pinned block until the copy is done)."""
        host = torch.tensor(values, dtype=dtype)
        if self.device.type == "cuda":
            return host.pin_memory().to(self.device, non_blocking=True)
        return host.to(self.device)

    def learning_rate(self, lr) -> torch.Tensor:
        """``lr`` as the kernels read it: a 0-d device tensor as given, a number as a
        tensor made when it changes."""
        if isinstance(lr, torch.Tensor):
            return lr
        return self.cached("_lr", lr, lambda: torch.full((), lr, dtype=self.compute,
                                                         device=self.device))


class FusedPlan(DeviceValues):
    """The tables and workspace of one fused step of ``plans``' chains (all on one device,
    of one dtype). Build it once and keep it: it is specialised to the chains' shapes, and
    to the tensors' addresses (the pointer table is rebuilt when one changes; a captured
    CUDA graph needs the same tensors every step). Not for two threads at once.

    Parameters
    ----------
    plans : the chains' :class:`~gsgd_backends.plan.StepPlan`s (their chains, device and dtype).
    blocks : tile sizes (:class:`Blocks`).
    """

    def __init__(self, plans: Sequence[StepPlan], blocks: Blocks = Blocks()) -> None:
        if not plans:
            raise ValueError("a fused plan needs at least one chain")
        self.plans, self.blocks = tuple(plans), blocks
        self.device = torch.device(plans[0].device)
        self.dtype = plans[0].dtype
        for p in self.plans:
            if torch.device(p.device) != self.device or p.dtype != self.dtype:
                raise ValueError(f"a fused plan steps chains of one device and dtype: {p} "
                                 f"against {self.device}, {self.dtype}")
        if self.dtype not in TRITON_DTYPES:
            raise ValueError(f"the fused step takes floating tensors, got {self.dtype}")
        self.compute = (torch.float32 if self.dtype in (torch.float16, torch.bfloat16)
                        else self.dtype)
        t = _Tables()
        chains, ws = [], 0
        for c, p in enumerate(self.plans):
            nodes = sum(p.chain.sizes)
            chains.append([len(t.layers), p.chain.L, ws, nodes])
            ws += 4 * nodes
            self._chain_tables(t, c, p.chain)
        dev = self.device

        def ints(a):
            return torch.as_tensor(np.asarray(a, np.int64), device=dev)

        self.chains, self.layers = ints(chains), ints(t.layers)
        self.idx = ints(np.concatenate(t.idx))
        self.scale = torch.as_tensor(t.scale, dtype=self.compute, device=dev)
        self.ws = torch.zeros(ws, dtype=self.compute, device=dev)
        self.part = torch.zeros(max(t.part, 1), dtype=self.compute, device=dev)
        self.coefs = torch.zeros(len(chains) * fk.KFIELDS.value, dtype=self.compute,
                                 device=dev)
        self.flag = torch.zeros(len(chains), dtype=torch.int32, device=dev)
        self.ok = torch.zeros(len(chains), dtype=torch.int32, device=dev)
        self.read_tiles, self.bias_tiles, self.write_tiles = (
            ints(x).reshape(-1) for x in self._tiles(t))

    def __repr__(self) -> str:
        return (f"FusedPlan({len(self.plans)} chains, {len(self.layers)} layers, "
                f"device={self.device}, dtype={self.dtype})")

    def _chain_tables(self, t: _Tables, c: int, chain) -> None:
        """Append ``chain``'s layers (chain ``c``) to the tables."""
        meta = layer_meta(chain, np_compat, "cpu")
        nodes = np.cumsum((0,) + tuple(chain.sizes))
        for l in range(1, chain.L + 1):
            n, p, k = chain.layer_shape(l)
            m = meta[l - 1]
            starts, members = _csr(np.asarray(m.tau_src), p, np.asarray(m.tau_free, bool)
                                   ) if l < chain.L else (np.zeros(p + 1), np.zeros(0))
            chunks = -(-n // self.blocks.chunk)
            part = -1
            if l >= 2:
                part, t.part = t.part, t.part + chunks * p * k
            t.layers.append([
                c, l, chain.L, n, p, k, nodes[l - 1], nodes[l],
                t.put(m.tau_idx), t.put(m.tau_src), t.put(np.asarray(m.tau_free, np.int64)),
                t.put(m.free_idx), t.put(m.sigma), t.put(starts), t.put(members),
                int(np.max(np.diff(starts), initial=0)), part, chunks,
                int(_has_bias(chain, l))])
            t.scale.append(float(chain.skeleton_scale[l - 1]))

    def _tiles(self, t: _Tables):
        """The read pass's tiles ``(layer, kind, chunk, first column)`` (all, and those of
        the bias gradients alone) and the write pass's ``(layer, first row, first column)``."""
        bl = self.blocks
        read, bias, write = [], [], []
        for li, row in enumerate(t.layers):
            n, width = row[fk.ROWS.value], row[fk.UNITS.value] * row[fk.SLOTS.value]
            for chunk in range(row[fk.CHUNKS.value]):
                read += [(li, 0, chunk, c0) for c0 in range(0, width, bl.cols)]
            if row[fk.HAS_BIAS.value]:
                bias += [(li, 1, 0, c0) for c0 in range(0, n, bl.cols)]
            write += [(li, r0, c0) for r0 in range(0, n, bl.rows)
                      for c0 in range(0, width, bl.cols)]
        return read + bias, bias, write

    def pointers(self, lists) -> torch.Tensor:
        """The pointer table of the tensors in ``lists`` (one row of ``fk.PTRS``
        addresses per layer), rebuilt only when an address changes."""
        key = tuple(0 if a is None else a.data_ptr() for a in lists)
        return self.cached("_ptrs", key, lambda: self.on_device(key, torch.int64))

    def step_pointers(self, steps, checks) -> torch.Tensor:
        """The table of the chains' step counters' and gradient checks' addresses (0 where
        none; cached as :meth:`pointers`)."""
        key = tuple(0 if t is None else t.data_ptr() for pair in zip(steps, checks)
                    for t in pair)
        return self.cached("_steps", key, lambda: self.on_device(key, torch.int64))

    def hyperparameters(self, values: tuple) -> torch.Tensor:
        """The rule's hyperparameters (:mod:`.fused_kernels`' ``_direction``, ``_adam``) as
        a device tensor, made when they change."""
        return self.cached("_hyper", values, lambda: self.on_device(values, self.compute))


def _has_bias(chain, l: int) -> bool:
    bias = chain.bias
    return bool(bias if isinstance(bias, bool) else bias[l - 1])


class Buffers(NamedTuple):
    """One buffer of a chain's rule (momentum; Adam's moments): per layer the weight's
    (``weights``) and the bias's (``biases``, ``None`` where the layer has none)."""

    name: str
    weights: Sequence
    biases: Sequence


def _check_buffers(c: int, weights, biases, buffers: Sequence[Buffers], dtype) -> None:
    """``ValueError`` naming the chain, layer and shapes unless each buffer has its
    parameter's shape and ``dtype``."""
    for buf in buffers:
        for what, arrays, params in (("", buf.weights, weights), ("bias ", buf.biases, biases)):
            if len(arrays) != len(params):
                raise ValueError(f"chain {c}: {what}{buf.name} has {len(arrays)} arrays for "
                                 f"{len(params)} layers")
            for l, (a, x) in enumerate(zip(arrays, params), start=1):
                if (a is None) != (x is None) or a is not None and (
                        a.shape != x.shape or a.dtype != dtype):
                    raise ValueError(
                        f"chain {c}, layer {l}: the {what}{buf.name} buffer has shape "
                        f"{None if a is None else tuple(a.shape)} and dtype "
                        f"{None if a is None else a.dtype}; expected "
                        f"{None if x is None else tuple(x.shape)} and {dtype}")


def _flat_lists(plan: FusedPlan, weights, biases, grads, bias_grads, buffers, sums,
                buffer_dtype):
    """Validate one step's tensors (the core's errors, :meth:`StepPlan.prepared`; the
    rule's ``buffers``, one list of :class:`Buffers` per chain, of ``buffer_dtype``) and
    list them in the pointer table's order (``None`` where a layer has none)."""
    out = []
    slots = fk.P_MB.value - fk.P_M.value
    for c, p in enumerate(plan.plans):
        L = p.chain.L
        b = biases[c] if biases[c] is not None else [None] * L
        gb = bias_grads[c] if bias_grads[c] is not None else [None] * L
        p.prepared(weights[c], biases[c], grads[c], bias_grads[c])
        if not p.fits(p.chain, weights[c][0]):
            raise ValueError(f"chain {c}: {p} does not fit weights of dtype "
                             f"{weights[c][0].dtype} on {weights[c][0].device}")
        _check_buffers(c, weights[c], b, buffers[c], buffer_dtype)
        pad = [None] * (slots - len(buffers[c]))
        for l in range(L):
            row = ([weights[c][l], grads[c][l], b[l], gb[l],
                    None if sums is None or l == 0 else sums[c][l - 1]]
                   + [x.weights[l] for x in buffers[c]] + pad
                   + [x.biases[l] for x in buffers[c]] + pad)
            what = ["weight", "gradient", "bias", "bias gradient", "column sum"] + [
                f"{x.name} buffer" for x in buffers[c]] + pad + [
                f"bias {x.name} buffer" for x in buffers[c]] + pad
            for name, a in zip(what, row):
                if a is not None and a.device != plan.device:
                    raise ValueError(f"chain {c}, layer {l + 1}: the {name} is on {a.device}, "
                                     f"the plan's tensors on {plan.device}")
                if a is not None and not a.is_contiguous():
                    raise ValueError(f"chain {c}, layer {l + 1}: the fused step writes in "
                                     f"place and takes contiguous tensors; the {name} of "
                                     f"shape {tuple(a.shape)} is not contiguous")
            out += row
    return out


def _check_device(plan: FusedPlan, lr, counters, found_inf, grad_scale, checks) -> None:
    """``ValueError`` for a CPU step outside the interpreter and for device tensors that
    are not where the parameters are or not of the kernels' kinds (``counters``: the
    states' step counters, ``(name, tensor)``)."""
    if plan.device.type == "cpu" and not interpreted():
        raise ValueError("the fused step runs on CPU tensors only under Triton's interpreter "
                         "(TRITON_INTERPRET=1 set before gsgd_backends.fused is imported, "
                         "for tests); step CPU parameters with fused=False")
    named = [("lr", lr), ("found_inf", found_inf), ("grad_scale", grad_scale)] + list(
        counters or []) + [
        (f"gradient_check[{c}]", t) for c, t in enumerate(checks or [])]
    for name, t in named:
        if isinstance(t, torch.Tensor) and (t.device != plan.device or t.numel() != 1):
            raise ValueError(f"{name} must be a one-element tensor on {plan.device}, got "
                             f"shape {tuple(t.shape)} on {t.device}")
    for name, t in counters or []:
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be an int32 tensor (as the core's init makes it), "
                             f"got {t.dtype}")


def check_lengths(plan: FusedPlan, **lists) -> None:
    """``ValueError`` naming the first of ``lists`` (per chain; ``None`` passes) that has
    not one entry per chain of ``plan``."""
    n = len(plan.plans)
    for name, v in lists.items():
        if v is not None and len(v) != n:
            raise ValueError(f"{name}: the plan steps {n} chains, got {len(v)} lists")


def checked_tensors(plan: FusedPlan, weights, biases, grads, bias_grads, lr, *, counters,
                    buffers, buffer_dtype, found_inf, sums, checks, grad_scale=None) -> list:
    """Check a step's arguments (``ValueError`` before anything runs) and list its tensors
    in the pointer table's order: per chain the lists :func:`fused_step_` takes, the
    rule's :class:`Buffers` (``buffers[c]``, of ``buffer_dtype``) and step counter
    (``counters[c]``: ``(name, tensor)``; ``counters`` ``None`` where the rule keeps none)."""
    n = len(plan.plans)
    check_lengths(plan, weights=weights, biases=biases, grads=grads, bias_grads=bias_grads,
                  states=counters, column_sums=sums, gradient_check=checks)
    if (sums is None) != (checks is None):
        raise ValueError("gradient_check is the check of column_sums: pass both")
    for c, p in enumerate(plan.plans if sums is not None else ()):
        check_column_sums(p.chain, sums[c], plan.dtype, checks[c])
    tensors = _flat_lists(plan, weights, biases if biases is not None else [None] * n, grads,
                          bias_grads if bias_grads is not None else [None] * n, buffers, sums,
                          buffer_dtype)
    _check_device(plan, lr, counters, found_inf, grad_scale, checks)
    return tensors


def launch_step(plan: FusedPlan, tensors: list, lr, *, counters, checks, found_inf,
                rule: int, hyper: tuple, maximize: bool, buffer_dtype,
                grad_scale=None) -> None:
    """The three launches of a checked step (:func:`checked_tensors`): ``rule``, the
    kernels' ``RULE`` flags, and ``hyper``, their hyperparameter vector; ``grad_scale``
    (GradScaler's, or ``None``) the scale the gradients are read unscaled by."""
    n = len(plan.plans)
    given = checks is not None
    ptrs = plan.pointers(tensors)
    table = plan.flag  # read only where a counter or a check is given
    if counters is not None or given:
        table = plan.step_pointers([None] * n if counters is None else [t for _, t in counters],
                                   checks if given else [None] * n)
    lr_t = plan.learning_rate(lr)
    hyper_t = plan.hyperparameters(tuple(float(h) for h in hyper))
    bl = plan.blocks
    flags = dict(ST=TRITON_DTYPES[plan.dtype], DT=TRITON_DTYPES[plan.compute],
                 MAXIMIZE=bool(maximize), UNSCALE=grad_scale is not None)
    scale = plan.flag if grad_scale is None else grad_scale  # read only to unscale
    rule_flags = dict(BT=TRITON_DTYPES[buffer_dtype], RULE=int(rule), **flags)
    tiles = plan.bias_tiles if given else plan.read_tiles
    if tiles.shape[0]:
        launch(fk.read_pass, tiles.shape[0] // 4, tiles, plan.layers, ptrs, plan.part,
               plan.flag, scale, ROWS_PER=bl.chunk, BR=bl.rows, BC=bl.cols, **flags)
    launch(fk.vector_stage, n, plan.chains, plan.layers, ptrs, table, plan.idx, plan.scale,
           plan.part, plan.ws, plan.flag, plan.ok,
           plan.flag if found_inf is None else found_inf, scale, lr_t, hyper_t, plan.coefs,
           float(torch.finfo(plan.compute).eps), HAS_STEP=counters is not None,
           HAS_FOUND=found_inf is not None, GIVEN=given, BLOCK=bl.nodes, **rule_flags)
    launch(fk.write_pass, plan.write_tiles.shape[0] // 3, plan.write_tiles, plan.chains,
           plan.layers, ptrs, plan.coefs, plan.idx, plan.ws, plan.ok, lr_t, hyper_t, scale,
           BR=bl.rows, BC=bl.cols, **rule_flags)


def fused_step_(plan: FusedPlan, weights, biases, grads, bias_grads, lr, states=None, *,
                momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False,
                weight_decay: float = 0.0, maximize: bool = False,
                found_inf: torch.Tensor | None = None, column_sums=None,
                gradient_check=None, grad_scale: torch.Tensor | None = None) -> None:
    """One G-SGD step of every chain of ``plan``, in place, in three kernel launches.

    ``weights``, ``biases``, ``grads``, ``bias_grads``: one list per chain, as
    :func:`gsgd_core.gsgd_update` takes them; ``states``: one
    :class:`gsgd_core.GSGDState` per chain (needed with momentum or weight decay), whose
    buffers and step counter are updated in place. Each chain's result is
    :func:`gsgd_core.gsgd_update`'s (to rounding), ``maximize`` being the step on the
    negated gradients: a chain with a non-finite gradient is skipped whole, and every chain
    is skipped while ``found_inf`` (a one-element device tensor, GradScaler's) is non-zero.
    ``lr`` is a number or a one-element device tensor (read on the device). Given
    ``grad_scale`` (a one-element device tensor, GradScaler's), the gradients are read as
    ``grad * float32(1 / grad_scale)``, as ``scaler.unscale_`` leaves them, and written back
    so where a chain steps (as torch's fused optimizers leave them). Nothing is read back
    to the host; bad input raises the core's ``ValueError`` before any launch.

    ``column_sums`` and ``gradient_check``: per chain, ``colsum(W_l * grad_l)``,
    ``l = 2..L``, taken from the backward pass (DESIGN §12), and a 0-d tensor that is
    finite only if every weight gradient is (:meth:`StepPlan.column_sums`); the read pass
    then reads only the bias gradients (their check), and no weight before the write pass.
    """
    check_update_hypers(lr if not isinstance(lr, torch.Tensor) else 1.0, momentum=momentum,
                        dampening=dampening, nesterov=nesterov, weight_decay=weight_decay)
    if (momentum or weight_decay) and states is None:
        raise ValueError("momentum and weight decay need states: one gsgd_init(chain, "
                         "weights, biases) per chain")
    n = len(plan.plans)
    buffers = [[Buffers("momentum", s.momentum, s.bias_momentum)] if momentum else []
               for s in states] if states is not None else [[]] * n
    counters = None if states is None else [(f"states[{c}].step", s.step)
                                            for c, s in enumerate(states)]
    tensors = checked_tensors(plan, weights, biases, grads, bias_grads, lr, counters=counters,
                              buffers=buffers, buffer_dtype=plan.dtype, found_inf=found_inf,
                              sums=column_sums, checks=gradient_check, grad_scale=grad_scale)
    rule = ((fk.R_WD.value if weight_decay else 0) | (fk.R_M.value if momentum else 0)
            | (fk.R_NESTEROV.value if nesterov else 0))
    launch_step(plan, tensors, lr, counters=counters, checks=gradient_check,
                found_inf=found_inf, rule=rule, hyper=(momentum, dampening, weight_decay),
                maximize=maximize, buffer_dtype=plan.dtype, grad_scale=grad_scale)
