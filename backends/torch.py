"""PyTorch kernels of the fast step (:mod:`.fast`), in place.

``KERNELS`` (eager): on the CPU both heavy passes run over blocks of rows that stay in cache:
the column sum as ``addcmul_`` of each block into one block of partial sums, the bulk update
as a few in-place ops per block, each block checked for non-finite values before it is
written. On a GPU each layer is one block.

``COMPILED``: the column sum stays eager (inductor's reductions over rows stride across
them); the vector stage and the bulk stage of :mod:`.fast` are each compiled whole by
``torch.compile``, specialised to the chain's shapes, so a step is two compiled calls and a
few eager ops. The bulk is one loop per layer: :func:`.fast.recip_rows` (no division per
entry) where the layer's node vectors are tame, :func:`.fast.exact_rows` elsewhere. The first
step of a new chain compiles for some seconds.
"""

from __future__ import annotations

import array_api_compat.torch as xp
import torch

from .fast import exact_rows, recip_rows, recip_square

#: Elements per block on the CPU (2 MiB of float32; measured best for 4M-element layers).
CHUNK = 1 << 19


class TorchKernels:
    def __init__(self, chunk: int, compiled: bool = False) -> None:
        self.chunk, self.compiled = chunk, compiled
        self.recip = compiled  # the compiled bulk runs recip_rows on tame layers
        self._buffers: dict = {}
        self._stages: dict = {}

    def context(self):
        """Parameters are written in place, outside autograd."""
        return torch.no_grad()

    def stage(self, fn):
        """``fn`` itself, or compiled whole (specialised to the chain's shapes) if compiled."""
        if not self.compiled:
            return fn
        if fn not in self._stages:
            self._stages[fn] = torch.compile(fn, dynamic=False)
        return self._stages[fn]

    def view3(self, w, shape):
        """A ``(n, p, k)`` view of ``w`` sharing its storage, or ``None`` if not contiguous."""
        return w.detach().view(shape) if w.is_contiguous() else None

    def _rows(self, W) -> int:
        n, p, k = W.shape
        return n if W.device.type != "cpu" else max(1, min(n, self.chunk // (p * k)))

    def _buffer(self, like, size: int):
        key = (like.dtype, like.device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < size:
            buf = self._buffers[key] = torch.empty(size, dtype=like.dtype, device=like.device)
        return buf

    def colsum(self, W, G):
        """``sum(W * G, dim=(0, 2))``: blocks of rows accumulated by ``addcmul_`` into one
        cache-resident block of partial sums (row-major streaming; ATen's and inductor's
        reductions over dim 0 stride across rows and run at half the read bandwidth)."""
        n, p, k = W.shape
        rows = self._rows(W)
        W2, G2 = W.reshape(n, p * k), G.reshape(n, p * k)
        acc = torch.mul(W2[:rows], G2[:rows])
        for i in range(rows, n, rows):
            j = min(n, i + rows)
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

    def bulk_(self, W, G, f, beta, rho, lr: float, tame: bool) -> None:
        """``W <- (W - lr * G / (f[b] beta[a])**2) / rho[a]`` in place. Compiled (traced
        inside the compiled write stage): one loop, :func:`.fast.recip_rows` for a tame layer
        and :func:`.fast.exact_rows` otherwise. Eager: block by block, a block holding a
        non-finite result recomputed by the core's rules."""
        if self.compiled:
            W.copy_((recip_rows if tame else exact_rows)(xp, W, G, f, beta, rho, lr))
            return
        n, p, k = W.shape
        rows = self._rows(W)
        buf = self._buffer(W, rows * p * (k + 1))
        u = recip_square(xp, f)
        v3, rho3 = recip_square(xp, beta).view(1, p, 1), rho.view(1, p, 1)
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
                W[i:j].copy_(exact_rows(xp, W[i:j], G[i:j], f[i:j], beta, rho, lr))


KERNELS = TorchKernels(CHUNK)
COMPILED = TorchKernels(CHUNK, compiled=True)
