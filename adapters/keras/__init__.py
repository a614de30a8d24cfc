"""G-SGD, G-Adam(W) and PSI-SGD(M) for Keras 3 models, on the JAX and torch backends.

::

    from gsgd_adapters.keras import GSGD, skeleton_init

    skeleton_init(model)                         # once, after the usual init
    model.compile(optimizer=GSGD(model, 0.01, momentum=0.9), loss="mse")
    model.fit(x, y)

:func:`find_chains` reads the chains from the model's layer graph and checks each by a random
rescaling; the optimizers give every other variable Keras's own rule, and
``opt.describe()`` says why.
"""

import keras as _keras

if _keras.backend.backend() not in ("jax", "torch"):
    raise ImportError(
        f"gsgd_adapters.keras supports the JAX and torch backends of Keras, not "
        f"{_keras.backend.backend()!r}: the step runs on the backend's arrays through the Array "
        "API, which TensorFlow's tensors do not implement. Set KERAS_BACKEND=jax or "
        "KERAS_BACKEND=torch before importing keras.")

from .discovery import ChainLayers, Discovery, find_chains  # noqa: E402
from .ops import skeleton_init  # noqa: E402
from .optimizers import GAdam, GAdamW, GSGD, PSISGD  # noqa: E402

__all__ = ["ChainLayers", "Discovery", "GAdam", "GAdamW", "GSGD", "PSISGD", "find_chains",
           "skeleton_init"]
