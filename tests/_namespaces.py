"""The array namespaces the suite runs on, each with conversions to and from host NumPy."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Callable

import array_api_compat
import numpy as np
import pytest


@dataclass
class Namespace:
    name: str
    dtype_name: str
    xp: Any = None
    dtype: Any = None
    device: Any = None
    skip_reason: str | None = None
    _from_np: Callable | None = None
    #: Where the arrays live when it is not the library's default place ("cuda").
    place: str = ""

    @property
    def id(self) -> str:
        return "-".join(filter(None, (self.name, self.place, self.dtype_name)))

    @property
    def is_f64(self) -> bool:
        return self.dtype_name == "float64"

    @property
    def rtol(self) -> float:
        return 1e-9 if self.is_f64 else 2e-3

    def asarray(self, a):
        """Host data to this namespace's dtype (``None`` stays ``None``)."""
        if a is None:
            return None
        return self._from_np(np.asarray(a, dtype=np.float64).astype(self.dtype_name))

    def aslist(self, arrays):
        return [self.asarray(a) for a in arrays]

    @staticmethod
    def to_numpy(a):
        if a is None:
            return None
        if hasattr(a, "detach"):
            return a.detach().cpu().numpy()
        if hasattr(a, "get") and type(a).__module__.startswith("cupy"):
            return a.get()
        try:
            return np.from_dlpack(a)
        except (TypeError, AttributeError, BufferError, RuntimeError):
            return np.asarray(a)

    def tolist(self, arrays):
        return [self.to_numpy(a) for a in arrays]


def _numpy(dt):
    xp = array_api_compat.array_namespace(np.zeros(1))
    return Namespace("numpy", dt, xp, getattr(np, dt), "cpu", _from_np=lambda a: a)


def _strict(dt):
    import array_api_strict as xs
    return Namespace("array_api_strict", dt, xs, getattr(xs, dt), xs.Device("CPU_DEVICE"),
                     _from_np=lambda a: xs.asarray(a))


def _torch(dt):
    import torch
    return Namespace("torch", dt, array_api_compat.array_namespace(torch.zeros(1)),
                     getattr(torch, dt), torch.device("cpu"),
                     _from_np=lambda a: torch.as_tensor(a))


def _torch_cuda(dt):
    import torch
    if not torch.cuda.is_available():
        return Namespace("torch", dt, skip_reason="no CUDA device", place="cuda")
    cuda = torch.device("cuda", torch.cuda.current_device())   # as tensors report it
    return Namespace("torch", dt, array_api_compat.array_namespace(torch.zeros(1)),
                     getattr(torch, dt), cuda, place="cuda",
                     _from_np=lambda a: torch.as_tensor(a, device=cuda))


def _jax(dt):
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    return Namespace("jax", dt, jnp, getattr(jnp, dt), None, _from_np=lambda a: jnp.asarray(a))


def _cupy(dt):
    import cupy
    try:
        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver or no device: CuPy imports but cannot run
        return Namespace("cupy", dt, skip_reason=f"CuPy installed but no GPU usable: {exc}")
    return Namespace("cupy", dt, array_api_compat.array_namespace(cupy.zeros(1)),
                     getattr(cupy, dt), None, _from_np=cupy.asarray)


def available_namespaces() -> list[Namespace]:
    out = []
    for module, make in (("numpy", _numpy), ("array_api_strict", _strict), ("torch", _torch),
                         ("torch", _torch_cuda), ("jax", _jax), ("cupy", _cupy)):
        for dt in ("float64", "float32"):
            if importlib.util.find_spec(module) is None:
                out.append(Namespace(module, dt, skip_reason=f"{module} is not installed"))
            else:
                out.append(make(dt))
    return out


def float32_cpu_namespaces() -> list[Namespace]:
    """float32 on the CPU in each installed namespace whose arithmetic is its own (strict
    wraps NumPy's): elementwise float32 operations round alike in each, so results that
    need no reordered sums are the same bits in every one."""
    return [ns for ns in available_namespaces() if ns.dtype_name == "float32" and not ns.place
            and ns.name in ("numpy", "array_api_strict", "torch") and not ns.skip_reason]


def assert_same_bits_in_float32_namespaces(compute: Callable) -> None:
    """``compute(ns)`` -> ``{name: [host array or None, ...]}`` on every namespace of
    :func:`float32_cpu_namespaces`: float32 results with the same bits as the first's."""
    namespaces = float32_cpu_namespaces()
    if len(namespaces) < 2:
        pytest.skip("one float32 namespace installed")
    expected = compute(namespaces[0])
    for ns in namespaces[1:]:
        for name, arrays in compute(ns).items():
            for i, (a, e) in enumerate(zip(arrays, expected[name], strict=True)):
                assert (a is None and e is None) or (
                    a.dtype == np.float32 and np.array_equal(a, e)), (ns.id, name, i)
