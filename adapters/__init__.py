"""gsgd_adapters: framework glue over the gsgd core.

- :mod:`gsgd_adapters.torch`: ``GSGD``, ``PSISGD`` and ``PathSGD`` as ``torch.optim``
  optimizers that take a model (they call :mod:`gsgd_backends`, in place).
- :mod:`gsgd_adapters.optax`: ``gsgd``, ``psi_sgd`` and ``path_sgd`` as optax
  transformations (they call the functional :mod:`gsgd_core`, jit-compatible).

Each is imported on demand, so installing one framework is enough.
"""

__all__: list[str] = []
