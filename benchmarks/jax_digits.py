"""Train the digits MLP in plain JAX with ``gsgd_adapters.optax.gsgd`` next to ``optax.sgd``.

    python -m benchmarks.jax_digits [--epochs 20] [--lr 0.2]

Both start from the same skeleton-initialised weights (paper §11.2); the training loss after
each epoch is printed side by side.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gsgd_core as gc
from gsgd_adapters.optax import chains_from_pairs, gsgd

from . import threads
from .digits import load


def init(widths, seed):
    rng = np.random.default_rng(seed)
    params = [(rng.standard_normal((o, i)) * np.sqrt(2 / i), np.zeros(o))
              for i, o in zip(widths[:-1], widths[1:])]
    chain = gc.Chain.mlp(widths)
    W, _ = gc.skeleton_init(chain, [w for w, _ in params])
    return [(jnp.asarray(w, jnp.float32), jnp.asarray(b, jnp.float32))
            for w, (_, b) in zip(W, params)]


def forward(params, x):
    for i, (W, b) in enumerate(params):
        x = x @ W.T + b
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    return x


def loss_fn(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(forward(params, x), y).mean()


def train(opt, params, x, y, epochs, batch, seed):
    state = opt.init(params)

    @jax.jit
    def step(p, s, xb, yb):
        g = jax.grad(loss_fn)(p, xb, yb)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    rng = np.random.default_rng(seed)
    curve = []
    for _ in range(epochs):
        perm = rng.permutation(len(y))
        for i in range(0, len(y) - batch + 1, batch):  # full batches: one compiled shape
            idx = perm[i:i + batch]
            params, state = step(params, state, x[idx], y[idx])
        curve.append(float(loss_fn(params, x, y)))
    return params, curve


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.jax_digits", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=0.2)
    ap.add_argument("--width", type=int, default=64)
    threads.add_argument(ap)
    args = ap.parse_args(argv)
    threads.announce(threads.use(args.threads, jax=True), args.threads)
    data = load()
    x, y = jnp.asarray(data.x_train.numpy()), jnp.asarray(data.y_train.numpy())
    xt, yt = jnp.asarray(data.x_test.numpy()), jnp.asarray(data.y_test.numpy())
    params = init([64, args.width, args.width, 10], seed=0)
    runs = {"optax.sgd": optax.sgd(args.lr),
            "gsgd": gsgd(args.lr, chains_from_pairs(params))}
    curves, errors = {}, {}
    for name, opt in runs.items():
        p, curves[name] = train(opt, params, x, y, args.epochs, 64, seed=0)
        errors[name] = float((forward(p, xt).argmax(1) != yt).mean())
    print(f"{'epoch':>5} " + " ".join(f"{n:>12}" for n in runs))
    for e in range(args.epochs):
        print(f"{e + 1:>5} " + " ".join(f"{curves[n][e]:>12.5f}" for n in runs))
    print("test error " + " ".join(f"{n}: {100 * errors[n]:.2f}%" for n in runs))


if __name__ == "__main__":
    main()
