"""CuPy kernels of the fast step: the NumPy kernels over ``cupy``, one block per layer.

A GPU gains nothing from cache-sized blocks, so each layer is one block: the column sum is
``cupy.einsum`` and the bulk update four elementwise kernels plus one reduction that checks
the result (:func:`.fast.plain_rows_`); one fused ``ElementwiseKernel`` would read the
arrays fewer times.
"""

from __future__ import annotations

import cupy
import cupyx

from .numpy import ArrayKernels


class CupyKernels(ArrayKernels):
    def scatter_add(self, target, index, values):
        out = target.copy()
        cupyx.scatter_add(out, index, values)
        return out


KERNELS = CupyKernels(cupy, None)
