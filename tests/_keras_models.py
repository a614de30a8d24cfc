"""A catalogue of small Keras models: what chain discovery must claim in each, and why it
leaves the rest out. Each entry builds a fresh model (float64 where the backend allows) and
names the chains it must claim, as lists of layer names. Dropout layers carry a seed, so
that a model and its clone draw the same masks."""

import keras
from keras import layers as L


def _seq(*layers, shape):
    return keras.Sequential([keras.Input(shape), *layers])


def mlp_relu():
    return _seq(L.Dense(6, activation="relu", name="a"), L.Dense(5, activation="relu", name="b"),
                L.Dense(3, name="c"), shape=(4,)), [["a", "b", "c"]]


def mlp_relu_layers():
    return _seq(L.Dense(6, name="a"), L.ReLU(), L.Dense(4, name="b"), L.Activation("relu"),
                L.Dropout(0.2, seed=1), L.Dense(3, name="c"), shape=(4,)), [["a", "b", "c"]]


def mlp_no_bias():
    return _seq(L.Dense(6, activation="relu", use_bias=False, name="a"), L.Dense(3, name="b"),
                shape=(4,)), [["a", "b"]]


def leaky():
    return _seq(L.Dense(6, name="a"), L.LeakyReLU(0.1), L.Dense(3, name="b"),
                shape=(4,)), [["a", "b"]]


def cnn_flatten():
    return _seq(L.Conv2D(3, 3, activation="relu", name="a"), L.MaxPooling2D(2), L.Flatten(),
                L.Dense(5, activation="relu", name="b"), L.Dense(2, name="c"),
                shape=(6, 6, 2)), [["a", "b", "c"]]


def cnn_global_pool():
    return _seq(L.Conv2D(3, 3, padding="same", activation="relu", name="a"),
                L.AveragePooling2D(2), L.Conv2D(4, 2, activation="relu", name="b"),
                L.GlobalAveragePooling2D(), L.Dense(2, name="c"),
                shape=(6, 6, 1)), [["a", "b", "c"]]


def conv1d():
    return _seq(L.Conv1D(3, 3, activation="relu", name="a"), L.SpatialDropout1D(0.1, seed=1),
                L.Conv1D(4, 2, name="b"), L.Flatten(), L.Dense(2, name="c"),
                shape=(7, 2)), [["a", "b", "c"]]


def channels_first():
    return _seq(L.Conv2D(3, 3, activation="relu", data_format="channels_first", name="a"),
                L.Flatten(), L.Dense(4, activation="relu", name="b"), L.Dense(2, name="c"),
                shape=(2, 5, 5)), [["a", "b", "c"]]


def conv3d_reshape():
    return _seq(L.Conv3D(2, 2, activation="relu", name="a"), L.Reshape((-1,)),
                L.Dense(3, name="b"), shape=(3, 3, 3, 1)), [["a", "b"]]


def nested_functional():
    x = keras.Input((4,))
    h = L.Dense(5, activation="relu", name="a")(x)
    inner = keras.Sequential([L.Dense(4, activation="relu", name="b"), L.Dense(3, name="c")])
    return keras.Model(x, inner(h)), [["a", "b", "c"]]


def batch_norm():
    return _seq(L.Dense(5, activation="relu", name="a"), L.Dense(4, use_bias=False, name="b"),
                L.BatchNormalization(epsilon=1e-12), L.ReLU(),
                L.Dense(4, activation="relu", name="c"),
                L.Dense(2, name="d"), shape=(3,)), [["c", "d"]]


def gelu():
    return _seq(L.Dense(5, activation="gelu", name="a"), L.Dense(2, name="b"),
                shape=(3,)), []


def layer_norm():
    return _seq(L.Dense(5, name="a"), L.LayerNormalization(), L.ReLU(), L.Dense(2, name="b"),
                shape=(3,)), []


def residual():
    x = keras.Input((4,))
    h = L.Dense(4, activation="relu", name="a")(x)
    h = L.Add()([h, L.Dense(4, name="b")(h)])
    return keras.Model(x, L.Dense(2, name="c")(h)), []


def shared():
    x = keras.Input((4,))
    d = L.Dense(4, activation="relu", name="a")
    return keras.Model(x, L.Dense(2, name="b")(d(d(x)))), []


def relu6():
    return _seq(L.Dense(5, name="a"), L.ReLU(max_value=6.0), L.Dense(2, name="b"),
                shape=(3,)), []


def flatten_mixing_axes():
    return _seq(L.Conv2D(3, 2, activation="relu", name="a"),
                L.Flatten(data_format="channels_first"), L.Dense(2, name="b"),
                shape=(4, 4, 2)), []


CATALOGUE = [mlp_relu, mlp_relu_layers, mlp_no_bias, leaky, cnn_flatten, cnn_global_pool,
             conv1d, channels_first, conv3d_reshape, nested_functional, batch_norm, gelu,
             layer_norm, residual, shared, relu6, flatten_mixing_axes]
