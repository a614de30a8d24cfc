"""A chain's column sums taken from the backward pass, so that a step reads each weight once.

The backward sweep of a G-SGD step needs, for every layer ``l >= 2`` of a chain,
``colsum_l[a] = sum_{b,k} W_l[b,a,k] * grad_l[b,a,k]``. A layer is bilinear in its weight
and its input, so (DESIGN §12)::

    colsum_l[a] = sum over batch and positions of x_l[n, a, pos] * dL/dx_l[n, a, pos]

exactly, where ``x_l`` is the layer's input. :class:`BackwardSums` wraps that input in an
identity autograd function (:class:`_Tap`) whose backward accumulates ``x * dL/dx`` per
input unit: one reduction over activations, whose two factors autograd holds anyway. A
hook on the layer's output bounds the weight gradient's entries (:class:`_Layer`), which
proves them finite without reading them.

The sums stand for ``W * grad`` only while each weight's ``.grad`` is exactly the
accumulation of the backward passes they saw, with the weights they saw. Everything else is
detected, and the step then reads ``W * grad`` as before (a fallback, counted):

- gradients that were there when the optimizer was built (a backward pass before it, or
  assigned by hand): the sums began at zero and never saw them;
- ``.grad`` replaced, or changed in place (clipping, an all-reduce: the tensor's
  identity and its version counter, checked before every accumulation and at the step);
  DDP's all-reduce is accounted for instead, when the optimizer was given the DDP module:
  the sums are averaged over its processes as the gradients are (:mod:`.ddp`);
- ``.grad`` cleared by someone else (``model.zero_grad()``): set to ``None`` before a forward
  pass, it is accounted for exactly (the sums restart at zero, as the gradient does); zeroed
  in place, or cleared or assigned between a forward pass and its backward, it is detected
  (a hook on the weight checks the gradient just before each accumulation);
- a use of the layer whose input does not require grad (no_grad parts, ``detach``): its
  backward reaches the layer's output and weight but not the input's tap (per backward
  call, the uses through the output's tap and through the input's must be as many);
- a backward pass through the layer that does not accumulate into the weight's gradient
  (``torch.autograd.grad``), or the reverse: the graph tasks that each saw must be the same;
- weights written since the sums began (the version counter of each weight), and a step
  taken since (the optimizer's step writes CPU weights through NumPy views, out of sight of
  version counters: the record holds nothing more until the gradients are cleared);
- ``GradScaler``: its unscaling kernel bypasses version counters, so the optimizers take
  the scale from ``scaler.step`` and unscale the gradients and the sums together (exactly,
  for a power of two), and refuse the sums when ``scaler.unscale_`` ran first.

A forward pass through the layer with other parameters (``torch.func.functional_call``)
is not tapped.

Writes through ``.data`` bypass version counters and cannot be detected: after such a write
to a gradient or a weight, call the optimizer's ``zero_grad``. Nor can a loss that also
reads a weight outside its layer in a backward pass through the layer (a penalty such as
``lam * w.square().sum()`` added to a loss of the output): autograd hands the weight one
gradient per backward pass, and the sums miss the penalty's part of it: pass
``backward_sums=False`` to the optimizer for such a loss.
"""

from __future__ import annotations

import functools
import math
import operator
import weakref
from collections import Counter

import torch
import torch.nn as nn

from .ddp import DDPSums
from .fsdp import is_sharded

__all__ = ["BackwardSums", "ChainSums", "step_arguments"]


def _graph_task() -> int:
    return torch._C._current_graph_task_id()


class _Tap(torch.autograd.Function):
    """The identity on a layer's input ``x``; its backward adds ``sum(x * dL/dx)`` per input
    unit into ``layer``'s sums."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.save_for_backward(x)
        ctx.layer = layer
        return x.view_as(x)

    @staticmethod
    def backward(ctx, gx):
        (x,) = ctx.saved_tensors
        ctx.layer.add_(x, gx)
        return gx, None


class _Layer:
    """One chain layer's record: a bound on its gradient's entries (it says they are
    finite), its input's column sums (layers ``2..L``, ``tap``), and what says they are
    valid.

    The bound: every entry of a backward pass's weight gradient is a sum over batch and
    positions of ``dL/dz[n, b, pos] * x[n, a, pos']`` (one position of the input per position
    of the output), so by Cauchy-Schwarz it is at most ``||dL/dz|| * ||x||`` (Frobenius
    norms), and the accumulated gradient at most the sum of those, over the backward passes
    that reached it. Where that sum is far below the dtype's largest number, no entry (nor
    its rounding) can overflow, and finite factors give finite entries; a non-finite factor
    makes the bound non-finite. The check costs two norms over activations, not a read of
    the gradient."""

    def __init__(self, module: nn.Module, units: int, tap: bool) -> None:
        self.weight, self.units, self.tap = module.weight, units, tap
        # Input units are on axis 1 of a convolution's input and on the last axis (as units
        # times positions, channel-major after a flatten) of a Linear's.
        self.conv = isinstance(module, nn.modules.conv._ConvNd)
        self.sums = self.bound = None
        self.on_accumulated = None  # told after each accumulation (:mod:`.ddp`)
        self.reset()
        if self.weight.grad is not None:  # sums of zero do not stand for what it holds
            self._break("the gradient was there before the optimizer")

    def reset(self) -> None:
        """Sums of zero (in the weight's dtype and on its device, which ``model.to`` may have
        changed), valid for a gradient that is ``None`` or is the current one."""
        w = self.weight
        if not self._fits():
            self.sums = torch.zeros(self.units if self.tap else 0, dtype=w.dtype,
                                    device=w.device)
            self.bound = torch.zeros((), dtype=w.dtype, device=w.device)
        self.sums.zero_()
        self.bound.zero_()
        self.clean = True  # nothing recorded since (a forward pass need not reset again)
        self.known = _state(self.weight.grad)
        self.weight_version = self.weight._version
        # per graph task (one backward call): the uses of the layer it went through (the
        # output's tap), those that reached the input's tap, and whether it accumulated
        self.uses, self.taps, self.accumulations = Counter(), Counter(), set()
        self.broken = ""

    def add_(self, x: torch.Tensor, gx: torch.Tensor) -> None:
        """``sums += sum(x * gx)`` per input unit (the tap's backward)."""
        if self.broken:  # nothing to keep until the record restarts
            return
        self.clean = False
        self.taps[_graph_task()] += 1
        with torch.no_grad():
            prod = x * gx
            if self.conv:  # (batch, units, positions...): positions first, contiguous
                batched = x.ndim == self.weight.ndim
                prod = prod.reshape(prod.shape[:2 if batched else 1] + (-1,))
                prod = prod.sum(-1, dtype=self.sums.dtype)
                self.sums.add_(prod.sum(0) if batched else prod)
            else:
                prod = prod.reshape(-1, x.shape[-1]).sum(0, dtype=self.sums.dtype)
                self.sums.add_(prod if prod.shape[0] == self.units else
                               prod.view(self.units, -1).sum(1))

    def add_bound(self, gz: torch.Tensor, x_norm: torch.Tensor) -> None:
        """``bound += ||gz|| * ||x||`` (a hook on the layer's output, which gets ``gz`` before
        any in-place operation on the output has changed it: an ``inplace=True`` ReLU)."""
        if self.broken:
            return
        self.clean = False
        self.uses[_graph_task()] += 1
        with torch.no_grad():
            self.bound.add_(torch.linalg.vector_norm(gz) * x_norm)

    def before_forward(self, x: torch.Tensor) -> bool:
        """Before a forward pass that may reach the weight's gradient: whether its input is
        to be tapped (an input that needs no grad is not: that use's backward will reach the
        output's tap and not the input's, and :meth:`why_invalid` says so)."""
        if self.weight.grad is None and not (
                self.clean and self.weight._version == self.weight_version and self._fits()):
            # exact: the gradient is zero (cleared by anyone), and so are the sums; what
            # pending graphs will add is recorded when they are backpropagated. ``model.to``
            # swaps the weight's data without a version bump: hence the dtype/device test
            self.reset()
        return self.tap and x.requires_grad

    def accumulating(self) -> None:
        """Before autograd accumulates into the weight's gradient: it must be as known (a
        change made after a backward pass, or between a forward pass and its backward)."""
        if not _same(self.known, self.weight.grad):
            self._break("the gradient was changed after a backward pass")

    def accumulated(self) -> None:
        """After autograd accumulated into the weight's gradient (in place, or into a new
        tensor): the gradient now known."""
        # told though the record is broken: DDP's end of this backward pass says whether it
        # was reduced (a ``no_sync`` before it is no longer the last)
        if self.on_accumulated is not None:
            self.on_accumulated(self)
        if self.broken:
            return
        self.clean = False
        self.accumulations.add(_graph_task())
        self.known = _state(self.weight.grad)

    def reduced(self) -> None:
        """DDP wrote the gradient after this backward pass's accumulation (its all-reduce,
        :mod:`.ddp`): the gradient it left is the known one."""
        if not self.broken:
            self.known = _state(self.weight.grad)

    def _fits(self) -> bool:
        w = self.weight
        return self.sums is not None and self.sums.dtype == w.dtype and self.sums.device == w.device

    def _break(self, why: str) -> None:
        self.broken = self.broken or why
        self.clean = False

    def why_invalid(self) -> str:
        """Why this record does not stand for the layer's ``W * grad`` now (``""``: it
        does)."""
        if self.broken:
            return self.broken
        if self.known is None or not _same(self.known, self.weight.grad):
            return "the gradient was changed after a backward pass"
        if self.weight._version != self.weight_version:
            return "the weights were written after a backward pass"
        if set(self.uses) != self.accumulations:
            return "a backward pass went through the layer and not into its gradient, or back"
        if self.tap and self.taps != self.uses:
            return "a backward pass went through the layer but not through its input"
        return ""


def _state(grad):
    return None if grad is None else (weakref.ref(grad), grad._version)


def _same(known, grad) -> bool:
    if known is None or grad is None:
        return known is None and grad is None
    return known[0]() is grad and grad._version == known[1]


def step_arguments(taken) -> dict:
    """The step's keyword arguments (:func:`gsgd_backends.gsgd_update_`) of what
    :meth:`BackwardSums.take` returned: none for ``None``."""
    return {} if taken is None else dict(column_sums=taken[0], gradient_check=taken[1])


class BackwardSums:
    """The column sums of a chain's layers ``2..L``, taken during the backward pass.

    Parameters
    ----------
    modules : the chain's Linear/Conv layers, in order.
    sizes : the chain's widths (:attr:`gsgd_core.Chain.sizes`): layer ``l``'s input units
        are ``sizes[l-1]``.

    :meth:`take` hands the step the sums when they are valid; :meth:`clear` restarts them
    (the optimizer's ``zero_grad``); :meth:`remove` takes the hooks off the model.
    """

    def __init__(self, modules, sizes) -> None:
        self.layers = [_Layer(m, sizes[l], tap=l >= 1) for l, m in enumerate(modules)]
        self.handles = []
        for m, layer in zip(modules, self.layers):
            self.handles += [
                m.register_forward_pre_hook(_Hook(layer, "tap")),
                m.register_forward_hook(_Hook(layer, "output")),
                m.weight.register_hook(_Hook(layer, "accumulating")),
                m.weight.register_post_accumulate_grad_hook(_Hook(layer, "accumulated"))]
        #: how the chain's steps got their column sums: "backward", or the fallback's reason
        self.counts: Counter = Counter()

    def take(self, refused: str = "") -> tuple[list[torch.Tensor], torch.Tensor] | None:
        """``(sums, check)`` if the record stands for ``W * grad`` now, else ``None``:
        ``sums``, the column sums of layers ``2..L``; ``check``, 0 where every layer's bound
        proves its gradient finite, else ``inf`` (the step then checks the gradients
        themselves). ``refused``: the caller's reason not to use them. Counted either way
        (:attr:`counts`).

        The weights are about to be written (not always through a version counter: the
        eager step writes CPU tensors through NumPy views), so the record holds no more
        until the gradients are cleared."""
        why = refused or next((w for w in (k.why_invalid() for k in self.layers) if w), "")
        self.counts["backward" if not why else why] += 1
        for layer in self.layers:
            layer._break("the gradients were not cleared after a step")
        if why:
            return None
        bound = functools.reduce(operator.add, [layer.bound for layer in self.layers])
        # far below the largest number: the bound's own rounding and the gradient's
        # (a relative error of at most its reduction length times eps) cannot reach it
        limit = torch.finfo(bound.dtype).max * 2.0**-16
        check = torch.where(bound <= limit, 0.0, math.inf).to(bound.dtype)
        return [layer.sums for layer in self.layers[1:]], check

    def refuse(self, why: str) -> None:
        """The gradients were changed where no version counter sees it: the record holds no
        more until they are cleared."""
        for layer in self.layers:
            layer._break(why)

    def rescale(self, factor: float) -> None:
        """The gradients were multiplied by ``factor`` in place (``GradScaler``'s unscaling,
        done by the optimizer): so are the sums. Exact only for a power of two, the only
        factor taken; any other refuses the record."""
        if math.frexp(factor)[0] != 0.5:
            self.refuse("the gradients were unscaled by a factor that is not a power of two")
            return
        for layer in self.layers:
            layer.sums.mul_(factor)
            layer.bound.mul_(factor)

    def clear(self) -> None:
        """Restart every layer's sums at zero (after the gradients were cleared)."""
        for layer in self.layers:
            layer.reset()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


class ChainSums:
    """The backward sums of an optimizer's chains: their one owner, through their lifecycle.

    Created on the layers of each chain that can take them (not one FSDP2 shards: its steps
    reduce their local rows' sums across processes; not one ``bn="paper"`` scales: its
    gradients are scaled by row norms before the step), or on none (``on=False``). The
    optimizer clears them with the gradients (:meth:`clear`), unscales or refuses them with
    ``GradScaler`` (:meth:`unscaled`), averages them over the processes of ``ddp`` (a DDP
    module) before a step (:meth:`reduce`), and each chain step takes them (:meth:`take`,
    negated to maximise); :attr:`counts` says where the steps got them. A copy of the
    optimizer takes new ones on the copy's layers, not averaged (its steps read
    ``W * grad`` under DDP).
    """

    def __init__(self, parts, on: bool, ddp=None) -> None:
        self._parts, self._on = list(parts), on
        self._of = {id(p): BackwardSums(p.modules, p.chain.sizes) for p in self._parts
                    if on and not any(p.normalised) and not is_sharded(p.weights[0])}
        # DDP averages the gradients: the sums are averaged with them
        self._ddp = DDPSums(ddp, self._of.values()) if ddp is not None and self._of else None

    def __reduce__(self):
        # a copy (copy.deepcopy, pickling) starts anew on the copy's layers: a copy of the
        # model carries the original's hooks disarmed
        return (ChainSums, (self._parts, self._on))

    def take(self, part, whole: bool, maximize: bool):
        """The chain's column sums and gradient check from the backward pass when they stand
        for ``W * grad`` of this step (:meth:`BackwardSums.take`), as the step's keyword
        arguments (:func:`step_arguments`); none when the chain has none or is stepped in
        runs (not ``whole``: a layer had no gradient). Counted either way."""
        sums = self._of.get(id(part))
        if sums is None:
            return {}
        refused = "" if self._ddp is None else self._ddp.take_reason(sums)
        taken = sums.take(refused or ("" if whole else "a layer had no gradient"))
        if taken is not None and maximize:
            taken = ([-s for s in taken[0]], taken[1])
        return step_arguments(taken)

    def reduce(self) -> None:
        """Before a step of a DDP model's optimizer, on every process: the sums averaged
        over processes as the gradients are (:meth:`.ddp.DDPSums.reduce`)."""
        if self._ddp is not None:
            self._ddp.reduce()

    def clear(self) -> None:
        for sums in self._of.values():
            sums.clear()

    def unscaled(self, factor: float | None,
                 why: str = "GradScaler.unscale_ changed the gradients in place") -> None:
        """The gradients were unscaled in place for ``GradScaler``: by the optimizer, by
        ``factor`` (the sums are rescaled with them, :meth:`BackwardSums.rescale`), or
        (``None``) out of the version counters' sight (``why``: by ``GradScaler.unscale_``;
        refused until the gradients are cleared)."""
        for sums in self._of.values():
            if factor is None:
                sums.refuse(why)
            else:
                sums.rescale(factor)

    def __getitem__(self, part_id: int) -> BackwardSums:
        """The sums of the chain whose part has this ``id``."""
        return self._of[part_id]

    @property
    def counts(self) -> Counter:
        """How every chain's steps got their column sums (``describe()``)."""
        return sum((s.counts for s in self._of.values()), Counter())


class _Hook:
    """A hook of one layer's sums: before a forward pass (the input's tap), after it (the
    output's, for the bound), before and after an accumulation into the weight's gradient.
    A copy of the model (``copy.deepcopy``, pickling) gets a hook that does nothing: the
    sums belong to this model's optimizer."""

    def __init__(self, layer: _Layer | None, when: str) -> None:
        self.layer, self.when = layer, when

    def __reduce__(self):
        return (_Hook, (None, self.when))

    def __call__(self, *args):
        if self.layer is None:
            return None
        return getattr(self, "_" + self.when)(self.layer, *args)

    @staticmethod
    def _accumulating(layer: _Layer, grad: torch.Tensor) -> None:
        layer.accumulating()

    @staticmethod
    def _accumulated(layer: _Layer, weight: torch.Tensor) -> None:
        layer.accumulated()

    @staticmethod
    def _armed(layer: _Layer, module: nn.Module, args: tuple) -> bool:
        """Whether a forward pass of ``module`` may reach the layer's weight gradient."""
        return (module.weight is layer.weight and torch.is_grad_enabled()
                and layer.weight.requires_grad and bool(args)
                and isinstance(args[0], torch.Tensor))

    @staticmethod
    def _output(layer: _Layer, module: nn.Module, args: tuple, out) -> None:
        if (_Hook._armed(layer, module, args) and isinstance(out, torch.Tensor)
                and out.requires_grad):
            with torch.no_grad():
                x_norm = torch.linalg.vector_norm(args[0].detach())
            out.register_hook(functools.partial(layer.add_bound, x_norm=x_norm))

    @staticmethod
    def _tap(layer: _Layer, module: nn.Module, args: tuple):
        if not _Hook._armed(layer, module, args) or not layer.before_forward(args[0]):
            return None
        return (_Tap.apply(args[0], layer),) + tuple(args[1:])
