"""gsgd_backends: the in-place layer over :mod:`gsgd_core`.

Same operations as the core with a trailing underscore, updating the caller's arrays in
place. The G-SGD step of NumPy, PyTorch and CuPy arrays (momentum and weight decay
included) has a fast path (:mod:`gsgd_backends.fast` with the library's kernels, found by
:func:`kernels_for`); every other operation and namespace takes the generic path, the
functional core plus a write-back.
JAX arrays are immutable and get a clear error pointing to the functional core.
"""

from ._dispatch import kernels_for
from .inplace import (canonicalize_, gsgd_step_, gsgd_update_, path_sgd_step_, path_update_,
                      psi_update_, rescale_, skeleton_init_, step_plan)
from .kernels import BlockKernels, Kernels, LayerKernels
from .plan import StepPlan

__all__ = ["BlockKernels", "Kernels", "LayerKernels", "StepPlan", "kernels_for", "step_plan",
           "canonicalize_", "gsgd_step_", "gsgd_update_", "path_sgd_step_", "path_update_",
           "psi_update_", "rescale_", "skeleton_init_"]
