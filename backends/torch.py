"""PyTorch kernels of the fast step (:mod:`.fast`), in place.

``KERNELS`` (eager). The plan of CPU tensors computes on NumPy views of them (zero-copy):
the node-vector work (a few hundred operations on short vectors, most of a small model's
step) and small layers (:data:`SMALL`) take NumPy's kernels, where an operation costs a
fraction of ATen's dispatch, and each large layer takes torch's own kernels on tensors
sharing the NumPy arrays' memory (:class:`TorchOnNumPy`): the column sum as ``addcmul_``
of blocks of rows into one cache-resident block of partial sums, the bulk update as a few
in-place ops per block, each block checked for non-finite values before it is written. On
a GPU everything stays with torch, each layer is one block, and the bulk takes the core's
per-entry rules without reading anything back: the step's one host synchronisation is
the vector stage's flags.

``COMPILED``: the column sum stays eager (inductor's reductions over rows stride across
them; with the sums from the backward pass there is none); the rest of the step is one
``torch.compile`` graph per plan, specialised to its shapes (:func:`.fast.one_graph_stage_`):
the vector stage, then one loop per layer that writes the bulk, the special edges and the
biases in place, with nothing read back until it ends. The plain bulk is
:func:`.fast.recip_rows` (no division per entry); a step in which a layer's node vectors are
not tame writes nothing and is taken again by the two stages of :mod:`.fast`, each compiled
whole, whose bulk gives such a layer :func:`.fast.exact_rows`. The learning rate enters as a
tensor, so a schedule never recompiles. The first step of a new chain compiles for some
seconds.
"""

from __future__ import annotations

import math
import types

import array_api_compat.torch as compat
import numpy as np
import torch

from . import numpy as numpy_kernels
from .fast import exact_rows, momentum_rows_, plain_rows_, recip_rows, rows_by_rules
from .kernels import namespace
from .plan import StepPlan
from .rule_step import rule_bulk_

#: Elements per block on the CPU (2 MiB of float32; measured best for 4M-element layers).
CHUNK = 1 << 19
#: Compiled loops over fewer than twice this many entries run on one thread (inductor's
#: ``cpp.min_chunk_size``): the vector stage's dozens of loops over node vectors would
#: each end on a barrier of the threads, which costs more than the loop.
SERIAL = 1 << 15
#: CPU layers up to this size take NumPy's kernels: below it, the cost of an ATen call
#: outweighs its second thread (chosen by timing layer updates on both sides of it).
SMALL = 1 << 17


def _take(x, indices, /, *, axis: int = 0):
    """``take`` as a bare ``index_select``: the fast step's indices are never negative, and
    compat's ``take`` spends three more ops per call making negative ones positive (the
    eager step makes dozens of such calls)."""
    return torch.index_select(x, axis, indices)


#: ``array_api_compat.torch`` with :func:`_take` (eager kernels).
NAMESPACE = namespace(compat, take=_take)


def _numpy_views(tensors) -> list:
    """NumPy arrays sharing the CPU tensors' memory (``None`` stays)."""
    return [None if t is None else t.detach().numpy() for t in tensors]


def _realized(array: torch.Tensor) -> torch.Tensor:
    """A copy of ``array``: the body of the operator ``gsgd::realized``, which a compiled
    graph calls as it is, so that ``array`` is computed, and stored, before it (a compiler
    inlines what it can into the loops that read it, and would recompute short vectors,
    gathers and all, for every entry of a layer). On the CPU the copy takes one thread
    (NumPy's): it is short, and ATen's threads would wait on one another for longer."""
    if array.device.type == "cpu" and array.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(array.numpy().copy())
    return array.clone()


# A plain operator, not torch.library.custom_op: a call skips the autograd wrapper, which
# costs the step more than the copy.
_LIBRARY = torch.library.Library("gsgd", "DEF")
_LIBRARY.define("realized(Tensor array) -> Tensor")
_LIBRARY.impl("realized", _realized, "CompositeExplicitAutograd")
torch.library.register_fake("gsgd::realized", lambda array: torch.empty_like(array),
                            lib=_LIBRARY)
realized = torch.ops.gsgd.realized


class TorchKernels:
    """The fast step's kernels (:class:`gsgd_backends.kernels.Kernels`) over torch tensors:
    eager, or compiled by ``torch.compile`` (module docstring)."""

    mod = torch

    def __init__(self, chunk: int, *, compiled: bool = False, host: bool = True,
                 checked: bool = True, one_graph: bool = True) -> None:
        self.chunk, self.traced = chunk, compiled
        #: Compiled: the whole step is one graph (:func:`.fast.one_graph_stage_`), else
        #: the two stages.
        self.one_graph = compiled and one_graph
        #: Eager CPU plans compute on NumPy views; layers up to ``small`` weights take
        #: NumPy's kernels.
        self.host, self.small = host and not compiled, SMALL
        #: Eager bulk blocks are checked by a host read each (else: per-entry rules).
        self.checked = checked and not compiled
        self.xp = compat if compiled else NAMESPACE

    def plan(self, chain, array) -> StepPlan:
        """Eager float32/float64 CPU tensors: a plan on NumPy views, each layer on NumPy's
        kernels or, above ``small`` weights, on :data:`ON_NUMPY`. Other devices: every
        layer on :data:`ON_DEVICE` (no host read in the bulk). Otherwise every layer on
        these kernels."""
        device, dtype, L = array.device, array.dtype, chain.L
        if self.host and device.type == "cpu" and dtype in (torch.float32, torch.float64):
            layer_kernels = [numpy_kernels.KERNELS if math.prod(chain.layer_shape(l))
                             <= self.small else ON_NUMPY for l in range(1, L + 1)]
            return StepPlan(chain, numpy_kernels.KERNELS, xp=numpy_kernels.NAMESPACE, device=device,
                            dtype=dtype, layer_kernels=layer_kernels, view=_numpy_views,
                            step_device="cpu", step_dtype=torch.empty(0, dtype=dtype).numpy().dtype)
        kernels = self if device.type == "cpu" or not self.checked else ON_DEVICE
        return StepPlan(chain, kernels, xp=kernels.xp, device=device, dtype=dtype,
                        layer_kernels=[kernels] * L)

    def context(self):
        """Parameters are written in place, outside autograd."""
        return torch.no_grad()

    def compile(self, fn):
        """``fn`` itself, or, if compiled, a copy of ``fn`` compiled whole (specialised to
        the shapes it meets). Each plan compiles its own copy: dynamo keeps its cache, and
        its limit of recompilations, per code object, so one shared ``fn`` would stop
        compiling after a handful of models."""
        if not self.traced:
            return fn
        copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                                  fn.__defaults__, fn.__closure__)
        copy.__kwdefaults__ = fn.__kwdefaults__
        return torch.compile(copy, dynamic=False, options={"cpp.min_chunk_size": SERIAL})

    def realized(self, array):
        """``array``, computed and stored before anything reads it (traced: through
        :func:`realized`)."""
        return realized(array) if self.traced else array

    def scalar(self, value: float, dtype, device):
        """``value`` as the stages take it: compiled stages get a 0-d tensor, since dynamo
        would compile anew for every distinct Python float (a learning-rate schedule)."""
        return torch.full((), value, dtype=dtype, device=device) if self.traced else value

    def view3(self, w, shape, writable: bool = True):
        """A ``(n, p, k)`` view of ``w`` sharing its storage, or ``None`` if not contiguous
        (a read-only array that is not contiguous is reshaped into a copy)."""
        if not w.is_contiguous():
            return None if writable else w.detach().reshape(shape)
        return w.detach().view(shape)

    def block_rows(self, W) -> int:
        """Rows per block of ``W``'s bulk update: cache-sized on the CPU when blocks are
        checked, else all of them."""
        return self._cpu_block_rows(W) if self.checked else W.shape[0]

    def _cpu_block_rows(self, W) -> int:
        """Rows per cache-sized block of ``W`` (all of them on a GPU)."""
        n = W.shape[0]
        if W.device.type != "cpu":
            return n
        return max(1, min(n, self.chunk // math.prod(W.shape[1:])))

    def scratch(self, scratch, like, size: int):
        """A flat buffer of at least ``size`` elements of ``like``'s dtype and device."""
        return scratch.get(like, size, lambda n: torch.empty(n, dtype=like.dtype,
                                                              device=like.device))

    def total(self, G):
        return G.sum()

    def colsum(self, W, G, scratch):
        """``sum(W * G, dim=(0, 2))``: blocks of rows accumulated by ``addcmul_`` into one
        cache-resident block of partial sums (row-major streaming; ATen's and inductor's
        reductions over dim 0 stride across rows and run at half the read bandwidth)."""
        n, p, k = W.shape
        rows = self._cpu_block_rows(W)  # compiled too: a whole-layer product would not fit
        W2, G2 = W.reshape(n, p * k), G.reshape(n, p * k)
        # Last rows first, so that the bulk update starts on rows still in cache.
        acc = torch.mul(W2[n - rows:], G2[n - rows:],
                        out=self.scratch(scratch, W, rows * p * k)[:rows * p * k].view(rows, p * k))
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

    def add_product_(self, block, u, W) -> None:
        """``block <- W + block * u`` in place (``u`` a column of row factors), one pass."""
        torch.addcmul(W, block, u, out=block)

    def bulk_(self, W, G, *, F, B, rho, lr, recips=None, scratch=None, squares=None) -> None:
        """``W <- (W - lr * G / (F[b] B[a])**2) / rho[a]`` in place, ``W`` and ``G`` as
        ``(n, p*k)``. Compiled (traced inside the compiled bulk stage) or on a GPU: one
        loop, :func:`.fast.recip_rows` for a tame layer (``recips`` given) and
        :func:`.fast.exact_rows` otherwise, with no host read. Eager on the CPU: block by
        block, a block holding a non-finite result recomputed by the core's rules."""
        if not self.checked:
            # written into W itself: through a view, inductor stages a copy
            W.copy_(recip_rows(compat, W, G, recips, lr) if recips is not None else
                    exact_rows(compat, W.view(W.shape[0], B.shape[0], -1),
                               G.view(G.shape[0], B.shape[0], -1), F=F, B_prev=B, rho=rho,
                               lr=lr).view(W.shape))
            return
        plain_rows_(self, W, G, F=F, B_prev=B, rho=rho, lr=lr, scratch=scratch, squares=squares)

    def rows_bulk_(self, W, G, M, *, F, B_cols, rho_cols, lr, rule, scratch=None) -> None:
        """Weight decay and momentum: compiled or on a GPU, :func:`.fast.rows_by_rules`
        whole (no host read); eager on the CPU, :func:`.fast.momentum_rows_` (in-place
        blocks, bit-identical to the core)."""
        if not self.checked:
            w, m = rows_by_rules(compat, W, G, M, F=F, B_cols=B_cols, rho_cols=rho_cols, lr=lr,
                                 rule=rule)
            W.copy_(w)
            if M is not None:
                M.copy_(m)
            return
        momentum_rows_(self, W, G, M, F=F, B_cols=B_cols, rho_cols=rho_cols, lr=lr, rule=rule,
                       scratch=scratch)

    def rule_bulk_(self, rule, coef, W, G, M, *, F, B, rho) -> None:
        """:func:`.rule_step.rule_bulk_`, its blocks checked by a host read on the CPU only."""
        rule_bulk_(self, rule, coef, W, G, M, F=F, B_prev=B, rho=rho, checked=self.checked)


class TorchOnNumPy:
    """Layer kernels (:class:`gsgd_backends.kernels.LayerKernels`) for a large layer of a
    step that computes on NumPy views of CPU tensors: torch's eager kernels on tensors
    sharing the NumPy arrays' memory, so that the bulk runs on ATen's threads."""

    def __init__(self, kernels: TorchKernels) -> None:
        self.kernels = kernels

    def total(self, G):
        """On torch's threads: NumPy's pairwise sum of a large layer is several times
        slower."""
        return self.kernels.total(torch.from_numpy(G)).numpy()

    def colsum(self, W, G, scratch):
        return self.kernels.colsum(torch.from_numpy(W), torch.from_numpy(G), scratch).numpy()

    def bulk_(self, W, G, *, F, B, rho, lr, recips=None, scratch=None, squares=None) -> None:
        W, G, F, B, rho = _tensors((W, G, F, B, rho))
        self.kernels.bulk_(W, G, F=F, B=B, rho=rho, lr=lr, scratch=scratch,
                           squares=_tensors(squares))

    def rows_bulk_(self, W, G, M, *, F, B_cols, rho_cols, lr, rule, scratch=None) -> None:
        W, G, M, F, B_cols, rho_cols = _tensors((W, G, M, F, B_cols, rho_cols))
        self.kernels.rows_bulk_(W, G, M, F=F, B_cols=B_cols, rho_cols=rho_cols, lr=lr,
                                rule=_tensors(rule), scratch=scratch)

    def rule_bulk_(self, rule, coef, W, G, M, *, F, B, rho) -> None:
        W, G, M, F, B, rho = _tensors((W, G, M, F, B, rho))
        self.kernels.rule_bulk_(rule, _tensors(coef), W, G, M, F=F, B=B, rho=rho)


def _tensors(x):
    """Every NumPy array or scalar in nested tuples and lists as a tensor (sharing memory
    where it can); other leaves stay."""
    if isinstance(x, np.ndarray):  # a read-only one is a node vector: copied, not shared
        return torch.from_numpy(x if x.flags.writeable else x.copy())
    if isinstance(x, np.generic):
        return torch.as_tensor(x)
    if isinstance(x, (tuple, list)):
        items = [_tensors(y) for y in x]
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
    return x


KERNELS = TorchKernels(CHUNK)
COMPILED = TorchKernels(CHUNK, compiled=True)
#: Eager kernels of plans on GPUs: whole layers, per-entry rules, no host read in the bulk.
ON_DEVICE = TorchKernels(CHUNK, host=False, checked=False)
#: Layer kernels of a large layer in a plan of CPU tensors (:class:`TorchOnNumPy`).
ON_NUMPY = TorchOnNumPy(KERNELS)
