"""PyTorch kernels of the fast step (:mod:`.fast`), in place.

``KERNELS`` (eager): on the CPU both heavy passes run over blocks of rows that stay in cache:
the column sum as ``addcmul_`` of each block into one block of partial sums, the bulk update
as a few in-place ops per block, each block checked for non-finite values before it is
written. The vector stage and small layers (:data:`SMALL`) run NumPy's kernels on
zero-copy views of the tensors, where an operation costs a fraction of ATen's dispatch.
On a GPU each layer is one block, and everything stays with torch.

``COMPILED``: the column sum stays eager (inductor's reductions over rows stride across
them); the vector stage and the bulk stage of :mod:`.fast` are each compiled whole by
``torch.compile``, per chain and specialised to its shapes, so a step is two compiled calls
and a few eager ops. The bulk is one loop per layer: :func:`.fast.recip_rows` (no division
per entry) where the layer's node vectors are tame, :func:`.fast.exact_rows` elsewhere. The
learning rate enters as a tensor, so a schedule never recompiles. The first step of a new
chain compiles for some seconds.
"""

from __future__ import annotations

import functools
import math
import types

import array_api_compat.numpy as np_compat
import array_api_compat.torch as compat
import numpy as np
import torch

from gsgd_core.arrays import layer_meta
from gsgd_core.gsgd import StepRule

from . import numpy as numpy_kernels
from .fast import (step_plan, exact_rows, recip_rows, recip_square, special_vectors,
                   vector_stage)

#: Elements per block on the CPU (2 MiB of float32; measured best for 4M-element layers).
CHUNK = 1 << 19
#: Eager CPU layers up to this size take NumPy's kernels on zero-copy views: below it, the
#: cost of an ATen call outweighs its second thread (chosen by timing layer updates on
#: both sides of it).
SMALL = 1 << 17


class _Namespace:
    """``array_api_compat.torch`` with ``take`` as a bare ``index_select``: the fast step's
    indices are never negative, and compat's ``take`` spends three more ops per call making
    negative ones positive (the eager step makes dozens of such calls)."""

    def __getattr__(self, name: str):
        return getattr(compat, name)

    @staticmethod
    def take(x, indices, /, *, axis: int = 0):
        return torch.index_select(x, axis, indices)


class TorchKernels:
    mod = torch

    def __init__(self, chunk: int, compiled: bool = False) -> None:
        self.chunk, self.compiled = chunk, compiled
        self.recip = compiled  # the compiled bulk runs recip_rows on tame layers
        self.inplace = not compiled  # a traced bulk is functional: inductor fuses it
        # CPU layers up to this size, and the vector stage unless it is 0, go to NumPy.
        self.small = 0 if compiled else SMALL
        self.xp = compat if compiled else _Namespace()
        self._scratch = numpy_kernels.Scratch()

    def context(self):
        """Parameters are written in place, outside autograd."""
        return torch.no_grad()

    def stage(self, fn, chain):
        """``fn`` itself, or, if compiled, ``fn`` compiled whole for ``chain`` (specialised
        to its shapes). Each chain compiles its own copy of ``fn``: dynamo keeps its cache,
        and its limit of recompilations, per code object, so one shared ``fn`` would stop
        compiling after a handful of models."""
        if not self.compiled:
            hosted = fn in (vector_stage, special_vectors) and self.small > 0
            return functools.partial(_vectors_on_numpy, fn) if hosted else fn
        key = ("torch-stage", fn.__name__)
        if key not in chain._cache:
            copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                                      fn.__defaults__, fn.__closure__)
            chain._cache[key] = torch.compile(copy, dynamic=False)
        return chain._cache[key]

    def scalar(self, value: float, dtype, device):
        """``value`` as the stages take it: compiled stages get a 0-d tensor, since dynamo
        would compile anew for every distinct Python float (a learning-rate schedule)."""
        return torch.full((), value, dtype=dtype, device=device) if self.compiled else value

    def view3(self, w, shape, writable: bool = True):
        """A ``(n, p, k)`` view of ``w`` sharing its storage, or ``None`` if not contiguous
        (a read-only array that is not contiguous is reshaped into a copy)."""
        if not w.is_contiguous():
            return None if writable else w.detach().reshape(shape)
        return w.detach().view(shape)

    def _rows(self, W) -> int:
        """Rows per cache-sized block of ``W`` (all of them on a GPU)."""
        n = W.shape[0]
        if W.device.type != "cpu":
            return n
        return max(1, min(n, self.chunk // math.prod(W.shape[1:])))

    def host(self, W):
        """For a small CPU layer (up to ``self.small`` weights, :data:`SMALL` when eager),
        NumPy's kernels and the map of a tensor to a NumPy view of its memory; else
        ``None``."""
        if W.device.type != "cpu" or W.numel() > self.small:
            return None
        return numpy_kernels.KERNELS, torch.Tensor.numpy

    def block_rows(self, W) -> int:
        """Rows per block of a bulk update: all of them when compiled (one fused loop)."""
        return W.shape[0] if self.compiled else self._rows(W)

    def scratch(self, like, size: int):
        """A reused flat buffer of at least ``size`` elements of ``like``'s dtype and device."""
        key = (like.dtype, like.device)
        buf = self._scratch.buffers.get(key)
        if buf is None or buf.numel() < size:
            buf = self._scratch.buffers[key] = torch.empty(size, dtype=like.dtype,
                                                             device=like.device)
        return buf

    def colsum(self, W, G):
        """``sum(W * G, dim=(0, 2))``: blocks of rows accumulated by ``addcmul_`` into one
        cache-resident block of partial sums (row-major streaming; ATen's and inductor's
        reductions over dim 0 stride across rows and run at half the read bandwidth); a
        small CPU layer by NumPy's ``einsum`` (:data:`SMALL`)."""
        host = self.host(W)
        if host is not None:
            kernels, view = host
            return torch.from_numpy(kernels.colsum(view(W), view(G)))
        n, p, k = W.shape
        rows = self._rows(W)
        W2, G2 = W.reshape(n, p * k), G.reshape(n, p * k)
        # Last rows first, so that the bulk update starts on rows still in cache.
        acc = torch.mul(W2[n - rows:], G2[n - rows:],
                        out=self.scratch(W, rows * p * k)[:rows * p * k].view(rows, p * k))
        for j in range(n - rows, 0, -rows):
            i = max(0, j - rows)
            acc[:j - i].addcmul_(W2[i:j], G2[i:j])
        return acc.sum(0).view(p, k).sum(1)

    def scatter_add(self, target, index, values):
        return target.index_add(0, index, values)

    def put_(self, dst, index, values) -> None:
        """``dst.flatten()[index] = values`` in place (all of ``dst`` if ``index`` is None)."""
        if index is None:
            dst.copy_(values)
        else:
            dst.view(-1).index_copy_(0, index, values)

    def bulk_(self, W, G, f, beta, rho, lr, recips=None) -> None:
        """``W <- (W - lr * G / (f[b] beta[a])**2) / rho[a]`` in place, ``W`` and ``G`` as
        ``(n, p*k)``. Compiled (traced inside the compiled bulk stage): one loop,
        :func:`.fast.recip_rows` for a tame layer (``recips`` given) and
        :func:`.fast.exact_rows` otherwise. Eager: block by block, a block holding a
        non-finite result recomputed by the core's rules; a small CPU layer by NumPy's
        kernels (:data:`SMALL`)."""
        if self.compiled:  # written into W itself: through a view, inductor stages a copy
            W.copy_(recip_rows(compat, W, G, recips, lr) if recips is not None else
                    exact_rows(compat, W.view(W.shape[0], beta.shape[0], -1),
                               G.view(G.shape[0], beta.shape[0], -1), f, beta, rho,
                               lr).view(W.shape))
            return
        host = self.host(W)
        if host is not None:
            kernels, view = host
            with kernels.context():
                kernels.bulk_(*map(view, (W, G, f, beta, rho)), lr)
            return
        W, G = W.view(W.shape[0], beta.shape[0], -1), G.view(G.shape[0], beta.shape[0], -1)
        n, p, k = W.shape
        rows = self._rows(W)
        buf = self.scratch(W, rows * p * (k + 1))
        u = recip_square(compat, f)
        v3, rho3 = recip_square(compat, beta).view(1, p, 1), rho.view(1, p, 1)
        for i in range(0, n, rows):
            j = min(n, i + rows)
            c = buf[:(j - i) * p].view(j - i, p, 1)
            block = buf[rows * p:rows * p + (j - i) * p * k].view(j - i, p, k)
            torch.mul(u[i:j].view(-1, 1, 1), v3, out=c)
            torch.mul(G[i:j], c, out=block)
            torch.add(W[i:j], block, alpha=-lr, out=block)
            block.div_(rho3)
            if bool(torch.isfinite(block.sum())):
                W[i:j].copy_(block)
            else:
                W[i:j].copy_(exact_rows(compat, W[i:j], G[i:j], f[i:j], beta, rho, lr))


def _vectors_on_numpy(fn, kernels, chain, meta, plan, *args):
    """An eager vector stage (:func:`.fast.vector_stage`, :func:`.fast.special_vectors`) of
    CPU tensors run by NumPy on zero-copy views of them: its few hundred operations on
    node-sized vectors cost several times less there than through ATen, and they are most
    of a small model's step. The results come back as tensors sharing NumPy's memory; a CUDA
    step stays with torch. ``args`` are the stage's own: arrays (or lists of them), the
    device, the learning rate and the step rule."""
    if _first_tensor(args).device.type != "cpu":
        return fn(kernels, chain, meta, plan, *args)

    def host(a):
        if isinstance(a, (torch.device, str)):  # the stage's device argument
            return "cpu"
        if isinstance(a, StepRule):
            return a if a.first is None else a._replace(first=bool(a.first))
        return _map(lambda t: t.detach().numpy() if isinstance(t, torch.Tensor) else t, a)

    nk = numpy_kernels.KERNELS
    with nk.context():
        v = fn(nk, chain, layer_meta(chain, np_compat, "cpu"), step_plan(chain, np_compat, "cpu"),
               *map(host, args))
    return type(v)(*_map(_from_numpy, list(v)))


def _first_tensor(x):
    """The first tensor in nested lists and tuples (``None`` if there is none)."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (list, tuple)):
        for y in x:
            t = _first_tensor(y)
            if t is not None:
                return t
    return None


def _from_numpy(a) -> torch.Tensor:
    """A tensor sharing ``a``'s memory (a copy if torch cannot: read-only or strided)."""
    a = np.asarray(a)
    return torch.from_numpy(a if a.flags.c_contiguous and a.flags.writeable else a.copy())


def _map(f, x):
    """``f`` on every array in nested lists and tuples (``None`` stays)."""
    if x is None:
        return None
    if isinstance(x, (list, tuple)):
        return type(x)(_map(f, y) for y in x)
    return f(x)


KERNELS = TorchKernels(CHUNK)
COMPILED = TorchKernels(CHUNK, compiled=True)
