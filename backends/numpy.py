"""NumPy kernels of the fast step (:mod:`.fast`): a fused column sum and a chunked bulk update.

``einsum`` forms the column sum of ``W * grad`` without a temporary (one read of each).
The bulk update (:func:`.fast.plain_rows_`) runs over blocks of rows small enough to stay in
cache, so its few in-place ufunc calls per block cost one read of ``W`` and ``grad`` and one
write of ``W``; each block is checked for non-finite values before it is written.
"""

from __future__ import annotations

import importlib
import math

import array_api_compat.numpy as np_compat
import numpy as np

from .fast import momentum_rows_, plain_rows_
from .kernels import namespace
from .plan import StepPlan
from .rule_step import rule_bulk_

#: ``array_api_compat.numpy`` with ``take`` and ``reshape`` as the arrays' own methods:
#: NumPy's functions wrap them in three Python calls each (a dispatcher, the function,
#: ``_wrapfunc``). The fast step takes and reshapes arrays (never NumPy scalars), gathers by
#: indices that are never negative and reshapes without ``copy=``, so the methods do what
#: the functions do.
NAMESPACE = namespace(np_compat, take=np.ndarray.take, reshape=np.ndarray.reshape)
#: Elements per block of the bulk update (512 KiB of float64: well inside a 1 MiB L2).
CHUNK = 1 << 16
#: Conv layers from this many weights take the row-wise column sum (timed: below it the
#: two extra calls cost more than the three-axis einsum loses).
ROWWISE = 1 << 13


class ArrayKernels:
    """The fast step's kernels (:class:`gsgd_backends.kernels.Kernels`) over a
    NumPy-compatible module (``numpy``; ``cupy`` reuses them with whole-layer blocks, see
    :mod:`.cupy`)."""

    #: Eager: blocks are updated by in-place ufuncs (``out=``) and checked as they go.
    traced, checked, one_graph = False, True, False

    def __init__(self, mod, chunk: int | None) -> None:
        self.mod, self.chunk = mod, chunk
        self.xp = (NAMESPACE if mod is np else
                   importlib.import_module(f"array_api_compat.{mod.__name__}"))

    def plan(self, chain, array) -> StepPlan:
        """Every layer on these kernels."""
        return StepPlan(chain, self, xp=self.xp, device=getattr(array, "device", "cpu"),
                        dtype=array.dtype, layer_kernels=[self] * chain.L)

    def context(self):
        """Overflows inside the step are detected and handled, not warnings."""
        return np.errstate(over="ignore", invalid="ignore", under="ignore", divide="ignore")

    def compile(self, fn):
        """Steps run eagerly: ``fn`` itself."""
        return fn

    def scalar(self, value: float, dtype, device) -> float:
        return value

    def view3(self, w, shape, writable: bool = True):
        """A ``(n, p, k)`` view of ``w`` sharing its memory, or ``None`` if ``w`` cannot be
        written in place (not contiguous or read-only); read-only use reshapes any array."""
        if not writable:
            return w.reshape(shape)
        flags = w.flags
        if not flags.c_contiguous or not getattr(flags, "writeable", True):
            return None
        return w.reshape(shape)

    def total(self, G):
        """A 0-d array, not a NumPy scalar (which the namespace's ``reshape`` refuses)."""
        return G.sum(keepdims=True).reshape(())

    def colsum(self, W, G, scratch=None):
        """``sum(W * G, axis=(0, 2))``. A conv layer's (``k > 1``) of :data:`ROWWISE`
        weights or more: one ``einsum`` over the columns of the ``(n, p*k)`` views, whose
        loop runs along each row with the sums in cache (over three axes it strides across
        ``k``), then the sum over ``k``."""
        mod, (n, p, k) = self.mod, W.shape
        if k == 1 or n * p * k < ROWWISE:
            return mod.einsum("bak,bak->a", W, G)
        s = mod.einsum("bc,bc->c", W.reshape(n, p * k), G.reshape(n, p * k))
        return s.reshape(p, k).sum(axis=1)

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

    def scratch(self, scratch, like, size: int):
        """A flat buffer of at least ``size`` elements of ``like``'s dtype from ``scratch``."""
        return scratch.get(like, size, lambda n: self.mod.empty(n, dtype=like.dtype))

    def add_product_(self, block, u, W) -> None:
        """``block <- block * u + W`` in place (``u`` a column of row factors)."""
        self.mod.multiply(block, u, out=block)
        self.mod.add(block, W, out=block)

    def bulk_(self, W, G, *, F, B, rho, lr: float, recips=None, scratch=None,
              squares=None) -> None:
        """:func:`.fast.plain_rows_`: in-place blocks, each checked before it is written
        (eager kernels never get ``recips``). ``W``, ``G`` come as ``(n, p*k)``."""
        plain_rows_(self, W, G, F=F, B_prev=B, rho=rho, lr=lr, scratch=scratch, squares=squares)

    def rows_bulk_(self, W, G, M, *, F, B_cols, rho_cols, lr, rule, scratch=None) -> None:
        """:func:`.fast.momentum_rows_`: in-place blocks, bit-identical to the core."""
        momentum_rows_(self, W, G, M, F=F, B_cols=B_cols, rho_cols=rho_cols, lr=lr, rule=rule,
                       scratch=scratch)

    def rule_bulk_(self, rule, coef, W, G, M, *, F, B, rho) -> None:
        rule_bulk_(self, rule, coef, W, G, M, F=F, B_prev=B, rho=rho)


KERNELS = ArrayKernels(np, CHUNK)
