"""Which library an array belongs to, found without importing libraries that are not loaded.

Like einops, look only at the array's type and at ``sys.modules``: a framework that the
caller has not imported cannot own their arrays, so it is never imported here.
"""

from __future__ import annotations

import importlib
import sys

IMMUTABLE = {"jax", "jaxlib"}
#: Libraries with a fast path: ``gsgd_backends.<name>`` holds their kernels.
FAST = ("numpy", "torch", "cupy")


def library(array) -> str:
    """Top-level module of the array's type: ``numpy``, ``torch``, ``cupy``, ``jax``, ..."""
    return type(array).__module__.split(".", 1)[0]


def assign(dst, src) -> None:
    """Write ``src`` into ``dst`` in place (same shape), outside any autograd graph."""
    lib = library(dst)
    if lib in IMMUTABLE:
        raise ValueError(
            f"{lib} arrays are immutable and cannot be updated in place: use the functional "
            "gsgd_core API (gsgd_core.gsgd_update returns new arrays), or "
            "gsgd_adapters.optax in a JAX training loop")
    if lib == "torch":
        torch = sys.modules["torch"]
        with torch.no_grad():
            dst.copy_(src)
    else:
        dst[...] = src


def kernels_for(array):
    """The fast-path kernels for the array's library (imported on first use), or ``None``
    when the library has none and the generic core path applies."""
    lib = library(array)
    if lib not in FAST:
        return None
    return importlib.import_module(f".{lib}", __package__).KERNELS
