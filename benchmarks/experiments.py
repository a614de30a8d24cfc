"""Budgets, runs, comparisons and verdicts of the experiments: small analogues of the G-SGD
and PSI-SGD papers' figures, on digits and MNIST.

Every optimizer family has its own learning-rate grid, searched on the validation split
(two seeds); the chosen rate is then run on every seed; :data:`STATS_RULE` says how seeds
are counted. Tables carry the "SGD, skeleton init" control (experiments page) wherever G-SGD
starts from a skeleton initialisation, so that the optimizer is not credited with the
init.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
from tqdm import tqdm

from . import digits, mnist
from .digits import Data, Run, train

#: How each :attr:`Run.data <benchmarks.digits.Run>` is loaded (once, on first use).
DATASETS = {"digits": digits.load, "mnist": mnist.load}


@dataclass(frozen=True)
class Budget:
    """Seeds, epochs, sizes and learning-rate grids of the experiments; ``mnist`` is the
    budget of the MNIST experiments (``depths``: hidden layers of their MLPs;
    ``cnn_epochs``: epochs of their CNN)."""

    seeds: int
    epochs: int
    widths: tuple
    sgd_grid: tuple
    momentum_grid: tuple
    adam_grid: tuple
    path_grid: tuple
    spreads: tuple
    depths: tuple = ()
    cnn_epochs: int = 0
    mnist: Budget | None = None


# Path-SGD's good rates depend on the init's scale: its MNIST grid spans 1e-4 to 3.
DEFAULT = Budget(seeds=5, epochs=20, widths=(8, 16, 32, 64, 128, 256),
                 sgd_grid=(0.05, 0.1, 0.2, 0.5), momentum_grid=(0.005, 0.01, 0.02, 0.05),
                 adam_grid=(1e-3, 3e-3, 1e-2), path_grid=(1e-3, 1e-2, 1e-1, 1.0),
                 spreads=(0.0, 0.5, 1.0, 2.0),
                 mnist=Budget(seeds=3, epochs=10, widths=(64,),
                              sgd_grid=(0.01, 0.03, 0.1, 0.3, 1.0),
                              momentum_grid=(0.003, 0.01, 0.03, 0.1), adam_grid=(),
                              path_grid=(1e-4, 1e-3, 1e-2, 0.1, 1.0, 3.0),
                              spreads=(0.0, 1.0, 2.0), depths=(2, 4, 6), cnn_epochs=4))
QUICK = Budget(seeds=2, epochs=3, widths=(16, 64), sgd_grid=(0.1, 0.5),
               momentum_grid=(0.01, 0.05), adam_grid=(3e-3,), path_grid=(1e-2, 1e-1),
               spreads=(0.0, 2.0),
               mnist=Budget(seeds=2, epochs=2, widths=(64,), sgd_grid=(0.1,),
                            momentum_grid=(0.01,), adam_grid=(), path_grid=(1e-4, 1.0),
                            spreads=(0.0, 2.0), depths=(2,), cnn_epochs=1))


@dataclass(frozen=True)
class Arm:
    """One row of a comparison: an optimizer, its init and its learning-rate grid."""

    label: str
    opt: str
    init: str
    grid: tuple


#: How every table, verdict and plot treats seeds (stated in the summary).
STATS_RULE = (
    "A run is *unstable* if its training loss became non-finite or ended above its value "
    "before training. Means ± standard deviations (and plot bands) are over the stable runs "
    "of a row; the unstable ones are counted in their own column, and a verdict names an "
    "unstable optimizer before any win or tie. Learning rates are chosen on the validation "
    "split of two selection seeds, among the rates stable on both (lowest mean validation "
    "error, then training loss); the seeds reported include the selection seeds. Epoch cost: "
    "CPU seconds of one epoch's training steps, relative to the baseline row of the same "
    "table, all measured in the same run.")


@dataclass
class Outcome:
    arm: Arm
    lr: float
    runs: list            # one result dict per seed
    note: str = ""        # how the lr was chosen when no rate was stable

    @property
    def stable(self) -> list:
        return [r for r in self.runs if not r["unstable"]]

    @property
    def unstable(self) -> int:
        return len(self.runs) - len(self.stable)

    def final(self, key) -> np.ndarray:
        """Final training loss (``"loss"``) or an error, of the stable runs."""
        return np.array([r[key][-1] if key == "loss" else r[key] for r in self.stable])

    @property
    def epoch_seconds(self) -> float:
        return float(np.mean([r["epoch_seconds"] for r in self.runs]))


@dataclass
class Section:
    title: str
    text: str
    tables: list = field(default_factory=list)     # markdown strings
    figures: list = field(default_factory=list)    # (file name, caption)
    data: dict = field(default_factory=dict)


GRID_SEEDS = 2


class Runner:
    """Trains runs on the data sets of :data:`DATASETS` (each loaded when a run first needs
    it) under one overall progress bar (runs done of all planned, with tqdm's estimate of the
    time left), or, ``dry``, returns placeholders at once and prints nothing: an experiment
    run dry counts the runs it plans (their number does not depend on results), and its
    placeholder results must never be shown as if they had been measured.
    """

    def __init__(self, total: int | None = None, dry: bool = False) -> None:
        self.dry, self.count, self._data = dry, 0, {}
        self.bar = None if dry else tqdm(total=total, unit="run", dynamic_ncols=True,
                                         desc="all experiments")

    def data(self, name: str) -> Data:
        if name not in self._data:
            self._data[name] = DATASETS[name]()
        return self._data[name]

    def stage(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_description(text)

    def __call__(self, runs, desc: str) -> list[dict]:
        if self.bar is not None:
            self.bar.set_postfix_str(desc)
        out = []
        for run in runs:
            out.append(_placeholder(run) if self.dry else train(run, self.data(run.data)))
            self.count += 1
            if self.bar is not None:
                self.bar.update(1)
        return out

    def write(self, text: str) -> None:
        """Print above the bar; a dry run prints nothing (its results are placeholders)."""
        if self.bar is not None:
            self.bar.write(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _placeholder(run: Run) -> dict:
    return dict(loss0=1.0, loss=[0.5] * run.epochs, val_err=0.5, test_err=0.5, diverged=False,
                unstable=False, epoch_seconds=1.0)


def compare(arms, base: Run, budget: Budget, runner, desc: str) -> list[Outcome]:
    """Choose each arm's lr on the first two seeds (see :data:`STATS_RULE`), then run the
    other seeds at it."""
    grid_seeds = range(min(GRID_SEEDS, budget.seeds))
    grid_runs = [replace(base, opt=a.opt, init=a.init, lr=lr, seed=s, epochs=budget.epochs)
                 for a in arms for lr in a.grid for s in grid_seeds]
    results = dict(zip(grid_runs, runner(grid_runs, f"{desc}: lr grid")))

    def score(run):
        rs = [results[replace(run, seed=s)] for s in grid_seeds]
        return (sum(r["unstable"] for r in rs), np.mean([r["val_err"] for r in rs]),
                np.mean([r["loss"][-1] for r in rs]))

    chosen = []
    for a in arms:
        best = min((replace(base, opt=a.opt, init=a.init, lr=lr, seed=0, epochs=budget.epochs)
                    for lr in a.grid), key=score)
        note = "" if score(best)[0] == 0 else (
            f"no lr of the grid was stable on both selection seeds; {best.lr:g} was unstable "
            f"on {score(best)[0]}")
        chosen.append((a, best, note))
    seed_runs = [replace(best, seed=s) for _, best, _ in chosen
                 for s in range(len(grid_seeds), budget.seeds)]
    results.update(zip(seed_runs, runner(seed_runs, f"{desc}: seeds")))
    return [Outcome(a, best.lr, [results[replace(best, seed=s)] for s in range(budget.seeds)],
                    note) for a, best, note in chosen]


def _ms(vals, pct=False):
    vals = np.asarray(vals, dtype=float)
    if vals.size == 0:
        return "—"
    k = 100.0 if pct else 1.0
    return f"{k * vals.mean():.3g} ± {k * vals.std():.2g}" + ("%" if pct else "")


def table(outcomes, extra_cols=None, baseline: str = "SGD") -> str:
    """Rows ``(prefix, outcome)``; statistics by :data:`STATS_RULE`; the epoch cost is
    relative to the first row of the same prefix whose label starts with ``baseline``."""
    base = {}
    for prefix, o in outcomes:
        if o.arm.label.startswith(baseline):
            base.setdefault(tuple(prefix), o.epoch_seconds)
    head = "| " + " | ".join((extra_cols or []) + [
        "optimizer", "lr", "train loss", "test error", "unstable",
        f"epoch cost vs {baseline}"]) + " |"
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for prefix, o in outcomes:
        ref = base.get(tuple(prefix))
        cost = f"{o.epoch_seconds / ref:.2f}" if ref else "—"
        rows.append("| " + " | ".join(list(prefix) + [
            o.arm.label, f"{o.lr:g}", _ms(o.final("loss")), _ms(o.final("test_err"), pct=True),
            f"{o.unstable}/{len(o.runs)}", cost]) + " |")
    notes = [f"- {o.arm.label}" + (f" ({', '.join(p)})" if p else "") + f": {o.note}"
             for p, o in outcomes if o.note]
    return "\n".join(rows + ([""] + notes if notes else []))


def sgd_arms(b: Budget, gsgd: str = "gsgd", sgd: str = "sgd", grid=None):
    grid = grid or b.sgd_grid
    return [Arm("SGD, He init", sgd, "he", grid), Arm("SGD, skeleton init", sgd, "skeleton", grid),
            Arm("G-SGD, skeleton init", gsgd, "skeleton", grid)]


def verdict(rows, ours: str = "G-SGD") -> str:
    """One line per table group: an unstable ``ours`` row says so first; otherwise it wins,
    loses or ties against the best stable other row on mean test error (by more than the
    larger of the two standard deviations), and unstable other rows are named."""
    groups: dict = {}
    for prefix, o in rows:
        groups.setdefault(tuple(prefix), []).append(o)
    lines = []
    for prefix, outs in groups.items():
        mine = [o for o in outs if o.arm.label.startswith(ours)]
        others = [o for o in outs if not o.arm.label.startswith(ours)]
        if not mine or not others:
            continue
        me, where = mine[0], ", ".join(prefix) or "overall"
        shaky = [f"{o.arm.label} unstable on {o.unstable}/{len(o.runs)} seeds"
                 for o in others if o.unstable]
        tail = f" ({'; '.join(shaky)})" if shaky else ""
        if me.unstable:
            lines.append(f"- {where}: {me.arm.label} is unstable on {me.unstable}/"
                         f"{len(me.runs)} seeds{tail}")
            continue
        steady = [o for o in others if not o.unstable]
        m = me.final("test_err")
        if not steady:
            lines.append(f"- {where}: {me.arm.label} is the only stable optimizer: "
                         f"{100 * m.mean():.2f}% test error{tail}")
            continue
        best = min(steady, key=lambda o: o.final("test_err").mean())
        b = best.final("test_err")
        gap, noise = 100 * (m.mean() - b.mean()), 100 * max(m.std(), b.std())
        word = ("wins" if gap < -noise else "loses" if gap > noise else "ties (within noise)")
        lines.append(f"- {where}: {me.arm.label} {word}: {100 * m.mean():.2f}% test "
                     f"error against {best.arm.label}'s {100 * b.mean():.2f}% "
                     f"(std up to {noise:.2f}){tail}")
    return "\n".join(lines)
