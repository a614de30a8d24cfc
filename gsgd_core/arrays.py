"""Namespace resolution, input validation and the 3-D layer views used by every public function.

Every public function of :mod:`gsgd_core` calls :func:`prepare` once: it validates the
structure of its arguments (layer counts, shapes, dtypes) before any arithmetic, resolves the
array namespace ``xp`` once, and returns the layers viewed as ``(n_l, n_{l-1}, k_l)``.
Results are reshaped back with :func:`restore`, so they come out in the caller's namespace,
dtype, device and shape. The fast paths of :mod:`gsgd_backends` validate through the same
:func:`prepare` and reuse the elementwise rules (:func:`safe_div`, :func:`outer3`).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Sequence

import array_api_compat
import numpy as np

from .chain import Chain


@dataclass(frozen=True)
class LayerMeta:
    """Skeleton metadata of one layer, as arrays of one namespace and device."""

    tau_idx: Any      # flat indices of the tau edges (one per node of layer l)
    tau_src: Any      # tau_l(j): source node of each tau edge
    tau_free: Any     # bool per node of layer l: its tau edge is also a free edge
    free_idx: Any     # flat indices of the free edges lying in this layer (one per node of l-1)
    sigma: Any        # sigma_{l-1}(a): target of each free edge
    free_mask: Any    # bool (n_l, n_{l-1}, k_l)
    tau_mask: Any     # bool (n_l, n_{l-1}, k_l)


@dataclass(frozen=True)
class Prepared:
    """A validated call: namespace, compute and storage dtypes, device, original shapes.

    ``dtype`` is the dtype arithmetic runs in: the inputs' own, except float16 and bfloat16,
    which are computed in float32 and written back in their own dtype (numerics guide).
    """

    xp: Any
    dtype: Any
    store: Any
    device: Any
    shapes: tuple
    meta: tuple  # LayerMeta per layer, index l-1


def _layer_meta(chain: Chain, xp, device) -> tuple[LayerMeta, ...]:
    def arr(a):
        return xp.asarray(a, device=device)

    metas = []
    for l in range(1, chain.L + 1):
        tau_idx, free_idx = chain.tau_index(l), chain.free_index(l)
        free_flat = chain.free_masks[l - 1].reshape(-1)
        tau_src = np.asarray(chain.tau[l - 1] if l < chain.L else [], dtype=np.int64)
        sigma = np.asarray(chain.sigma[l - 2] if l >= 2 else [], dtype=np.int64)
        metas.append(LayerMeta(
            tau_idx=arr(tau_idx.astype(np.int64)), tau_src=arr(tau_src),
            tau_free=arr(free_flat[tau_idx]), free_idx=arr(free_idx.astype(np.int64)),
            sigma=arr(sigma), free_mask=arr(chain.free_masks[l - 1]),
            tau_mask=arr(chain.tau_masks[l - 1])))
    return tuple(metas)


def layer_meta(chain: Chain, xp, device) -> tuple[LayerMeta, ...]:
    """Metadata of every layer in namespace ``xp`` on ``device``, cached on the chain.

    Arrays of a lazy namespace (JAX, whose arrays made under ``jit`` are tracers even where
    the weights are concrete) are never cached, so no traced value outlives its trace; nor
    are they where the device is unknown.
    """
    key = (xp.__name__, str(device))
    cached = chain._cache.get(key)
    if cached is None:
        cached = _layer_meta(chain, xp, device)
        if device is not None and not array_api_compat.is_lazy_array(cached[0].free_mask):
            chain._cache[key] = cached
    return cached


def _shape_error(chain: Chain, l: int, what: str, shape) -> ValueError:
    n, n_prev, k = chain.layer_shape(l)
    return ValueError(
        f"layer {l}: {what} has shape {tuple(shape)}, but the chain expects ({n}, {n_prev * k}), "
        f"({n}, {n_prev}) with k=1, or ({n}, {n_prev}, *kernel) with prod(kernel)={k} "
        f"(chain sizes={list(chain.sizes)}, slots={list(chain.slots)})")


def check_weight_shape(chain: Chain, l: int, shape, what: str = "weight") -> None:
    n, n_prev, k = chain.layer_shape(l)
    shape = tuple(shape)
    if len(shape) < 2 or shape[0] != n:
        raise _shape_error(chain, l, what, shape)
    if len(shape) == 2 and shape[1] == n_prev * k:
        return
    if len(shape) >= 3 and shape[1] == n_prev and math.prod(shape[2:]) == k:
        return
    raise _shape_error(chain, l, what, shape)


def check_list(chain: Chain, name: str, values) -> list:
    """``values`` as a list of one entry per layer of ``chain`` (``ValueError`` naming
    ``name`` otherwise)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ValueError(f"{name} must be a list with one entry per layer ({chain.L}), "
                         f"got {type(values).__name__}")
    if len(values) != chain.L:
        raise ValueError(f"{name} has {len(values)} entries, but the chain has {chain.L} layers")
    return list(values)


def is_array(x) -> bool:
    """``x`` is an array of a namespace that array-api-compat knows."""
    return array_api_compat.is_array_api_obj(x)


class _NoGrads:
    """The type of :data:`NO_GRADS`."""

    def __repr__(self) -> str:
        return "NO_GRADS"


#: ``grads=`` of a call that takes no gradients; a call that takes them passes the caller's
#: list, so that a missing one (``None``) is refused by name like any other wrong list.
NO_GRADS = _NoGrads()


def prepare(chain: Chain, weights, biases=None, *, grads=NO_GRADS, bias_grads=None,
            extra: Sequence[tuple[str, Any]] = (), biases_optional: bool = False) -> Prepared:
    """Validate a call's arrays against ``chain`` and resolve their namespace once.

    ``grads`` and ``bias_grads`` are a step's gradients (``bias_grads=None``: none for a
    chain without biases); ``grads`` stays :data:`NO_GRADS` in a call that takes none.
    ``extra`` holds further per-layer lists (``(name, list)``) whose entries must have the
    weights' shapes (momentum buffers, path values, ...); ``None`` entries are skipped.
    With ``biases_optional``, ``biases=None`` is accepted whatever the chain's biases.
    """
    if not isinstance(chain, Chain):
        raise ValueError(f"chain must be a gsgd_core.Chain, got {type(chain).__name__}")
    weights = check_list(chain, "weights", weights)
    biases = [None] * chain.L if biases is None else check_list(chain, "biases", biases)
    for l, (w, b) in enumerate(zip(weights, biases), start=1):
        if not is_array(w):
            raise ValueError(f"layer {l}: weight is a {type(w).__name__}, not an array")
        check_weight_shape(chain, l, w.shape)
        has_bias = chain.bias[l - 1] and not (biases_optional and b is None)
        if has_bias and b is None:
            raise ValueError(f"layer {l}: the chain has a bias here but biases[{l - 1}] is None")
        if not has_bias and b is not None:
            raise ValueError(f"layer {l}: the chain has no bias here but biases[{l - 1}] "
                             f"is an array of shape {tuple(b.shape)}")
        if b is not None and tuple(b.shape) != (chain.sizes[l],):
            raise ValueError(f"layer {l}: bias has shape {tuple(b.shape)}, "
                             f"expected ({chain.sizes[l]},)")
    arrays = [w for w in weights] + [b for b in biases if b is not None]
    lists = list(extra)
    if grads is not NO_GRADS:
        lists += [("grads", grads),
                  ("bias_grads", [None] * chain.L if bias_grads is None else bias_grads)]
    for name, values in lists:
        values = check_list(chain, name, values)
        is_bias = name.startswith("bias")
        for l, (v, w, b) in enumerate(zip(values, weights, biases), start=1):
            ref = b if is_bias else w
            if v is None:
                if is_bias and b is not None and name == "bias_grads":
                    raise ValueError(f"layer {l}: the layer has a bias but bias_grads[{l - 1}] "
                                     f"is None")
                continue
            if ref is None:
                raise ValueError(f"layer {l}: {name}[{l - 1}] given for a layer without a bias")
            if not is_array(v):
                raise ValueError(f"layer {l}: {name}[{l - 1}] is a {type(v).__name__}, "
                                 f"not an array")
            if tuple(v.shape) != tuple(ref.shape):
                raise ValueError(f"layer {l}: {name}[{l - 1}] has shape {tuple(v.shape)}, "
                                 f"but the {'bias' if is_bias else 'weight'} has shape "
                                 f"{tuple(ref.shape)}")
            arrays.append(v)
    xp, dtype, device = alike(arrays)
    compute = xp.float32 if xp.finfo(dtype).bits < 32 else dtype
    return Prepared(xp=xp, dtype=compute, store=dtype, device=device,
                    shapes=tuple(tuple(w.shape) for w in weights),
                    meta=layer_meta(chain, xp, device))


def alike(arrays: Sequence) -> tuple[Any, Any, Any]:
    """The namespace, dtype and device of ``arrays`` (the first weight first), which every
    array must share; the dtype is real floating point. ``ValueError`` names the first array
    that differs. The device is where new arrays go (:func:`creation_device`)."""
    try:
        xp = array_api_compat.array_namespace(*arrays)
    except TypeError as exc:
        raise ValueError(f"all arrays must come from one array namespace: {exc}") from None
    dtype = arrays[0].dtype
    if not xp.isdtype(dtype, "real floating"):
        raise ValueError(f"weights must be real floating point, got dtype {dtype}")
    for a in arrays:
        if a.dtype != dtype:
            raise ValueError(f"all arrays must share the weights' dtype {dtype}; "
                             f"found an array of dtype {a.dtype} and shape {tuple(a.shape)}")
    device = array_api_compat.device(arrays[0])
    where = _where(arrays[0], device)
    for a in arrays:
        if _where(a, array_api_compat.device(a)) != where:
            raise ValueError(f"all arrays must be on the weights' device {device}; found an "
                             f"array of shape {tuple(a.shape)} on {array_api_compat.device(a)}")
    return xp, dtype, creation_device(arrays[0])


def _spans(x, device) -> frozenset | None:
    """The devices ``x`` is split or copied over when they are several, else ``None``.

    An array over several devices (a sharded ``jax.Array``) has a ``devices()`` method, and
    its ``device`` is then its placement over them (a ``Sharding``), which two arrays on the
    same devices may hold differently (sharded and replicated). A traced array has no device
    (``None``) and is placed by its compiler."""
    devices = getattr(x, "devices", None)
    if device is None or not callable(devices):
        return None
    found = frozenset(devices())
    return found if len(found) > 1 else None


def _where(x, device):
    """What two arrays that can meet in one computation share: their device, or the set of
    devices they span."""
    spans = _spans(x, device)
    return device if spans is None else spans


def creation_device(x):
    """The ``device=`` for new arrays that meet ``x``: its device, or ``None`` (the
    namespace's default, which JAX moves to wherever the computation runs) where ``x``
    spans several devices, since a placement of ``x``'s rank fits no array of another rank,
    and where ``x`` is a JAX array committed to no device (made without one): an array made
    with ``device=`` is committed, and JAX compiles each eager operation anew for each mix
    of committed and uncommitted operands. New arrays shaped like ``x`` are made with
    ``zeros_like``, which keeps its placement."""
    device = array_api_compat.device(x)
    if device is None or _spans(x, device) is not None or getattr(x, "committed", True) is False:
        return None
    return device


def _cast(p: Prepared, a, dtype):
    return a if a.dtype == dtype else p.xp.astype(a, dtype)


def view3(p: Prepared, chain: Chain, arrays) -> list:
    """Layers (one array per layer, none missing) as ``(n_l, n_{l-1}, k_l)`` views in the
    compute dtype."""
    return [_cast(p, p.xp.reshape(a, chain.layer_shape(l)), p.dtype)
            for l, a in enumerate(arrays, start=1)]


def restore(p: Prepared, arrays) -> list:
    """3-D layer arrays (one per layer, none missing) back in the caller's shapes and
    dtype."""
    return [_cast(p, p.xp.reshape(a, s), p.store) for a, s in zip(arrays, p.shapes)]


def vecs(p: Prepared, arrays, L: int) -> list:
    """Per-layer vectors (biases, their gradients) in the compute dtype; ``None`` -> Nones."""
    return [None] * L if arrays is None else [None if a is None else _cast(p, a, p.dtype)
                                              for a in arrays]


def unvecs(p: Prepared, arrays) -> list:
    """Per-layer vectors back in the caller's dtype."""
    return [None if a is None else _cast(p, a, p.store) for a in arrays]


def quiet_fp() -> np.errstate:
    """A context that silences NumPy's floating-point warnings, for the body of a function
    whose overflows are guarded (:mod:`.rules`): they are handled by design, not errors.
    Other namespaces do not warn. A context inside the body rather than a decorator keeps
    each function a plain function (mutation testing mutates only those)."""
    return np.errstate(over="ignore", invalid="ignore", under="ignore", divide="ignore")


def is_real(x) -> bool:
    """``isinstance(x, numbers.Real)``, with float and int tested first: an ABC's
    ``isinstance`` runs Python code, a tuple of types does not (hyperparameters are checked
    on every step)."""
    return isinstance(x, (float, int)) or isinstance(x, numbers.Real)


def is_off(x) -> bool:
    """A hyperparameter switched off: a Python zero. An array (a schedule's value, or any
    hyperparameter ``optax.inject_hyperparams`` passes, traced under ``jit``) may hold any
    value, so it keeps its state and its arithmetic."""
    return is_real(x) and x == 0


def check_hyper(name: str, value, *, low: float = 0.0, high: float | None = None) -> None:
    """Validate a hyperparameter given as a Python number; arrays (traced schedules) pass."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if is_real(value):
        if not math.isfinite(value) or value < low or (high is not None and value > high):
            bound = f"in [{low:g}, {high:g}]" if high is not None else f">= {low:g}"
            raise ValueError(f"{name} must be finite and {bound}, got {value!r}")
        return
    if not is_array(value) or tuple(value.shape) != ():
        raise ValueError(f"{name} must be a Python number or a 0-d array, got {value!r}")


def scalar(p: Prepared, value):
    """A hyperparameter as something that combines with arrays without changing their dtype."""
    if isinstance(value, numbers.Real):
        return float(value)
    return p.xp.astype(p.xp.asarray(value, device=p.device), p.dtype)


def outer3(u, v):
    """``u[:, None, None] * v[None, :, None]``: a per-edge product of node vectors."""
    return u[:, None, None] * v[None, :, None]


def shaped(p: Prepared, arrays) -> list:
    """3-D layer arrays (one per layer, none missing) in the caller's shapes, in the
    compute dtype."""
    return [p.xp.reshape(a, s) for a, s in zip(arrays, p.shapes)]


def guard_tree(xp, ok, new, old):
    """:func:`gsgd_core.rules.guard` over a state of nested tuples, lists, NamedTuples and
    dicts: each array leaf of ``new`` where ``ok`` (and, for floating arrays, where
    finite), else ``old``'s."""
    if new is None:
        return None
    if isinstance(new, dict):
        return {k: guard_tree(xp, ok, new[k], old[k]) for k in new}
    if isinstance(new, (tuple, list)):
        items = [guard_tree(xp, ok, n, o) for n, o in zip(new, old)]
        return type(new)(*items) if hasattr(new, "_fields") else type(new)(items)
    if not is_array(new):
        return new
    keep = ok & xp.isfinite(new) if xp.isdtype(new.dtype, "real floating") else ok
    return xp.where(keep, new, old)
