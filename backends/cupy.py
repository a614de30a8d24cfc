"""CuPy kernels of the fast step: the NumPy kernels over ``cupy``, one block per layer.

A GPU gains nothing from cache-sized blocks, so each layer is one block: the column sum is
``cupy.einsum`` and the bulk update four elementwise kernels plus one reduction that checks
the result (:func:`.fast.plain_rows_`); one fused ``ElementwiseKernel`` would read the
arrays fewer times.
"""

from __future__ import annotations

import cupy

from .numpy import ArrayKernels

#: CuPy's ufuncs have ``at`` (CuPy 13 and later), so the NumPy kernels serve unchanged.
KERNELS = ArrayKernels(cupy, None)
