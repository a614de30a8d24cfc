"""gsgd_adapters: framework glue over the gsgd core.

- :mod:`gsgd_adapters.torch`: ``GSGD``, ``PSISGD`` and ``PathSGD`` as ``torch.optim``
  optimizers that take a model (they call :mod:`gsgd_backends`, in place).
- :mod:`gsgd_adapters.optax`: ``gsgd``, ``psi_sgd`` and ``path_sgd`` as optax
  transformations (they call the functional :mod:`gsgd_core`, jit-compatible).
- :mod:`gsgd_adapters.jax`: ``find_chains``, the chains of a Flax, Equinox or Haiku model
  proven from its jaxpr (what the optax transformations take), and ``skeleton_init``,
  ``random_rescale``, ``check_invariance`` on params pytrees.

Each is imported on demand, so installing one framework is enough.
"""

__all__: list[str] = []
