"""The kernel interface: what a fast step asks of an array library.

The steps (:mod:`.fast`, :mod:`.rule_step`, :mod:`.sharded`) are written once against
:class:`Kernels`; :mod:`.numpy`, :mod:`.torch` and :mod:`.cupy` implement it. A kernel set
builds the :class:`~gsgd_backends.plan.StepPlan` of a chain (:meth:`Kernels.plan`), which
picks each layer's kernels once, so no kernel re-dispatches while a step runs.
"""

from __future__ import annotations

import types
from typing import Any, Callable, ContextManager, Protocol, runtime_checkable

__all__ = ["BlockKernels", "Kernels", "LayerKernels", "Namespace", "namespace"]


class Namespace(types.SimpleNamespace):
    """An array namespace as :func:`namespace` builds it; like a module, it equals and
    hashes as itself."""

    __eq__, __hash__ = object.__eq__, object.__hash__


def namespace(base, **functions: Callable) -> Namespace:
    """The array namespace ``base`` (its public names and ``__name__``) with some of its
    functions replaced by ``functions``: the fast step calls a few functions dozens of times
    per step on short vectors, where a library's Python wrappers around them cost more than
    the work. A copy, not a proxy: a lookup costs no Python call."""
    names = {n: getattr(base, n) for n in dir(base) if not n.startswith("_")}
    return Namespace(**{**names, "__name__": base.__name__, **functions})


# The protocols declare and run nothing: mutating them (mutmut's "no mutate block") would
# only add members that no kernel set has.
@runtime_checkable
class LayerKernels(Protocol):  # pragma: no mutate block
    """The passes over one layer's weights: the column sum before the update and the bulk
    update (a plan holds one such set per layer).

    ``W``, ``G``, ``M`` of the bulk operations are a layer's weights, gradients and
    momentum buffers as ``(n, p*k)`` views written in place (``colsum`` takes
    ``(n, p, k)``); ``F``, ``B``, ``rho`` are node vectors (:mod:`.fast`); ``scratch``
    is the plan's :class:`~gsgd_backends.plan.Scratch` (``None`` for traced kernels).
    """

    def total(self, G) -> Any:
        """The sum of every entry of ``G`` (0-d; it checks them: a NaN or Inf makes it
        non-finite)."""

    def colsum(self, W, G, scratch) -> Any:
        """``sum(W * G, axis=(0, 2))`` of a ``(n, p, k)`` layer."""

    def bulk_(self, W, G, *, F, B, rho, lr, recips=None, scratch=None, squares=None) -> None:
        """The plain bulk update ``W <- (W - lr G / (F[b] B[a])**2) / rho[a]`` by the
        core's rules (``recips``: :func:`.fast.reciprocals` for a tame layer, or ``None``;
        ``squares``: :func:`.fast.bulk_factors` of the layer, ``B``'s per column, which
        kernels whose ``checked`` is true need)."""

    def rows_bulk_(self, W, G, M, *, F, B_cols, rho_cols, lr, rule, scratch=None) -> None:
        """The bulk update with weight decay and momentum (:func:`.fast.rows_by_rules`),
        ``W`` and ``M`` in place; ``B`` and ``rho`` given per column."""

    def rule_bulk_(self, rule, coef, W, G, M, *, F, B, rho) -> None:
        """An elementwise path rule's bulk update (:func:`.rule_step.rule_bulk_`), ``W``
        and every buffer of ``M`` in place."""


@runtime_checkable
class Kernels(LayerKernels, Protocol):  # pragma: no mutate block
    """The operations of a fast step on one library's arrays: the node-vector work and the
    special edges, and the layer passes of :class:`LayerKernels`."""

    #: array-api-compat namespace of the kernels' arrays.
    xp: Any
    #: The stages are traced by a compiler (functional, no scratch buffers, no host reads):
    #: the bulk then takes precomputed reciprocals on layers whose node vectors are tame.
    traced: bool
    #: The plain bulk runs the eager block loops (:func:`.fast.plain_rows_`, each block
    #: checked by a host read): the vector stage then forms their factors (``squares``).
    checked: bool
    #: The step is one traced function (:func:`.fast.one_graph_stage_`), not two stages.
    one_graph: bool

    def plan(self, chain, array) -> Any:
        """The :class:`~gsgd_backends.plan.StepPlan` of ``chain`` for arrays like
        ``array`` (its device and dtype)."""

    def context(self) -> ContextManager:
        """The context a step runs in (no autograd; floating-point warnings off)."""

    def compile(self, fn: Callable) -> Callable:
        """``fn`` as a stage runs it: itself, or a compiled copy."""

    def scalar(self, value: float, dtype, device) -> Any:
        """A hyperparameter as the stages take it."""

    def view3(self, w, shape, writable: bool = True) -> Any:
        """A ``(n, p, k)`` view of ``w`` sharing its memory, or ``None`` if ``w`` cannot be
        written in place (a read-only view may be a copy)."""

    def scatter_add(self, target, index, values) -> Any:
        """``target`` with ``values`` added at ``index`` (repeats accumulate); a new array."""

    def put_(self, dst, index, values) -> None:
        """``dst.flat[index] = values`` in place (all of ``dst`` if ``index`` is ``None``)."""


@runtime_checkable
class BlockKernels(Protocol):  # pragma: no mutate block
    """What the eager block loops (:func:`.fast.plain_rows_`, :func:`.fast.momentum_rows_`,
    :func:`.rule_step.rule_bulk_`) ask of a kernel set besides :class:`Kernels`: in-place
    operations on blocks of a layer's rows through one scratch buffer, each block checked by
    a host read."""

    #: array-api-compat namespace of the kernels' arrays.
    xp: Any
    #: The array module whose functions write into ``out=`` (``numpy``, ``torch``, ``cupy``).
    mod: Any

    def block_rows(self, W) -> int:
        """Rows per block of a ``(n, p*k)`` layer ``W`` (cache-sized on a CPU)."""

    def scratch(self, scratch, like, size: int) -> Any:
        """A flat buffer of at least ``size`` elements of ``like``'s dtype and device, kept
        in ``scratch`` (the plan's :class:`~gsgd_backends.plan.Scratch`)."""

    def add_product_(self, block, u, W) -> None:
        """``block <- W + block * u`` in place, ``u`` a column of row factors."""
