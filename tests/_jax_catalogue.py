"""A catalogue of JAX layouts written the way Flax, Equinox and Haiku users write them, each
with the chains ``find_chains`` must claim and the leaves it must refuse (with a word of
the reason).

Every entry is a :class:`Case`: ``build()`` returns ``(apply_fn, params, args, kwargs)``;
``chains`` lists each expected chain's weights (key paths ``"a/b/c"``) in data-flow order;
``refused`` maps leaves to a fragment of their printed reason; ``normalised`` lists the
weights PSI-SGD takes (batch norm). Models are tiny, for float64 checks on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import equinox as eqx
import flax.linen as nn
from flax import nnx
import haiku as hk
import jax
import jax.numpy as jnp

from gsgd_adapters.jax.nnx import as_function

KEY = jax.random.PRNGKey(0)
X = jax.random.normal(jax.random.PRNGKey(1), (3, 5))            # a batch of vectors
IMAGES = jax.random.normal(jax.random.PRNGKey(2), (2, 6, 6, 2))  # NHWC
NOT_HOMOGENEOUS = "not positively homogeneous"


@dataclass
class Case:
    build: Callable
    chains: list
    refused: dict = field(default_factory=dict)
    normalised: list = field(default_factory=list)
    trains: bool = True   # the twins' training check applies (no state beside params)


# ---------------------------------------------------------------------------- Flax linen
def flax(module, x=X, **kwargs):
    variables = module.init(KEY, x, **{k: v for k, v in kwargs.items() if k != "rngs"})
    return module.apply, variables, (x,), kwargs


class FlaxMLP(nn.Module):
    act: Callable = nn.relu

    @nn.compact
    def __call__(self, x):
        x = self.act(nn.Dense(6)(x))
        x = self.act(nn.Dense(4)(x))
        return nn.Dense(3)(x)


class FlaxCNN(nn.Module):
    """conv, max pool, conv, average pool, NHWC flatten (position-major), Dense, Dense."""

    @nn.compact
    def __call__(self, x):
        x = nn.max_pool(nn.relu(nn.Conv(3, (3, 3))(x)), (2, 2), (2, 2))
        x = nn.avg_pool(nn.relu(nn.Conv(4, (3, 3))(x)), (3, 3), (1, 1), padding="SAME")
        x = nn.relu(nn.Dense(5)(x.reshape((x.shape[0], -1))))
        return nn.Dense(3)(x)


class FlaxDropoutLeaky(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = jax.nn.leaky_relu(nn.Dense(6)(x), 0.1)
        x = nn.Dropout(0.5, deterministic=not train)(x)
        return nn.Dense(3)(x)


class FlaxWhereRelu(nn.Module):
    """ReLU as ``jnp.where`` and as ``jnp.maximum``, a Dense without bias."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(6)(x)
        h = nn.Dense(4, use_bias=False)(jnp.where(h > 0, h, 0.0))
        return nn.Dense(3)(jnp.maximum(h, 0.0))


class FlaxGlobalPool(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(3, (3, 3))(x))
        x = nn.relu(nn.Conv(4, (3, 3), strides=2)(x))
        return nn.Dense(3)(x.mean(axis=(1, 2)))


class FlaxLayerNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(nn.LayerNorm()(nn.Dense(6)(x))))


class FlaxGroupNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.GroupNorm(num_groups=2)(nn.Conv(4, (3, 3))(x))
        return nn.Dense(3)(nn.relu(x).reshape((x.shape[0], -1)))


class FlaxRMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(nn.RMSNorm()(nn.Dense(6)(x))))


class FlaxFeatureMax(nn.Module):
    """A max across units: each unit divided by the layer's largest."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(6)(x))
        return nn.Dense(3)(h - h.max(axis=-1, keepdims=True))


class FlaxShared(nn.Module):
    """One Dense applied twice."""

    @nn.compact
    def __call__(self, x):
        shared = nn.Dense(5)
        return nn.Dense(3)(nn.relu(shared(nn.relu(shared(x)))))


class FlaxResidual(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(6)(x))
        h = nn.relu(nn.Dense(6)(h)) + h
        return nn.Dense(3)(h)


class FlaxReturnsHidden(nn.Module):
    """The hidden layer is returned beside the output (a feature extractor)."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(6)(x))
        return nn.Dense(3)(h), h


class FlaxSameScaleSum(nn.Module):
    """A sum whose two branches carry the same units: claimed."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(6)(x))
        return nn.Dense(3)(h + 0.5 * nn.leaky_relu(h))


class FlaxBatchNorm(nn.Module):
    squared_head: bool = False   # a last layer without a bias, its output squared

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(4, (3, 3), use_bias=False)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
        x = nn.relu(nn.Conv(3, (3, 3))(x))
        y = nn.Dense(3, use_bias=not self.squared_head)(x.reshape((x.shape[0], -1)))
        return y * y if self.squared_head else y


def flax_batchnorm(squared_head=False):
    """Applied in training mode: the output is ``(y, {"batch_stats": ...})``."""
    model = FlaxBatchNorm(squared_head)
    variables = model.init(KEY, IMAGES)
    return (lambda v, x: model.apply(v, x, mutable=["batch_stats"])), variables, (IMAGES,), {}


class NnxMLP(nnx.Module):
    def __init__(self, rngs, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.l1, self.l2 = nnx.Linear(5, 6, **kw), nnx.Linear(6, 3, **kw)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def flax_nnx():
    """nnx's idiom: split the module into its graph and its state (the params)."""
    graphdef, state = nnx.split(NnxMLP(nnx.Rngs(0)))
    return (lambda s, x: nnx.merge(graphdef, s)(x)), state, (X,), {}


class NnxCNN(nnx.Module):
    """conv, batch norm (in training mode, NNX's default), conv, max pool, conv, average
    pool, NHWC flatten, Linear, Linear."""

    def __init__(self, rngs, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.c1 = nnx.Conv(2, 3, (3, 3), use_bias=False, **kw)
        self.bn = nnx.BatchNorm(3, **kw)
        for stat in (self.bn.mean, self.bn.var):   # float32 whatever param_dtype is
            stat.set_value(stat.get_value().astype(param_dtype))
        self.c2 = nnx.Conv(3, 4, (3, 3), **kw)
        self.c3 = nnx.Conv(4, 3, (3, 3), **kw)
        self.l1, self.l2 = nnx.Linear(27, 5, **kw), nnx.Linear(5, 3, **kw)

    def __call__(self, x):
        x = nnx.relu(self.bn(self.c1(x)))
        x = nnx.max_pool(nnx.relu(self.c2(x)), (2, 2), (2, 2))
        x = nnx.avg_pool(nnx.relu(self.c3(x)), (3, 3), (1, 1), padding="SAME")
        return self.l2(nnx.relu(self.l1(x.reshape((x.shape[0], -1)))))


def nnx_module(model, x):
    """What ``find_chains(model, x)`` traces: the module as a function of its pure params."""
    return (*as_function(model), (x,), {})


# ---------------------------------------------------------------------------- Equinox
def vmapped(model, x=X):
    """Equinox's idiom: the arrays are the params (for optax), the rest stays static."""
    params, static = eqx.partition(model, eqx.is_array)
    return (lambda p, x: jax.vmap(eqx.combine(p, static))(x)), params, (x,), {}


class EqxCNN(eqx.Module):
    """Conv2d, MaxPool2d, Conv2d, channel-major flatten (ravel of CHW), Linear, Linear."""

    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    pool: eqx.nn.MaxPool2d
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.conv1 = eqx.nn.Conv2d(2, 3, 3, padding=1, key=k[0])
        self.pool = eqx.nn.MaxPool2d(2, 2)
        self.conv2 = eqx.nn.Conv2d(3, 4, 3, key=k[1])
        self.fc1, self.fc2 = eqx.nn.Linear(4, 5, key=k[2]), eqx.nn.Linear(5, 3, key=k[3])

    def __call__(self, x):
        x = self.pool(jax.nn.relu(self.conv1(x)))
        x = jax.nn.relu(self.conv2(x))
        return self.fc2(jax.nn.relu(self.fc1(jnp.ravel(x))))


class EqxLinears(eqx.Module):
    layers: list

    def __init__(self, key, bias=False):
        k = jax.random.split(key, 3)
        self.layers = [eqx.nn.Linear(5, 6, use_bias=bias, key=k[0]),
                       eqx.nn.Linear(6, 4, use_bias=bias, key=k[1]),
                       eqx.nn.Linear(4, 3, use_bias=bias, key=k[2])]

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


# ---------------------------------------------------------------------------- Haiku
def haiku(fn, x=X):
    t = hk.without_apply_rng(hk.transform(fn))
    return t.apply, t.init(KEY, x), (x,), {}


def hk_mlp(x):
    return hk.Sequential([hk.Linear(6), jax.nn.relu, hk.Linear(4), jax.nn.relu,
                          hk.Linear(3)])(x)


def hk_nested(x):
    """Names are in creation order: the output layer is ``linear``, the first ``linear_1``."""
    return hk.Linear(3)(jax.nn.relu(hk.Linear(6)(x)))


def hk_cnn(x):
    x = jax.nn.relu(hk.Conv2D(3, 3)(x))
    x = hk.MaxPool((1, 2, 2, 1), (1, 2, 2, 1), "VALID")(x)
    x = jax.nn.relu(hk.Conv2D(4, 3)(x))
    return hk.Linear(3)(jax.nn.relu(hk.Linear(5)(hk.Flatten()(x))))


def hk_batchnorm():
    def fn(x, is_training=True):
        x = hk.Linear(6, with_bias=False)(x)
        x = jax.nn.relu(hk.BatchNorm(True, True, 0.9)(x, is_training))
        return hk.Linear(3)(x)
    t = hk.without_apply_rng(hk.transform_with_state(fn))
    params, state = t.init(KEY, X)
    return (lambda p, x: t.apply(p, state, x)), params, (X,), {}


# ---------------------------------------------------------------------------- plain JAX
def plain_pairs():
    """Hand-written ``x @ W.T + b`` with ``(out, in)`` weights in a list of pairs."""
    ks = jax.random.split(KEY, 3)
    params = [(jax.random.normal(k, (o, i)), jnp.zeros(o))
              for k, (i, o) in zip(ks, [(5, 6), (6, 4), (4, 3)])]

    def apply(params, x):
        for i, (w, b) in enumerate(params):
            x = x @ w.T + b
            x = jax.nn.relu(x) if i < len(params) - 1 else x
        return x
    return apply, params, (X,), {}


D = "params/Dense_{}/{}".format
C = "params/Conv_{}/{}".format
CATALOGUE = {
    "flax_mlp": Case(lambda: flax(FlaxMLP()), [[D(0, "kernel"), D(1, "kernel"), D(2, "kernel")]]),
    "flax_cnn_nhwc_flatten": Case(lambda: flax(FlaxCNN(), IMAGES), [
        [C(0, "kernel"), C(1, "kernel"), D(0, "kernel"), D(1, "kernel")]]),
    "flax_dropout_leaky_relu": Case(
        lambda: flax(FlaxDropoutLeaky(), rngs={"dropout": jax.random.PRNGKey(3)}),
        [[D(0, "kernel"), D(1, "kernel")]]),
    "flax_where_and_maximum": Case(lambda: flax(FlaxWhereRelu()),
                                   [[D(0, "kernel"), D(1, "kernel"), D(2, "kernel")]]),
    "flax_global_average_pool": Case(lambda: flax(FlaxGlobalPool(), IMAGES),
                                     [[C(0, "kernel"), C(1, "kernel"), D(0, "kernel")]]),
    "flax_gelu": Case(lambda: flax(FlaxMLP(nn.gelu)), [],
                      {D(0, "kernel"): NOT_HOMOGENEOUS, D(2, "kernel"): "no layer before"}),
    "flax_silu": Case(lambda: flax(FlaxMLP(nn.silu)), [], {D(0, "kernel"): "logistic"}),
    "flax_tanh": Case(lambda: flax(FlaxMLP(jnp.tanh)), [], {D(1, "kernel"): "tanh"}),
    "flax_layer_norm": Case(lambda: flax(FlaxLayerNorm()), [],
                            {D(0, "kernel"): "its units", "params/LayerNorm_0/scale": "read by"}),
    "flax_group_norm": Case(lambda: flax(FlaxGroupNorm(), IMAGES), [],
                            {C(0, "kernel"): "splits its units"}),
    "flax_rms_norm": Case(lambda: flax(FlaxRMSNorm()), [], {D(0, "kernel"): "its units"}),
    "flax_feature_max": Case(lambda: flax(FlaxFeatureMax()), [],
                             {D(0, "kernel"): "across its units"}),
    "flax_shared_dense": Case(lambda: flax(FlaxShared()), [],
                              {D(0, "kernel"): "read 2 times", D(1, "kernel"): "no layer"}),
    "flax_residual": Case(lambda: flax(FlaxResidual()), [],
                          {D(0, "kernel"): "branch", D(1, "kernel"): "residual"}),
    "flax_returns_hidden": Case(lambda: flax(FlaxReturnsHidden()), [],
                                {D(0, "kernel"): "returned by the model"}),
    "flax_same_scale_sum": Case(lambda: flax(FlaxSameScaleSum()),
                                [[D(0, "kernel"), D(1, "kernel")]]),
    "flax_nnx_mlp": Case(flax_nnx, [["l1/kernel/value", "l2/kernel/value"]]),
    "nnx_cnn_batch_norm": Case(lambda: nnx_module(NnxCNN(nnx.Rngs(0), jnp.float64), IMAGES),
                               [["c2/kernel", "c3/kernel", "l1/kernel", "l2/kernel"]],
                               {"bn/scale": "read by"}, normalised=["c1/kernel"],
                               trains=False),   # its twins train in test_nnx.py
    "flax_batch_norm": Case(flax_batchnorm, [[C(1, "kernel"), D(0, "kernel")]],
                            {"params/BatchNorm_0/scale": "read by"},
                            normalised=[C(0, "kernel")], trains=False),
    # the last layer's units end at a square, not a normalisation: only the model's output
    # (not the statistics returned beside it) shows that its scale still matters
    "flax_batch_norm_squared_head": Case(
        lambda: flax_batchnorm(squared_head=True), [[C(1, "kernel"), D(0, "kernel")]],
        {"params/BatchNorm_0/scale": "read by"}, normalised=[C(0, "kernel")], trains=False),
    "eqx_mlp_vmap": Case(lambda: vmapped(eqx.nn.MLP(5, 3, 6, 2, key=KEY)),
                         [["layers/0/weight", "layers/1/weight", "layers/2/weight"]]),
    "eqx_mlp_tanh": Case(lambda: vmapped(eqx.nn.MLP(5, 3, 6, 2, activation=jnp.tanh, key=KEY)),
                         [], {"layers/0/weight": "tanh"}),
    "eqx_linear_no_bias": Case(lambda: vmapped(EqxLinears(KEY)),
                               [["layers/0/weight", "layers/1/weight", "layers/2/weight"]]),
    "eqx_cnn_chw_flatten": Case(
        lambda: vmapped(EqxCNN(KEY), jnp.transpose(IMAGES, (0, 3, 1, 2))),
        [["conv1/weight", "conv2/weight", "fc1/weight", "fc2/weight"]]),
    "haiku_sequential_mlp": Case(lambda: haiku(hk_mlp),
                                 [["linear/w", "linear_1/w", "linear_2/w"]]),
    "haiku_names_not_in_flow_order": Case(lambda: haiku(hk_nested), [["linear_1/w", "linear/w"]]),
    "haiku_cnn_flatten": Case(lambda: haiku(hk_cnn, IMAGES), [
        ["conv2_d/w", "conv2_d_1/w", "linear_1/w", "linear/w"]]),
    "haiku_batch_norm": Case(hk_batchnorm, [], {"batch_norm/scale": "read by"},
                             normalised=["linear/w"], trains=False),
    "plain_out_in_pairs": Case(plain_pairs, [["0/0", "1/0", "2/0"]]),
}
