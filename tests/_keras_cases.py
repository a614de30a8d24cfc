"""The Keras adapter on one Keras backend: tests/test_keras.py runs this file in a process
of its own per backend (``KERAS_BACKEND`` is read once, when keras is imported)."""

import os

import numpy as np
import pytest

BACKEND = os.environ["KERAS_BACKEND"]
if BACKEND == "jax":
    import jax
    jax.config.update("jax_enable_x64", True)

import keras  # noqa: E402
from keras import layers as L  # noqa: E402

from _keras_models import CATALOGUE  # noqa: E402
from gsgd_adapters.keras import GAdam, GSGD, PSISGD, find_chains, skeleton_init  # noqa: E402
from gsgd_adapters.keras.discovery import rescaled  # noqa: E402
from gsgd_core import random_rescaling  # noqa: E402

keras.config.set_floatx("float64")
if BACKEND == "torch":
    # Keras's type promotion computes float64 in float32 on torch (as JAX does without
    # x64); the float64 checks need float64 arithmetic.
    from keras.src.backend.common import dtypes
    dtypes.BIT64_TO_BIT32_DTYPE["float64"] = "float64"
RNG = np.random.default_rng(0)
X4, Y2 = RNG.normal(size=(8, 4)), RNG.normal(size=(8, 2))


def data(model, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(8, *model.inputs[0].shape[1:]))
    return x, rng.normal(size=(8, *model.outputs[0].shape[1:]))


def fit(model, opt, x, y, steps=3, **compile_args):
    model.compile(optimizer=opt, loss="mse", **compile_args)
    model.fit(x, y, batch_size=len(x), epochs=steps, shuffle=False, verbose=0)
    return np.asarray(keras.ops.convert_to_numpy(model(x)))


def twin(model, spread=1.0, seed=3):
    """A copy of ``model`` with every chain's hidden units rescaled at random."""
    copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    for c in find_chains(copy):
        W, b = rescaled(c, random_rescaling(c.chain, np.random.default_rng(seed), spread))
        for v, value in zip([*c.kernels, *c.biases], [*W, *b]):
            if v is not None:
                v.assign(value)
    return copy


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))


@pytest.mark.parametrize("build", CATALOGUE, ids=lambda f: f.__name__)
def test_catalogue_claims(build):
    keras.utils.set_random_seed(0)
    model, expected = build()
    found = find_chains(model)
    assert [list(c.layers) for c in found] == expected, str(found)
    claimed = {n for c in found for n in c.layers} | set(found.normalised)
    with_weights = [ly.name for ly in model._flatten_layers(include_self=False)
                    if ly.trainable_weights and not isinstance(ly, keras.Model)]
    assert all(n in claimed or n in found.reasons for n in with_weights), str(found)
    assert all(change < 1e-9 for change in found.changes.values())


TWINS = [f for f in CATALOGUE if f()[1]]
# JAX compiles each model's step: its twins run on a few models, torch's on all.
if BACKEND == "jax":
    TWINS = TWINS[3:5]


@pytest.mark.parametrize("build", TWINS, ids=lambda f: f.__name__)
def test_rescaled_twins_train_identically(build):
    """Under GSGD and GAdam a model and its rescaled twin follow the same functions for
    several fit steps; under Keras's SGD they part."""
    for make, same in ((lambda m: GSGD(m, 0.05, momentum=0.9), True),
                       (lambda m: GAdam(m, 0.01), True),
                       (lambda m: keras.optimizers.SGD(0.05, momentum=0.9), False)):
        keras.utils.set_random_seed(0)
        a, _ = build()
        skeleton_init(a)
        b = twin(a)
        x, y = data(a)
        out_a, out_b = fit(a, make(a), x, y), fit(b, make(b), x, y)
        assert (rel(out_a, out_b) < 1e-9) == same, rel(out_a, out_b)


def test_a_model_with_no_chain_trains_as_keras_sgd():
    keras.utils.set_random_seed(0)
    model, _ = next(f for f in CATALOGUE if f.__name__ == "gelu")()
    x, y = data(model)
    start = model.get_weights()
    opt = GSGD(model, 0.1, momentum=0.5)
    assert "gelu" in str(opt.describe())
    ours = fit(model, opt, x, y)
    model.set_weights(start)
    theirs = fit(model, keras.optimizers.SGD(0.1, momentum=0.5), x, y)
    np.testing.assert_allclose(ours, theirs, rtol=1e-14, atol=0)


def test_bad_models_are_refused_naming_them():
    unbuilt = keras.Sequential([L.Dense(3, name="d")], name="lazy")
    with pytest.raises(ValueError, match="'lazy' is not built"):
        GSGD(unbuilt, 0.1)

    class Sub(keras.Model):
        def __init__(self):
            super().__init__(name="sub")
            self.d = L.Dense(2)

        def call(self, x):
            return self.d(x)

    sub = Sub()
    sub(np.zeros((1, 3)))
    with pytest.raises(ValueError, match="'sub': its layers were not traced"):
        GSGD(sub, 0.1)
    keras.utils.set_random_seed(0)
    one, _ = CATALOGUE[0]()
    other, _ = CATALOGUE[0]()
    opt = GSGD(one, 0.1)
    with pytest.raises(ValueError, match="layer 'a'"):
        opt.build(other.trainable_variables)
