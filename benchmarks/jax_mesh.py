"""``python -m benchmarks.jax_mesh``: what G-SGD's step adds to the collectives of a training
step on a JAX mesh, read from the compiled programs.

A Flax MLP 32-256-256-256-10 (float32, chains by ``find_chains``) on a 2x2 mesh
``("data", "model")`` of 4 host devices, batch 64 sharded over ``"data"``, in four layouts
(params replicated; FSDP; tensor parallel; kernels over both axes). For each, one jitted
training step (gradient and update) per optimizer; XLA inserts the collectives, and
:func:`collectives` reads them from ``jax.jit(step).lower(...).compile().as_text()``. Prints
a Markdown table: bytes per step and the arrays larger than a layer's width ("weight-sized":
a weight or a shard of one) that the step's collectives move. Run it from the repository
root; it sets ``--xla_force_host_platform_device_count=4`` itself.
"""

from __future__ import annotations

import math
import os
import re

KINDS = "all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all"
_OP = re.compile(rf"=\s+(.*?)\s+({KINDS})(?:-start)?\(")
_ARRAY = re.compile(r"\b(pred|bf16|[fsu]\d+)\[([\d,]*)\]")


def collectives(hlo: str) -> list[tuple[str, int, int]]:
    """``(kind, elements, bytes)`` of every array a collective of the compiled HLO text
    ``hlo`` returns (a tuple's arrays one by one; an async pair once, at its start)."""
    found = []
    for line in hlo.splitlines():
        op = _OP.search(line)
        if op is None:
            continue
        for dtype, dims in _ARRAY.findall(op.group(1)):
            n = math.prod(int(d) for d in dims.split(",") if d)
            size = 1 if dtype == "pred" else int(dtype.lstrip("bfsu")) // 8
            found.append((op.group(2), n, n * size))
    return found


def weight_sized(found, width: int) -> int:
    """How many of the arrays :func:`collectives` found hold more than ``width`` numbers."""
    return sum(1 for _, n, _ in found if n > width)


def main() -> None:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=4")
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from gsgd_adapters.jax import find_chains
    from gsgd_adapters.optax import gsgd, in_path_space

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for w in (256, 256, 256):
                x = nn.relu(nn.Dense(w)(x))
            return nn.Dense(10)(x)

    model, width = MLP(), 256
    x = jnp.asarray(np.random.default_rng(0).normal(size=(64, 32)), jnp.float32)
    y = jnp.asarray(np.random.default_rng(1).integers(0, 10, 64))
    params = model.init(jax.random.PRNGKey(0), x)
    chains = find_chains(model.apply, params, x)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    col, row = P(None, "model"), P("model", None)

    def dense(kernels, biases):
        def spec(path, leaf):
            i = int(path[1].key.split("_")[1])
            return (kernels if leaf.ndim == 2 else biases)[i]
        return spec

    layouts = {
        "replicated": lambda path, leaf: P(),
        "FSDP (kernels over in, out, in, out)": dense([row, col, row, col], [P()] * 4),
        "tensor parallel (column, row, column, row)":
            dense([col, row, col, row], [P("model"), P(), P("model"), P()]),
        "2-D (kernels over data x model)": dense([P("data", "model")] * 4, [P("model")] * 4),
    }
    optimizers = {"SGD m=0.9": optax.sgd(0.05, momentum=0.9),
                  "G-SGD m=0.9": gsgd(0.05, chains, momentum=0.9),
                  "Adam": optax.adam(1e-3), "G-Adam": in_path_space(optax.adam(1e-3), chains)}

    def loss(p, x, y):
        logits = model.apply(p, x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

    batch = NamedSharding(mesh, P("data"))
    xb, yb = jax.device_put(x, batch), jax.device_put(y, batch)
    print("| layout | optimizer | arrays moved | weight-sized arrays | bytes per step |")
    print("|---|---|---:|---:|---:|")
    for name, spec in layouts.items():
        placed = jax.tree_util.tree_map_with_path(
            lambda path, a: jax.device_put(a, NamedSharding(mesh, spec(path, a))), params)
        for opt_name, opt in optimizers.items():
            def step(p, s, x, y):
                u, s = opt.update(jax.grad(loss)(p, x, y), s, p)
                return optax.apply_updates(p, u), s

            hlo = jax.jit(step).lower(placed, opt.init(placed), xb, yb).compile().as_text()
            found = collectives(hlo)
            print(f"| {name} | {opt_name} | {len(found)} | {weight_sized(found, width)} | "
                  f"{sum(b for *_, b in found) / 1024:.1f} KiB |", flush=True)


if __name__ == "__main__":
    main()
