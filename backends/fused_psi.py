"""The fused PSI-SGD(M) step: every normalised weight of a model in one Triton launch, no
host read.

:func:`gsgd_core.psi_update` per row ``i`` of each weight (Yi et al., Algorithm 1)::

    u_i <- momentum * u_i + ||w_i||^2 g_i,   w_i <- w_i - lr * u_i,
    rows with ||w_i|| > max_norm divided by their norm (and u_i with them),
    rows with a non-finite gradient or new value kept as they were

here :mod:`.fused_psi_kernels`' ``psi_rows``, one launch over a table of tiles of rows of
every weight (``data_ptr()``s and sizes, as :mod:`.fused`'s write pass takes them): the
per-row rules decide on the device, a set ``found_inf`` (GradScaler's) skips the step, and
the learning rate may be a 0-d device tensor, so nothing is read back to the host and the
step can be captured in a CUDA graph. float16 and bfloat16 are computed in float32, as the
core computes them. CPU tensors run only under Triton's interpreter (as :mod:`.fused`).

This module imports triton: import it only where triton is installed.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch

from gsgd_core.arrays import is_off
from gsgd_core.psi import PSIState, check_psi_arguments

from . import fused_psi_kernels as fk
from .fused import TRITON_DTYPES, DeviceValues, launch, interpreted

__all__ = ["FusedPSIPlan", "PSIBlocks", "fused_psi_step_"]


class PSIBlocks(NamedTuple):
    """Tile sizes: each program updates ``rows`` rows, ``cols`` entries at a time."""

    rows: int = 8
    cols: int = 256


class FusedPSIPlan(DeviceValues):
    """The tables of one fused PSI step of weights shaped as ``weights`` (one device, one
    dtype). Build it once and keep it: the pointer table is rebuilt only when a tensor's
    address changes (a captured CUDA graph needs the same tensors every step).

    Parameters
    ----------
    weights : the weights the plan steps (their shapes, device and dtype).
    blocks : tile sizes (:class:`PSIBlocks`).
    """

    def __init__(self, weights: Sequence[torch.Tensor], blocks: PSIBlocks = PSIBlocks()
                 ) -> None:
        if not weights:
            raise ValueError("a fused PSI plan needs at least one weight")
        self.shapes = tuple(tuple(w.shape) for w in weights)
        self.device, self.dtype = weights[0].device, weights[0].dtype
        if self.dtype not in TRITON_DTYPES:
            raise ValueError(f"the fused PSI step takes floating tensors, got {self.dtype}")
        if any(len(s) < 1 for s in self.shapes):
            raise ValueError(f"the fused PSI step takes weights with rows, got shapes "
                             f"{list(self.shapes)}")
        self.blocks = blocks
        self.compute = (torch.float32 if self.dtype in (torch.float16, torch.bfloat16)
                        else self.dtype)
        sizes = [(s[0], math.prod(s[1:])) for s in self.shapes]
        tiles = [(i, r0) for i, (n, _) in enumerate(sizes) for r0 in range(0, n, blocks.rows)]
        self.sizes = torch.tensor(sizes, dtype=torch.int64, device=self.device)
        self.tiles = torch.tensor(tiles, dtype=torch.int64, device=self.device).reshape(-1)

    def __repr__(self) -> str:
        return (f"FusedPSIPlan({len(self.shapes)} weights, device={self.device}, "
                f"dtype={self.dtype})")

    def pointers(self, weights, grads, buffers) -> torch.Tensor:
        """The pointer table (weight, gradient, buffer per weight; 0 where no buffer)."""
        key = tuple(0 if a is None else a.data_ptr()
                    for row in zip(weights, grads, buffers) for a in row)
        return self.cached("_ptrs", key, lambda: self.on_device(key, torch.int64))

    def idle_state(self) -> PSIState:
        """The state PSI-SGD steps with (it keeps no buffer and the kernel reads none):
        views of one zero in the weights' shapes, made once."""
        def make():
            zero = torch.zeros((), dtype=self.dtype, device=self.device)
            return PSIState(tuple(zero.expand(s) for s in self.shapes))

        return self.cached("_idle", self.shapes, make)

    def hyperparameters(self, momentum: float, max_norm: float) -> torch.Tensor:
        """``(momentum, max_norm)`` as a device tensor, made when they change."""
        key = (float(momentum), float(max_norm))
        return self.cached("_hyper", key, lambda: self.on_device(key, self.compute))


def _check(plan: FusedPSIPlan, state, weights, grads, lr, momentum, max_norm,
           found_inf, grad_scale) -> list:
    """The core's ``ValueError``s (:func:`gsgd_core.psi.check_psi_arguments`), then the
    plan's: shapes, device, dtype, contiguity, device tensors. Returns the buffers the
    kernel reads (``None`` each for PSI-SGD)."""
    check_psi_arguments(state, weights, grads, lr=1.0 if isinstance(lr, torch.Tensor) else lr,
                        momentum=momentum, max_norm=max_norm)
    for name, v in (("momentum", momentum), ("max_norm", max_norm)):
        if isinstance(v, torch.Tensor):  # its value would be read back to choose the kernel
            raise ValueError(f"the fused PSI step takes {name} as a Python number, got a "
                             f"tensor; only lr may be a device tensor")
    if plan.device.type == "cpu" and not interpreted():
        raise ValueError("the fused PSI step runs on CPU tensors only under Triton's "
                         "interpreter (TRITON_INTERPRET=1 set before gsgd_backends.fused is "
                         "imported, for tests); step CPU parameters with fused=False")
    if tuple(tuple(w.shape) for w in weights) != plan.shapes:
        raise ValueError(f"the plan steps weights of shapes {list(plan.shapes)}, got "
                         f"{[tuple(w.shape) for w in weights]}")
    buffers = list(state.momentum) if not is_off(momentum) else [None] * len(weights)
    for i, row in enumerate(zip(weights, grads, buffers)):
        for what, a in zip(("weight", "gradient", "momentum buffer"), row):
            if a is not None and (a.device != plan.device or a.dtype != plan.dtype
                                  or not a.is_contiguous()):
                raise ValueError(f"weight {i}: the fused PSI step takes contiguous tensors "
                                 f"of {plan.dtype} on {plan.device}; the {what} of shape "
                                 f"{tuple(a.shape)} is {a.dtype} on {a.device}"
                                 f"{'' if a.is_contiguous() else ', not contiguous'}")
    for name, t in (("lr", lr), ("found_inf", found_inf), ("grad_scale", grad_scale)):
        if isinstance(t, torch.Tensor) and (t.device != plan.device or t.numel() != 1):
            raise ValueError(f"{name} must be a one-element tensor on {plan.device}, got "
                             f"shape {tuple(t.shape)} on {t.device}")
    return buffers


def fused_psi_step_(plan: FusedPSIPlan, state: PSIState, weights, grads, lr, *,
                    momentum: float = 0.0, max_norm: float = 1e4,
                    found_inf: torch.Tensor | None = None,
                    grad_scale: torch.Tensor | None = None) -> None:
    """One PSI-SGD(M) step of ``weights`` and ``state``'s buffers, in place, in one kernel
    launch: :func:`gsgd_core.psi_update`'s result (to rounding), nothing written while
    ``found_inf`` (a one-element device tensor) is non-zero. ``lr`` is a number or a
    one-element device tensor; ``momentum = 0`` (PSI-SGD) neither reads nor writes the
    buffers. Given ``grad_scale`` (a one-element device tensor, GradScaler's), the
    gradients are read unscaled (:func:`~.fused.fused_step_`) and written back so in the rows
    written. Nothing is read back to the host; bad input raises the core's ``ValueError``
    (or the plan's) before the launch."""
    buffers = _check(plan, state, weights, grads, lr, momentum, max_norm, found_inf,
                     grad_scale)
    if not plan.tiles.numel():
        return
    ptrs = plan.pointers(weights, grads, buffers)
    hyper = plan.hyperparameters(momentum, max_norm)
    launch(fk.psi_rows, plan.tiles.shape[0] // 2, plan.tiles, plan.sizes, ptrs,
           plan.learning_rate(lr), hyper, hyper if found_inf is None else found_inf,
           hyper if grad_scale is None else grad_scale,
           ST=TRITON_DTYPES[plan.dtype], DT=TRITON_DTYPES[plan.compute],
           HAS_M=not is_off(momentum), HAS_FOUND=found_inf is not None,
           UNSCALE=grad_scale is not None, BR=plan.blocks.rows, BC=plan.blocks.cols)
