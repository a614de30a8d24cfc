"""The six experiments: small analogues of the G-SGD and PSI-SGD papers' figures.

Every optimizer family has its own learning-rate grid, searched on the validation split
(two seeds); the chosen rate is then run on every seed and reported as mean ± std. Tables
carry the "SGD, skeleton init" control (DESIGN §9) wherever G-SGD starts from a skeleton
initialisation, so that the optimizer is not credited with the init.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
from tqdm import tqdm

from .digits import Data, Run, train


@dataclass(frozen=True)
class Budget:
    seeds: int
    epochs: int
    widths: tuple
    sgd_grid: tuple
    momentum_grid: tuple
    adam_grid: tuple
    path_grid: tuple
    spreads: tuple


DEFAULT = Budget(seeds=5, epochs=20, widths=(8, 16, 32, 64, 128, 256),
                 sgd_grid=(0.05, 0.1, 0.2, 0.5), momentum_grid=(0.005, 0.01, 0.02, 0.05),
                 adam_grid=(1e-3, 3e-3, 1e-2), path_grid=(1e-3, 1e-2, 1e-1, 1.0),
                 spreads=(0.0, 0.5, 1.0, 2.0))
QUICK = Budget(seeds=2, epochs=3, widths=(16, 64), sgd_grid=(0.1, 0.5),
               momentum_grid=(0.01, 0.05), adam_grid=(3e-3,), path_grid=(1e-2, 1e-1),
               spreads=(0.0, 2.0))


@dataclass(frozen=True)
class Arm:
    """One row of a comparison: an optimizer, its init and its learning-rate grid."""

    label: str
    opt: str
    init: str
    grid: tuple


@dataclass
class Outcome:
    arm: Arm
    lr: float
    runs: list            # one result dict per seed

    def final(self, key):
        vals = np.array([r[key][-1] if key == "loss" else r[key] for r in self.runs])
        return vals

    @property
    def diverged(self) -> int:
        return sum(r["diverged"] for r in self.runs)


@dataclass
class Section:
    title: str
    text: str
    tables: list = field(default_factory=list)     # markdown strings
    figures: list = field(default_factory=list)    # (file name, caption)
    data: dict = field(default_factory=dict)


def _progress(runs, desc, data):
    return [train(r, data) for r in tqdm(runs, desc=desc, leave=False, unit="run")]


GRID_SEEDS = 2


def compare(arms, base: Run, budget: Budget, data: Data, desc: str) -> list[Outcome]:
    """Grid-search each arm's lr on the first two seeds (mean validation error, then mean
    training loss; a diverged run counts as 100% error), then run the other seeds at it."""
    grid_seeds = range(min(GRID_SEEDS, budget.seeds))
    grid_runs = [replace(base, opt=a.opt, init=a.init, lr=lr, seed=s, epochs=budget.epochs)
                 for a in arms for lr in a.grid for s in grid_seeds]
    results = dict(zip(grid_runs, _progress(grid_runs, f"{desc}: lr grid", data)))

    def score(run):
        rs = [results[replace(run, seed=s)] for s in grid_seeds]
        return (np.mean([r["val_err"] for r in rs]), np.mean([r["loss"][-1] for r in rs]))

    chosen = [(a, min((replace(base, opt=a.opt, init=a.init, lr=lr, seed=0,
                                epochs=budget.epochs) for lr in a.grid), key=score))
              for a in arms]
    seed_runs = [replace(best, seed=s) for _, best in chosen
                 for s in range(len(grid_seeds), budget.seeds)]
    results.update(zip(seed_runs, _progress(seed_runs, f"{desc}: seeds", data)))
    return [Outcome(a, best.lr, [results[replace(best, seed=s)] for s in range(budget.seeds)])
            for a, best in chosen]


def _ms(vals, pct=False):
    vals = np.asarray(vals, dtype=float)
    if not np.all(np.isfinite(vals)):
        return "diverged"
    k = 100.0 if pct else 1.0
    return f"{k * vals.mean():.3g} ± {k * vals.std():.2g}" + ("%" if pct else "")


def table(outcomes, extra_cols=None) -> str:
    head = "| " + " | ".join((extra_cols or []) + ["optimizer", "lr", "train loss",
                                                   "test error", "NaN runs"]) + " |"
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for prefix, o in outcomes:
        ok = [r for r in o.runs if not r["diverged"]]
        loss = _ms([r["loss"][-1] for r in ok]) if ok else "diverged"
        err = _ms([r["test_err"] for r in ok], pct=True) if ok else "—"
        rows.append("| " + " | ".join(list(prefix) + [o.arm.label, f"{o.lr:g}", loss, err,
                                                      f"{o.diverged}/{len(o.runs)}"]) + " |")
    return "\n".join(rows)


def sgd_arms(b: Budget, gsgd: str = "gsgd", sgd: str = "sgd", grid=None):
    grid = grid or b.sgd_grid
    return [Arm("SGD, He init", sgd, "he", grid), Arm("SGD, skeleton init", sgd, "skeleton", grid),
            Arm("G-SGD, skeleton init", gsgd, "skeleton", grid)]


def verdict(rows, ours: str = "G-SGD") -> str:
    """One line per table group: does the ``ours`` row beat the best other row on mean test
    error, by more than the larger of the two standard deviations?"""
    groups: dict = {}
    for prefix, o in rows:
        groups.setdefault(tuple(prefix), []).append(o)
    lines = []
    for prefix, outs in groups.items():
        mine = [o for o in outs if o.arm.label.startswith(ours)]
        others = [o for o in outs if not o.arm.label.startswith(ours)]
        if not mine or not others:
            continue
        m = mine[0].final("test_err")
        best = min(others, key=lambda o: o.final("test_err").mean())
        b = best.final("test_err")
        gap, noise = 100 * (m.mean() - b.mean()), 100 * max(m.std(), b.std())
        word = ("wins" if gap < -noise else "loses" if gap > noise else "ties (within noise)")
        where = ", ".join(prefix) or "overall"
        lines.append(f"- {where}: {mine[0].arm.label} {word}: {100 * m.mean():.2f}% test "
                     f"error against {best.arm.label}'s {100 * b.mean():.2f}% "
                     f"(std up to {noise:.2f})")
    return "\n".join(lines)
