"""NumPy kernels of the fast step (:mod:`.fast`): a fused column sum and a chunked bulk update.

``einsum`` forms the column sum of ``W * grad`` without a temporary (one read of each).
The bulk update runs over blocks of rows small enough to stay in cache, so its few in-place
ufunc calls per block cost one read of ``W`` and ``grad`` and one write of ``W``; each block
is checked for non-finite values before it is written.
"""

from __future__ import annotations

import importlib
import math
import threading

import numpy as np

from .fast import exact_rows, recip_square

#: Elements per block of the bulk update (512 KiB of float64: well inside a 1 MiB L2).
CHUNK = 1 << 16


class Scratch(threading.local):
    """Scratch buffers of one kernel set, per thread: kernel sets are shared module objects,
    and two optimizers stepping in two threads must not write into one buffer."""

    def __init__(self) -> None:
        self.buffers: dict = {}


class ArrayKernels:
    """The fast step's kernels over a NumPy-compatible module (``numpy``; ``cupy`` reuses
    them with whole-layer blocks, see :mod:`.cupy`)."""

    #: The bulk checks its blocks itself: no tame test of the node vectors (:mod:`.fast`).
    recip = False
    #: Blocks are updated by in-place ufuncs (``out=``) on scratch buffers.
    inplace = True

    def __init__(self, mod, chunk: int | None) -> None:
        self.mod, self.chunk = mod, chunk
        self.xp = importlib.import_module(f"array_api_compat.{mod.__name__}")
        self._scratch = Scratch()

    def context(self):
        """Overflows inside the step are detected and handled, not warnings."""
        return np.errstate(over="ignore", invalid="ignore", under="ignore", divide="ignore")

    def stage(self, fn, chain):
        """Steps run eagerly: ``fn`` itself."""
        return fn

    def scalar(self, value: float, dtype, device) -> float:
        return value

    def view3(self, w, shape, writable: bool = True):
        """A ``(n, p, k)`` view of ``w`` sharing its memory, or ``None`` if ``w`` cannot be
        written in place (not contiguous or read-only); read-only use reshapes any array."""
        if not writable:
            return self.mod.reshape(w, shape)
        flags = w.flags
        if not flags.c_contiguous or not getattr(flags, "writeable", True):
            return None
        return w.reshape(shape)

    def host(self, W):
        """Other kernels for layer ``W``: none (see :meth:`.torch.TorchKernels.host`)."""
        return None

    def colsum(self, W, G):
        """``sum(W * G, axis=(0, 2))``."""
        return self.mod.einsum("bak,bak->a", W, G)

    def scatter_add(self, target, index, values):
        out = target.copy()
        self.mod.add.at(out, index, values)
        return out

    def put_(self, dst, index, values) -> None:
        """``dst.flat[index] = values`` (all of ``dst`` if ``index`` is ``None``)."""
        if index is None:
            dst[...] = values
        else:
            dst.reshape(-1)[index] = values

    def block_rows(self, W) -> int:
        """Rows per block of ``W`` (all of them without a chunk size)."""
        n = W.shape[0]
        return n if self.chunk is None else max(1, min(n, self.chunk // math.prod(W.shape[1:])))

    def scratch(self, like, size: int):
        """A reused flat buffer of at least ``size`` elements of ``like``'s dtype."""
        buf = self._scratch.buffers.get(like.dtype)
        if buf is None or buf.size < size:
            buf = self._scratch.buffers[like.dtype] = self.mod.empty(size, dtype=like.dtype)
        return buf

    def bulk_(self, W, G, f, beta, rho, lr: float, recips=None) -> None:
        """``W <- (W - lr * G / (f[b] beta[a])**2) / rho[a]`` in place, block by block; a
        block with a non-finite result is recomputed by :func:`.fast.exact_rows` (these
        kernels never get ``recips``: ``recip = False``). ``W``, ``G`` come as ``(n, p*k)``."""
        xp, mod = self.xp, self.mod
        W, G = W.reshape(W.shape[0], beta.shape[0], -1), G.reshape(G.shape[0], beta.shape[0], -1)
        n, p, k = W.shape
        rows = self.block_rows(W)
        buf = self.scratch(W, rows * p * (k + 1))
        u = recip_square(xp, f)
        v3, rho3 = mod.reshape(recip_square(xp, beta), (1, p, 1)), mod.reshape(rho, (1, p, 1))
        for i in range(0, n, rows):
            j = min(n, i + rows)
            c = buf[:(j - i) * p].reshape(j - i, p, 1)
            block = buf[rows * p:rows * p + (j - i) * p * k].reshape(j - i, p, k)
            mod.multiply(mod.reshape(u[i:j], (-1, 1, 1)), v3, out=c)
            mod.multiply(G[i:j], c, out=block)
            mod.multiply(block, -lr, out=block)
            mod.add(W[i:j], block, out=block)
            mod.divide(block, rho3, out=block)
            if math.isfinite(float(block.sum())):
                W[i:j] = block
            else:
                W[i:j] = exact_rows(xp, W[i:j], G[i:j], f[i:j], beta, rho, lr)


KERNELS = ArrayKernels(np, CHUNK)
