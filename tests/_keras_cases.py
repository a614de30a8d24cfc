"""The Keras adapter on one Keras backend: tests/test_keras.py runs this file in a process
of its own per backend (``KERAS_BACKEND`` is read once, when keras is imported)."""

import os
import warnings

import numpy as np
import pytest

BACKEND = os.environ["KERAS_BACKEND"]
if BACKEND == "jax":
    import jax
    jax.config.update("jax_enable_x64", True)

import keras  # noqa: E402
from keras import layers as L  # noqa: E402

from _keras_models import CATALOGUE  # noqa: E402
from gsgd_adapters.keras import (  # noqa: E402
    GAdam, GAdamW, GSGD, PSISGD, find_chains, skeleton_init)
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
    for v in model.trainable_variables:  # biases of their own (not zeros) for it to rescale
        if v.path.endswith("bias"):
            v.assign(np.random.default_rng(0).normal(size=v.shape))
    start = model.get_weights()
    found = find_chains(model)
    assert [list(c.layers) for c in found] == expected, str(found)
    # the self-check's rescaling is undone: every weight as it was, bit for bit
    for a, b in zip(model.get_weights(), start, strict=True):
        np.testing.assert_array_equal(a, b)
    claimed = {n for c in found for n in c.layers} | set(found.normalised)
    with_weights = [ly.name for ly in model._flatten_layers(include_self=False)
                    if ly.trainable_weights and not isinstance(ly, keras.Model)]
    assert all(n in claimed or n in found.reasons for n in with_weights), str(found)


def test_the_self_check_drops_a_claim_that_rescaling_breaks(monkeypatch):
    from gsgd_adapters.keras import units
    monkeypatch.setattr(units, "_HOMOGENEOUS", units._HOMOGENEOUS + (keras.activations.gelu,))
    keras.utils.set_random_seed(0)
    model, _ = next(f for f in CATALOGUE if f.__name__ == "gelu")()
    found = find_chains(model)
    assert len(found) == 0 and "the self-check found" in found.reasons["a"]
    assert len(find_chains(model, check=False)) == 1
    # the change is relative: outputs 2**-40 times as large (exactly) move by as much
    for v in (model.get_layer("b").kernel, model.get_layer("b").bias):
        v.assign(numpy(v.value) * 2.0 ** -40)
    small = find_chains(model)
    assert len(small) == 0 and small.changes == found.changes


TWINS = [f for f in CATALOGUE if f()[1]]
# JAX compiles each model's step: its twins run on one small model, torch's on all.
if BACKEND == "jax":
    TWINS = TWINS[:1]
# Code that runs alike on both backends is checked on torch, which compiles nothing.
torch_only = pytest.mark.skipif(BACKEND != "torch", reason="checked on the torch backend")


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


@torch_only
@pytest.mark.parametrize("build, ours, theirs", [
    ("gelu", lambda m: GSGD(m, 0.1, momentum=0.5),
     lambda: keras.optimizers.SGD(0.1, momentum=0.5)),
    ("gelu", lambda m: GSGD(m, 0.1), lambda: keras.optimizers.SGD(0.1)),
    ("gelu", lambda m: GAdam(m, 0.01, amsgrad=True),
     lambda: keras.optimizers.Adam(0.01, amsgrad=True)),
    ("gelu", lambda m: GAdam(m, 0.01), lambda: keras.optimizers.Adam(0.01)),
    ("gelu", lambda m: GSGD(m, 0.1, weight_decay=0.01),
     lambda: keras.optimizers.SGD(0.1, weight_decay=0.01)),
    ("mlp_relu", lambda m: PSISGD(m, 0.1, momentum=0.5),
     lambda: keras.optimizers.SGD(0.1, momentum=0.5))],
    ids=["sgd_momentum", "sgd", "adam_amsgrad", "adam", "sgd_decay", "psisgd_chains"])
def test_a_model_with_no_chain_trains_as_keras_sgd_or_adam(build, ours, theirs):
    """Without chains (or with PSISGD, which leaves them to SGD), each optimizer is Keras's
    own rule, with the same state."""
    keras.utils.set_random_seed(0)
    model, _ = next(f for f in CATALOGUE if f.__name__ == build)()
    x, y = data(model)
    start = model.get_weights()
    opt = ours(model)
    out = fit(model, opt, x, y)
    model.set_weights(start)
    keras_opt = theirs()
    np.testing.assert_allclose(out, fit(model, keras_opt, x, y), rtol=1e-14, atol=0)
    assert len(opt.variables) == len(keras_opt.variables)


@torch_only
@pytest.mark.parametrize("build", ["mlp_relu", "batch_norm"])
def test_without_momentum_no_state_is_kept(build):
    """G-SGD and PSI-SGD without momentum keep no buffer, as Keras's SGD."""
    keras.utils.set_random_seed(0)
    model, _ = next(f for f in CATALOGUE if f.__name__ == build)()
    x, y = data(model)
    opt = GSGD(model, 0.05)
    fit(model, opt, x, y, steps=2)
    assert len(opt.variables) == 2  # the step count and the learning rate


@torch_only
@pytest.mark.parametrize("make", [lambda m: GSGD(m, 0.05, momentum=0.9), GAdam],
                         ids=["gsgd", "gadam"])
def test_chain_weights_take_no_slots_of_keras_rule(make):
    """Chains keep their state in path space, in variables named after the chain: Keras's
    momentum or moments are made for no weight of a chain (all of them here), and building
    again adds nothing."""
    model = mlp()
    opt = make(model)
    opt.build(model.trainable_variables)
    made = [v.path for v in opt.variables]
    opt.build(model.trainable_variables)
    assert [v.path for v in opt.variables] == made
    assert not [p for p in made if p.endswith(("_momentum", "_velocity"))], made
    assert made[2:] and all(p.split("/")[-1].startswith("a_") for p in made[2:]), made


@torch_only
@pytest.mark.parametrize("kwargs, match", [
    (dict(momentum=1.5), r"momentum must be a number in \[0, 1\], got 1.5"),
    (dict(momentum="0.9"), r"momentum must be a number in \[0, 1\], got '0.9'"),
    (dict(bn="adam"), "bn must be 'psi' or 'sgd', got 'adam'"),
    (dict(nesterov=True), "nesterov needs momentum > 0"),
    (dict(skeleton="unit"), r"skeleton must be one of \('he', 'paper'\), got 'unit'")])
def test_bad_hyperparameters_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GSGD(mlp(), 0.1, **kwargs)


def test_an_optimizer_without_its_model_is_refused():
    with pytest.raises(ValueError, match=r"GAdam needs the model it trains: GAdam\(model, "):
        GAdam()


@torch_only
def test_a_float32_model_keeps_its_state_in_float32():
    """The chains' state takes the weights' dtype, not Keras's float64 default here."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), L.Dense(5, activation="relu", dtype="float32"),
                              L.Dense(2, dtype="float32")])
    x, y = data(model)
    opt = GSGD(model, 0.05, momentum=0.9)
    fit(model, opt, x.astype("float32"), y.astype("float32"), steps=2)
    assert {v.dtype for v in model.weights} == {"float32"}
    assert "float64" not in {v.dtype for v in opt.variables[2:]}  # past the count and rate


def test_bad_models_are_refused_naming_them():
    unbuilt = keras.Sequential([L.Dense(3, name="d")], name="lazy")
    with pytest.raises(ValueError, match="'lazy' is not built"):
        GSGD(unbuilt, 0.1)
    built_alone = L.Dense(3)
    built_alone.build((None, 4))  # its weights exist, the model around it was never built
    with pytest.raises(ValueError, match="'around' is not built"):
        GSGD(keras.Sequential([built_alone], name="around"), 0.1)
    with pytest.raises(ValueError, match=r"'bare' is not built \(it has no weights yet\)"):
        GSGD(keras.Sequential([keras.Input((3,)), L.ReLU()], name="bare"), 0.1)
    with pytest.raises(ValueError, match="expected a keras.Model, got Dense"):
        GSGD(built_alone, 0.1)

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

    class Doubled(keras.Sequential):  # its call is not the layer graph Keras traced
        def call(self, x, training=None, mask=None):
            return 2 * super().call(x, training=training, mask=mask)

    doubled = Doubled([keras.Input((3,)), L.Dense(2)], name="doubled")
    with pytest.raises(ValueError, match="'doubled': its layers were not traced"):
        GSGD(doubled, 0.1)
    keras.utils.set_random_seed(0)
    one, _ = CATALOGUE[0]()
    other, _ = CATALOGUE[0]()
    opt = GSGD(one, 0.1)
    with pytest.raises(ValueError, match="layer 'a'"):
        opt.build(other.trainable_variables)


def two_inputs():
    x1, x2 = keras.Input((3,)), keras.Input((4,))
    a = L.Dense(5, activation="relu", name="a")(x1)
    c = L.Dense(5, activation="relu", name="c")(x2)
    return keras.Model([x1, x2], [L.Dense(2, name="b")(a), L.Dense(2, name="d")(c)]), \
        [["a", "b"], ["c", "d"]]


def nested_functional_model():
    x, h = keras.Input((3,)), keras.Input((4,))
    inner = keras.Model(h, L.Dense(2, name="c")(L.Dense(5, activation="relu", name="b")(h)))
    return keras.Model(x, inner(L.Dense(4, activation="relu", name="a")(x))), \
        [["a", "b", "c"]]


def recurrent_states():
    x = keras.Input((3, 2))
    out, h, c = L.LSTM(4, return_state=True, name="lstm")(x)
    d = L.Dense(3, activation="relu", name="d")(c)
    return keras.Model(x, [L.Dense(2, name="e")(d), out]), [["d", "e"]]


class Sequential(keras.layers.Layer):
    """A custom layer of the user's that happens to share the name of Keras's model."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = L.Dense(4)

    def call(self, x):
        return self.inner(x)


def custom_named_sequential():
    x = keras.Input((3,))
    h = Sequential(name="seq")(L.Dense(5, activation="relu", name="a")(x))
    return keras.Model(x, L.Dense(2, name="c")(L.Dense(4, activation="relu", name="b")(h))), \
        [["b", "c"]]


#: the layer each model must leave out, with its reason (the others leave none out)
LEFT_OUT = {"recurrent_states": "lstm", "custom_named_sequential": "seq"}


@torch_only
@pytest.mark.parametrize("build", [two_inputs, nested_functional_model, recurrent_states,
                                   custom_named_sequential], ids=lambda f: f.__name__)
def test_discovery_reads_every_input_nested_model_and_output(build):
    """Chains on each of two inputs, through a functional model called inside another,
    after a layer of several outputs (an LSTM's states) and after a custom layer are
    claimed; the rest is left out, each with its reason."""
    keras.utils.set_random_seed(0)
    model, expected = build()
    found = find_chains(model)
    assert sorted(list(c.layers) for c in found) == expected, str(found)
    left_out = LEFT_OUT.get(build.__name__)
    assert (left_out in found.reasons) if left_out else not found.reasons, str(found)


@torch_only
def test_discovery_says_why_a_last_layer_is_in_no_chain():
    """A weight layer after a GELU reaches the output directly, also in a model that
    returns its input beside it: no chain, and the reason says where its units go."""
    x = keras.Input((3,))
    y = L.Dense(2, name="b")(L.Dense(4, activation="gelu", name="a")(x))
    for model in (keras.Model(x, y), keras.Model(x, [x, y])):
        reasons = find_chains(model).reasons
        assert reasons["b"] == "in no chain of two or more layers: its units reach the " \
            "model's output", reasons


def _cnn(*layers, shape=(6, 6, 2), fmt="channels_last"):
    """A convolution ``a`` (ReLU), then ``layers``."""
    return keras.Sequential([keras.Input(shape), L.Conv2D(3, 3, activation="relu", name="a",
                                                          data_format=fmt), *layers])


def _mlp_through(layer):
    return keras.Sequential([keras.Input((3,)), L.Dense(5, name="a"), layer,
                             L.Dense(2, name="b")])


def _named_like_keras(name):
    """A custom layer of the user's whose class shares the name of a Keras layer."""
    return type(name, (keras.layers.Layer,), {"call": lambda self, x: 2 * x})


class ShiftedDense(L.Dense):
    """Subclasses of Keras's layers whose call is not theirs."""

    def call(self, x):
        return super().call(x) + 1.0


class ShiftedConv2D(L.Conv2D):
    def call(self, x):
        return super().call(x) + 1.0


def _branch_and_merge():
    x = keras.Input((4,))
    h = L.Dense(4, activation="relu", name="a")(x)
    h = L.Add(name="add")([h, L.Dense(4, name="b")(h)])
    return keras.Model(x, L.Dense(2, name="c")(h))


def _ends(why: str, last: str = "b", **more) -> dict:
    """The reasons of a model whose ``a`` ends at ``why`` and whose ``last`` layer reaches
    the output."""
    return {"a": f"in no chain of two or more layers: {why}",
            last: "in no chain of two or more layers: its units reach the model's output",
            **more}


def _not_commuting(cls: str) -> dict:
    return _ends(f"x: {cls} is not known to commute with a positive rescaling of each unit")




def _bn_after(layer, axis: int, shape: tuple):
    """``layer``, then a batch normalisation ``n`` over ``axis``, ReLU, flatten, ``b``."""
    return keras.Sequential([keras.Input(shape), layer, L.BatchNormalization(axis=axis, name="n"),
                             L.ReLU(), L.Flatten(), L.Dense(2, name="b")])


def _normalised_ends() -> dict:
    """The reasons of a model of ``_bn_after`` whose ``a`` is normalised (it has none)."""
    return {"b": "in no chain of two or more layers: its units reach the model's output",
            "n": "BatchNormalization is not a Dense or Conv layer"}


def _flat():
    return L.Flatten(name="f"), L.Dense(2, name="b")

#: name -> (model, its chains, why it leaves each layer out)
UNITS_ZOO = {
    "relu_threshold": lambda: (_mlp_through(L.ReLU(threshold=0.5, name="r")), [], _ends(
        "r: a ReLU with a max_value or threshold is not positively homogeneous")),
    "tanh_layer": lambda: (_mlp_through(L.Activation("tanh", name="t")), [], _ends(
        "t: activation 'tanh' is not positively homogeneous")),
    "custom_named_dense": lambda: (_mlp_through(_named_like_keras("Dense")(name="x")), [],
                                   _not_commuting("Dense")),
    "custom_named_conv": lambda: (_cnn(_named_like_keras("Conv2D")(name="x"), *_flat()), [],
                                  _not_commuting("Conv2D")),
    "dense_subclass": lambda: (_mlp_through(ShiftedDense(4, name="x")), [], _not_commuting(
        "ShiftedDense") | {"x": "ShiftedDense is not a Dense or Conv layer"}),
    "conv_subclass": lambda: (_cnn(ShiftedConv2D(3, 1, name="x"), *_flat()), [], _not_commuting(
        "ShiftedConv2D") | {"x": "ShiftedConv2D is not a Dense or Conv layer"}),
    "grouped_conv": lambda: (_cnn(L.Conv2D(3, 1, groups=3, name="x"), *_flat()), [],
                             _not_commuting("Conv2D") | {
                                 "x": "Conv2D is not a Dense or Conv layer"}),
    "pool_across_units": lambda: (
        _cnn(L.MaxPooling2D(2, data_format="channels_first", name="p"), *_flat()), [], _ends(
            "p: MaxPooling2D does not pool over the units' positions (units on the last "
            "axis of 16 positions)")),
    "global_pool_channels_first": lambda: (
        _cnn(L.GlobalAveragePooling2D(data_format="channels_first", name="g"),
             L.Dense(2, name="b"), shape=(2, 6, 6), fmt="channels_first"), [["a", "b"]], {}),
    "global_pool_keepdims": lambda: (
        _cnn(L.GlobalAveragePooling2D(keepdims=True, name="g"),
             L.Conv2D(4, 1, activation="relu", name="b"), L.Flatten(name="f"),
             L.Dense(2, name="c")), [["a", "b", "c"]], {}),
    "gelu_dense": lambda: (
        keras.Sequential([keras.Input((3,)), L.Dense(5, activation="gelu", name="a"),
                          L.Dense(2, name="b")]), [],
        _ends("its activation 'gelu' is not positively homogeneous")),
    "branch_and_merge": lambda: (_branch_and_merge(), [], _ends(
        "a's output is read by 2 layers (a branch)", last="c",
        b="in no chain of two or more layers: add (Add) merges 2 tensors")),
    "pool_across_channels_first_units": lambda: (
        _cnn(L.MaxPooling2D(2, name="p"), *_flat(), shape=(2, 6, 6), fmt="channels_first"),
        [], _ends("p: MaxPooling2D does not pool over the units' positions (units on the "
                  "first axis of 16 positions)")),
    "flatten_mixing_axes": lambda: (
        _cnn(L.Flatten(data_format="channels_first", name="f"), L.Dense(2, name="b")), [],
        _ends("f: Flatten(data_format='channels_first') of channels-last units mixes their "
              "axes")),
    "flatten_channels_first_of_vectors": lambda: (
        _mlp_through(L.Flatten(data_format="channels_first", name="f")), [["a", "b"]], {}),
    "reshape_to_2d": lambda: (_cnn(L.Reshape((16, 3), name="r"), *_flat()), [], _ends(
        "r: Reshape to shape (16, 3) does not keep units together")),
    "flatten_twice": lambda: (_cnn(L.Flatten(name="f0"), *_flat()), [["a", "b"]], {}),
    "flatten_channels_first_of_channels_first": lambda: (
        _cnn(L.Flatten(data_format="channels_first", name="f"), L.Dense(2, name="b"),
             shape=(2, 6, 6), fmt="channels_first"), [["a", "b"]], {}),
    "two_convs_channels_first": lambda: (
        _cnn(L.Conv2D(4, 1, activation="relu", data_format="channels_first", name="b"),
             L.Flatten(name="f"), L.Dense(2, name="c"), shape=(2, 6, 6),
             fmt="channels_first"), [["a", "b", "c"]], {}),
    "convs_of_two_formats": lambda: (
        _cnn(L.Conv2D(4, 1, data_format="channels_first", name="b"), L.Flatten(name="f"),
             L.Dense(2, name="c")), [["b", "c"]], {
            "a": "in no chain of two or more layers: b convolves over another axis than the "
                 "units' (units on the last axis of 16 positions)"}),
    "dense_on_channels_first_maps": lambda: (
        _cnn(L.Dense(4, name="b"), L.Flatten(name="f"), L.Dense(2, name="c"),
             shape=(2, 6, 6), fmt="channels_first"), [["b", "c"]], {
            "a": "in no chain of two or more layers: b reads the last axis, the units are "
                 "on the first"}),
    "dense_with_bias_into_batch_norm": lambda: (
        _mlp_through(L.BatchNormalization(name="n")), [],
        _ends("n: BatchNormalization is not known to commute with a positive rescaling of each "
              "unit", n="BatchNormalization is not a Dense or Conv layer")),
    "bias_free_dense_into_layer_norm": lambda: (
        keras.Sequential([keras.Input((3,)), L.Dense(5, use_bias=False, name="a"),
                          L.LayerNormalization(name="n"), L.Dense(2, name="b")]), [],
        _ends("n: LayerNormalization is not known to commute with a positive rescaling of each "
              "unit", n="LayerNormalization is not a Dense or Conv layer")),
    # a kernel without bias, then batch normalisation over its units (PSI-SGD's) or not
    "conv_into_batch_norm_by_its_positive_axis": lambda: (
        _bn_after(L.Conv2D(3, 3, use_bias=False, name="a"), axis=3, shape=(6, 6, 2)), [],
        _normalised_ends()),
    "channels_first_conv_into_batch_norm": lambda: (
        _bn_after(L.Conv2D(3, 3, use_bias=False, data_format="channels_first", name="a"),
                  axis=1, shape=(2, 6, 6)), [], _normalised_ends()),
    "conv_into_batch_norm_over_rows": lambda: (
        _bn_after(L.Conv2D(3, 3, use_bias=False, name="a"), axis=1, shape=(6, 6, 2)), [],
        {"a": "in no chain of two or more layers: n: BatchNormalization is not known to "
              "commute with a positive rescaling of each unit"} | _normalised_ends()),
    "frozen_layer": lambda: (
        keras.Sequential([keras.Input((3,)), L.Dense(5, activation="relu", name="a"),
                          L.Dense(4, activation="relu", name="b", trainable=False),
                          L.Dense(4, activation="relu", name="c"), L.Dense(2, name="d")]),
        [["c", "d"]], {"a": "in no chain of two or more layers: b is frozen (trainable=False)",
                       "b": "frozen (trainable=False)"}),
    "shared_layer": lambda: (
        next(f for f in CATALOGUE if f.__name__ == "shared")()[0], [],
        {"a": "a shared layer (called 2 times)",
         "b": "in no chain of two or more layers: its units reach the model's output"}),
    # each position of a unit normalised apart, not the unit: no PSI (nor in the torch adapter)
    "bias_free_conv_into_batch_norm_of_its_flatten": lambda: (
        keras.Sequential([keras.Input((6, 6, 2)), L.Conv2D(3, 3, use_bias=False, name="a"),
                          L.Flatten(), L.BatchNormalization(name="n"), L.ReLU(),
                          L.Dense(2, name="b")]), [],
        _ends("n: BatchNormalization is not known to commute with a positive rescaling of each "
              "unit", n="BatchNormalization is not a Dense or Conv layer")),
    "dense_on_sequences_of_any_length": lambda: (
        keras.Sequential([keras.Input((None, 3)), L.Dense(5, activation="relu", name="a"),
                          L.Dense(2, name="b")]), [["a", "b"]], {}),
    "conv_on_sequences_of_any_length": lambda: (
        keras.Sequential([keras.Input((None, 2)), L.Conv1D(4, 3, activation="relu", name="a"),
                          L.MaxPooling1D(2), L.GlobalMaxPooling1D(), L.Dense(2, name="b")]),
        [["a", "b"]], {}),
    "dense_on_channels_last_maps": lambda: (
        _cnn(L.Dense(4, activation="relu", name="b"), L.Flatten(name="f"),
             L.Dense(2, name="c")), [["a", "b", "c"]], {}),
}


@torch_only
@pytest.mark.parametrize("name", UNITS_ZOO)
def test_discovery_follows_units_through_each_layer_or_says_why_not(name):
    """Where the units of a layer go, layer by layer: the chains claimed, and why every
    other layer with weights is left out (custom layers, whatever their class's name, and
    subclasses of Keras's; grouped convolutions; pooling, flattening and reading along
    another axis than the units')."""
    keras.utils.set_random_seed(0)
    model, chains, reasons = UNITS_ZOO[name]()
    found = find_chains(model)
    assert sorted(list(c.layers) for c in found) == chains, str(found)
    assert dict(found.reasons) == reasons


@torch_only
def test_print_shows_the_chains_the_normalised_kernels_and_the_layers_left_out():
    """``print(found)``: each chain with its core chain, then the kernels followed by batch
    normalisation and the layers left out with why, each only where there is one."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), L.Dense(4, use_bias=False, name="a"),
                              L.BatchNormalization(name="n"), L.ReLU(),
                              L.Dense(4, activation="relu", name="b"), L.Dense(2, name="c")])
    found = find_chains(model)
    assert str(found) == "\n".join([
        "1 chain(s)", f"  b -> c: {found.chains[0].chain}",
        "followed by batch normalisation (PSI-SGD): a",
        "left out:", "  n: BatchNormalization is not a Dense or Conv layer"])
    found = find_chains(CATALOGUE[0]()[0])
    assert str(found) == f"1 chain(s)\n  a -> b -> c: {found.chains[0].chain}"


@torch_only
def test_the_self_check_calls_the_model_for_inference_as_it_is_called():
    """The self-check calls the model in inference mode: a random augmentation in front
    of a chain (active in training only) keeps its claim; and a model of one input is
    called with that input, as a user calls it, without a warning of Keras's."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6, 6, 2)), L.RandomFlip(seed=1),
                              L.Conv2D(3, 3, activation="relu", name="a"), L.Flatten(),
                              L.Dense(2, name="b")])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        found = find_chains(model)
    assert [list(c.layers) for c in found] == [["a", "b"]], str(found)


def small_cnn():
    return keras.Sequential([keras.Input((6, 6, 2)), L.Conv2D(3, 3, activation="relu"),
                             L.MaxPooling2D(2), L.Flatten(), L.Dense(4, activation="relu"),
                             L.Dense(2)])


def numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


def torch_twin(model):
    """The torch network of ``small_cnn`` with ``model``'s weights, and its layers paired
    with the Keras layers and the map of a Keras kernel to the torch layout."""
    import torch

    net = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                              torch.nn.Flatten(), torch.nn.Linear(12, 4), torch.nn.ReLU(),
                              torch.nn.Linear(4, 2)).double()
    as_torch = [lambda k: k.transpose(3, 2, 0, 1),     # HWIO -> OIHW
                lambda k: k.reshape(2, 2, 3, 4).transpose(3, 2, 0, 1).reshape(4, 12),
                lambda k: k.T]                          # (in, out) -> (out, in)
    pairs = list(zip([ly for ly in model.layers if ly.weights], [net[0], net[4], net[6]],
                     as_torch))
    with torch.no_grad():
        for ly, t, f in pairs:
            t.weight.copy_(torch.tensor(f(numpy(ly.kernel.value))))
            t.bias.copy_(torch.tensor(numpy(ly.bias.value)))
    return net, pairs


@pytest.mark.skipif(BACKEND != "torch", reason="the torch adapter runs on the torch backend")
@pytest.mark.parametrize("skeleton", ["he", "paper"])
def test_skeleton_init_sets_what_the_torch_adapter_sets(skeleton):
    """Both recipes (He's: skeleton edges at He's scale with their signs, the rest scaled
    by sqrt(1 - share); the paper's: skeleton edges +1, the rest as they were) give the
    kernels the torch adapter gives the same network."""
    from gsgd_adapters.torch import skeleton_init_

    keras.utils.set_random_seed(0)
    model = small_cnn()
    net, pairs = torch_twin(model)
    before = [numpy(ly.kernel.value) for ly, _, _ in pairs]
    skeleton_init(model, skeleton=skeleton)
    skeleton_init_(net, skeleton=skeleton)
    for (ly, t, f), old in zip(pairs, before):
        assert not np.array_equal(numpy(ly.kernel.value), old)
        np.testing.assert_allclose(f(numpy(ly.kernel.value)), t.weight.detach().numpy(),
                                   rtol=1e-12, atol=0)


#: Keras's optimizer of a model and the torch adapter's of the same network
SAME_AS_TORCH = {
    "gsgd": (lambda m: GSGD(m, 0.05, momentum=0.9), lambda net, T: T.GSGD(net, lr=0.05,
                                                                          momentum=0.9)),
    "gsgd_nesterov_decay": (
        lambda m: GSGD(m, 0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
        lambda net, T: T.GSGD(net, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "gsgd_defaults": (lambda m: GSGD(m), lambda net, T: T.GSGD(net, lr=0.01)),
    "gadam_defaults": (lambda m: GAdam(m), lambda net, T: T.GAdam(net, eps=1e-7)),
    "gadam_amsgrad_decay": (
        lambda m: GAdam(m, 0.01, beta_1=0.8, beta_2=0.99, epsilon=1e-6, amsgrad=True,
                        weight_decay=0.01),
        lambda net, T: T.GAdam(net, lr=0.01, betas=(0.8, 0.99), eps=1e-6, amsgrad=True,
                               weight_decay=0.01)),
    "gadamw_defaults": (lambda m: GAdamW(m),
                        lambda net, T: T.GAdamW(net, eps=1e-7, weight_decay=0.004)),
}


@pytest.mark.skipif(BACKEND != "torch", reason="the torch adapter runs on the torch backend")
@pytest.mark.parametrize("name", SAME_AS_TORCH)
def test_same_trajectory_as_the_torch_adapter(name):
    """G-SGD (momentum, Nesterov, weight decay on path values), G-Adam (its defaults, AMSGrad,
    L2 on path values) and G-AdamW (decoupled decay, its default) step a Keras model as the
    torch adapter steps the same network."""
    import torch
    import gsgd_adapters.torch as T

    keras.utils.set_random_seed(0)
    model = small_cnn()
    skeleton_init(model)
    net, pairs = torch_twin(model)
    x, y = data(model)
    xt, yt = torch.tensor(x).permute(0, 3, 1, 2), torch.tensor(y)
    ours, theirs = SAME_AS_TORCH[name]
    fit(model, ours(model), x, y)
    opt = theirs(net, T)
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(xt), yt).backward()
        opt.step()
    for ly, t, f in pairs:
        ours = f(numpy(ly.kernel.value))
        assert rel(t.weight.detach().numpy(), ours) < 1e-10
        assert rel(t.bias.detach().numpy(), numpy(ly.bias.value)) < 1e-10


@pytest.mark.skipif(BACKEND != "jax", reason="optax runs on the JAX backend")
def test_same_chains_and_trajectory_as_optax():
    """The layer graph's chains are the ones the jaxpr of ``model.stateless_call`` proves,
    and a jitted fit follows optax's G-SGD step for step."""
    import jax.numpy as jnp
    import optax
    from gsgd_adapters.jax import find_chains as find_in_jaxpr
    from gsgd_adapters.optax import gsgd

    keras.utils.set_random_seed(0)
    model = small_cnn()
    skeleton_init(model)
    x, y = data(model)
    params = [v.value for v in model.trainable_variables]
    apply = lambda p, x: model.stateless_call(p, [], x)[0]
    found = find_in_jaxpr(apply, params, x)
    assert [c.chain for c in found] == [c.chain for c in find_chains(model)]
    opt = gsgd(0.05, found, momentum=0.9)

    @jax.jit
    def step(params, state):
        grads = jax.grad(lambda p: jnp.mean((apply(p, x) - y) ** 2))(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = opt.init(params)
    for _ in range(3):
        params, state = step(params, state)
    fit(model, GSGD(model, 0.05, momentum=0.9), x, y, jit_compile=True)
    assert model.jit_compile
    for v, p in zip(model.trainable_variables, params):
        assert rel(numpy(p), numpy(v.value)) < 1e-10


def mlp():
    keras.utils.set_random_seed(0)
    model, _ = CATALOGUE[0]()
    skeleton_init(model)
    return model


def test_save_and_load_resume_bit_exact(tmp_path):
    model = mlp()
    x, y = data(model)
    fit(model, GSGD(model, 0.05, momentum=0.9), x, y, steps=2)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert type(loaded.optimizer) is GSGD
    assert str(loaded.optimizer.describe()) .startswith("1 chain(s)\n  a -> b -> c")
    for m in (model, loaded):
        m.fit(x, y, batch_size=len(x), epochs=2, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights() + [numpy(v) for v in model.optimizer.variables],
                    loaded.get_weights() + [numpy(v) for v in loaded.optimizer.variables]):
        np.testing.assert_array_equal(a, b)


@torch_only
@pytest.mark.parametrize("make, hyper", [
    (GAdam, dict(beta_1=0.8, beta_2=0.99, epsilon=1e-6, amsgrad=True, skeleton="paper")),
    (GSGD, dict(momentum=0.8, nesterov=True, bn="sgd", skeleton="paper"))],
    ids=["gadam", "gsgd"])
def test_config_round_trip_keeps_the_claims(make, hyper):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), L.Dense(5, activation="relu", name="a",
                                                         use_bias=False), L.Dense(3, name="b")])
    opt = make(model, 0.01, name="mine", **hyper)
    again = make.from_config(opt.get_config())
    again.build(model.trainable_variables)
    opt.build(model.trainable_variables)
    assert {k: getattr(again, k) for k in hyper} == hyper and again.name == "mine"
    assert [c.chain for c in again.describe()] == [c.chain for c in opt.describe()]
    assert list(opt.describe().changes) == ["a -> b"]  # the self-check's, kept by build


@torch_only
def test_the_skeleton_is_the_optimizers_from_the_start_and_checked_in_a_config():
    """The chains an optimizer describes have its skeleton's units before it is built, and
    a config naming an unknown skeleton is refused."""
    model = mlp()
    opt = GSGD(model, 0.1, skeleton="paper")
    assert [c.chain for c in opt.describe()] == [c.chain for c in find_chains(
        model, skeleton="paper")]
    config = opt.get_config() | {"skeleton": "unit"}
    with pytest.raises(ValueError, match="skeleton must be one of"):
        GSGD.from_config(config)
    with pytest.raises(ValueError, match=r"skeleton must be one of \('he', 'paper'\), got 'unit'"):
        find_chains(model, skeleton="unit")


@torch_only
def test_a_config_built_on_another_models_variables_is_refused():
    config = GSGD(mlp(), 0.1).get_config()
    other = keras.Sequential([keras.Input((4,)), L.Dense(3, name="x")])
    with pytest.raises(ValueError, match="layer 'a': its variable 'a/kernel' is not among"):
        GSGD.from_config(config).build(other.trainable_variables)


def named_cnn(side, data_format):
    shape = (side, side, 2) if data_format == "channels_last" else (2, side, side)
    return keras.Sequential([keras.Input(shape), L.Conv2D(3, 3, activation="relu", name="a",
                                                          data_format=data_format),
                             L.Flatten(), L.Dense(4, activation="relu", name="b"),
                             L.Dense(2, name="c")])


@torch_only
@pytest.mark.parametrize("data_format", ["channels_last", "channels_first"])
def test_saved_claims_that_do_not_fit_a_kernel_are_refused(data_format):
    """The claims of a config say how a kernel after a flatten reads its inputs (4
    positions of 3 channels: 12 inputs); a model whose kernel there reads 27 is refused,
    naming the kernel's shape."""
    keras.utils.set_random_seed(0)
    config = GSGD(named_cnn(4, data_format), 0.1).get_config()
    with pytest.raises(ValueError, match=r"does not fit a kernel of shape \(27, 4\)"):
        GSGD.from_config(config).build(named_cnn(5, data_format).trainable_variables)


@torch_only
def test_a_schedule_sets_each_steps_learning_rate():
    x, y = data(mlp())
    model = mlp()
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    scheduled = fit(model, GSGD(model, schedule), x, y, steps=2)
    model = mlp()
    opt = GSGD(model, 0.1)
    fit(model, opt, x, y, steps=1)
    opt.learning_rate = 0.05
    model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    assert rel(scheduled, numpy(model(x))) < 1e-12


def test_gradient_accumulation_steps_once_per_accumulated_batch():
    model = mlp()
    x, y = data(model)
    whole = fit(model, GSGD(model, 0.05), x, y, steps=1)
    model = mlp()
    model.compile(optimizer=GSGD(model, 0.05, gradient_accumulation_steps=2), loss="mse")
    model.fit(x, y, batch_size=len(x) // 2, epochs=1, shuffle=False, verbose=0)
    assert rel(whole, numpy(model(x))) < 1e-12


@torch_only
def test_gradients_for_some_variables_step_those_alone_by_keras_rule():
    """A custom loop may give ``apply_gradients`` gradients for some of the variables (a
    head trained alone, variables the loss does not reach): a chain missing some of its
    gradients takes Keras's rule, which moves the variables given by SGD's step, and no
    other variable moves."""
    model = mlp()
    opt = GSGD(model, 0.1)
    opt.build(model.trainable_variables)
    start = [numpy(v.value) for v in model.trainable_variables]
    head = model.get_layer("c").trainable_variables
    opt.apply_gradients([(keras.ops.ones(v.shape, dtype=v.dtype), v) for v in head])
    for v, s in zip(model.trainable_variables, start):
        moved = s - 0.1 if any(v is h for h in head) else s
        np.testing.assert_allclose(numpy(v.value), moved, rtol=1e-15, atol=0)


@torch_only
def test_global_clipnorm_clips_the_gradients_the_step_reads():
    model = mlp()
    x, y = data(model)
    start = model(x)
    clipped = fit(model, GSGD(model, 0.05, global_clipnorm=1e-9), x, y, steps=1)
    assert rel(numpy(start), clipped) < 1e-8


@torch_only
def test_mixed_precision_steps_in_float32():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = mlp()
        x, y = data(model)
        start = [numpy(v) for v in model.trainable_variables]
        opt = GSGD(model, 0.05, momentum=0.9)
        # the layers compute in float16: the self-check allows float16's rounding
        assert [c.name() for c in opt.describe()] == ["a -> b -> c"], str(opt.describe())
        fit(model, opt, x, y, steps=1)
        assert isinstance(model.optimizer.inner_optimizer, GSGD)
    finally:
        keras.mixed_precision.set_global_policy("float64")
    for v, s in zip(model.trainable_variables, start):
        assert v.dtype == "float32" and np.all(np.isfinite(numpy(v)))
        assert not np.array_equal(numpy(v), s)


@pytest.mark.skipif(BACKEND != "torch", reason="the torch adapter runs on the torch backend")
@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_psi_sgd_steps_as_the_torch_adapter(momentum):
    """PSI-SGD(M) on a kernel followed by batch normalisation, SGD(M) on the rest: the
    weights the torch adapter's PSISGD gives the same network."""
    import torch
    from gsgd_adapters.torch import PSISGD as TorchPSISGD

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), L.Dense(4, use_bias=False, name="b"),
                              L.BatchNormalization(epsilon=1e-3), L.ReLU(),
                              L.Dense(2, name="c")])
    net = torch.nn.Sequential(torch.nn.Linear(3, 4, bias=False),
                              torch.nn.BatchNorm1d(4, eps=1e-3), torch.nn.ReLU(),
                              torch.nn.Linear(4, 2)).double()
    with torch.no_grad():
        net[0].weight.copy_(torch.tensor(numpy(model.get_layer("b").kernel.value).T))
        net[3].weight.copy_(torch.tensor(numpy(model.get_layer("c").kernel.value).T))
        net[3].bias.copy_(torch.tensor(numpy(model.get_layer("c").bias.value)))
    x, y = data(model)
    fit(model, PSISGD(model, 0.05, momentum=momentum), x, y)
    opt = TorchPSISGD(net, lr=0.05, momentum=momentum)
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(torch.tensor(x)), torch.tensor(y)).backward()
        opt.step()
    assert rel(net[0].weight.detach().numpy().T, numpy(model.get_layer("b").kernel.value)) \
        < 1e-10
    assert rel(net[3].weight.detach().numpy().T, numpy(model.get_layer("c").kernel.value)) \
        < 1e-10


@torch_only
def test_psi_sgd_steps_normalised_kernels_by_their_rule():
    """PSISGD moves a kernel followed by batch normalisation by ``lr * ||w_i||^2 g_i`` per
    row (Yi et al.): its iterates commute with rescaling the rows (Theorem 1)."""
    keras.utils.set_random_seed(0)
    model, _ = next(f for f in CATALOGUE if f.__name__ == "batch_norm")()
    opt = PSISGD(model, 0.05, momentum=0.5)
    assert list(opt.describe().normalised) == ["b"]
    x, y = data(model)
    kernel = model.get_layer("b").kernel
    twin_model = keras.models.clone_model(model)
    twin_model.set_weights(model.get_weights())
    scales = np.exp(np.random.default_rng(1).normal(size=kernel.shape[-1]))
    twin_kernel = twin_model.get_layer("b").kernel
    twin_kernel.assign(numpy(twin_kernel.value) * scales)
    fit(model, opt, x, y)
    fit(twin_model, PSISGD(twin_model, 0.05, momentum=0.5), x, y)
    # (batch normalisation's epsilon, 1e-12 here, keeps the invariance from being exact)
    assert rel(numpy(kernel.value), numpy(twin_kernel.value) / scales) < 1e-8
