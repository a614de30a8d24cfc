"""How a Keras kernel lays out its units, and the core's view of it.

Keras kernels are ``(*kernel, in, out)``: ``(in, out)`` for ``Dense``, HWIO for ``Conv2D``
(whatever the layer's ``data_format``: it moves the activations' channel axis, not the
kernel's). The core views layer ``l``'s weight as ``(n_l, n_{l-1}, k_l)`` (theory page). A
``Dense`` after a flatten of ``C`` channels times ``S`` positions reads ``C*S`` inputs
position-major (index ``s*C + c``: a ``channels_last`` tensor, or Keras's own ``Flatten``
of a ``channels_first`` one, which moves the channels last first) or channel-major
(``c*S + s``); both are a reshape and a transpose away from the core's ``(out, C, S)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import array_api_compat


@dataclass(frozen=True)
class KernelLayout:
    """``before * n * after`` inputs along the kernel's ``in`` axis, input unit ``j`` at
    ``(p * n + j) * after + q``: ``before = S`` position-major, ``after = S``
    channel-major, both ``1`` without a flatten."""

    before: int = 1
    after: int = 1

    def _split(self, shape: tuple) -> tuple[tuple, tuple]:
        """``shape`` with ``in`` split into ``(before, n, after)``, and the axis order that
        makes it ``(out, n, before, *kernel, after)``."""
        *kernel, fan_in, _ = shape
        if fan_in % (self.before * self.after):
            raise ValueError(f"{self} does not fit a kernel of shape {shape}")
        n = fan_in // (self.before * self.after)
        split = (*kernel, self.before, n, self.after, shape[-1])
        k = len(kernel)
        return split, (k + 3, k + 1, k, *range(k), k + 2)

    def core_shape(self, shape: tuple) -> tuple[int, int, int]:
        """``(n_out, n_in, slots)``: the core's view of a kernel of ``shape``."""
        split, order = self._split(tuple(shape))
        return split[order[0]], split[order[1]], math.prod(split[a] for a in order[2:])

    def view(self, x):
        """The core's ``(n_out, n_in, slots)`` view of kernel ``x`` (a backend array)."""
        xp = array_api_compat.array_namespace(x)
        split, order = self._split(tuple(x.shape))
        return xp.reshape(xp.permute_dims(xp.reshape(x, split), order),
                          self.core_shape(x.shape))

    def kernel(self, y, shape: tuple):
        """The inverse of :meth:`view`: the core's array ``y`` as a kernel of ``shape``."""
        xp = array_api_compat.array_namespace(y)
        split, order = self._split(tuple(shape))
        inverse = tuple(sorted(range(len(order)), key=order.__getitem__))
        return xp.reshape(xp.permute_dims(xp.reshape(y, [split[a] for a in order]), inverse),
                          tuple(shape))
