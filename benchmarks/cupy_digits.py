"""``python -m benchmarks.cupy_digits``: a hand-written CuPy training loop with G-SGD.

An MLP 64-h-h-10 on scikit-learn's digits, forward and backward written in array code, with
:class:`gsgd_adapters.cupy.GSGD` beside plain in-place SGD from the same start. Runs on the
GPU with CuPy, or on the CPU with NumPy (``--backend numpy``, the default without a GPU).

    python -m benchmarks.cupy_digits [--backend auto|cupy|numpy] [--epochs 30] [--hidden 128]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from gsgd_adapters.cupy import GSGD
from gsgd_core import Chain

from . import threads


def backend(name: str):
    if name == "numpy":
        return np
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
        return cupy
    except Exception:  # no CuPy, or no usable GPU
        if name == "cupy":
            raise
        return np


def load(xp):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    X, y = load_digits(return_X_y=True)
    X_tr, X_te, y_tr, y_te = train_test_split(X / 16.0, y, test_size=0.25, stratify=y,
                                              random_state=0)
    mean = X_tr.mean(axis=0)
    f = lambda a: xp.asarray(a - mean, dtype=xp.float32)  # noqa: E731
    return f(X_tr), xp.asarray(y_tr), f(X_te), xp.asarray(y_te)


def init(xp, widths, seed):
    """He-initialised weights ``(out, in)`` and zero biases."""
    rng = np.random.default_rng(seed)
    W = [xp.asarray(rng.standard_normal((b, a)) * np.sqrt(2.0 / a), dtype=xp.float32)
         for a, b in zip(widths[:-1], widths[1:])]
    return W, [xp.zeros(b, dtype=xp.float32) for b in widths[1:]]


def loss_and_grads(xp, W, b, x, y):
    """Softmax cross-entropy of the ReLU MLP and its gradients, by hand."""
    acts = [x]
    for l, (w, c) in enumerate(zip(W, b)):
        z = acts[-1] @ w.T + c
        acts.append(xp.maximum(z, 0) if l < len(W) - 1 else z)
    z = acts[-1] - acts[-1].max(axis=1, keepdims=True)
    logp = z - xp.log(xp.exp(z).sum(axis=1, keepdims=True))
    n = x.shape[0]
    loss = -logp[xp.arange(n), y].mean()
    d = xp.exp(logp)
    d[xp.arange(n), y] -= 1
    d /= n
    gW, gb = [None] * len(W), [None] * len(W)
    for l in range(len(W) - 1, -1, -1):
        gW[l], gb[l] = d.T @ acts[l], d.sum(axis=0)
        if l:
            d = (d @ W[l]) * (acts[l] > 0)
    return float(loss), gW, gb


def train(xp, data, widths, opt_name, lr, epochs, batch=64, seed=0):
    x, y, x_te, y_te = data
    W, b = init(xp, widths, seed)
    chain = Chain.mlp(widths)
    opt = GSGD(chain, W, b, lr=lr) if opt_name == "gsgd" else None
    if opt is not None:
        opt.skeleton_init()
    rng = np.random.default_rng(seed + 1)
    losses, step_time = [], 0.0
    for _ in range(epochs):
        order, total = xp.asarray(rng.permutation(x.shape[0])), 0.0
        for i in range(0, x.shape[0], batch):
            idx = order[i:i + batch]
            loss, gW, gb = loss_and_grads(xp, W, b, x[idx], y[idx])
            total += loss * idx.shape[0]
            t0 = time.perf_counter()
            if opt is not None:
                opt.step(gW, gb)
            else:
                for p, g in zip(W + b, gW + gb):
                    p -= lr * g
            _sync(xp)
            step_time += time.perf_counter() - t0
        losses.append(total / x.shape[0])
    z = x_te
    for l, (w, c) in enumerate(zip(W, b)):
        z = z @ w.T + c
        z = xp.maximum(z, 0) if l < len(W) - 1 else z
    error = float((z.argmax(axis=1) != y_te).mean())
    return losses, error, step_time


def _sync(xp):
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cupy_digits", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["auto", "cupy", "numpy"], default="auto")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.1)
    threads.add_argument(ap, what="digits-sized nets on the CPU")
    args = ap.parse_args(argv)
    threads.announce(threads.use(args.threads), args.threads)
    xp = backend(args.backend)
    data = load(xp)
    widths = (64, args.hidden, args.hidden, 10)
    runs = {name: train(xp, data, widths, name, args.lr, args.epochs) for name in ("sgd", "gsgd")}
    print(f"# MLP {'-'.join(map(str, widths))} on digits, {xp.__name__}, lr {args.lr}")
    print(f"{'epoch':>5} {'sgd':>12} {'gsgd':>12}")
    for e in range(args.epochs):
        print(f"{e + 1:>5} {runs['sgd'][0][e]:>12.5f} {runs['gsgd'][0][e]:>12.5f}")
    print("test error " + " ".join(f"{n}: {100 * r[1]:.2f}%" for n, r in runs.items()))
    print("optimizer time " + " ".join(f"{n}: {r[2]:.3f} s" for n, r in runs.items()))


if __name__ == "__main__":
    main()
