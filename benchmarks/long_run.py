"""Long runs: do weights, path values and skeleton products stay finite and well
scaled over 20,000 steps, and is a periodic canonicalisation needed?

    python -m benchmarks.long_run [--steps 20000]

For G-SGD (plain and momentum 0.9) on a digits MLP 64-64-64-10 and PSI-SGDM on its batch-norm
twin: the largest learning rate of a grid that still trains (training loss below 0.3 after
2,000 steps), then the long run, reporting ranges every 10% of the run.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

import gsgd_core as gc
from gsgd_adapters.torch import discover

from . import threads
from .digits import OPTIMIZERS, Run, build, load


def _stats(model) -> dict:
    """Largest weight, path-value range, skeleton-product range (B, F) of the model's chain."""
    out = dict(max_w=max(float(p.detach().abs().max()) for p in model.parameters()))
    chains = discover(model).chains
    if chains:
        c = chains[0]
        W = [m.weight.detach().double().numpy() for m in c.modules]
        b = [m.bias.detach().double().numpy() for m in c.modules]
        V, Vb = gc.path_values(c.chain, W, b)
        nonzero = np.concatenate([np.abs(v[v != 0]) for v in V])
        out.update(min_v=float(nonzero.min()), max_v=float(nonzero.max()))
        W3 = [w.reshape(c.chain.layer_shape(i + 1)) for i, w in enumerate(W)]
        B1 = np.abs(np.array([W3[0][j, c.chain.tau[0][j], 0] for j in range(c.chain.sizes[1])]))
        out.update(min_B=float(B1.min()), max_B=float(B1.max()))
    out["finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return out


def _steps(model, opt, data, n, gen, every=None, report=None):
    x, y = data.x_train, data.y_train
    for k in range(1, n + 1):
        idx = torch.randint(len(y), (64,), generator=gen)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
        if every and k % every == 0:
            report(k)


def _loss(model, data) -> float:
    with torch.no_grad():
        return float(F.cross_entropy(model(data.x_train), data.y_train))


TRAINS = 0.3  # full-training-set cross-entropy after the probe (chance level is 2.3)


def largest_lr_that_trains(opt_name, grid, data, bn=False, probe=2000):
    """The largest lr of ``grid`` whose loss is below ``TRAINS`` after ``probe`` steps, for
    two minibatch orders (near the stability edge, one order can train and the other not)."""
    for lr in sorted(grid, reverse=True):
        ends = []
        for order in (0, 1):
            model = build(Run((64, 64, 64, 10), opt_name, lr, 0,
                              "skeleton" if not bn else "he", bn=bn))
            _steps(model, OPTIMIZERS[opt_name](model, lr), data, probe,
                   torch.Generator().manual_seed(order))
            ends.append(_loss(model, data))
        if all(math.isfinite(e) and e < TRAINS for e in ends):
            return lr
    return min(grid)


def long_run(opt_name, grid, data, steps, bn=False):
    lr = largest_lr_that_trains(opt_name, grid, data, bn)
    model = build(Run((64, 64, 64, 10), opt_name, lr, 0, "he" if bn else "skeleton", bn=bn))
    opt = OPTIMIZERS[opt_name](model, lr)
    rows = []

    def report(k):
        rows.append(dict(step=k, loss=_loss(model, data), **_stats(model)))

    t0 = time.perf_counter()
    _steps(model, opt, data, steps, torch.Generator().manual_seed(1), max(steps // 10, 1), report)
    return lr, rows, time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.long_run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20_000)
    threads.add_argument(ap)
    args = ap.parse_args(argv)
    threads.announce(threads.use(args.threads), args.threads)
    data = load()
    for name, grid, bn in (("gsgd", (0.2, 0.5, 1.0, 2.0), False),
                           ("gsgdm", (0.02, 0.05, 0.1, 0.2), False),
                           ("psisgdm", (0.02, 0.05, 0.1, 0.2), True)):
        lr, rows, secs = long_run(name, grid, data, args.steps, bn)
        print(f"\n{name}: lr {lr:g} (largest of {grid} that trains), {args.steps} steps, "
              f"{secs:.0f} s")
        keys = [k for k in rows[0] if k != "step"]
        print("  step " + " ".join(f"{k:>10}" for k in keys))
        for r in rows:
            print(f"{r['step']:>6} " + " ".join(
                f"{r[k]:>10.3g}" if isinstance(r[k], float) else f"{str(r[k]):>10}"
                for k in keys))


if __name__ == "__main__":
    main()
