"""Train a small Keras CNN on the embedded MNIST images with ``gsgd_adapters.keras.GSGD``
next to ``keras.optimizers.SGD``.

    python -m benchmarks.keras_mnist [--epochs 10] [--lr 0.05] [--out results]

The model is ``Conv2D(8) -> MaxPool -> Conv2D(16) -> MaxPool -> Flatten -> Dense(32) ->
Dense(10)`` (ReLU), on the 3,000 training images of :mod:`benchmarks.mnist`. Three runs
from one He initialisation: Keras's SGD, Keras's SGD from the skeleton-initialised weights
(the control row, theory page §9) and G-SGD from those weights, each with ``model.fit`` at
one learning rate (no search). It prints the training loss after each epoch, the test
error, and the time of an epoch against Keras SGD's (after a first epoch that compiles),
and writes the loss curves to ``keras_mnist.png`` in ``--out``. The backend is
``KERAS_BACKEND`` (JAX when unset).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from gsgd_adapters.keras import GSGD, skeleton_init  # noqa: E402

from . import threads  # noqa: E402
from .mnist import load  # noqa: E402


def cnn() -> keras.Model:
    layers = keras.layers
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        layers.Conv2D(8, 3, activation="relu", kernel_initializer="he_normal"),
        layers.MaxPooling2D(2),
        layers.Conv2D(16, 3, activation="relu", kernel_initializer="he_normal"),
        layers.MaxPooling2D(2),
        layers.Flatten(),
        layers.Dense(32, activation="relu", kernel_initializer="he_normal"),
        layers.Dense(10, kernel_initializer="he_normal"),
    ])


def run(weights, skeleton: bool, make_opt, data, epochs: int, batch: int):
    """Loss after each epoch, test error and seconds per epoch (after the first) of one
    run from ``weights``."""
    x, y, xt, yt = data
    model = cnn()
    model.set_weights(weights)
    if skeleton:
        skeleton_init(model)
    model.compile(optimizer=make_opt(model),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    curve, times = [], []
    for _ in range(epochs):
        start = time.perf_counter()
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=True, verbose=0)
        times.append(time.perf_counter() - start)
        curve.append(float(model.evaluate(x, y, batch_size=500, verbose=0)))
    error = float((np.argmax(model.predict(xt, batch_size=500, verbose=0), 1) != yt).mean())
    return curve, error, float(np.median(times[1:] or times))


def figure(out: pathlib.Path, curves: dict) -> pathlib.Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for label, curve in curves.items():
        ax.plot(range(1, len(curve) + 1), curve, label=label)
    ax.set(xlabel="epoch", ylabel="training loss", yscale="log",
           title=f"Keras CNN on MNIST ({keras.backend.backend()} backend)")
    ax.legend()
    fig.tight_layout()
    path = out / "keras_mnist.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.keras_mnist", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--train", type=int, default=None, help="use the first N training images")
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    threads.add_argument(ap)
    args = ap.parse_args(argv)
    threads.announce(threads.use(args.threads, jax=keras.backend.backend() == "jax"),
                     args.threads)
    d = load()
    x = d.x_train.numpy().reshape(-1, 28, 28, 1)[:args.train]
    data = (x, d.y_train.numpy()[:args.train], d.x_test.numpy().reshape(-1, 28, 28, 1),
            d.y_test.numpy())
    keras.utils.set_random_seed(0)
    weights = cnn().get_weights()
    sgd = lambda m: keras.optimizers.SGD(args.lr)
    runs = {"Keras SGD": (False, sgd), "SGD, skeleton init": (True, sgd),
            "G-SGD": (True, lambda m: GSGD(m, args.lr))}
    results = {name: run(weights, skel, make, data, args.epochs, args.batch)
               for name, (skel, make) in runs.items()}
    print(f"{'epoch':>5} " + " ".join(f"{n:>20}" for n in runs))
    for e in range(args.epochs):
        print(f"{e + 1:>5} " + " ".join(f"{results[n][0][e]:>20.5f}" for n in runs))
    print("test error " + "; ".join(f"{n}: {100 * r[1]:.1f}%" for n, r in results.items()))
    base = results["Keras SGD"][2]
    print("epoch time " + "; ".join(f"{n}: {r[2]:.2f} s ({r[2] / base:.2f}x)"
                                    for n, r in results.items()))
    args.out.mkdir(parents=True, exist_ok=True)
    print("figure", figure(args.out, {n: r[0] for n, r in results.items()}))


if __name__ == "__main__":
    main()
