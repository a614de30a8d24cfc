"""Chains whose parameters FSDP2 (``fully_shard``) shards: DTensors split by rows.

Under FSDP2 every weight and bias is a DTensor sharded along its first dimension
(``Shard(0)``) over a 1-D device mesh, or over one dimension of a 2-D mesh and replicated
over the other (HSDP, placements ``(Replicate(), Shard(0))``): each process holds the rows
of some output units, and after the backward pass every replica holds the same gradient
rows (FSDP reduces them over both dimensions). A chain step then runs
:mod:`gsgd_backends.sharded` on the local rows, with one all-reduce of ``O(sum of widths)``
numbers over the process group of the sharding dimension (each replica group computes the
same step); a step that the backends hand back (a non-finite value, half precision) and the
algorithms without a sharded step (Path-SGD) run on the full arrays gathered from every
process, and each process writes its rows back (``O(m)`` communication, the same result
everywhere).

Tensor parallelism (``parallelize_module``) splits a layer over its input units
(``RowwiseParallel``: ``Shard(1)``) or replicates it (a bias): refused, naming the layout.
"""

from __future__ import annotations

from typing import Callable

import torch

from gsgd_backends.sharded import RowShard

try:  # a torch built without distributed support has no DTensor: nothing is sharded
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover - CPU wheels ship torch.distributed
    DTensor = None

__all__ = ["is_sharded", "all_finite", "check_chain", "local", "row_range", "row_ranges",
           "row_shard", "sharded_step"]


def is_sharded(t) -> bool:
    """Whether ``t`` is a DTensor (FSDP2 parameter, gradient or state)."""
    return DTensor is not None and isinstance(t, DTensor)


def local(t):
    """The local rows of a DTensor (a view: writes reach the parameter); others as they
    are."""
    return t.to_local() if is_sharded(t) else t


def all_finite(t) -> bool:
    """Whether every entry of ``t`` is finite; for a DTensor, on every process (a
    collective over each dimension of its mesh: every process gets the same answer, so all
    raise or step together, replicas included)."""
    if not is_sharded(t):
        return bool(torch.isfinite(t).all())
    flag = torch.isfinite(t.to_local()).all().to(torch.int32).reshape(1)
    for dim in range(t.device_mesh.ndim):
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=t.device_mesh.get_group(dim))
    return bool(flag)


def every_finite(tensors) -> bool:
    """:func:`all_finite` of every tensor, with one host synchronisation where none is
    sharded (a part's step reads it once, not once per parameter)."""
    if any(is_sharded(t) for t in tensors):
        return all(all_finite(t) for t in tensors)
    # max |entry| per tensor (one multi-tensor kernel): NaN or Inf exactly where the tensor
    # holds one, and no overflow from finite entries
    return bool(torch.stack(torch._foreach_norm(tensors, float("inf"))).isfinite().all())


def shard_dim(p) -> int | None:
    """The mesh dimension over which the DTensor ``p`` is split by rows, if it is split by
    rows over one dimension and replicated over the others (FSDP2, HSDP); else ``None``."""
    placements = tuple(p.placements)
    rows = [d for d, pl in enumerate(placements) if pl == Shard(0)]
    if len(rows) != 1 or any(pl != Replicate() for d, pl in enumerate(placements)
                             if d != rows[0]):
        return None
    return rows[0]


def _layout(placements) -> str:
    """What a layout G-SGD cannot step is: tensor parallelism's split over input units
    (``RowwiseParallel``), a replicated parameter (a ``RowwiseParallel`` bias, DDP-style
    replication as a DTensor), or another split."""
    if any(pl == Shard(1) for pl in placements):
        return ("split over its input units (tensor parallelism: RowwiseParallel, or "
                "Shard(1))")
    if all(pl == Replicate() for pl in placements):
        return "replicated on every process (a DTensor not split by rows)"
    return "split otherwise than by rows over one mesh dimension"


def check_chain(params, names) -> None:
    """``ValueError`` naming the parameter if a chain's parameters are sharded in a layout
    G-SGD cannot step: a mix of sharded and plain parameters, a placement other than
    ``Shard(0)`` over one mesh dimension and ``Replicate()`` over the others (FSDP2's and
    HSDP's layouts: tensor parallelism is refused), or parameters on different meshes."""
    sharded = [is_sharded(p) for p in params]
    if not any(sharded):
        return
    mesh = None
    for p, name, s in zip(params, names, sharded):
        if not s:
            raise ValueError(f"{name} is a plain tensor in a chain whose other parameters "
                             "FSDP2 shards: shard every layer of the chain (fully_shard on "
                             "each layer or on a module holding them)")
        if shard_dim(p) is None:  # one placement per mesh dimension
            raise ValueError(
                f"{name} is a DTensor placed {tuple(p.placements)} on a {p.device_mesh.ndim}-D "
                f"mesh, {_layout(p.placements)}: G-SGD steps chains split by rows (Shard(0), "
                "the output units) over one mesh dimension and replicated over any other "
                "(FSDP2's fully_shard, HSDP); tensor parallelism is not supported")
        if mesh is None:
            mesh = p.device_mesh
        elif p.device_mesh != mesh or shard_dim(p) != shard_dim(params[0]):
            raise ValueError(f"{name} lies on a different device mesh, or is split over "
                             "another dimension of it, from the chain's other parameters")


def row_range(p, name: str) -> tuple[int, int]:
    """The global rows of ``p`` held by this process: FSDP2 splits dimension 0 over the
    mesh dimension :func:`shard_dim` as ``torch.chunk`` does (chunks of ``ceil(n / world)``,
    the last ones short or empty)."""
    mesh, dim = p.device_mesh, shard_dim(p)
    n, world, rank = p.shape[0], mesh.size(dim), mesh.get_local_rank(dim)
    step = -(-n // world)
    r0, r1 = min(n, rank * step), min(n, (rank + 1) * step)
    if p.to_local().shape[0] != r1 - r0:
        raise ValueError(f"{name}: this process holds {p.to_local().shape[0]} of its {n} rows, "
                         f"not the {r1 - r0} of an even split over {world} processes")
    return r0, r1


def row_shard(chain, rows, weight) -> RowShard:
    """The :class:`RowShard` of a chain holding ``rows`` (:func:`row_ranges`), whose sums
    over processes are all-reduces over the process group of the mesh dimension that splits
    ``weight`` (a DTensor) by rows: its replicas, which hold the same rows, each reduce
    their own."""
    group = weight.device_mesh.get_group(shard_dim(weight))

    def reduce(v):  # a tensor, or a NumPy view the CPU plan computes on (shared)
        dist.all_reduce(torch.as_tensor(v), group=group)
        return v

    return RowShard(chain, rows, reduce)


def row_ranges(weights, names) -> tuple:
    """:func:`row_range` of each weight: the rows a :class:`RowShard` of them holds."""
    return tuple(row_range(w, n) for w, n in zip(weights, names))


def sharded_step(arrays, fast: Callable | None, full: Callable) -> bool:
    """Step the nested lists ``arrays`` (parameters, gradients, state; DTensors or plain
    tensors): ``fast(local arrays)`` on the local rows if given, and when it hands the step
    back (``False``) or is ``None``, ``full(full arrays)`` on arrays gathered from every
    process, whose rows are then written back into each DTensor. Returns ``full``'s result
    in that case, else ``True``."""
    if fast is not None and fast(_map(local, arrays)):
        return True
    gathered = _map(lambda t: t.full_tensor() if is_sharded(t) else t, arrays)
    result = full(gathered)
    _write_rows(arrays, gathered)
    return result


def _write_rows(dst, src) -> None:
    if isinstance(dst, (list, tuple)):
        for d, s in zip(dst, src):
            _write_rows(d, s)
    elif is_sharded(dst):
        loc = dst.to_local()
        r0 = row_range(dst, "state")[0]
        with torch.no_grad():
            loc.copy_(src[r0:r0 + loc.shape[0]])


def _map(f, x):
    if isinstance(x, (list, tuple)):
        return type(x)(*(_map(f, y) for y in x)) if hasattr(x, "_fields") \
            else type(x)(_map(f, y) for y in x)
    return f(x)
