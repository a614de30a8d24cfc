"""Train the digits MLP in Flax with ``gsgd_adapters.optax.gsgd`` next to ``optax.sgd``.

    python -m benchmarks.jax_digits [--epochs 20] [--lr 0.2]

The chains come from ``gsgd_adapters.jax.find_chains`` on the Flax model (no description by
hand); both optimizers start from the same skeleton-initialised weights (paper §11.2), and
the training loss after each epoch is printed side by side.
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from gsgd_adapters.jax import find_chains, skeleton_init
from gsgd_adapters.optax import gsgd

from . import threads
from .digits import load


class MLP(nn.Module):
    widths: tuple

    @nn.compact
    def __call__(self, x):
        for width in self.widths[:-1]:
            x = nn.relu(nn.Dense(width, kernel_init=nn.initializers.he_normal())(x))
        return nn.Dense(self.widths[-1], kernel_init=nn.initializers.he_normal())(x)


def loss_fn(model, params, x, y):
    logits = model.apply(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def train(model, opt, params, x, y, epochs, batch, seed):
    state = opt.init(params)

    @jax.jit
    def step(p, s, xb, yb):
        g = jax.grad(lambda p: loss_fn(model, p, xb, yb))(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    rng = np.random.default_rng(seed)
    curve = []
    for _ in range(epochs):
        perm = rng.permutation(len(y))
        for i in range(0, len(y) - batch + 1, batch):  # full batches: one compiled shape
            idx = perm[i:i + batch]
            params, state = step(params, state, x[idx], y[idx])
        curve.append(float(loss_fn(model, params, x, y)))
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
    model = MLP((args.width, args.width, 10))
    params = model.init(jax.random.PRNGKey(0), x[:1])
    chains = find_chains(model.apply, params, x[:1], skeleton="paper")
    params = skeleton_init(params, chains, skeleton="paper")
    runs = {"optax.sgd": optax.sgd(args.lr), "gsgd": gsgd(args.lr, chains)}
    curves, errors = {}, {}
    for name, opt in runs.items():
        p, curves[name] = train(model, opt, params, x, y, args.epochs, 64, seed=0)
        errors[name] = float((model.apply(p, xt).argmax(1) != yt).mean())
    print(f"{'epoch':>5} " + " ".join(f"{n:>12}" for n in runs))
    for e in range(args.epochs):
        print(f"{e + 1:>5} " + " ".join(f"{curves[n][e]:>12.5f}" for n in runs))
    print("test error " + " ".join(f"{n}: {100 * errors[n]:.2f}%" for n in runs))


if __name__ == "__main__":
    main()
