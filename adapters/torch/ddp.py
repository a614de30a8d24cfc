"""The column sums of a DDP model's chains, averaged over processes as DDP averages the
gradients.

DDP all-reduces the gradients at the end of the backward pass, so each process's sums
from the backward pass (:mod:`.backward_sums`) are those of its own gradient, not of the
mean that the step reads. The sums are linear in the gradient and the weights are the same
on every process (DESIGN §12)::

    colsum(W * mean_r grad_r) = mean_r colsum(W * grad_r)

so one all-reduce of every chain's sums (vectors of units, with each layer's bound on its
gradient's entries and a flag per chain saying whether its sums are valid on that process)
before the step gives each process the sums of the averaged gradient: the step reads each
weight once, as without DDP.

The sums stand for the gradients only while these are the accumulation of the backward
passes the sums saw, then reduced by DDP. DDP writes the gradients (copies its buckets back,
or all-reduces them where they are views) after the accumulations the sums saw, at the end
of the backward pass: a callback queued behind DDP's own, at the end of each backward pass,
takes the gradients as DDP left them as the known ones. Whether that backward pass was
reduced is what DDP decided at the forward pass (``no_sync``): a forward pre-hook on the
DDP module reads it there. The sums are refused (the step reads ``W * grad``, counted in
``describe()``) on every process when they are invalid on any, when the last backward
pass ran under ``no_sync`` (each process then holds its own gradient), and when a
communication hook reduces the gradients (it need not average them; compression does not).
Changes made to a gradient during the backward pass, by a hook of the user's, are not
seen.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["DDPSums", "find_ddp"]


def find_ddp(model) -> nn.parallel.DistributedDataParallel | None:
    """The DDP module ``model`` is or wraps (through ``torch.compile``), if any."""
    while isinstance(model, nn.Module):
        if isinstance(model, nn.parallel.DistributedDataParallel):
            return model
        model = getattr(model, "_orig_mod", None)
    return None


def _queue(callback) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)


class DDPSums:
    """The backward sums of a DDP model's chains (:class:`.backward_sums.BackwardSums`),
    each averaged over DDP's processes by :meth:`reduce` before a step.

    Parameters
    ----------
    ddp : the DDP module whose ``module`` holds the chains.
    records : the chains' :class:`.backward_sums.BackwardSums`.
    """

    def __init__(self, ddp: nn.parallel.DistributedDataParallel, records) -> None:
        self.ddp, self.records = ddp, list(records)
        self.layers = [layer for r in self.records for layer in r.layers]
        for layer in self.layers:
            layer.on_accumulated = self._accumulated
        ddp.register_forward_pre_hook(_Forward(self))
        # what DDP's last forward pass decided for the next backward pass, and whether the
        # last backward pass that reached a chain was reduced (None: none yet)
        self.will_sync = self.synced = None
        self.awaited: set[int] = set()  # graph tasks whose end is awaited
        #: per record (by id) after :meth:`reduce`: why its sums cannot be used ("": they can)
        self.refused: dict[int, str] = {}

    def forward(self) -> None:
        """DDP's forward pass: it reduces the next backward pass unless under ``no_sync``
        (DDP's own test; a forward pass without grad leaves DDP's decision as it was)."""
        if torch.is_grad_enabled():
            self.will_sync = bool(self.ddp.require_backward_grad_sync)

    def _accumulated(self, layer) -> None:
        """A chain weight's gradient was accumulated: once per backward pass, queue the end
        of the backward pass behind DDP's callback that writes the averaged gradients.
        Callbacks run in the order queued, and one queued by a callback after all those
        queued during the backward pass: hence a callback that queues :meth:`_backward_end`
        (DDP may queue its own after this accumulation)."""
        task = torch._C._current_graph_task_id()
        if task not in self.awaited:
            self.awaited.add(task)
            _queue(lambda: _queue(functools.partial(self._backward_end, task)))

    def _backward_end(self, task: int) -> None:
        """After DDP's reduction: the gradients it wrote are those the sums stand for, in
        every layer that accumulated in this backward pass."""
        self.awaited.discard(task)
        for layer in self.layers:
            if task in layer.accumulations:
                layer.reduced()
        self.synced, self.will_sync = bool(self.will_sync), False

    def _why(self, record, hook: str) -> str:
        if hook:
            return (f"DDP's communication hook {hook} reduces the gradients (the column "
                    "sums follow DDP's own all-reduce only)")
        if self.synced is False:
            return "the last backward pass ran under DDP's no_sync"
        return next((w for w in (layer.why_invalid() for layer in record.layers) if w), "")

    def _comm_hook(self) -> str:
        hooks = getattr(self.ddp, "_comm_hooks", None)
        if hooks:
            return getattr(hooks[0][0], "__qualname__", repr(hooks[0][0]))
        return self.ddp._get_ddp_logging_data().get("comm_hook", "")

    def reduce(self) -> None:
        """One all-reduce over DDP's process group of every chain's sums, bounds and
        validity: each valid record's sums and bound become their mean over processes,
        and :attr:`refused` says why the others' are not used (the same on every process).
        Called before every step on every process, as DDP's own collectives are."""
        hook = self._comm_hook()
        local = [self._why(r, hook) for r in self.records]
        sums = [t for layer in self.layers for t in (layer.sums, layer.bound.reshape(1))]
        dtype = functools.reduce(torch.promote_types, [t.dtype for t in sums])
        flags = torch.tensor([float(bool(w)) for w in local], dtype=dtype,
                             device=sums[0].device)
        # one vector on the first layer's device (a module may span devices)
        flat = torch.cat([flags] + [t.to(device=flags.device, dtype=dtype) for t in sums])
        dist.all_reduce(flat, group=self.ddp.process_group)
        flat /= dist.get_world_size(self.ddp.process_group)
        invalid = flat[:len(local)].tolist()
        self.refused = {id(r): w or ("the column sums were refused on another process"
                                     if bad else "")
                        for r, w, bad in zip(self.records, local, invalid)}
        for t, mean in zip(sums, flat[len(local):].split([t.numel() for t in sums])):
            t.copy_(mean.view_as(t))

    def take_reason(self, record) -> str:
        """Why ``record``'s sums cannot be used by this step ("": they are the mean over
        processes); a record not reduced since its last step is refused."""
        return self.refused.pop(id(record), "the column sums were not reduced over DDP's "
                                            "processes before the step")


class _Forward:
    """The forward pre-hook of the DDP module (:meth:`DDPSums.forward`); disarmed in a
    copy, as :class:`.backward_sums._Hook` is."""

    def __init__(self, sums: DDPSums | None) -> None:
        self.sums = sums

    def __reduce__(self):
        return (_Forward, (None,))

    def __call__(self, module, args) -> None:
        if self.sums is not None:
            self.sums.forward()
