"""Flax models placed on a 2x2 mesh ``("data", "model")`` of 4 host devices, and the layouts
the mesh tests place them in, for ``_jax_mesh_worker.py`` (a process started with
``--xla_force_host_platform_device_count=4``)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gsgd_adapters.optax import chains_from_dict

BATCH = 8


class MLP(nn.Module):
    widths: tuple = (16, 16, 4)

    @nn.compact
    def __call__(self, x):
        for w in self.widths[:-1]:
            x = nn.relu(nn.Dense(w)(x))
        return nn.Dense(self.widths[-1])(x)


class CNN(nn.Module):
    """Two convolutions; the loss reads the second one's channels averaged over positions."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(4, (3, 3))(x))
        return jnp.mean(nn.Conv(4, (3, 3))(x), axis=(1, 2))


def _dense(kernels, biases):
    """A spec per leaf of an MLP's params: ``kernels[i]``, ``biases[i]`` for ``Dense_i``."""
    def spec(path, leaf):
        layer = int(path[0].key.split("_")[1])
        return (kernels if leaf.ndim == 2 else biases)[layer]
    return spec


def _cnn(path, leaf):
    """Convolution kernels (HWIO) and biases over their output channels."""
    return P(None, None, None, "model") if leaf.ndim == 4 else P("model")


COL, ROW = P(None, "model"), P("model", None)
# Each layout: (model, spec of each params leaf, spec of the batch).
LAYOUTS = {
    "replicated": ("mlp", lambda path, leaf: P(), P("data")),
    # each kernel sharded over one of its axes (inputs, outputs, inputs), biases
    # replicated: a parameter's shards live apart and are gathered where they are used
    "fsdp": ("mlp", _dense([ROW, COL, ROW], [P()] * 3), P("data")),
    # Megatron: a layer's units over "model" with its bias, the next layer's inputs alike
    "tensor": ("mlp", _dense([COL, ROW, COL], [P("model"), P(), P("model")]), P("data")),
    # kernels over both mesh axes, biases over "model"
    "mesh2d": ("mlp", _dense([P("data", "model")] * 3, [P("model")] * 3), P("data")),
    "conv": ("cnn", _cnn, P("data")),
}

# Every transformation trains in every layout (each from skeleton_init and random_rescale).
TRANSFORMS = ("gsgd", "psi_sgd", "path_sgd", "in_path_space")
# The buffers each transformation's state holds per number of the params (and step counts).
BUFFERS = {"gsgd": 1, "psi_sgd": 1, "path_sgd": 0, "in_path_space": 2}
# Where the collectives of an update are read: units and inputs sharded (the tensor layout
# holds both kernel shardings of FSDP's), both mesh axes, convolutions.
COLLECTIVES = (("tensor", "gsgd"), ("mesh2d", "gsgd"), ("conv", "gsgd"),
               ("tensor", "in_path_space"))


def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))


def model(name: str):
    """``(module, params, chains, batch x, labels y)`` in float64; the params (without
    Flax's ``"params"`` level) are drawn with NumPy, so no JAX operation runs eagerly."""
    rng = np.random.default_rng(0)
    if name == "mlp":
        module, x = MLP(), rng.normal(size=(BATCH, 8))
        shapes = list(zip((8,) + MLP.widths[:-1], MLP.widths))
        names = [f"Dense_{i}" for i in range(len(shapes))]
    else:
        module, x = CNN(), rng.normal(size=(BATCH, 6, 6, 2))
        shapes, names = [(3, 3, 2, 4), (3, 3, 4, 4)], ["Conv_0", "Conv_1"]
    params = {n: {"kernel": jnp.asarray(rng.normal(size=s) / np.sqrt(np.prod(s[:-1]))),
                  "bias": jnp.asarray(0.1 * rng.normal(size=s[-1]))}
              for n, s in zip(names, shapes)}
    chains = chains_from_dict(params, names, weight="kernel", bias="bias", transposed=True)
    y = jnp.asarray(rng.integers(0, 4, BATCH))
    return module, params, chains, jnp.asarray(x), y


def place(tree, spec, m: Mesh):
    """``tree`` with each leaf put on mesh ``m`` with ``spec(path, leaf)``."""
    return jax.tree_util.tree_map_with_path(
        lambda path, a: jax.device_put(a, NamedSharding(m, spec(path, a))), tree)


def loss_fn(module):
    def loss(params, x, y):
        logits = module.apply({"params": params}, x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))
    return loss
