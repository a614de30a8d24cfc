"""gsgd_adapters: framework glue over :mod:`gsgd_backends` (DESIGN §7).

Planned here: ``torch.optim`` optimizers that take a model (issue 6), a CuPy training-loop
helper (issue 3) and an optax transformation (issue 7). This release ships none of them yet;
use :mod:`gsgd_core` (functional) or :mod:`gsgd_backends` (in place) directly.
"""

__all__: list[str] = []
