"""G-SGD on a JAX mesh that spans two processes: ``python docs/jax_multiprocess_example.py``.

Starts two CPU processes of 2 devices each (``jax.distributed.initialize``, gloo
collectives), places a Flax MLP on a 2x2 mesh ``("data", "model")`` over all 4 devices in the
tensor-parallel layout, and trains it 5 steps with ``gsgd(..., momentum=0.9)`` under
``jax.jit``. Process 0 then trains the same model on one local device and prints the largest
relative difference (float64).
"""

import os
import socket
import subprocess
import sys


def launch() -> None:
    with socket.socket() as s:           # a free port for the coordinator
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = os.environ | {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    procs = [subprocess.Popen([sys.executable, __file__, str(port), str(rank)], env=env)
             for rank in range(2)]
    sys.exit(max(p.wait() for p in procs))


def run(port: int, rank: int) -> None:
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from gsgd_adapters.jax import find_chains
    from gsgd_adapters.optax import gsgd

    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=rank)

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(64, param_dtype=jnp.float64)(x))
            x = nn.relu(nn.Dense(64, param_dtype=jnp.float64)(x))
            return nn.Dense(10, param_dtype=jnp.float64)(x)

    model = MLP()
    rng = np.random.default_rng(0)                 # the same data in every process
    x, y = rng.normal(size=(16, 32)), rng.integers(0, 10, 16)
    params = model.init(jax.random.PRNGKey(0), jnp.asarray(x))
    chains = find_chains(model.apply, params, jnp.asarray(x))
    opt = gsgd(0.05, chains, momentum=0.9)

    def loss(p, x, y):
        logits = model.apply(p, x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

    @jax.jit
    def train(p, x, y):
        s = opt.init(p)
        for _ in range(5):
            u, s = opt.update(jax.grad(loss)(p, x, y), s, p)
            p = optax.apply_updates(p, u)
        return p

    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    specs = {"Dense_0": (P(None, "model"), P("model")),      # columns, then rows
             "Dense_1": (P("model", None), P()), "Dense_2": (P(None, "model"), P("model"))}

    def put(a, spec):           # every process holds the whole array; each keeps its shards
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec),
                                            lambda index: np.asarray(a)[index])

    placed = {"params": {k: {"kernel": put(v["kernel"], specs[k][0]),
                             "bias": put(v["bias"], specs[k][1])}
                         for k, v in params["params"].items()}}
    got = multihost_utils.process_allgather(
        train(placed, put(x, P("data")), put(y, P("data"))), tiled=True)
    if rank == 0:
        local = jax.local_devices()[0]
        one = jax.device_get(train(*jax.device_put((params, x, y), local)))
        worst = max(float(np.max(np.abs(a - b)) / np.max(np.abs(b))) for a, b in
                    zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(one)))
        print(f"{jax.process_count()} processes, {jax.device_count()} devices, mesh "
              f"{dict(mesh.shape)}: largest relative difference from one device {worst:.1e}")
    jax.distributed.shutdown()


if __name__ == "__main__":
    if len(sys.argv) == 1:
        launch()
    else:
        run(int(sys.argv[1]), int(sys.argv[2]))
